"""The block-size policies a decoding loop asks each cycle: ``Fixed`` (``--block-size N``)
and ``Adaptive`` ("auto": the block with the most expected tokens per second, from the cost
model and the live acceptance), what the loop asks of them (``Policy``, ``Choice``), and
``starting``, an adaptive policy from its prices and history (the calibration service's
``policy(...)`` builds a request's from its block size: 1..the drafter's trained size, or
"auto", ``request.plan.check_block_size``).

The choice depends only on the past, so every cycle stays lossless whatever it picks."""

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Protocol, runtime_checkable

from .acceptance import PRIOR_WEIGHT, SAMPLED_PRIOR_WEIGHT, SEED_WEIGHT, Acceptance, expected_tokens
from .costs import CostModel
from .timing import Corrected, Timing

PROBE_FIRST, PROBE_MAX = 16, 64  # plain steps before the first probe and, backing off, at most
PROBE_BUDGET = 0.015  # a failed probe's extra cost, spread over the wait, is at most this share
SHADOW_BUDGET = 0.03  # shadow probes' drafter passes cost at most this share of the plain steps


@dataclass(frozen=True)
class Choice:
    """One cycle's block: ``block`` rows (1: a plain decode step); ``copy``: verify the copy
    on offer instead of a draft; ``fallback``: the policy is decoding plain for now (a block
    over 1 is then a probe)."""
    block: int
    copy: bool = False
    fallback: bool = False


@runtime_checkable
class Policy(Protocol):
    """What a decoding loop asks of a block-size policy and tells it (``isinstance(x, Policy)``
    tells a policy from a block size)."""
    largest: int  # the widest block a draft may fill
    copy_largest: int  # the widest block a copy may verify

    def choose(self, context: int, copy: int = 0) -> Choice:
        """This cycle's block at a context of ``context`` tokens, ``copy`` tokens of a copy on offer."""

    def record(self, b: int, accepted: int, copy: bool = False):
        """A cycle of block ``b`` (a copy's, with ``copy``) had ``accepted`` drafts accepted."""

    def timed(self, b: int, seconds: float, copy: bool = False):
        """A cycle of block ``b`` took ``seconds`` (the loop says which cycles it times)."""

    def shadow(self) -> bool:
        """Whether the plain step just chosen should carry a shadow probe."""

    def record_shadow(self, chance: float):
        """A shadow probe's block-2 draft would have been accepted with ``chance``."""


def tokens_per_second(rates: List[float], costs: CostModel, context: int, b: int,
                      drafted: bool = True) -> float:
    return expected_tokens(rates, b) / (costs.cycle if drafted else costs.verify)(b, context)


def best_block(rates: List[float], costs: CostModel, context: int, largest: int,
               smallest: int = 1, drafted: bool = True) -> int:
    """The block size in smallest..largest with the most expected tokens per second
    (``drafted=False``: blocks that cost no drafter pass, copies)."""
    return max(range(smallest, largest + 1),
               key=lambda b: tokens_per_second(rates, costs, context, b, drafted))


class Fixed:
    """A block size that never changes (``--block-size N``)."""

    fallback = False

    def __init__(self, block_size: int):
        self.largest = self.copy_largest = block_size

    def choose(self, context: int, copy: int = 0) -> Choice:
        """A copy on offer is always taken: at T=0 a copy is accepted far further than a
        draft on the built-in pair (docs/copies.md)."""
        return Choice(self.largest, copy=copy > 0)

    def block_size(self, context: int) -> int:
        return self.largest

    def record(self, b: int, accepted: int, copy: bool = False):
        pass

    def timed(self, b: int, seconds: float, copy: bool = False):
        pass

    def shadow(self) -> bool:
        return False

    def record_shadow(self, chance: float):
        pass


