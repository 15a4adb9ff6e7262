"""The DFlash cycle: draft -> propose -> verify -> accept, one block at a time.

From the anchor (the latest token, not yet read by the target) the drafter fills a block
[anchor, MASK ...] in one pass over the target's features (draft), picks a token for each
mask (propose), the target reads [anchor, d1 .. d_{b-1}] in one pass (verify), and the
longest prefix it agrees with is kept with the target's own next token, the next anchor
(accept); the caches are rolled back to the kept tokens.  The policy (``adaptive``) picks
each block's size, learns what was accepted and how long it took; a block of 1 is a plain
decode step (``plain.py``), and where the sequence repeats itself a block may be a copy of
earlier tokens instead of a draft (``lookup.py``), verified and accepted the same way.
``dflash_steps`` yields (token, logprobs, from_draft, stats) per token; the policy and the
costs it prices with come from above (the calibration service, asked by ``generate.py``).
"""

from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from .. import adaptive, tree as trees
from ..model.drafter import Drafter, propose
from ..request.plan import Plan, Reuse
from ..request.sampling import SamplingParams, processed_logits, processed_logprobs, sample, verify_greedy, verify_sampled
from .clock import Clock
from .draft_context import DraftContext
from .kv_quant import KVQuantization
from .lookup import Lookup, one_hot_rows
from .plain import PlainSteps
from .stats import CycleStats
from .target import Target, rollback, snapshot

__all__ = ["CycleStats", "Sequence", "cycle", "dflash_steps", "prefill"]


def prefill(target: Target, prompt: mx.array, cache, step: int = 2048, kv: Optional[KVQuantization] = None):
    """Run the prompt through the target in chunks; last logits and all features.  With KV
    quantization (``kv``, quantizing after each call) or exact verify (``target.verifiers.exact``)
    the chunks are mlx-lm's own: the prompt but its last token, and that token alone, so the
    cache and the first token's logits are computed as mlx-lm's decoding computes them."""
    feats = []
    chunks = [(i, min(i + step, prompt.size)) for i in range(0, prompt.size, step)]
    if (kv is not None and kv.on) or target.verifiers.exact:
        chunks = [(i, min(i + step, prompt.size - 1)) for i in range(0, prompt.size - 1, step)]
        chunks.append((prompt.size - 1, prompt.size))
    for i, j in chunks:
        logits, f = target(prompt[None, i:j], cache)
        if kv is not None:
            kv(cache)
        mx.eval(logits, f)
        feats.append(f)
    return logits[0, -1:], mx.concatenate(feats, axis=1)


