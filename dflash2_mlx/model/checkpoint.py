"""Reading drafter checkpoints (config.json + safetensors), validating a target /
drafter pair, and quantizing a drafter.

Checkpoints are data: only safetensors are read, nothing is imported or unpickled.
"""

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from huggingface_hub import snapshot_download
from mlx.utils import tree_flatten, tree_unflatten

from .config import DrafterConfig, DrafterConfigError
from .drafter import Drafter
from .target_model import model_args


class CheckpointError(ValueError):
    """A drafter checkpoint that is missing, incomplete or inconsistent."""


class PairError(ValueError):
    """A drafter that does not fit the target it is paired with."""


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
# Copies of the target's own tensors that some exports carry; the drafter uses the target's.
TARGET_TENSORS = ("embed_tokens.weight", "lm_head.weight")


def resolve(path_or_repo: str, fetch: bool = True) -> Path:
    """A local directory, or a hub id fetched with huggingface_hub (json + safetensors only);
    without ``fetch``, only a hub id already downloaded (a listing must not start a download)."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        return path
    if str(path_or_repo).startswith((".", "/", "~")) or str(path_or_repo).count("/") != 1:
        raise CheckpointError(f"no such directory: {path_or_repo}")
    return Path(snapshot_download(str(path_or_repo), local_files_only=not fetch,
                                  allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model"]))


def resolved_here(path_or_repo: str) -> Optional[Path]:
    """``resolve`` without fetching; None where the model is not on this machine."""
    try:
        return resolve(path_or_repo, fetch=False)
    except Exception:  # no such directory, not downloaded, or no hub: nothing is known of it here
        return None


def read_config(path: Path) -> DrafterConfig:
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path} has no config.json")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from e
    return DrafterConfig.from_dict(raw)


def read_weights(path: Path) -> dict:
    files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        absent = [s for s in shards if not (path / s).is_file()]
        if absent:
            raise CheckpointError(f"{path}: shard(s) listed in the index are missing: {', '.join(absent)}")
        files = [path / s for s in shards]
    if not files:
        pickles = [p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if pickles:
            raise CheckpointError(
                f"{path} holds only pickle checkpoints ({', '.join(pickles)}); "
                "convert them to safetensors, pickles are never loaded"
            )
        raise CheckpointError(f"{path} has no *.safetensors weights")
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:  # mlx raises plain exceptions for truncated files
            raise CheckpointError(f"cannot read {f.name}: {e}") from e
    return weights


def sanitize(weights: dict) -> dict:
    out = {}
    for k, v in weights.items():
        if k.startswith("model."):
            k = k[len("model."):]
        if k.endswith(("_codebook.weight",)):
            k = k[: -len(".weight")]
        if k in TARGET_TENSORS:
            continue
        out[k] = v
    return out


def quantize(drafter: Drafter, bits: int, group_size: int):
    if bits not in (2, 4, 8):
        raise ValueError(f"draft quantization bits must be 2, 4 or 8, got {bits}")
    if group_size not in (32, 64, 128):
        raise ValueError(f"draft quantization group size must be 32, 64 or 128, got {group_size}")
    nn.quantize(
        drafter, group_size=group_size, bits=bits,
        class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % group_size == 0,
    )


def dequantized_weight(m: nn.QuantizedLinear) -> mx.array:
    return mx.dequantize(m.weight, m.scales, m.get("biases"), m.group_size, m.bits,
                         mode=m.mode, dtype=mx.float32)


def dequantize(drafter: Drafter):
    """Quantized Linear layers back to fp32: on a CPU an fp32 matmul is several times
    faster than a quantized one (quantized weights are for Metal's memory bandwidth)."""
    swaps = []
    for name, m in drafter.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            w = dequantized_weight(m)
            linear = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            linear.weight = w
            if "bias" in m:
                linear.bias = m.bias
            swaps.append((name, linear))
    drafter.update_modules(tree_unflatten(swaps), strict=False)


def check_draft_vocab(path, vocab: mx.array, vocab_size: int):
    if mx.issubdtype(vocab.dtype, mx.floating) or vocab.ndim != 1:
        raise CheckpointError(f"{path}: draft_vocab must be a 1-D integer tensor")
    ids = vocab.tolist()
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise CheckpointError(f"{path}: draft_vocab holds ids outside the vocabulary (size {vocab_size}): {bad[:5]}")
    if len(set(ids)) != len(ids):
        raise CheckpointError(f"{path}: draft_vocab repeats token ids")


def set_activation_bits(drafter: Drafter, bits: int):
    """32: fp32 activations; 16: bfloat16 (fp16 overflows broke other ports on M1/M2)."""
    if bits not in (16, 32):
        raise ValueError(f"draft activation bits must be 16 or 32, got {bits}")
    dtype = mx.float32 if bits == 32 else mx.bfloat16
    drafter.activation_dtype = dtype
    drafter.apply(lambda x: x.astype(dtype) if mx.issubdtype(x.dtype, mx.floating) else x)


def load_drafter(path_or_repo: str, target=None) -> Drafter:
    """Read a drafter checkpoint.  With ``target`` (an mlx-lm model) its config is checked
    against the target before any tensor is read, so a drafter made for another model
    fails with the cause (PairError), not with its tensors."""
    path = resolve(path_or_repo)
    try:
        cfg = read_config(path)
    except DrafterConfigError as e:
        raise CheckpointError(f"{path}: {e}") from e
    if target is not None:
        validate_pair(target, cfg)
    weights = sanitize(read_weights(path))
    drafter = Drafter(cfg)
    q = cfg.raw.get("quantization")
    if q:
        nn.quantize(
            drafter, group_size=q["group_size"], bits=q["bits"],
            class_predicate=lambda p, m: isinstance(m, nn.Linear) and f"{p}.scales" in weights,
        )
    expected = dict(tree_flatten(drafter.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing:
        raise CheckpointError(f"{path}: missing tensors: {', '.join(missing[:8])}"
                              + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))
    if unexpected:
        raise CheckpointError(f"{path}: unexpected tensors: {', '.join(unexpected[:8])}"
                              + (f" (+{len(unexpected) - 8} more)" if len(unexpected) > 8 else ""))
    wrong = [f"{k} {tuple(weights[k].shape)} (expected {tuple(v.shape)})"
             for k, v in expected.items() if weights[k].shape != v.shape]
    if wrong:
        raise CheckpointError(f"{path}: wrong tensor shapes: {'; '.join(wrong[:8])}")
    if "draft_vocab" in weights:
        check_draft_vocab(path, weights["draft_vocab"], cfg.vocab_size)
    drafter.load_weights(list(weights.items()))
    if q and not mx.metal.is_available():
        dequantize(drafter)
    drafter.apply(lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x)
    mx.eval(drafter.parameters())
    drafter.eval()
    return drafter


def pair_problems(cfg: DrafterConfig, vocab: int, hidden: int, depth: int) -> list:
    """Every way a drafter config does not fit a target of this vocabulary, width and depth."""
    problems = []
    if cfg.vocab_size != vocab:
        problems.append(f"vocab size: drafter {cfg.vocab_size}, target {vocab}")
    if cfg.hidden_size != hidden:
        problems.append(f"hidden size: drafter {cfg.hidden_size}, target {hidden}")
    if cfg.num_target_layers is not None and cfg.num_target_layers != depth:
        problems.append(f"num_target_layers: drafter trained on {cfg.num_target_layers}, target has {depth}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < depth]
    if bad:
        problems.append(f"target_layer_ids {bad} out of range for a {depth}-layer target")
    if not 0 <= cfg.mask_token_id < vocab:
        problems.append(f"mask_token_id {cfg.mask_token_id} not in the target vocabulary (size {vocab})")
    return problems


def validate_pair(target_model, drafter):
    """Raise PairError naming every mismatch between a target and a drafter (or its config)."""
    args = model_args(target_model)
    problems = pair_problems(getattr(drafter, "config", drafter), args.vocab_size, args.hidden_size,
                             len(target_model.layers))
    if problems:
        raise PairError("drafter does not match the target: " + "; ".join(problems))


def save_drafter(drafter: Drafter, path, extra_config: Optional[dict] = None):
    """Write a checkpoint in the published format (config.json + model.safetensors)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = drafter.config.to_dict()
    if extra_config:
        cfg.update(extra_config)
    weights = dict(tree_flatten(drafter.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
