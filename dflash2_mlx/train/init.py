"""New drafters sized from a target, warm-started from the target's own layers, and DFlash 2
drafters warm-started from DFlash v1.

A new drafter copies the target's width (it must: it reads the target's features and
uses its embedding and LM head), heads, head size, MLP size, norm eps and RoPE, and
takes its depth, block size, tapped layers, mask token, selector rank / top-k from
the caller.  The config goes through ``DrafterConfig.from_dict`` of the published
format, so what is trained is what ``load_drafter`` reads back.

Warm start: the v2 drafter gets every v1 tensor; its convs are the identity (base tap 0
= 1, tap 1 = 0, zero projection) and its successor codebook is zero, so every pair
score equals the drafter's own logit and the greedy selector walk picks the argmax:
the warm-started drafter first drafts exactly what the v1 drafter drafted.

From the target: a drafter is as wide as its target and its layers have the same parts
(attention projections, MLP, two norms), so each can start as a copy of a target layer
(the last ones read the most contextual states) instead of from noise.
"""

from collections import Counter
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..model.config import DrafterConfig, V1_ARCH, V2_ARCH, default_target_layer_ids
from ..model.checkpoint import dequantized_weight
from ..model.drafter import Drafter
from ..model.target_model import model_args, text_model


def default_mask_token_id(tokenizer, vocab_size: int) -> int:
    """The tokenizer's mask token; else an embedding row no token uses; else pad; else the
    last id.  The row's embedding is the target's (frozen): the drafter learns to read it."""
    mask = getattr(tokenizer, "mask_token_id", None)
    if mask is not None and 0 <= mask < vocab_size:
        return int(mask)
    n = len(tokenizer.get_vocab()) if hasattr(tokenizer, "get_vocab") else vocab_size
    if n < vocab_size:
        return vocab_size - 1
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is not None and 0 <= pad < vocab_size:
        return int(pad)
    return vocab_size - 1