class Adaptive:
    """Chooses each cycle's block size from the cost model and the live acceptance.

    When the best block is 1 (plain decoding) it probes with the best drafting block
    after ``wait`` plain steps; the wait doubles after every probe with nothing accepted
    (up to PROBE_MAX) and starts over after one that had a draft accepted.  It is never
    shorter than what keeps a failed probe's extra cost within PROBE_BUDGET of the plain
    steps around it, so probes grow rarer where verifying more rows costs more (long
    contexts).  A request starts from its pair's history (worth SEED_WEIGHT cycles) when
    there is one; only a pair without any probes at once when its prior says plain.

    Probes alone learn slowly: a stretch of failed cycles can send the decayed estimate
    below what the drafter deserves, and plain decoding then tests it only at probes that
    grow rarer.  So while decoding plain, every few steps (as many as keep the drafter's
    cost within ``shadow_budget`` of the plain steps; 0: never) the cycle also drafts a
    block of 2 from the step's input token without verifying it, and tells ``record_shadow``
    whether that draft would have been accepted.

    Where a copy is on offer (``loop/lookup.py``) it weighs verifying the copy (its own
    acceptance, a target pass without a drafter pass) against drafting and plain steps."""

    history_key = timing_key = None  # where ``remember`` saves it (``policy`` sets them)

    def __init__(self, costs: CostModel, largest: int, acceptance: Acceptance, seeded: bool = False,
                 shadow_budget: float = SHADOW_BUDGET, copy_largest: Optional[int] = None,
                 timing: Optional[Timing] = None, priced: Optional[Callable] = None):
        # With ``timing``, cycles are priced at what they really took (``timed``) by
        # ``priced(costs, timing)`` (default ``Corrected``; a batch: ``BatchCosts``); without,
        # at the cost model's figures (given ones: tests, simulations).
        priced = priced or (Corrected if timing is not None else None)
        self.costs = priced(costs, timing) if priced else costs
        self.largest, self.acceptance = largest, acceptance
        self.copy_largest = copy_largest or largest  # the widest block a copy may verify
        self.fallback = False
        self.wait = PROBE_FIRST if seeded else 0
        self.backoff = PROBE_FIRST
        self.context = 0  # the context of the latest choice, which its cycle is priced at
        self.shadow_budget, self.since_shadow = shadow_budget, 0
        # Copies learn within the request, from a prior that has them tried: seeded from a
        # pair's history (tried), a few requests that copied badly kept later ones from ever
        # copying, and with the drafter's prior a drafter accepted well was never weighed
        # against a copy's real acceptance (which then varied from run to run).
        self.copies = Acceptance.copies(self.copy_largest - 1)

    def choose(self, context: int, copy: int = 0) -> Choice:
        """The block with the most expected tokens per second, a probe when plain decoding
        has waited long enough, or the copy on offer where it beats both.  The policy moves
        to the choice (its context, and fallback unless it copies), which ``record``,
        ``timed`` and ``shadow`` then go by."""
        self.context = context
        rates = self.acceptance.rates()
        b = best_block(rates, self.costs, context, self.largest)
        if copy:
            copied = self.copies.rates()
            c = best_block(copied, self.costs, context, min(self.copy_largest, copy + 1),
                           smallest=2, drafted=False)
            if (tokens_per_second(copied, self.costs, context, c, drafted=False)
                    > tokens_per_second(rates, self.costs, context, b)):
                return Choice(c, copy=True, fallback=self.fallback)  # the drafter's probes wait
        self.fallback = b == 1
        if b == 1 and self.wait <= 0:  # a probe
            b = best_block(rates, self.costs, context, self.largest, smallest=2)
        return Choice(b, fallback=self.fallback)

    def block_size(self, context: int) -> int:
        """The block alone, no copy on offer (a batch weighs each sequence's copies itself)."""
        return self.choose(context).block

    def _wait(self, steps: int, probe: int) -> int:
        """At least ``steps``, and enough plain steps to amortize a failed probe of block
        ``probe`` at the current context within PROBE_BUDGET."""
        extra = self.costs.cycle(probe, self.context) / self.costs.cycle(1, self.context) - 1
        return max(steps, math.ceil(extra / PROBE_BUDGET))

    def record(self, b: int, accepted: int, copy: bool = False):
        if copy:
            self.copies.record(b, accepted)
            return
        if b > 1:
            self.acceptance.record(b, accepted)
        if not self.fallback:  # drafting: a fallback from here waits before probing
            self.wait, self.backoff = self._wait(PROBE_FIRST, 2), PROBE_FIRST  # sized for the cheapest probe
        elif b == 1:
            self.wait -= 1
        elif accepted:  # a probe with a sign of life: probe again soon (at once if all taken)
            self.wait = 0 if accepted == b - 1 else self._wait(PROBE_FIRST, b)
            self.backoff = PROBE_FIRST
        else:  # a probe that found nothing: wait longer
            self.wait = self._wait(self.backoff, b)
            self.backoff = min(2 * self.backoff, PROBE_MAX)

    def timed(self, b: int, seconds: float, copy: bool = False):
        """The wall time of a cycle of block ``b``: a copy's, a drafted cycle's that followed
        a drafted one, or a pipelined plain step's (``loop/clock.py`` says which it times)."""
        if isinstance(self.costs, Corrected):
            self.costs.observe(b, self.context, seconds, copy)

    def shadow(self) -> bool:
        if not self.fallback or self.shadow_budget <= 0:
            return False
        self.since_shadow += 1
        share = self.costs.draft(2, self.context) / self.costs.cycle(1, self.context)
        if self.since_shadow < share / self.shadow_budget:
            return False
        self.since_shadow = 0
        return True

    def record_shadow(self, chance: float):
        self.acceptance.record_first(chance)


def starting(costs: CostModel, largest: int, positions: int, hist: Optional[Acceptance],
             greedy: bool = True, shadow_budget: float = SHADOW_BUDGET,
             copy_largest: Optional[int] = None, timing: Optional[Timing] = None,
             priced: Optional[Callable] = None) -> Adaptive:
    """A request's ``Adaptive`` policy, seeded from the pair's history ``hist`` (worth
    SEED_WEIGHT cycles) when there is one, else from the prior."""
    start = hist.scaled(SEED_WEIGHT) if hist else Acceptance.empty(
        positions, PRIOR_WEIGHT if greedy else SAMPLED_PRIOR_WEIGHT)
    return Adaptive(costs, largest, start, seeded=hist is not None, shadow_budget=shadow_budget,
                    copy_largest=copy_largest, timing=timing, priced=priced)
