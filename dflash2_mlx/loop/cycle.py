"""The DFlash draft -> propose -> verify -> accept cycle.

Each cycle: the policy picks the block size (fixed, or adaptive: ``adaptive.py``), the
drafter fills a block [anchor, MASK...] in one pass, the drafted tokens are proposed
(argmax / sample / selector walk), the target verifies the whole block in one pass, the
accepted prefix plus the target's own next token is committed, the target cache is
rolled back to that point and the draft context gets the committed tokens' features; the
policy learns what was accepted and how long the cycle took.  A block of 1 is a plain
decode step, pipelined as mlx-lm's are; the adaptive policy may have it carry a shadow
probe (a block-2 draft never verified: ``shadow_chance``).  Where the sequence repeats
itself, the block may be a copy instead of a draft (``lookup.py``): no drafter pass,
verified and accepted the same way.  Yields (token, logprobs, from_draft, stats) per token.
"""

import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Dict, Iterator, List, Optional

import mlx.core as mx
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, maybe_quantize_kv_cache

from .. import adaptive
from .draft_context import DraftContext
from ..model.drafter import Drafter, first_row, propose
from .lookup import Lookup, one_hot_rows
from .sampling import (SamplingParams, probs, processed_logits, processed_logprobs, sample, verify_greedy, verify_sampled)
from .target import Target, rollback, snapshot


@dataclass
class CycleStats:
    """Draft statistics of one generation, updated after every cycle."""
    block_size: int  # the largest block a cycle may use
    cycles: int = 0
    accepted: int = 0  # draft tokens accepted in the latest cycle
    total_accepted: int = 0
    position_accepted: List[int] = field(default_factory=list)
    block_sizes: Dict[int, int] = field(default_factory=Counter)  # cycles per block size
    fallback: bool = False  # the adaptive policy is decoding plain (probing now and then)
    shadows: int = 0  # plain steps that carried a shadow probe
    copies: int = 0  # cycles that verified a copy (``lookup.py``) instead of a draft
    copied: int = 0  # ... and the copied tokens they accepted

    def __post_init__(self):
        self.position_accepted = [0] * max(self.block_size - 1, 0)

    def record(self, block_size: int, accepted: int, fallback: bool = False, copy: bool = False):
        self.cycles += 1
        self.copies += copy
        self.copied += accepted if copy else 0
        self.block_sizes[block_size] += 1
        self.fallback = fallback
        self.accepted = accepted
        self.total_accepted += accepted
        for i in range(accepted):
            self.position_accepted[i] += 1

    @property
    def tau(self) -> float:
        """Mean acceptance length: accepted draft tokens + the target's bonus token."""
        return (self.total_accepted + self.cycles) / self.cycles if self.cycles else 0.0


def prefill(target: Target, prompt: mx.array, cache, step: int = 2048, after=None):
    """Run the prompt through the target in chunks; last logits and all features.
    ``after(cache)`` after each call (mlx-lm's KV quantization): then the chunks are
    mlx-lm's own, the prompt but its last token, and that token alone."""
    feats = []
    chunks = [(i, min(i + step, prompt.size)) for i in range(0, prompt.size, step)]
    if after is not None:
        chunks = [(i, min(i + step, prompt.size - 1)) for i in range(0, prompt.size - 1, step)]
        chunks.append((prompt.size - 1, prompt.size))
    for i, j in chunks:
        logits, f = target(prompt[None, i:j], cache)
        if after is not None:
            after(cache)
        mx.eval(logits, f)
        feats.append(f)
    return logits[0, -1:], mx.concatenate(feats, axis=1)


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


