"""Target and draft distributions, and the accept rules of verification.

``p`` is exactly what a plain mlx-lm run samples from: logits processors (with the
token history up to that row), log-softmax, then mlx-lm's own top-p, min-p, XTC and
top-k filters in its order, then ``softmax(logprobs / temp)``.  Rejection sampling
then makes every emitted token distributed as under ``p``, whatever ``q`` was.

XTC ("exclude top choices") is a coin flip per token in mlx-lm: with probability
``xtc_probability`` the tokens above ``xtc_threshold`` but the least likely of them are
removed.  The token a plain step emits is then drawn from the mixture
``(1 - P) * p_kept + P * p_removed``, and that mixture is this module's ``p``.
"""

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


@dataclass
class SamplingParams:
    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    min_tokens_to_keep: int = 1
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_special_tokens: Tuple[int, ...] = ()  # never removed by XTC (mlx-lm's CLI: "\n" and EOS)

    def __post_init__(self):
        if self.temp < 0:
            raise ValueError(f"temp must be >= 0, got {self.temp}")
        if not 0 < self.top_p <= 1.0 and self.top_p != 0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.min_tokens_to_keep < 1:
            raise ValueError(f"min_tokens_to_keep must be >= 1, got {self.min_tokens_to_keep}")
        if not 0 <= self.xtc_probability <= 1.0:
            raise ValueError(f"xtc_probability must be in [0, 1], got {self.xtc_probability}")
        if not 0 <= self.xtc_threshold <= 0.5:
            raise ValueError(f"xtc_threshold must be in [0, 0.5], got {self.xtc_threshold}")
        self.xtc_special_tokens = tuple(int(t) for t in self.xtc_special_tokens)

    @property
    def greedy(self) -> bool:
        return self.temp == 0


