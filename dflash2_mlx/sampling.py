"""Target and draft distributions, and the accept rules of verification.

``p`` is exactly what a plain mlx-lm run samples from: logits processors (with the
token history up to that row), log-softmax, then mlx-lm's own top-p, min-p and
top-k filters in its order, then ``softmax(logprobs / temp)``.  Rejection sampling
then makes every emitted token distributed as under ``p``, whatever ``q`` was.
"""

from dataclasses import dataclass
from typing import Callable, List, Optional

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


@dataclass
class SamplingParams:
    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    min_tokens_to_keep: int = 1

    def __post_init__(self):
        if self.temp < 0:
            raise ValueError(f"temp must be >= 0, got {self.temp}")
        if not 0 < self.top_p <= 1.0 and self.top_p != 0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temp == 0


def processed_logprobs(logits: mx.array, history: mx.array, block: mx.array,
                       processors: Optional[List[Callable]]) -> mx.array:
    """Log-softmax of each row of ``logits`` [L, V] after the logits processors.

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
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def filtered(logprobs: mx.array, params: SamplingParams) -> mx.array:
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p != 0.0:
        logprobs = apply_min_p(logprobs, params.min_p, params.min_tokens_to_keep)
    if params.top_k > 0:
        logprobs = apply_top_k(logprobs, params.top_k)
    return logprobs


def probs(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """The distribution mlx-lm's sampler draws from, for temp > 0."""
    return mx.softmax(filtered(logprobs, params) * (1.0 / params.temp), axis=-1, precise=True)


def sample(logprobs: mx.array, params: SamplingParams) -> mx.array:
    if params.greedy:
        return mx.argmax(logprobs, axis=-1)
    return mx.random.categorical(filtered(logprobs, params) * (1.0 / params.temp))


def accept_greedy(target_tokens: mx.array, draft: mx.array):
    """Longest prefix where the draft equals the target's argmax, and the bonus token."""
    n = draft.shape[0]
    match = (draft == target_tokens[:n]).tolist()
    accepted = next((i for i, m in enumerate(match) if not m), n)
    return accepted, int(target_tokens[accepted].item())


def accept_sampled(p: mx.array, q: mx.array, draft: mx.array):
    """Speculative rejection sampling.

    p: [n + 1, V] target rows (row i is the distribution of draft[i]; row n the bonus);
    q: [n, V] the rows the draft tokens were sampled from.
    Accept draft[i] while u * q(d) < p(d); at the first rejection sample from
    normalize(max(p - q, 0)); when all are accepted, sample the bonus from p[n].
    """
    n = draft.shape[0]
    if n:
        idx = draft[:, None]
        p_d = mx.take_along_axis(p[:n], idx, axis=-1)[:, 0]
        q_d = mx.take_along_axis(q, idx, axis=-1)[:, 0]
        u = mx.random.uniform(shape=(n,))
        ok = (u * q_d < p_d).tolist()
        accepted = next((i for i, m in enumerate(ok) if not m), n)
    else:
        accepted = 0
    if accepted < n:
        residual = mx.maximum(p[accepted] - q[accepted], 0)
        token = mx.random.categorical(mx.log(residual))
    else:
        token = mx.random.categorical(mx.log(p[n]))
    return accepted, int(token.item())
