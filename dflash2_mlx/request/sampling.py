"""Target and draft distributions, and the accept rules of verification.

``p`` is exactly what a plain mlx-lm run samples from: logits processors (with the
token history up to that row), log-softmax, then mlx-lm's own top-p, min-p, XTC and
top-k filters in its order, then ``softmax(logprobs / temp)``.  Rejection sampling
then makes every emitted token distributed as under ``p``, whatever ``q`` was.

XTC ("exclude top choices") is a coin flip per token in mlx-lm: with probability
``xtc_probability`` the tokens above ``xtc_threshold`` but the least likely of them are
removed.  The token a plain step emits is then drawn from the mixture
``(1 - P) * p_kept + P * p_removed``, and that mixture is this module's ``p``.

The accept rule is written once, as lazy verdicts (``greedy_verdicts``,
``sampled_verdicts``: which draft tokens pass, and the token drawn after each prefix) that
``accept`` reads, with its random draws made by ``accept_draws``.  A single stream
verifies with ``verify_greedy`` (the raw logits' argmax where it is sure to be the
log-probabilities') and ``verify_sampled`` (row by row, up to the first rejection); a batch
with ``verify_lazy`` (every row of every sequence, evaluated at once).  Both draw the same,
so a seeded sequence emits the same tokens in a batch as alone.
"""

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from .arguments import check_all


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
        check_all(temp=self.temp, top_p=self.top_p, min_p=self.min_p, top_k=self.top_k,
                  min_tokens_to_keep=self.min_tokens_to_keep, xtc_probability=self.xtc_probability,
                  xtc_threshold=self.xtc_threshold)
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


def accept_draws(n: int, vocab: int) -> Tuple[mx.array, mx.array]:
    """The accept rule's random draws, in their order: a uniform per draft token (none
    without a draft), then one gumbel draw per vocabulary entry for the token after the
    accepted drafts (``mx.random.categorical`` is the argmax of the log-probabilities plus
    such a draw).  All are drawn first, so a seed gives the same text however far a block
    gets, and a sequence draws the same in a batch as alone."""
    u = mx.random.uniform(shape=(n,)) if n else mx.zeros((0,))
    return u, mx.random.gumbel(shape=(vocab,))


def greedy_verdicts(top: mx.array, draft: mx.array) -> Tuple[mx.array, mx.array]:
    """Greedy verification, lazily: ok [n] (draft token i is the target's argmax ``top``
    [n + 1] there) and the candidates (``top``: the target's token after any prefix)."""
    return draft == top[: draft.shape[0]], top


def sampled_verdicts(p: mx.array, q: Optional[mx.array], draft: mx.array, u: mx.array,
                     noise: mx.array) -> Tuple[mx.array, mx.array]:
    """Speculative rejection sampling, lazily, on target rows ``p`` [k, V] (``probs``): the
    first m = len(draft) rows judge the draft tokens, drawn from the rows ``q`` [m, V], and a
    row past them is the bonus row.  ok [m]: u * q(d) < p(d), draft token i is accepted;
    candidates [k]: the token drawn if the first rejection is at row i, from
    normalize(max(p - q, 0)), or from p at the bonus row.  ``u``, ``noise``: ``accept_draws``."""
    m = draft.shape[0]
    if not m:
        return mx.zeros((0,), dtype=mx.bool_), mx.argmax(mx.log(p) + noise, axis=-1)
    idx = draft[:, None]
    ok = u * mx.take_along_axis(q, idx, axis=-1)[:, 0] < mx.take_along_axis(p[:m], idx, axis=-1)[:, 0]
    rows = mx.concatenate([mx.maximum(p[:m] - q, 0), p[m:]])
    return ok, mx.argmax(mx.log(rows) + noise, axis=-1)


def accept(ok: List[bool], candidates: List[int]) -> Tuple[int, int]:
    """The verdicts read: drafts accepted (up to the first rejection), and the token after them."""
    accepted = next((i for i, m in enumerate(ok) if not m), len(ok))
    return accepted, candidates[accepted]


def accept_greedy(target_tokens: mx.array, draft: mx.array) -> Tuple[int, int]:
    """Longest prefix where the draft equals the target's argmax, and the bonus token."""
    ok, candidates = greedy_verdicts(target_tokens, draft)
    return accept(ok.tolist(), candidates.tolist())


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
    A log-softmax costs an exp per vocabulary entry and row, so it is left lazy
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
    samples them (``probs``); the rule is ``sampled_verdicts``'.  Rows are normalized one at
    a time up to the first rejection: each costs two exps per vocabulary entry, and the
    rows after a rejection are never used.
    """
    n = draft.shape[0]
    u, noise = accept_draws(n, logits.shape[-1])
    rows = []
    for i in range(n + 1):
        rows.append(log_softmax(logits[i : i + 1]))
        ok, token = sampled_verdicts(probs(rows[-1], params), q[i : i + 1] if i < n else None,
                                     draft[i : i + 1], u[i : i + 1], noise)
        if i == n or not ok.item():
            return i, int(token.item()), mx.concatenate(rows)


def verify_lazy(logprobs: mx.array, draft: Optional[mx.array], q: Optional[mx.array],
                params: SamplingParams) -> Tuple[mx.array, mx.array]:
    """One sequence's verification as lazy verdicts (ok [n], candidates [n + 1]), so that a
    batch of them is evaluated at once and read by ``accept``: the rule and the draws of
    ``verify_greedy`` / ``verify_sampled``, on every row of processed ``logprobs`` at once.
    ``draft`` None: a plain step, drawn as ``sample`` draws it."""
    if draft is None:
        return mx.zeros((0,), dtype=mx.bool_), sample(logprobs, params)
    if params.greedy:
        return greedy_verdicts(mx.argmax(logprobs, axis=-1), draft)
    p = probs(logprobs, params)
    return sampled_verdicts(p, q, draft, *accept_draws(draft.shape[0], p.shape[-1]))


def xtc_special_tokens(tokenizer) -> List[int]:
    """The tokens XTC never removes where mlx-lm's CLI and server sample: "\\n" and EOS."""
    return tokenizer.encode("\n") + list(tokenizer.eos_token_ids)
