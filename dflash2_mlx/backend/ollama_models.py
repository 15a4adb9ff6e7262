"""What Ollama's /api/tags, /api/show and /api/ps tell of a model, read from its files
(config.json, the safetensors headers, the tokenizer's chat template) and its settings:
nothing is loaded to describe a model."""

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Optional

from .ollama_wire import timestamp
from .pool import UnknownModel
from .settings import SettingsError

LATEST = ":latest"


def tagged(name: str) -> str:
    """A model name as Ollama shows it: with a tag (``:latest`` when it has none)."""
    return name if ":" in name else name + LATEST



def _path(pool, model_id: str) -> Optional[Path]:
    try:
        path = Path(pool.path_of(model_id)).expanduser()
    except UnknownModel:
        return None
    return path if path.is_dir() else None  # a hub id not on this machine


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _weights(path: Optional[Path], bits: Optional[int]):
    """(parameter count, dtypes, digest) from the safetensors headers: nothing is loaded."""
    count, dtypes, digest = 0, set(), hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")) if path else ():
        try:
            with open(f, "rb") as fh:
                raw = fh.read(int.from_bytes(fh.read(8), "little"))
            header = json.loads(raw)
        except (OSError, ValueError):
            continue
        digest.update(raw)
        for key, t in header.items():
            if key == "__metadata__" or not isinstance(t, dict):
                continue
            n = math.prod(t.get("shape", ()))
            count += n * 32 // bits if bits and t.get("dtype") == "U32" else n  # packed weights
            dtypes.add(t.get("dtype"))
    return count, dtypes, digest.hexdigest()


def _facts(pool, model_id: str):
    """(config.json, parameter count, /api/tags entry) of a model, from its files."""
    path = _path(pool, model_id)
    config = _json(path / "config.json") if path else {}
    bits = (config.get("quantization") or {}).get("bits")
    count, dtypes, digest = _weights(path, bits)
    floats = sorted(d for d in dtypes if d and d.startswith(("F", "BF")))
    family = config.get("model_type", "")
    details = {"parent_model": "", "format": "mlx", "family": family, "families": [family] if family else None,
               "parameter_size": f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.0f}M" if count else "",
               "quantization_level": f"Q{bits}" if bits else "/".join(floats)}
    files = [f for f in [path / "config.json", *sorted(path.glob("*.safetensors"))] if f.is_file()] if path else []
    name = tagged(pool.public_name(model_id))
    entry = {"name": name, "model": name, "modified_at": timestamp(max((f.stat().st_mtime for f in files), default=0)),
             "size": sum(f.stat().st_size for f in files if f.suffix == ".safetensors"),
             "digest": digest, "details": details}
    return config, count, entry


def model_entry(pool, model_id: str) -> dict:
    """A model of /api/tags: name, modified_at, size (the weights' bytes), digest, details."""
    return _facts(pool, model_id)[2]


def _template(path: Optional[Path]) -> str:
    if path is None:
        return ""
    template = _json(path / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str) and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    return template if isinstance(template, str) else ""


def _parameters(settings) -> str:
    """The model's sampling settings in Ollama's names, one ``name value`` a line."""
    named = {"temperature": settings.temperature, "top_p": settings.top_p, "top_k": settings.top_k,
             "min_p": settings.min_p, "num_predict": settings.max_tokens,
             "repeat_penalty": settings.repetition_penalty, "presence_penalty": settings.presence_penalty,
             "num_ctx": settings.max_context_window}
    return "\n".join(f"{k:<30} {v}" for k, v in named.items() if v is not None)


def show_body(pool, model_id: str) -> dict:
    config, count, entry = _facts(pool, model_id)
    template = _template(_path(pool, model_id))
    arch = config.get("model_type", "unknown")
    info = {"general.architecture": arch, "general.parameter_count": count}
    for ours, theirs in (("context_length", "max_position_embeddings"), ("embedding_length", "hidden_size"),
                         ("block_count", "num_hidden_layers"), ("attention.head_count", "num_attention_heads"),
                         ("attention.head_count_kv", "num_key_value_heads"), ("vocab_size", "vocab_size")):
        if theirs in config:
            info[f"{arch}.{ours}"] = config[theirs]
    out = {"modelfile": f"# served by dflash2-mlx\nFROM {entry['name']}\n", "template": template,
           "details": entry["details"], "model_info": info, "modified_at": entry["modified_at"],
           "capabilities": ["completion"] + (["tools"] if "tools" in template else [])}
    try:
        settings = pool.settings_of(model_id)
        out["parameters"] = _parameters(settings)
        if settings.max_context_window:
            info[f"{arch}.context_length"] = settings.max_context_window
        out["dflash"] = engine = settings.engine()
        if engine["drafter"]:  # its name: where it lies on this machine is no client's business
            engine["drafter"] = Path(engine["drafter"]).name
    except SettingsError as e:
        out["dflash"] = {"error": str(e)}
    return out


def running_entry(pool, model_id: str, engine) -> dict:
    """A loaded model of /api/ps; expires_at: when its ttl_seconds will unload it (none: never)."""
    entry = model_entry(pool, model_id)
    ttl = engine.settings.ttl_seconds
    expires = None
    if ttl and not engine.settings.is_pinned:
        expires = timestamp(time.time() + ttl - (time.monotonic() - engine.last_used))
    return {**entry, "expires_at": expires, "size_vram": entry["size"], "context_length": engine.context_window,
            "dflash": {**engine.settings.engine(), "live": engine.live()}}
