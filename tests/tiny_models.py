"""Tiny random targets (real mlx-lm model classes) with an offline tokenizer.

Used by the tests and by the benchmarks that need a pair that runs in seconds:
``python tests/tiny_models.py OUT_DIR`` writes ``OUT_DIR/target`` (qwen3) and
``OUT_DIR/drafter`` (DFlash 2) that ``dflash2-mlx generate`` can load.
"""

import json
import string
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

ALPHABET = string.ascii_lowercase + " .,"
SPECIALS = ["<pad>", "<eos>", "<mask>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}.{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


# Qwen3's way: the generation prompt opens a think block unless enable_thinking is false,
# which leaves an empty one closed.
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}.{% endfor %}"
    "{% if add_generation_prompt %}a:{% if enable_thinking is defined and enable_thinking is false %}"
    "<think></think>{% else %}<think>{% endif %}{% endif %}"
)


def save_tokenizer(tok, path: Path, template: str = CHAT_TEMPLATE):
    """``tok`` (a tokenizers.Tokenizer) as a Hugging Face tokenizer directory with the specials."""
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<eos>", "pad_token": "<pad>", "mask_token": "<mask>",
        "chat_template": template,
    }))


def write_tokenizer(path: Path, alphabet: str = ALPHABET, vocab_size: int = None, thinking: bool = False):
    """A character-level tokenizer: specials, then one token per character; ``thinking``:
    with ``<think>`` / ``</think>`` tokens (as Qwen3's, not special: they stay in the text)
    and a template that opens a think block."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens = SPECIALS + [c for c in alphabet if c not in ":"] + [":"]
    tags = ["<think>", "</think>"] if thinking else []
    vocab = {t: i for i, t in enumerate(tokens + tags)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tags])
    save_tokenizer(tok, path, THINKING_TEMPLATE if thinking else CHAT_TEMPLATE)
    return len(vocab)


# Emoji byte-pieces of the byte-level tokenizer: a character U+1F000..U+1F7FF (emoji and
# pictographs) is four UTF-8 bytes F0 9F xx yy, written as two tokens, a lead piece
# (F0 9F xx) and a continuation byte (yy), so a reply cut by max_tokens can end inside one.
EMOJI_BYTES = range(0x80, 0xA0)


def byte_chars() -> dict:
    """GPT-2's byte -> printable character table, as a ByteLevel tokenizer writes bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def write_byte_tokenizer(path: Path, alphabet: str = ALPHABET):
    """A byte-level BPE tokenizer (mlx-lm streams it with its BPE detokenizer): specials,
    one token per character of ``alphabet``, then emoji pieces; merges make an emoji encode
    as its lead piece and its last byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    b = byte_chars()
    lead = b[0xF0] + b[0x9F]
    tokens = SPECIALS + [b[ord(c)] for c in alphabet if c not in ":"] + [b[ord(":")]]
    tokens += [b[0xF0], b[0x9F], lead] + [b[x] for x in EMOJI_BYTES if x != 0x9F]
    tokens += [lead + b[x] for x in EMOJI_BYTES]
    merges = [(b[0xF0], b[0x9F])] + [(lead, b[x]) for x in EMOJI_BYTES]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    save_tokenizer(tok, path)
    return len(tokens)


def target_config(family: str, vocab_size: int, hidden: int = 64, layers: int = 4, head_dim: int = 16,
                  window: int = 8) -> dict:
    base = dict(
        model_type=family, hidden_size=hidden, num_hidden_layers=layers,
        intermediate_size=2 * hidden, num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-6, vocab_size=vocab_size, rope_theta=10000.0,
        max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=1,
    )
    if family == "qwen3":
        base.update(head_dim=head_dim)
    elif family == "qwen3_moe":
        base.update(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    elif family in ("qwen3_5", "qwen3_next"):
        base.update(
            head_dim=head_dim, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            full_attention_interval=2, partial_rotary_factor=0.5,
        )
        if family == "qwen3_5":
            base["rope_parameters"] = {"type": "default", "rope_theta": 10000.0,
                                       "partial_rotary_factor": 0.5}
        else:
            base.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32, decoder_sparse_step=1,
                        mlp_only_layers=[], norm_topk_prob=True)
    elif family == "qwen2":
        base.update(tie_word_embeddings=True)
    elif family == "llama_sliding":  # mlx-lm's RotatingKVCache on every other layer
        base.update(model_type="llama", head_dim=16, sliding_window=window,
                    layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    elif family == "qwen3_5_moe":  # the hybrid MoE (Qwen3.6-35B-A3B's class), text fields nested
        text = target_config("qwen3_next", vocab_size, hidden, layers, head_dim, window)
        text.update(model_type="qwen3_5_moe_text",
                    rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
        base = dict(model_type="qwen3_5_moe", text_config=text, tie_word_embeddings=False, eos_token_id=1)
    elif family == "muse_glimmer":  # [local x3, global]: RoPE + window on locals, NoPE globals
        base.update(head_dim=head_dim, sliding_window=window, qk_scale_factor=3.87,
                    final_logit_softcapping=20.0, output_multiplier=0.2)
    elif family in ("gemma4_text", "gemma4"):
        # Sliding/global pattern, the globals' own head size, KV shared by the last layers
        # (mlx-lm makes no cache for those), per-layer inputs, logit softcapping.
        text = dict(base, model_type="gemma4_text", head_dim=head_dim, global_head_dim=2 * head_dim,
                    sliding_window=window, sliding_window_pattern=2, num_kv_shared_layers=layers // 2,
                    layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                    hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab_size,
                    tie_word_embeddings=True, final_logit_softcapping=30.0, use_double_wide_mlp=True)
        text.pop("rope_theta")
        base = text if family == "gemma4_text" else dict(
            model_type="gemma4", text_config=text, vocab_size=vocab_size, eos_token_id=1,
            tie_word_embeddings=True)
    return base


def make_target(path, family: str = "qwen3", seed: int = 0, hidden: int = 64, layers: int = 4,
                alphabet: str = ALPHABET, scale: float = 1.0, byte_level: bool = False, head_dim: int = 16,
                window: int = 8):
    """Write a random mlx-lm model directory of ``family`` with the char tokenizer (or, with
    ``byte_level``, the byte-level one with emoji pieces)."""
    path = Path(path)
    vocab = (write_byte_tokenizer if byte_level else write_tokenizer)(path, alphabet)
    config = target_config(family, vocab, hidden, layers, head_dim, window)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    if scale != 1.0:
        # Sharper logits make the random target's greedy choices far from ties.
        params = {k: v * scale if k.endswith("lm_head.weight") or "embed_tokens" in k else v
                  for k, v in params.items()}
    params = {k: v.astype(mx.float32) for k, v in params.items()}
    mx.save_safetensors(str(path / "model.safetensors"), params)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def drafter_config(target_path, version: int = 2, layers: int = 2, block_size: int = 8,
                   target_layer_ids=(1, 2), **overrides) -> dict:
    t = json.loads((Path(target_path) / "config.json").read_text())
    t = {**t, **t.get("text_config", {})}
    cfg = dict(
        architectures=["DFlash2DraftModel" if version == 2 else "DFlashDraftModel"],
        model_type="qwen3", hidden_size=t["hidden_size"], num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=2 * t["hidden_size"], vocab_size=t["vocab_size"],
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096,
        num_target_layers=t["num_hidden_layers"],
        dflash_config=dict(block_size=block_size, mask_token_id=SPECIALS.index("<mask>"),
                           target_layer_ids=list(target_layer_ids)),
    )
    if version == 2:
        cfg["dflash_config"].update(conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                                    selector_top_k=4)
        cfg["is_causal"] = False
    for k, v in overrides.items():
        (cfg["dflash_config"] if k in cfg["dflash_config"] else cfg)[k] = v
    return cfg


def make_drafter(path, target_path, version: int = 2, seed: int = 1, randomize_conv: bool = True,
                 draft_vocab=None, **kw):
    """Write a random drafter checkpoint (published format) for the target at ``target_path``;
    ``draft_vocab``: token ids it may propose (a draft vocabulary)."""
    from dflash2_mlx.model.config import DrafterConfig
    from dflash2_mlx.model.drafter import Drafter
    from dflash2_mlx.model.checkpoint import save_drafter

    if draft_vocab is not None:
        kw["draft_vocab_size"] = len(draft_vocab)
    cfg = DrafterConfig.from_dict(drafter_config(target_path, version, **kw))
    mx.random.seed(seed)
    drafter = Drafter(cfg)
    if draft_vocab is not None:
        drafter.draft_vocab = mx.array(draft_vocab, dtype=mx.int32)
    if version == 2 and randomize_conv:
        # Non-trivial convs and selector, so the v2 paths change the result.
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.kernel_projection.weight = 0.1 * mx.random.normal(conv.kernel_projection.weight.shape)
                conv.base_kernel = conv.base_kernel + 0.1 * mx.random.normal(conv.base_kernel.shape)
        sel = drafter.candidate_selector
        sel.successor_codebook = mx.random.normal(sel.successor_codebook.shape)
    save_drafter(drafter, path)
    return Path(path)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    make_target(out / "target", "qwen3", hidden=int(sys.argv[2]) if len(sys.argv) > 2 else 64)
    make_drafter(out / "drafter", out / "target", version=2)
    print(out / "target", out / "drafter")


def abcd_pair(root):
    """A qwen3 target over "abcd" (seed 3) and a DFlash 2 drafter for it (seed 11), written
    under ``root`` and loaded: (model, tokenizer, drafter)."""
    import dflash2_mlx as d

    make_target(root / "t", "qwen3", alphabet="abcd", seed=3)
    make_drafter(root / "d", root / "t", version=2, seed=11)
    return d.load(str(root / "t"), str(root / "d"))


def on_worker(fn, *a, **kw):
    """``fn(*a, **kw)`` on the backend's MLX worker thread (MLX work must stay on one thread)."""
    from dflash2_mlx.backend.worker import worker

    return worker().submit(fn, *a, **kw).result()