def speculative_generate_step(
    prompt: mx.array,
    target: Target,
    drafter: Drafter,
    *,
    max_tokens: int = 256,
    params: SamplingParams = SamplingParams(),
    logits_processors: Optional[List[Callable]] = None,
    block_size=adaptive.AUTO,
    prefill_step_size: int = 2048,
    prompt_cache: Optional[list] = None,
    draft_window: Optional[int] = None,
    draft_sink: int = 0,
    context: Optional[DraftContext] = None,
    cached_tokens: int = 0,
    lookup: bool = True,
    settle: bool = False,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
) -> Iterator:
    """``block_size``: a number, "auto", or a policy (``adaptive.policy``); ``draft_window``:
    how many of the latest context rows a draft reads (None: all), besides the first
    ``draft_sink`` (``draft_context.py``). A reused prefix: the first
    ``cached_tokens`` of the prompt are already in ``prompt_cache`` and ``context``.
    ``lookup``: blocks may be copies where the sequence repeats (False: always the drafter).
    ``settle``: when the steps end (or are closed), leave the cache holding the prompt and
    every token yielded, as mlx-lm's generate_step leaves it (no draft accepted but unread).
    ``kv_bits``: mlx-lm's KV cache quantization, from the step whose cache holds
    ``quantized_kv_start`` tokens on, as generate_step does it (a verify pass never runs
    across that token: rows before it attend to full-precision keys, rows after to
    quantized ones, in one-token steps as in blocks)."""
    cache = target.make_cache() if prompt_cache is None else prompt_cache
    policy = block_size if hasattr(block_size, "record") else adaptive.policy(
        target, drafter, block_size, params.greedy)
    context = DraftContext(drafter, draft_window, draft_sink) if context is None else context
    stats = CycleStats(max(policy.largest, policy.copy_largest))
    mask = drafter.config.mask_token_id

    quantize = None
    if kv_bits is not None:
        quantize = partial(maybe_quantize_kv_cache, quantized_kv_start=quantized_kv_start,
                           kv_group_size=kv_group_size, kv_bits=kv_bits)
    logits, features = prefill(target, prompt[cached_tokens:], cache, prefill_step_size, quantize)
    context.add(features)
    history = prompt
    logprobs = processed_logprobs(logits, prompt[:-1], prompt[-1:], logits_processors)
    anchor = int(sample(logprobs, params)[0].item())
    # Every token read so far: the prompt and each token once it is yielded.
    copier = Lookup(prompt.tolist() + [anchor]) if lookup else None
    emitted, last = 0, None  # tokens yielded, the latest
    saved = kept = None  # the latest cycle's caches before its verify pass, and the tokens it kept

    def out(token: int) -> int:
        nonlocal emitted, last
        emitted, last = emitted + 1, token
        return token

    pending = None  # a plain step's (token, logprobs, shadow chance or None): computing, not read yet

    def take(pending) -> int:
        if pending[2] is not None:
            policy.record_shadow(pending[2].item())
        token = int(pending[0].item())
        if copier is not None:
            copier.extend([token])
        return token

    steady = None  # when the last plain step began, if it waited for the one before it
    # Whether the last cycle drafted: only then is a draft's time its own (after plain steps or
    # a copy the drafter first reads the rows they committed, work those steps put off).
    drafted = False

    try:
        yield out(anchor), logprobs[0], False, stats
        while emitted + (pending is not None) < max_tokens:
            tic = time.perf_counter()
            if steady is not None:  # pipelined: a plain step takes what one iteration takes
                policy.timed(1, tic - steady)
                steady = None
            if copier is not None and copier.repeating and pending is not None and policy.largest > 1:
                # The sequence is repeating itself: read the plain step's token now (out of the
                # pipeline) so that the next block can be a copy that starts after it.
                anchor = take(pending)
                yield out(anchor), pending[1], False, stats
                pending = None
                continue
            copy = copier.draft(policy.copy_largest - 1) if copier is not None and pending is None else []
            b = policy.block_size(history.size, copy=len(copy))
            if quantize is not None and (held := kv_offset(cache)) < quantized_kv_start:
                b = min(b, quantized_kv_start - held)  # up to the token that quantizes the cache
            if b == 1:
                # A plain decode step, pipelined as in mlx-lm: the next step's graph is built
                # while this one computes, so reading a token never leaves the CPU idle.
                token = pending[0] if pending is not None else mx.array([anchor])
                shadow = policy.shadow()
                if quantize is not None:  # as mlx-lm quantizes after the step that reached the start
                    quantize(cache)
                logits, features = target(token[None], cache)
                logprobs = processed_logprobs(logits[0], history, token, logits_processors)
                step = (sample(logprobs, params), logprobs[0])
                # Before this step's features join the context: the draft sees what a cycle
                # anchored at ``token`` would see.
                step += (shadow_chance(drafter, context, token, step, params) if shadow else None,)
                mx.async_eval([x for x in step if x is not None])
                context.add(features)
                history = mx.concatenate([history, token])
                policy.record(1, 0)
                stats.record(1, 0, policy.fallback)
                drafted = False
                stats.shadows += shadow
                if pending is not None:
                    yield out(take(pending)), pending[1], False, stats
                    steady = tic
                pending = step
                continue
            if pending is not None:  # drafting resumes from the last plain step's token
                anchor = take(pending)
                yield out(anchor), pending[1], False, stats
                pending = None
            tic = time.perf_counter()
            copying = bool(copy) and policy.copying
            if copying:  # a copy of what followed the repeated tokens last time: no drafter pass
                draft = mx.array(copy[: b - 1])
                q = None if params.greedy else one_hot_rows(draft, drafter.config.vocab_size)
            else:
                block = mx.array([[anchor] + [mask] * (b - 1)])
                # Draft + propose: one drafter pass, then per-position picks or the selector walk.
                hidden = drafter(block, context.fed())
                draft, q = propose(drafter, hidden, mx.array(anchor), params)
            # Verify: one target pass over [anchor, d1 .. d_{B-1}].
            verify = mx.concatenate([mx.array([anchor]), draft.astype(mx.int32)])
            if quantize is not None:
                quantize(cache)
            saved = snapshot(cache)
            logits, features = target(verify[None], cache)
            rows = processed_logits(logits[0], history, verify, logits_processors)
            # Accept: greedy prefix match, or rejection sampling against q.
            if params.greedy:
                accepted, bonus, logprobs = verify_greedy(rows, draft)
            else:
                accepted, bonus, logprobs = verify_sampled(rows, q, draft, params)
            kept = verify[: accepted + 1]
            rollback(target, cache, saved, verify.size, kept[None])
            context.add(features[:, : accepted + 1])
            history = mx.concatenate([history, kept])
            policy.record(b, accepted)
            stats.record(b, accepted, policy.fallback, copying)
            new = draft[:accepted].tolist() + [bonus]
            if copying or drafted:
                policy.timed(b, time.perf_counter() - tic, copying)
            drafted = not copying
            if copier is not None:
                copier.extend(new)
            for i, token in enumerate(new):
                yield out(token), logprobs[i], i < accepted, stats
                if emitted >= max_tokens:
                    return
            anchor = bonus
        if pending is not None:
            yield out(take(pending)), pending[1], False, stats
    except Exception:
        settle = False  # an error mid-cycle: history may not say what the caches hold
        raise
    finally:
        if settle:
            _settle(target, cache, context, history.size, prompt.size + emitted, last, saved, kept, quantize)


def kv_offset(cache) -> int:
    """Tokens in the attention caches (mlx-lm's KV quantization goes by these; 0 without any)."""
    return max((c.offset for c in cache if hasattr(c, "offset")), default=0)


def _settle(target: Target, cache, context: DraftContext, fed: int, read: int, last: int, saved, kept,
            quantize=None):
    """Leave ``cache`` as mlx-lm's generate_step leaves it: holding the ``read`` tokens (the
    prompt and every token yielded), no draft accepted but never read, the last one fed;
    ``context`` holds the drafter's rows of the same tokens."""
    if fed > read:  # a cycle accepted more than was read before the steps ended
        rollback(target, cache, saved, kept.size, kept[None, : kept.size - (fed - read)])
        context.trim(fed - read)
    elif fed < read:  # mlx-lm's pipelined step has fed the token it yielded last
        _, features = target(mx.array([[last]]), cache)
        context.add(features)
    if quantize is not None:  # mlx-lm quantizes after every step, this loop before the next
        quantize(cache)
    mx.eval([c.state for c in cache])
