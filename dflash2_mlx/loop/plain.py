"""Plain decode steps (block 1) between cycles: pipelined as mlx-lm's are, and now and then
carrying a shadow probe for the adaptive policy."""

from dataclasses import dataclass
from typing import List, Optional, Tuple

import mlx.core as mx

from ..adaptive import Policy
from ..model.drafter import Drafter, first_row, propose
from ..request.sampling import SamplingParams, probs, processed_logprobs, sample
from .draft_context import DraftContext
from .lookup import Lookup


def shadow_chance(drafter: Drafter, context: DraftContext, token: mx.array, step: tuple,
                  params: SamplingParams) -> mx.array:
    """The chance that a block-2 draft anchored at ``token`` would have been accepted,
    against the plain step ``step`` (token, logprobs) that follows it: 0 or 1 at T=0, else
    sum(min(p, q)) at position 1.  Only the policy reads it, and it draws nothing from the
    random stream, so the output is unchanged, seeded sampling included."""
    block = mx.concatenate([token.astype(mx.int32), mx.array([drafter.config.mask_token_id])])
    hidden = drafter(block[None], context.fed())
    if params.greedy:
        return (propose(drafter, hidden, token[0], params)[0][0] == step[0][0]).astype(mx.float32)
    return mx.minimum(probs(step[1][None], params)[0], first_row(drafter, hidden, token[0], params)).sum()


@dataclass
class Step:
    """A plain step being computed: its token [1], its logprobs [V], and its shadow probe's
    chance (None: it carries none)."""
    token: mx.array
    logprobs: mx.array
    chance: Optional[mx.array] = None


class PlainSteps:
    """Plain decode steps of the sequence ``seq`` (a ``cycle.Sequence``), pipelined as in
    mlx-lm: each step's graph is built while the one before it computes, so a token is read
    one step after it was sampled (``take``) and reading it never leaves the CPU idle.  A
    step the policy picks (``policy.shadow()``) also carries a shadow probe
    (``shadow_chance``), told to the policy when its token is read; the copier
    (``lookup.py``) hears of each token then too."""

    def __init__(self, seq, policy: Policy, copier: Optional[Lookup]):
        self.seq, self.policy, self.copier = seq, policy, copier
        self.steps: List[Step] = []  # computing, not read yet (the oldest first)

    @property
    def waiting(self) -> int:
        """Steps whose token is not read yet: 0, or 1 between iterations of the loop."""
        return len(self.steps)

    def step(self) -> bool:
        """One step from the latest step's token (none waiting: the sequence's last token);
        the token joins the history, its features the draft context.  Returns whether it
        carries a shadow probe."""
        seq = self.seq
        token = self.steps[-1].token if self.steps else mx.array([seq.last])
        shadow = self.policy.shadow()
        seq.kv(seq.cache)  # as mlx-lm quantizes after the step that reached the start
        logits, features = seq.target(token[None], seq.cache)
        logprobs = processed_logprobs(logits[0], seq.history, token, seq.processors)
        step = Step(sample(logprobs, seq.params), logprobs[0])
        if shadow:  # before this step's features join the context: the draft sees what a
            # cycle anchored at ``token`` would see
            step.chance = shadow_chance(seq.drafter, seq.context, token, (step.token, step.logprobs),
                                        seq.params)
        mx.async_eval([x for x in (step.token, step.logprobs, step.chance) if x is not None])
        seq.context.add(features)
        seq.history = mx.concatenate([seq.history, token])
        self.steps.append(step)
        return shadow

    def take(self) -> Tuple[int, mx.array]:
        """The oldest waiting step's token and logprobs, read now."""
        step = self.steps.pop(0)
        if step.chance is not None:
            self.policy.record_shadow(step.chance.item())
        token = int(step.token.item())
        if self.copier is not None:
            self.copier.extend([token])
        return token, step.logprobs