@dataclass
class Sequence:
    """One sequence being decoded: the pair, its caches, and what they hold.  ``history``:
    the tokens the target has read (the prompt, then each committed token); ``emitted`` and
    ``last``: the tokens yielded and the latest; ``saved`` and ``kept``: the latest cycle's
    caches before its verify pass and the tokens it kept (what ``settle`` may undo)."""
    target: Target
    drafter: Drafter
    cache: list
    context: DraftContext
    params: SamplingParams
    processors: Optional[List[Callable]]
    kv: KVQuantization
    stats: CycleStats
    history: mx.array
    emitted: int = 0
    last: Optional[int] = None
    saved: Optional[list] = None
    kept: Optional[mx.array] = None
    as_path: bool = False

    def out(self, token: int, logprobs: mx.array, from_draft: bool = False) -> tuple:
        """What the steps yield for ``token``."""
        self.emitted, self.last = self.emitted + 1, token
        return token, logprobs, from_draft, self.stats

    def verify(self, block: mx.array) -> Tuple[mx.array, mx.array]:
        """One target pass over ``block``, from a snapshot of the caches: its processed
        logits and features.  On a hybrid target the block goes through a tree pass of one
        path where it can: its recurrent layers then keep every row's state, and ``keep``
        takes the kept row's instead of reading the kept tokens again."""
        self.kv(self.cache)
        self.saved = snapshot(self.cache)
        verifiers = self.target.verifiers
        self.as_path = self.target.needs_replay(self.cache) and verifiers.tree_fits(self.cache, block.size) is None
        if self.as_path:
            logits, features = verifiers.path(block, self.cache)
        else:
            logits, features = verifiers.block(block[None], self.cache)
        return processed_logits(logits[0], self.history, block, self.processors), features

    def keep(self, block: mx.array, features: mx.array, n: int):
        """Keep the first ``n`` tokens of the verified ``block``: the caches rolled back to
        them, their features into the draft context."""
        self.kept = block[:n]
        if self.as_path:
            trees.compact(self.cache, block.size, list(range(n)))
        else:
            rollback(self.target, self.cache, self.saved, block.size, self.kept[None])
        self.context.add(features[:, :n])
        self.history = mx.concatenate([self.history, self.kept])

    def verify_tree(self, tree: trees.Tree) -> Tuple[mx.array, mx.array]:
        """One target pass over ``tree``'s nodes: their raw logits [n, V] and features."""
        self.kv(self.cache)
        self.saved = snapshot(self.cache)
        logits, features = self.target.verifiers.tree(tree, self.cache)
        return logits[0], features

    def keep_path(self, tree: trees.Tree, features: mx.array, path: List[int]):
        """Keep the verified tree's nodes ``path`` (the anchor first), as ``keep`` keeps a
        block's first tokens: the caches compacted to them, their features into the draft
        context."""
        self.kept = mx.array(tree.tokens[path].astype("int32"))
        trees.compact(self.cache, tree.tokens.size, path)
        self.context.add(features[:, mx.array(path)])
        self.history = mx.concatenate([self.history, self.kept])

    def settle(self, prompt_tokens: int):
        """Leave the cache as mlx-lm's generate_step leaves it: holding the prompt and every
        token yielded, no draft accepted but never read, the last one fed; the draft context
        holds the drafter's rows of the same tokens."""
        fed, read = self.history.size, prompt_tokens + self.emitted
        if fed > read:  # a cycle accepted more than was read before the steps ended
            n = self.kept.size
            rollback(self.target, self.cache, self.saved, n, self.kept[None, : n - (fed - read)])
            self.context.trim(fed - read)
        elif fed < read:  # mlx-lm's pipelined step has fed the token it yielded last
            _, features = self.target(mx.array([[self.last]]), self.cache)
            self.context.add(features)
        self.kv(self.cache)  # mlx-lm quantizes after every step, the cycle before the next
        mx.eval([c.state for c in self.cache])


def cycle(seq: Sequence, anchor: int, b: int, copy: Optional[List[int]] = None) -> Tuple[List[int], int, mx.array]:
    """One cycle of block ``b`` from ``anchor``, drafted (or ``copy``: verifying that copy).
    Returns the new tokens (the accepted drafts and the target's next token), the drafts
    accepted, and the logprobs of the target's rows for them."""
    drafter, params = seq.drafter, seq.params
    if copy:  # what followed the repeated tokens before: no drafter pass, q one-hot
        draft = mx.array(copy[: b - 1])
        q = None if params.greedy else one_hot_rows(draft, drafter.config.vocab_size)
    else:  # draft + propose: one drafter pass, then per-position picks or the selector walk
        hidden = drafter(mx.array([[anchor] + [drafter.config.mask_token_id] * (b - 1)]), seq.context.fed())
        draft, q = propose(drafter, hidden, mx.array(anchor), params)
    # Verify: one target pass over [anchor, d1 .. d_{b-1}].
    block = mx.concatenate([mx.array([anchor]), draft.astype(mx.int32)])
    rows, features = seq.verify(block)
    # Accept: greedy prefix match, or rejection sampling against q; then the target's token.
    if params.greedy:
        accepted, bonus, logprobs = verify_greedy(rows, draft)
    else:
        accepted, bonus, logprobs = verify_sampled(rows, q, draft, params)
    seq.keep(block, features, accepted + 1)
    return draft[:accepted].tolist() + [bonus], accepted, logprobs