def worker_reference(target_path, drafter_path):
    """``dflash2_mlx.generate`` on a pair, run on the backend's MLX worker thread: the
    reference the engine and the server are compared with."""
    from dflash2_mlx import generate, load

    model, tokenizer, drafter = on_worker(load, str(target_path), str(drafter_path))

    def ref(prompt, **kw):
        return on_worker(generate, model, tokenizer, prompt, drafter, **kw)

    return ref


def looping_pair(path):
    """A target whose greedy token never changes and a drafter that proposes another token
    (every draft rejected) until its final norm's sign is flipped to ``only0`` (every draft
    accepted): embedding channel 0 is huge for every token and both final norms keep only
    that channel.  Returns (model, tokenizer, drafter, only0)."""
    import mlx.core as mx

    import dflash2_mlx as d

    make_target(path / "t", "qwen3", alphabet="abcdefgh")
    make_drafter(path / "d", path / "t", version=2)
    model, tok, drafter = d.load(str(path / "t"), str(path / "d"))
    model.model.embed_tokens.weight = model.model.embed_tokens.weight.at[:, 0].add(1000.0)
    only0 = mx.zeros((model.args.hidden_size,)).at[0].add(1.0)
    model.model.norm.weight = only0
    drafter.norm.weight = -only0
    return model, tok, drafter, only0


