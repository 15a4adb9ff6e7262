"""The DFlash draft -> propose -> verify -> accept cycle.

Each cycle: the drafter fills a block [anchor, MASK...] in one pass, the drafted
tokens are proposed (argmax / sample / selector walk), the target verifies the
whole block in one pass, the accepted prefix plus the target's own next token is
committed, the target cache is rolled back to that point and the draft cache gets
the committed tokens' features.  Yields (token, logprobs, from_draft, stats) per token.
"""

from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional

import mlx.core as mx

from .drafter import Drafter, propose
from .sampling import (SamplingParams, accept_greedy, accept_sampled, probs,
                       processed_logprobs, sample)
from .target import Target, rollback, snapshot


@dataclass
class CycleStats:
    """Draft statistics of one generation, updated after every cycle."""
    block_size: int
    cycles: int = 0
    accepted: int = 0  # draft tokens accepted in the latest cycle
    total_accepted: int = 0
    position_accepted: List[int] = field(default_factory=list)

    def __post_init__(self):
        self.position_accepted = [0] * max(self.block_size - 1, 0)

    def record(self, accepted: int):
        self.cycles += 1
        self.accepted = accepted
        self.total_accepted += accepted
        for i in range(accepted):
            self.position_accepted[i] += 1

    @property
    def tau(self) -> float:
        """Mean acceptance length: accepted draft tokens + the target's bonus token."""
        return (self.total_accepted + self.cycles) / self.cycles if self.cycles else 0.0


def prefill(target: Target, prompt: mx.array, cache, step: int = 2048):
    """Run the prompt through the target in chunks; last logits and all features."""
    feats = []
    for i in range(0, prompt.size, step):
        logits, f = target(prompt[None, i : i + step], cache)
        mx.eval(logits, f)
        feats.append(f)
    return logits[0, -1:], mx.concatenate(feats, axis=1)


def speculative_generate_step(
    prompt: mx.array,
    target: Target,
    drafter: Drafter,
    *,
    max_tokens: int = 256,
    params: SamplingParams = SamplingParams(),
    logits_processors: Optional[List[Callable]] = None,
    block_size: int = 5,
    prefill_step_size: int = 2048,
    prompt_cache: Optional[list] = None,
) -> Iterator:
    cache = target.make_cache() if prompt_cache is None else prompt_cache
    draft_cache = drafter.make_cache()
    stats = CycleStats(block_size)
    mask = drafter.config.mask_token_id

    logits, features = prefill(target, prompt, cache, prefill_step_size)
    drafter.append_context(features, draft_cache)
    history = prompt
    logprobs = processed_logprobs(logits, prompt[:-1], prompt[-1:], logits_processors)
    anchor = int(sample(logprobs, params)[0].item())
    yield anchor, logprobs[0], False, stats
    emitted = 1

    while emitted < max_tokens:
        block = mx.array([[anchor] + [mask] * (block_size - 1)])
        # Draft + propose: one drafter pass, then per-position picks or the selector walk.
        if block_size > 1:
            hidden = drafter(block, draft_cache)
            draft, q = propose(drafter, hidden, mx.array(anchor), params)
        else:
            draft, q = mx.array([], dtype=mx.int32), None
        # Verify: one target pass over [anchor, d1 .. d_{B-1}].
        verify = mx.concatenate([mx.array([anchor]), draft.astype(mx.int32)])
        saved = snapshot(cache)
        logits, features = target(verify[None], cache)
        logprobs = processed_logprobs(logits[0], history, verify, logits_processors)
        # Accept: greedy prefix match, or rejection sampling against q.
        if params.greedy:
            accepted, bonus = accept_greedy(mx.argmax(logprobs, axis=-1), draft)
        else:
            accepted, bonus = accept_sampled(probs(logprobs, params), q, draft)
        kept = verify[: accepted + 1]
        rollback(target, cache, saved, verify.size, kept[None])
        drafter.append_context(features[:, : accepted + 1], draft_cache)
        history = mx.concatenate([history, kept])
        stats.record(accepted)

        for i, token in enumerate(draft[:accepted].tolist() + [bonus]):
            yield token, logprobs[i], i < accepted, stats
            emitted += 1
            if emitted >= max_tokens:
                return
        anchor = bonus