def tree_cycle(seq: Sequence, anchor: int, b: int, budget: int) -> Tuple[List[int], int, mx.array]:
    """One cycle that verifies a tree of ``budget`` drafted nodes, at most ``b - 1`` deep,
    grown from one drafter pass over a block of ``b``; returns as ``cycle``."""
    drafter, params = seq.drafter, seq.params
    # Draft + propose: one drafter pass, its lattice, the walk's path and the likeliest others.
    hidden = drafter(mx.array([[anchor] + [drafter.config.mask_token_id] * (b - 1)]), seq.context.fed())
    logits = drafter.logits(hidden[0, 1:])
    cand, scores = trees.lattice(drafter, hidden, anchor, logits)
    if params.greedy:
        tree, q = trees.grow(anchor, cand, scores, budget, trees.GREEDY_TEMPERATURE), None
    else:  # the path the walk draws first, judged as a chain's draft
        draft, q = propose(drafter, hidden, mx.array(anchor), params, logits)
        tree = trees.grow(anchor, cand, scores, budget, params.temp, drawn=np.array(draft))
    # Verify: one target pass over every node, each reading only its own path.
    rows, features = seq.verify_tree(tree)
    # Accept: walk the tree with the target's own token at each node.
    path, token, logprobs = trees.accept(tree, rows, seq.history, seq.processors, params, q)
    seq.keep_path(tree, features, path)
    return tree.tokens[path[1:]].tolist() + [token], len(path) - 1, logprobs


def dflash_steps(prompt: mx.array, target: Target, drafter: Drafter, plan: Plan, policy: adaptive.Policy,
                 reuse: Optional[Reuse] = None, settle: bool = False,
                 costs: Optional[adaptive.CostModel] = None) -> Iterator:
    """The request's tokens as (token, logprobs, from_draft, stats): each cycle the policy
    chooses a block (or a plain step, or a copy), which is drafted, verified and accepted.
    ``policy``: the block-size policy; ``settle``: when the steps end (or are closed), leave
    the cache holding the prompt and every token yielded, as mlx-lm's generate_step leaves
    it; ``costs``: the pass costs a tree budget of "auto" is sized by."""
    seq, logprobs = start(prompt, target, drafter, plan, policy, reuse or Reuse())
    anchor = int(sample(logprobs, plan.params)[0].item())
    copier = Lookup(prompt.tolist() + [anchor]) if plan.lookup else None  # every token read so far
    plain, clock, budget = PlainSteps(seq, policy, copier), Clock(policy), TreeBudget(seq, plan, costs)
    try:
        yield seq.out(anchor, logprobs[0])
        while seq.emitted + plain.waiting < plan.limit:
            clock.tick()
            if plain.waiting and copier is not None and copier.repeating and policy.largest > 1:
                # The sequence repeats itself: read the plain step's token now (out of the
                # pipeline), so that the next block can be a copy that starts after it.
                yield seq.out(*plain.take())
                continue
            copy = copier.draft(policy.copy_largest - 1) if copier is not None and not plain.waiting else []
            choice = seq.kv.clamp(policy.choose(seq.history.size, copy=len(copy)), seq.cache)
            if choice.block == 1:  # a plain decode step, pipelined
                yield from plain_step(seq, plain, policy, clock, choice)
                continue
            if plain.waiting:  # drafting resumes from the last plain step's token
                yield seq.out(*plain.take())
            clock.begin()
            nodes = budget.nodes(choice)
            if nodes:
                new, accepted, logprobs = tree_cycle(seq, seq.last, choice.block, nodes)
            else:
                new, accepted, logprobs = cycle(seq, seq.last, choice.block, copy if choice.copy else None)
            policy.record(choice.block, accepted, choice.copy)
            seq.stats.record(choice.block, accepted, choice.fallback, choice.copy, nodes)
            budget.record(nodes, choice.block, accepted, clock.end(choice.block, choice.copy, tree=bool(nodes)))
            if copier is not None:
                copier.extend(new)
            for i, token in enumerate(new):
                yield seq.out(token, logprobs[i], i < accepted)
                if seq.emitted >= plan.limit:
                    return
        if plain.waiting:
            yield seq.out(*plain.take())
    except Exception:
        settle = False  # an error mid-cycle: history may not say what the caches hold
        raise
    finally:
        if settle:
            seq.settle(prompt.size)


