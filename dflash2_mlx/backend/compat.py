"""Does a drafter fit a target? Answered from the two config.json files, no weights loaded."""

import json
from pathlib import Path
from typing import Tuple

from huggingface_hub import hf_hub_download

from ..model.config import DrafterConfig, DrafterConfigError
from ..model.checkpoint import pair_problems


def read_json_config(path_or_repo) -> dict:
    """config.json of a local directory, or of a hub repo (only that file is fetched)."""
    path = Path(str(path_or_repo)).expanduser()
    if path.is_dir():
        file = path / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"{path} has no config.json")
        return json.loads(file.read_text())
    if path.exists() or str(path_or_repo).startswith((".", "/", "~")) or str(path_or_repo).count("/") != 1:
        raise FileNotFoundError(f"no such model directory: {path_or_repo}")
    return json.loads(Path(hf_hub_download(str(path_or_repo), "config.json")).read_text())


def text_config(cfg: dict) -> dict:
    """Multimodal configs nest the language model's sizes under ``text_config``."""
    inner = cfg.get("text_config")
    if isinstance(inner, dict):
        return {**cfg, **inner}
    return cfg


def is_compatible(model_path, draft_path) -> Tuple[bool, str]:
    """(True, summary) if the drafter fits the target, else (False, the first reasons)."""
    try:
        target = text_config(read_json_config(model_path))
    except Exception as e:
        return False, f"cannot read the target config: {e}"
    try:
        drafter = DrafterConfig.from_dict(read_json_config(draft_path))
    except DrafterConfigError as e:
        return False, f"not a DFlash drafter: {e}"
    except Exception as e:
        return False, f"cannot read the drafter config: {e}"

    vocab, hidden = target.get("vocab_size"), target.get("hidden_size")
    depth = target.get("num_hidden_layers")
    if vocab is None or hidden is None or depth is None:
        return False, "target config.json lacks vocab_size, hidden_size or num_hidden_layers"
    problems = pair_problems(drafter, vocab, hidden, depth)
    if problems:
        return False, "drafter does not match the target: " + "; ".join(problems)
    return True, (f"DFlash {drafter.version} drafter, block size {drafter.block_size}, "
                  f"taps layers {drafter.target_layer_ids} of {depth}")