def processed_logits(logits: mx.array, history: mx.array, block: mx.array,
                     processors: Optional[List[Callable]]) -> mx.array:
    """Rows of ``logits`` [L, V] in float32 after the logits processors.

    Row i follows ``history`` + ``block[: i + 1]``, as in a plain decode."""
    logits = logits.astype(mx.float32)
    if processors:
        rows = []
        for i in range(logits.shape[0]):
            tokens = mx.concatenate([history, block[: i + 1]])
            row = logits[i : i + 1]
            for proc in processors:
                row = proc(tokens, row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    return logits


def log_softmax(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def processed_logprobs(logits: mx.array, history: mx.array, block: mx.array,
                       processors: Optional[List[Callable]]) -> mx.array:
    """Log-softmax of each row of ``logits`` [L, V] after the logits processors."""
    return log_softmax(processed_logits(logits, history, block, processors))


def xtc_removed(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """``logprobs`` with XTC's cut made (mlx-lm's ``apply_xtc`` when its coin says cut):
    every token whose probability beats the least likely one above the threshold goes,
    but the special tokens."""
    p = mx.softmax(logprobs, axis=-1)
    least = mx.where(p > params.xtc_threshold, p, mx.inf).min(axis=-1, keepdims=True)
    cut = p > least
    if params.xtc_special_tokens:
        special = mx.zeros((logprobs.shape[-1],), dtype=mx.bool_)
        special[mx.array(params.xtc_special_tokens)] = True
        cut = cut & ~special
    return mx.where(cut, -mx.inf, logprobs)


def _nucleus(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """mlx-lm's chain before XTC: top-p, then min-p."""
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p != 0.0:
        logprobs = apply_min_p(logprobs, params.min_p, params.min_tokens_to_keep)
    return logprobs


def _top_k(logprobs: mx.array, params: SamplingParams) -> mx.array:
    return apply_top_k(logprobs, params.top_k) if params.top_k > 0 else logprobs


def filtered(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """mlx-lm's sampler chain where XTC's coin says keep (or XTC is off)."""
    return _top_k(_nucleus(logprobs, params), params)


def probs(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """The distribution mlx-lm's sampler draws from, for temp > 0."""
    kept = _nucleus(logprobs, params)  # shared by both of XTC's branches
    p = mx.softmax(_top_k(kept, params) * (1.0 / params.temp), axis=-1, precise=True)
    if params.xtc_probability > 0:
        cut = mx.softmax(_top_k(xtc_removed(kept, params), params) * (1.0 / params.temp), axis=-1, precise=True)
        p = (1 - params.xtc_probability) * p + params.xtc_probability * cut
    return p


def sample(logprobs: mx.array, params: SamplingParams) -> mx.array:
    if params.greedy:
        return mx.argmax(logprobs, axis=-1)
    if params.xtc_probability > 0:
        return mx.random.categorical(mx.log(probs(logprobs, params)))
    return mx.random.categorical(filtered(logprobs, params) * (1.0 / params.temp))


def accept_greedy(target_tokens: mx.array, draft: mx.array):
    """Longest prefix where the draft equals the target's argmax, and the bonus token."""
    n = draft.shape[0]
    match = (draft == target_tokens[:n]).tolist()
    accepted = next((i for i, m in enumerate(match) if not m), n)
    return accepted, int(target_tokens[accepted].item())


def clear_winners(rows: mx.array, top: mx.array) -> bool:
    """Whether every row's largest value beats its runner-up by more than subtracting the
    log-sum can round away.  That subtraction keeps the order of any two values and can
    only round them into a tie.  Each result is off by at most half an ulp of its size: the
    largest's log-probability is within log(V) < 16 of 0 (under 8 eps off), the runner-up's
    within 16 + gap (under 8 eps + gap * eps / 2 off), so a gap above 64 eps keeps them apart."""
    best = mx.take_along_axis(rows, top[:, None], axis=-1)
    others = mx.put_along_axis(rows, top[:, None], mx.array(-mx.inf, dtype=rows.dtype), axis=-1)
    margin = 64 * mx.finfo(rows.dtype).eps
    return bool(mx.all(best - mx.max(others, axis=-1, keepdims=True) > margin).item())


def verify_greedy(logits: mx.array, draft: mx.array):
    """Greedy acceptance of ``draft`` [n] against processed target rows ``logits`` [n + 1, V]:
    (accepted, bonus, logprobs of the rows up to the bonus's).

    Acceptance follows the argmax of the log-probabilities, as a plain mlx-lm step does.
    A log-softmax costs ~0.6 ms a row here (an exp per vocabulary entry), so it is left lazy
    (computed only if a caller reads it) wherever the raw logits' argmax is sure to be the
    same (``clear_winners``); where a row's two largest logits are too close, the emitted
    rows' log-probabilities decide, and where those disagree with the raw argmax every row
    is computed."""
    top = mx.argmax(logits, axis=-1)
    accepted, _ = accept_greedy(top, draft)
    rows = logits[: accepted + 1]
    logprobs = log_softmax(rows)
    if clear_winners(rows, top[: accepted + 1]):
        return accepted, int(top[accepted].item()), logprobs
    chosen = mx.argmax(logprobs, axis=-1)
    if mx.array_equal(chosen, top[: accepted + 1]).item():
        return accepted, int(chosen[accepted].item()), logprobs
    logprobs = log_softmax(logits)
    accepted, bonus = accept_greedy(mx.argmax(logprobs, axis=-1), draft)
    return accepted, bonus, logprobs


def verify_sampled(logits: mx.array, q: mx.array, draft: mx.array, params: SamplingParams):
    """Speculative rejection sampling of ``draft`` [n] against processed target rows
    ``logits`` [n + 1, V]: (accepted, token, logprobs of the rows up to the token's).

    q: [n, V] the rows the draft tokens were sampled from; p: the target's rows as mlx-lm
    samples them (``probs``).  Accept draft[i] while u * q(d) < p(d); at the first
    rejection sample from normalize(max(p - q, 0)); when all are accepted, sample the bonus
    from p[n].  Rows are normalized one at a time up to the first rejection: each costs two
    exps per vocabulary entry, and the rows after a rejection are never used.  The
    uniforms are drawn all at once first, so a seed gives the same text however far it gets.
    """
    n = draft.shape[0]
    if n:
        u = mx.random.uniform(shape=(n,))
        q_d = mx.take_along_axis(q, draft[:, None], axis=-1)[:, 0]
    rows = []
    for i in range(n + 1):
        rows.append(log_softmax(logits[i : i + 1]))
        p = probs(rows[-1], params)[0]
        if i == n:
            token = mx.random.categorical(mx.log(p))
        elif not (u[i] * q_d[i] < p[draft[i]]).item():
            token = mx.random.categorical(mx.log(mx.maximum(p - q[i], 0)))
        else:
            continue
        return i, int(token.item()), mx.concatenate(rows)


def xtc_special_tokens(tokenizer) -> List[int]:
    """The tokens XTC never removes where mlx-lm's CLI and server sample: "\\n" and EOS."""
    return tokenizer.encode("\n") + list(tokenizer.eos_token_ids)