def new_drafter_config(target_model, *, version: int = 2, num_layers: int = 5,
                       block_size: int = 16, mask_token_id: int,
                       target_layer_ids: Optional[Sequence[int]] = None,
                       num_target_features: int = 5, intermediate_size: Optional[int] = None,
                       selector_rank: int = 256, selector_top_k: int = 16,
                       conv_group_size: int = 16,
                       draft_vocab_size: Optional[int] = None,
                       sliding_window: Optional[int] = None) -> DrafterConfig:
    args = model_args(target_model)
    depth = len(target_model.layers)
    ids = target_layer_ids
    if ids is None:
        ids = sorted(set(default_target_layer_ids(depth, min(num_target_features, depth))))
    H = args.hidden_size
    heads = args.num_attention_heads
    head_dim = getattr(args, "head_dim", None) or H // heads
    cfg = dict(
        architectures=[V2_ARCH if version == 2 else V1_ARCH],
        model_type="qwen3",
        hidden_size=H,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(args, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size or args.intermediate_size,
        vocab_size=args.vocab_size,
        rms_norm_eps=getattr(args, "rms_norm_eps", 1e-6),
        rope_theta=getattr(args, "rope_theta", 10000.0),
        rope_scaling=getattr(args, "rope_scaling", None),
        max_position_embeddings=getattr(args, "max_position_embeddings", None) or 40960,
        num_target_layers=depth,
        dflash_config=dict(block_size=block_size, mask_token_id=int(mask_token_id),
                           target_layer_ids=[int(i) for i in ids]),
    )
    if draft_vocab_size:
        cfg["dflash_config"]["draft_vocab_size"] = int(draft_vocab_size)
    if sliding_window:
        # Every layer reads only the latest context rows: a fresh attention finds the
        # rows that matter sooner, and a draft's cost stops growing with the context.
        cfg.update(layer_types=["sliding_attention"] * num_layers, sliding_window=int(sliding_window))
    if version == 2:
        cfg["is_causal"] = False
        cfg["dflash_config"].update(conv_kernel_size=2, conv_group_size=conv_group_size,
                                    selector_rank=selector_rank, selector_top_k=selector_top_k)
    return DrafterConfig.from_dict(cfg)


def new_drafter(cfg: DrafterConfig, seed: int = 0,
                draft_vocab: Optional[Sequence[int]] = None) -> Drafter:
    """A freshly initialised drafter (mlx defaults; v2 convs identity, successor zero)."""
    mx.random.seed(seed)
    drafter = Drafter(cfg)
    if cfg.draft_vocab_size:
        if draft_vocab is None or len(draft_vocab) != cfg.draft_vocab_size:
            raise ValueError(f"a drafter with draft_vocab_size {cfg.draft_vocab_size} needs that many token ids")
        drafter.draft_vocab = mx.array(list(draft_vocab), dtype=mx.int32)
    mx.eval(drafter.parameters())
    return drafter


def frequent_tokens(records, n: int, vocab_size: int) -> list:
    """A draft vocabulary: the ``n`` token ids most frequent in the dataset's responses
    (then its prompts), topped up with the lowest ids (BPE ranks merges by frequency)."""
    counts = Counter()
    for r in records:
        counts.update(r["response_ids"])
    prompt = Counter(t for r in records for t in r["prompt_ids"])
    ranked = [t for t, _ in counts.most_common()]
    ranked += [t for t, _ in prompt.most_common() if t not in counts]
    seen = set(ranked[:n])
    ranked = ranked[:n] + [t for t in range(vocab_size) if t not in seen][: max(0, n - len(seen))]
    return ranked


def warm_start_v2(v1: Drafter, *, selector_rank: int = 256, selector_top_k: int = 16,
                  conv_group_size: int = 16, seed: int = 0) -> Drafter:
    """A DFlash 2 drafter holding ``v1``'s weights, with no-op convs and a selector that
    starts as the drafter's own argmax."""
    if v1.version != 1:
        raise ValueError("warm_start_v2 takes a DFlash v1 drafter")
    raw = v1.config.to_dict()
    raw["architectures"] = [V2_ARCH]
    # is_causal stays as v1 had it (absent = causal iff sliding), unlike fresh v2 configs.
    raw["dflash_config"].update(conv_kernel_size=2, conv_group_size=conv_group_size,
                                selector_rank=selector_rank, selector_top_k=selector_top_k)
    v2 = new_drafter(DrafterConfig.from_dict(raw), seed)
    v2.load_weights(list(tree_flatten(v1.parameters())), strict=False)
    mx.eval(v2.parameters())
    return v2


LAYER_PARTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj",
               "mlp.down_proj", "input_layernorm", "post_attention_layernorm")


def _weight(module) -> mx.array:
    """A Linear's or norm's weight; a quantized Linear's dequantized."""
    return dequantized_weight(module) if isinstance(module, nn.QuantizedLinear) else module.weight


def warm_start_from_target(drafter: Drafter, target_model, layer_ids: Sequence[int]) -> Drafter:
    """Copy target layer ``layer_ids[i]``'s attention, MLP and norm weights into drafter
    layer i (parts the target lacks, such as Qwen3's q/k norms on a Llama, keep their init)."""
    layers = text_model(target_model).layers
    if len(layer_ids) != len(drafter.layers):
        raise ValueError(f"{len(layer_ids)} target layers given for {len(drafter.layers)} drafter layers")
    weights = []
    for i, j in enumerate(layer_ids):
        if not 0 <= j < len(layers):
            raise ValueError(f"target layer {j} does not exist (the target has {len(layers)})")
        for part in LAYER_PARTS:
            src, dst = layers[j], drafter.layers[i]
            for name in part.split("."):
                src, dst = getattr(src, name, None), getattr(dst, name)
            if src is None:
                continue
            w = _weight(src).astype(dst.weight.dtype)
            if w.shape != dst.weight.shape:
                raise ValueError(f"target layer {j} {part} is {w.shape}, drafter layer {i} needs "
                                 f"{dst.weight.shape}")
            weights.append((f"layers.{i}.{part}.weight", w))
    drafter.load_weights(weights, strict=False)
    mx.eval(drafter.parameters())
    return drafter
