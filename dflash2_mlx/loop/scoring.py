"""A prompt's own log-probabilities under the target: what the legacy completions API
returns with ``echo`` and ``logprobs`` (lm-eval's loglikelihood requests)."""

from typing import List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..kernels.selector import top_candidates

# Rows of full-vocabulary log-probabilities held at once: bounds the memory of scoring a long prompt.
CHUNK = 256


def prompt_logprobs(model, ids: List[int], top: int = 0, chunk: int = CHUNK,
                    cache: Optional[list] = None) -> Tuple[List[float], List[List[Tuple[int, float]]]]:
    """For each token of ``ids`` after the first: its log-probability given the tokens
    before it, and the ``top`` most likely tokens there with theirs (most likely first).
    One teacher-forced pass of the target (raw logits, as mlx-lm's generation reports them
    before any logits processor), in chunks of rows. ``cache`` (an empty prompt cache):
    it ends holding every token but the last, from which decoding can go on."""
    cache = make_prompt_cache(model) if cache is None else cache
    token_lps: List[float] = []
    tops: List[List[Tuple[int, float]]] = []
    for lo in range(0, len(ids) - 1, chunk):
        hi = min(lo + chunk, len(ids) - 1)
        logits = model(mx.array(ids[lo:hi])[None], cache=cache)[0].astype(mx.float32)
        lps = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nxt = mx.array(ids[lo + 1 : hi + 1])
        picked = mx.take_along_axis(lps, nxt[:, None], axis=-1)[:, 0]
        if top:
            idx, vals = top_candidates(lps, top)
            mx.eval(picked, idx, vals)
            tops.extend(list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist()))
        else:
            mx.eval(picked)
            tops.extend([] for _ in range(hi - lo))
        token_lps.extend(picked.tolist())
    return token_lps, tops
