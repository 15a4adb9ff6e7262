"""Convert a llama-architecture GGUF file into an mlx-lm model directory.

The directory holds ``config.json`` (mlx-lm's ``llama`` model), ``model.safetensors``
(fp32, dequantized), ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat
template), so ``mlx_lm.load(out_dir)`` works.

Two GGUF facts shape this file (DESIGN.md §7):
- llama.cpp stores the rows of the Q and K projections permuted for its rotary layout
  (pairs of adjacent dimensions); mlx-lm's ``rope_traditional=False`` rotates the two
  halves of each head, so the permutation is undone here.
- ``mx.load`` reads F32/F16/BF16/Q4_0/Q4_1/Q8_0 correctly (the quantized ones as MLX
  affine weights, group size 32) but decodes some other types wrongly without an error;
  every other type is dequantized with the ``gguf`` package.
"""

import json
from pathlib import Path
from typing import Any, Dict, List, Union

import gguf
import mlx.core as mx
import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

PathLike = Union[str, Path]

# The tensor types mx.load decodes correctly, and their bit widths (None: not quantized).
_MX_NATIVE = {
    gguf.GGMLQuantizationType.F32: None,
    gguf.GGMLQuantizationType.F16: None,
    gguf.GGMLQuantizationType.BF16: None,
    gguf.GGMLQuantizationType.Q4_0: 4,
    gguf.GGMLQuantizationType.Q4_1: 4,
    gguf.GGMLQuantizationType.Q8_0: 8,
}
_GROUP_SIZE = 32

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_name(gguf_name: str) -> str:
    """The mlx-lm (Hugging Face) parameter name of a GGUF tensor name."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        layer, base, suffix = parts[1], parts[2], parts[3]
        if base not in _LAYER_NAMES:
            raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_LAYER_NAMES[base]}.{suffix}"
    base, suffix = parts[0], parts[1]
    if base not in _TOP_NAMES:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
    return f"{_TOP_NAMES[base]}.{suffix}"


def unpermute_rope(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation (its ``permute`` in convert_hf_to_gguf.py).

    llama.cpp orders each head's rows as interleaved pairs (x0, x_{d/2}, x1, ...); mlx-lm
    rotates the first half of the head against the second half.
    """
    shape = w.shape
    w = w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:])
    return w.swapaxes(1, 2).reshape(shape)


def llama_config(reader: gguf.GGUFReader) -> Dict[str, Any]:
    """The mlx-lm ``llama`` config.json of a llama-architecture GGUF."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUFs are supported, got {arch!r}")
    k = lambda key, default=None: _field(reader, f"llama.{key}", default)  # noqa: E731
    hidden, n_heads = int(k("embedding_length")), int(k("attention.head_count"))
    head_dim = int(k("attention.key_length", hidden // n_heads))
    if int(k("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError("partial rotary embeddings are not supported")
    scaling = k("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"rope scaling {scaling!r} is not supported")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("llama3-style rope frequency factors are not supported")
    vocab = k("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(k("block_count")),
        "intermediate_size": int(k("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(k("attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(k("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(k("rope.freq_base", 10000.0)),
        "rope_traditional": False,
        "max_position_embeddings": int(k("context_length")),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "torch_dtype": "float32",
    }
    for key in ("bos", "eos"):
        tid = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if tid is not None:
            config[f"{key}_token_id"] = int(tid)
    return config


def dequantized_weights(reader: gguf.GGUFReader, path: PathLike) -> Dict[str, mx.array]:
    """Every tensor of the GGUF as fp32, under its GGUF name, in HF (out, in) layout.

    mx.load refuses a whole file that holds a type it cannot read (Q5_0, ...), so it is
    used only when every tensor's type is one it decodes correctly.
    """
    use_mx = all(t.tensor_type in _MX_NATIVE for t in reader.tensors)
    native = mx.load(str(path)) if use_mx else {}
    weights = {}
    for t in reader.tensors:
        bits = _MX_NATIVE.get(t.tensor_type, "other") if use_mx else "other"
        if bits == "other":
            w = mx.array(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
        elif bits is None:
            w = native[t.name].astype(mx.float32)
        else:
            stem = t.name.rsplit(".", 1)[0]
            w = mx.dequantize(
                native[t.name],
                native[f"{stem}.scales"].astype(mx.float32),
                native[f"{stem}.biases"].astype(mx.float32),
                group_size=_GROUP_SIZE,
                bits=bits,
            )
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists ne0 (columns) first
        weights[t.name] = w.reshape(shape)
    return weights


def convert_weights(reader: gguf.GGUFReader, path: PathLike, config: Dict[str, Any]):
    """The mlx-lm weights (fp32, HF names, Q/K rows un-permuted)."""
    out = {}
    for name, w in dequantized_weights(reader, path).items():
        if name.endswith(("attn_q.weight", "attn_q.bias")):
            w = unpermute_rope(w, config["num_attention_heads"])
        elif name.endswith(("attn_k.weight", "attn_k.bias")):
            w = unpermute_rope(w, config["num_key_value_heads"])
        out[hf_name(name)] = w
    return out


def _pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        # llama.cpp: "\p{N}" (one digit per piece), then the GPT-2 regex.
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    if pre in ("gpt2", "default"):
        return byte_level
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}")


def build_tokenizer(reader: gguf.GGUFReader):
    """A byte-level BPE ``tokenizers.Tokenizer`` from the GGUF tokenizer metadata."""
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"only byte-level BPE (gpt2) GGUF tokenizers are supported: {model!r}")
    tokens: List[str] = _field(reader, "tokenizer.ggml.tokens")
    types: List[int] = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ")) for m in _field(reader, "tokenizer.ggml.merges")]
    if any(len(m) != 2 for m in merges):
        raise ValueError("a GGUF merge is not a pair of tokens")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    added = lambda t: AddedToken(t, special=True, normalized=False)  # noqa: E731
    tok.add_special_tokens([added(t) for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens(
        [AddedToken(t, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    )
    return tok


def tokenizer_config(reader: gguf.GGUFReader) -> Dict[str, Any]:
    """tokenizer_config.json: special tokens, BOS policy and the chat template."""
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    config: Dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(_field(reader, "llama.context_length", 2048)),
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
    }
    for key, name in (("bos", "bos"), ("eos", "eos"), ("unknown", "unk"), ("padding", "pad")):
        tid = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if tid is not None:
            config[f"{name}_token"] = tokens[int(tid)]
    config["additional_special_tokens"] = [
        t for t, ty in zip(tokens, types)
        if ty == _CONTROL and t not in config.values()
    ]
    template = _field(reader, "tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return config


def convert_gguf(gguf_path: PathLike, out_dir: PathLike) -> Path:
    """Write an mlx-lm model directory (fp32) for a llama-architecture GGUF file.

    Returns ``out_dir``. Writes into ``out_dir`` directly; callers that need an atomic
    result convert into a temporary directory and rename it (see ``smollm2.py``).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(gguf_path))
    config = llama_config(reader)
    weights = convert_weights(reader, gguf_path, config)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    del weights
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    build_tokenizer(reader).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(reader), indent=2) + "\n"
    )
    return out