def start(prompt: mx.array, target: Target, drafter: Drafter, plan: Plan, policy: adaptive.Policy,
          reuse: Reuse) -> Tuple[Sequence, mx.array]:
    """The sequence once its prompt is read (past the ``reuse``d prefix), and the logprobs of
    its first token."""
    cache = target.make_cache() if reuse.prompt_cache is None else reuse.prompt_cache
    context = DraftContext(drafter, plan.draft_window, plan.draft_sink) if reuse.draft_context is None \
        else reuse.draft_context
    seq = Sequence(target, drafter, cache, context, plan.params, plan.logits_processors,
                   KVQuantization(plan.kv_bits, plan.kv_group_size, plan.quantized_kv_start),
                   CycleStats(max(policy.largest, policy.copy_largest)), prompt)
    logits, features = prefill(target, prompt[reuse.cached_tokens:], cache, plan.prefill_step_size, seq.kv)
    context.add(features)
    return seq, processed_logprobs(logits, prompt[:-1], prompt[-1:], plan.logits_processors)


def plain_step(seq: Sequence, plain: PlainSteps, policy: adaptive.Policy, clock: Clock, choice: adaptive.Choice):
    """A plain decode step, pipelined: the step before it is read (and yielded) a step late."""
    shadow = plain.step()
    policy.record(1, 0, choice.copy)
    seq.stats.record(1, 0, choice.fallback)
    seq.stats.shadows += shadow
    clock.plain(pipelined=plain.waiting > 1)
    if plain.waiting > 1:
        yield seq.out(*plain.take())


class TreeBudget:
    """The nodes of the tree each drafted cycle verifies (``plan.tree_budget``): a number, or
    "auto" (per block size, the live choice among the trees the cost curve names,
    ``trees.Arms``); 0 for a chain, ``stats.chain_why`` saying why."""

    def __init__(self, seq: Sequence, plan: Plan, costs: Optional[adaptive.CostModel]):
        if plan.tree_budget == "auto" and costs is None:
            raise ValueError('a tree budget of "auto" is sized by the pair\'s pass costs: none were given')
        self.seq, self.budget, self.costs = seq, plan.tree_budget, costs  # the calibrated curve names the trees
        self.arms, self.arm = {}, None  # block size -> its trees' live choice; this cycle's

    def nodes(self, choice: adaptive.Choice) -> int:
        seq, self.arm = self.seq, None
        nodes = 0 if choice.copy or not self.budget else self.budget
        if nodes == "auto":
            if choice.block not in self.arms:
                self.arms[choice.block] = trees.Arms(self.costs, choice.block, seq.history.size)
            self.arm = self.arms[choice.block]
            nodes = self.arm.choose()
            seq.stats.chain_why = (None if nodes > choice.block - 1 else
                                   f"at block {choice.block}, no tree is priced within 1.4x the chain on this machine"
                                   if len(self.arm.candidates) == 1 else
                                   f"at block {choice.block}, the chain gave the most tokens per second")
            nodes = 0 if seq.stats.chain_why else nodes
        if nodes:
            seq.stats.chain_why = seq.target.verifiers.tree_fits(seq.cache, nodes + 1)
            nodes = 0 if seq.stats.chain_why else nodes
        return nodes

    def record(self, nodes: int, block: int, accepted: int, took: Optional[float]):
        """An "auto" cycle's tokens and time, for its arm."""
        if self.arm is not None and took is not None:
            self.arm.record(nodes or block - 1, accepted + 1, took)
