"""The DFlash / DFlash 2 drafter: Qwen3-style blocks whose attention also reads
the target's features as extra keys and values.

Block rows [anchor, MASK, ...] query; keys/values are [context rows; block rows].
Context rows sit at absolute positions 0..S-1 and the block at S..S+B-1 (S = the
anchor's position).  The drafter owns no embedding and no LM head: ``bind``
attaches the target's, which stay frozen.
"""

from typing import Callable, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from .. import kernels
from ..kernels.selector import top_candidates
from ..request import sampling
from .config import DrafterConfig


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        hd = cfg.head_dim
        self.scale = hd**-0.5
        H = cfg.hidden_size
        self.q_proj = nn.Linear(H, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, H, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.rope = initialize_rope(
            hd, base=cfg.rope_theta, traditional=False,
            scaling_config=cfg.rope_scaling,
            max_position_embeddings=cfg.max_position_embeddings,
        )

    def _heads(self, x, proj, n):
        B, L, _ = x.shape
        return proj(x).reshape(B, L, n, -1).transpose(0, 2, 1, 3)

    def keys_values(self, x, offset):
        """Rotated keys and values of rows starting at absolute position ``offset``."""
        k = self.rope(self.k_norm(self._heads(x, self.k_proj, self.n_kv_heads)), offset=offset)
        return k, self._heads(x, self.v_proj, self.n_kv_heads)

    def __call__(self, x, ctx_keys, ctx_values, offset, mask=None):
        B, L, _ = x.shape
        q = self.rope(self.q_norm(self._heads(x, self.q_proj, self.n_heads)), offset=offset)
        k, v = self.keys_values(x, offset)
        if ctx_keys is not None:
            k = mx.concatenate([ctx_keys.astype(k.dtype), k], axis=2)
            v = mx.concatenate([ctx_values.astype(v.dtype), v], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DynamicConv(nn.Module):
    """DFlash 2's two-tap dynamic conv around a sublayer (meaning: ``kernels.conv``).

    ``prepare`` convolves the sublayer input (side 0) and keeps the dynamic taps,
    ``finish`` convolves the sublayer output (side 1) with the taps computed from the same
    input.  The base kernel starts as the identity (tap 0 = 1, tap 1 = 0) and the projection
    at zero, so a fresh conv is an exact no-op and a v1 drafter can be warm-started."""

    def __init__(self, hidden_size: int, group_size: int = 16, kernel_size: int = 2):
        super().__init__()
        if kernel_size != 2:
            raise ValueError("DFlash 2's dynamic conv has exactly two taps")
        self.hidden_size = hidden_size
        self.group_size = group_size
        base = mx.zeros((2, kernel_size, hidden_size))
        self.base_kernel = base.at[:, 0, :].add(1.0)  # [side, tap, channel]
        self.kernel_projection = nn.Linear(
            hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False
        )
        self.kernel_projection.weight = mx.zeros_like(self.kernel_projection.weight)

    def _conv(self, x, dyn, side):
        return kernels.dynamic_conv(x, dyn[..., side, :, :], self.base_kernel[side])

    def prepare(self, u: mx.array):
        dyn = self.kernel_projection(u)
        dyn = dyn.reshape(*u.shape[:-1], 2, 2, self.hidden_size // self.group_size)
        return self._conv(u, dyn, 0), dyn

    def finish(self, y: mx.array, dyn: mx.array) -> mx.array:
        return self._conv(y, dyn, 1)


class CandidateSelector(nn.Module):
    """DFlash 2's path selector (meaning: ``kernels.selector``)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int = 256, top_k: int = 16):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = mx.random.normal((vocab_size, rank)) * rank**-0.5
        # Zero successor codebook: scores start as the drafter's logits (v1 behaviour).
        self.successor_codebook = mx.zeros((vocab_size, rank))

    def __call__(self, logits, hidden, anchor, temperature=0.0, uniforms=None, vocab=None):
        """Candidates (token ids), the walked path and its q rows for a drafted block.

        logits: [..., T, V] at block positions 1..B-1; hidden: [..., T, H] the
        final-normed drafter states at the same positions; anchor: [...]; vocab: the
        token ids of the logits' columns when they cover a draft vocabulary.
        Scoring and walking are one fused kernel on Metal (the twins elsewhere).
        """
        cand, unary = top_candidates(logits, self.top_k)
        if vocab is not None:
            cand = vocab[cand]
        gate = self.hidden_projection(hidden)
        _, path, q = kernels.select(unary, cand, gate, anchor, self.predecessor_codebook,
                            self.successor_codebook, temperature, uniforms)
        return cand, path, q


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, index: int):
        super().__init__()
        H = cfg.hidden_size
        self.sliding = cfg.is_sliding(index)
        self.window = cfg.sliding_window
        self.causal = cfg.block_is_causal(index)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        if cfg.version == 2:
            self.attention_conv = DynamicConv(H, cfg.conv_group_size, cfg.conv_kernel_size)
            self.mlp_conv = DynamicConv(H, cfg.conv_group_size, cfg.conv_kernel_size)

    def __call__(self, h, ctx_keys, ctx_values, offset, mask=None):
        conv = "attention_conv" in self
        x = self.input_layernorm(h)
        if conv:
            x, dyn = self.attention_conv.prepare(x)
        a = self.self_attn(x, ctx_keys, ctx_values, offset, mask)
        h = h + (self.attention_conv.finish(a, dyn) if conv else a)
        x = self.post_attention_layernorm(h)
        if conv:
            x, dyn = self.mlp_conv.prepare(x)
        m = self.mlp(x)
        return h + (self.mlp_conv.finish(m, dyn) if conv else m)


def block_mask(ctx_len: int, block: int, causal: bool):
    """Boolean [block, ctx + block] mask of one drafted block; None when it sees all."""
    if not causal:
        return None
    inner = mx.tril(mx.ones((block, block), dtype=mx.bool_))
    return mx.concatenate([mx.ones((block, ctx_len), dtype=mx.bool_), inner], axis=1)


class Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.layers = [DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        if cfg.version == 2:
            self.candidate_selector = CandidateSelector(
                H, cfg.vocab_size, cfg.selector_rank, cfg.selector_top_k
            )
        if cfg.draft_vocab_size:
            # The token ids the drafter may propose (most frequent first); its logits cover
            # only these rows of the target's LM head.  Data, not a weight: never trained.
            self.draft_vocab = mx.arange(cfg.draft_vocab_size, dtype=mx.int32)
            self.freeze(keys=["draft_vocab"], recurse=False)
        self.activation_dtype = mx.float32
        # True when the target gives ``fc``'s rows rather than the tapped layers (a target split
        # into a pipeline sums each rank's columns of ``fc`` over its own taps).
        self.features_projected = False
        object.__setattr__(self, "_embed", None)
        object.__setattr__(self, "_head", None)

    @property
    def version(self) -> int:
        return self.config.version

    def bind(self, embed: Callable, head: Callable):
        """Use the target's (scaled) embedding and LM head; they are not drafter weights.

        With a draft vocabulary, ``head`` computes only the rows of ``draft_vocab``."""
        object.__setattr__(self, "_embed", embed)
        object.__setattr__(self, "_head", head)

    def make_cache(self) -> List[KVCache]:
        return [KVCache() for _ in self.layers]

    def embed(self, ids: mx.array) -> mx.array:
        x = self._embed(ids) * self.config.input_embedding_scale
        return x.astype(self.activation_dtype)

    @property
    def vocab(self):
        """The draft vocabulary (token ids), or None when the drafter drafts over all."""
        return self.draft_vocab if "draft_vocab" in self else None

    def token_ids(self, idx: mx.array) -> mx.array:
        """Token ids of indices into ``logits``' last axis."""
        return idx if self.vocab is None else self.vocab[idx]

    def full_rows(self, q: mx.array, ids: mx.array = None) -> mx.array:
        """Rows ``q`` over the token ids ``ids`` (default: the draft vocabulary) scattered
        into rows over the whole vocabulary, zero elsewhere."""
        if ids is None:
            if self.vocab is None:
                return q
            ids = mx.broadcast_to(self.vocab, q.shape)
        out = mx.zeros((*q.shape[:-1], self.config.vocab_size), dtype=q.dtype)
        return mx.put_along_axis(out, ids, q, axis=-1)

    def logits(self, h: mx.array) -> mx.array:
        """Draft logits over the draft vocabulary (the whole vocabulary when there is none)."""
        out = self._head(h).astype(mx.float32) * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            out = mx.tanh(out / cap) * cap
        return out

    def context(self, features: mx.array) -> mx.array:
        """Target features [.., n * H] (tapped layers concatenated) -> context rows; features
        already through ``fc`` [.., H] (``features_projected``) skip it."""
        x = features.astype(self.activation_dtype)
        return self.hidden_norm(x if self.features_projected else self.fc(x))

    def append_context(self, features: mx.array, cache: List[KVCache]):
        """Add the K/V of newly committed tokens to the draft cache."""
        if features is None or features.shape[1] == 0:
            return
        ctx = self.context(features)
        offset = cache[0].offset
        for layer, c in zip(self.layers, cache):
            c.update_and_fetch(*layer.self_attn.keys_values(ctx, offset))

    def __call__(self, block_ids: mx.array, cache: List[KVCache]) -> mx.array:
        """Final-normed hidden states [batch, B, H] of a block whose anchor sits right
        after the cached context."""
        h = self.embed(block_ids)
        offset = cache[0].offset
        B = block_ids.shape[1]
        for layer, c in zip(self.layers, cache):
            k = v = None
            if c.offset:
                k, v = c.keys_and_values()
                if layer.sliding and c.offset >= layer.window:
                    k, v = k[..., -(layer.window - 1):, :], v[..., -(layer.window - 1):, :]
            ctx_len = 0 if k is None else k.shape[2]
            mask = block_mask(ctx_len, B, layer.causal)
            h = layer(h, k, v, offset, mask)
        return self.norm(h)


def propose(drafter: Drafter, hidden: mx.array, anchor: mx.array, params, logits: Optional[mx.array] = None):
    """Draft tokens for block positions 1..B-1 and the rows ``q`` they came from.

    hidden: [1, B, H] drafter states of the block (``logits``: the drafter's of positions
    1..B-1, when the caller has them).  v1 picks per position (argmax or a sample of the
    drafter's own distribution); v2 walks the selector's lattice.  ``q`` is [B-1, V] over
    the whole vocabulary (None at temperature 0)."""
    h = hidden[0, 1:]
    logits = drafter.logits(h) if logits is None else logits
    if drafter.version == 1:
        if params.greedy:
            return drafter.token_ids(mx.argmax(logits, axis=-1)), None
        q = sampling.probs(sampling.log_softmax(logits), params)
        return drafter.token_ids(mx.random.categorical(mx.log(q))), drafter.full_rows(q)
    uniforms = None if params.greedy else mx.random.uniform(shape=(h.shape[0],))
    cand, path, rows = drafter.candidate_selector(logits, h, anchor, params.temp, uniforms,
                                                  vocab=drafter.vocab)
    tokens = mx.take_along_axis(cand, path[:, None], axis=-1)[:, 0]
    if params.greedy:
        return tokens, None
    return tokens, drafter.full_rows(rows.astype(mx.float32), cand)


def first_row(drafter: Drafter, hidden: mx.array, anchor: mx.array, params) -> mx.array:
    """The row [V] that ``propose`` would draw block position 1 from (temperature > 0),
    without drawing: position 1 follows only the anchor, so the walk's uniform is moot."""
    h = hidden[0, 1:2]
    logits = drafter.logits(h)
    if drafter.version == 1:
        return drafter.full_rows(sampling.probs(sampling.log_softmax(logits), params))[0]
    cand, _, rows = drafter.candidate_selector(logits, h, anchor, params.temp, mx.zeros((1,)),
                                               vocab=drafter.vocab)
    return drafter.full_rows(rows.astype(mx.float32), cand)[0]