def thinking_pair(path, reply: str = "hm</think>ok"):
    """A qwen3 target whose greedy reply to any chat prompt (its template opens a think
    block) is ``reply`` then <eos>, and a random DFlash 2 drafter: every layer's output
    projections are zero, so each position's state is its token's embedding, and the LM head
    maps each token of the chain <think>, reply's tokens (all different), to the next one."""
    import mlx.core as mx

    path = Path(path)
    vocab = write_tokenizer(path / "t", thinking=True)
    config = target_config("qwen3", vocab, hidden=64, layers=2)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    ids = json.loads((path / "t" / "tokenizer.json").read_text())["model"]["vocab"]
    chain, i = ["<think>"], 0
    while i < len(reply):
        tag = next((t for t in ("</think>", "<think>") if reply.startswith(t, i)), reply[i])
        chain.append(tag)
        i += len(tag)
    chain.append("<eos>")
    embed = mx.zeros((vocab, 64)).at[mx.arange(vocab), mx.arange(vocab) % 64].add(1.0)
    head = mx.zeros((vocab, 64))
    for a, b in zip(chain, chain[1:]):
        head = head.at[ids[b], ids[a] % 64].add(10.0)
    for k in params:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            params[k] = mx.zeros_like(params[k])
    params["model.embed_tokens.weight"], params["lm_head.weight"] = embed, head
    mx.save_safetensors(str(path / "t" / "model.safetensors"), params)
    (path / "t" / "config.json").write_text(json.dumps(config, indent=1))
    make_drafter(path / "d", path / "t", version=2, target_layer_ids=(0, 1))
    return path / "t", path / "d"
