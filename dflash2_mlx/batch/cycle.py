"""The batched cycle: one block size for the batch, every sequence's block drafted (one
drafter pass for all) or copied, all blocks verified in one target pass over [S, b] rows,
and each sequence's own accepted prefix kept (``request.sampling.verify_lazy``, the single
stream's accept rule, evaluated once for the whole batch).  The policy, each sequence's
copies and the batch's costs learn from it."""

import time
from typing import List, Optional

import mlx.core as mx

from .. import adaptive
from ..loop.lookup import one_hot_rows
from ..model.drafter import propose
from ..request.sampling import accept, processed_logprobs, verify_lazy
from .cache import TargetBatch, draft_hidden
from .policy import BatchCosts
from .sequence import BatchSequence, Response


class BatchCycle:
    """draft -> verify -> accept for the sequences of a batch, called once per step.

    ``batch_drafter``: one drafter pass for all blocks (else one per sequence).  ``lookup``:
    a sequence may verify a copy of its own earlier tokens instead of its draft."""

    def __init__(self, target, drafter, batch: TargetBatch, policy, batch_drafter: bool = True,
                 lookup: bool = True):
        self.target, self.drafter, self.batch, self.policy = target, drafter, batch, policy
        self.batch_drafter, self.lookup = batch_drafter, lookup
        self.drafted = ()  # the sequences of the last cycle, if it drafted (``time``)

    def __call__(self, seqs: List[BatchSequence]) -> List[Response]:
        if not seqs:
            return []
        costs = getattr(self.policy, "costs", None)
        if isinstance(costs, BatchCosts):
            costs.streams = len(seqs)
        context = max(s.history.size for s in seqs)
        b = self.policy.block_size(context)
        tic = time.perf_counter()
        verify = mx.array([s.anchor for s in seqs], dtype=mx.int32)[:, None]
        copies = self.copies(seqs, b)
        drafts, qs = [None] * len(seqs), [None] * len(seqs)
        failed = {}  # index -> what its own draws or processors raised: it alone ends
        if b > 1:
            drafts, qs = self.draft(seqs, b, copies, failed)
            verify = mx.concatenate([verify, mx.stack(drafts)], axis=1)
        # Verify: one target pass over every sequence's block.
        saved = self.batch.snapshot()
        logits, features = self.batch.forward(self.target, verify)
        rows, verdicts = self.verdicts(seqs, logits, verify, drafts, qs, failed)
        accepted, tokens = zip(*(accept(ok.tolist(), cand.tolist()) if i not in failed else (0, s.anchor)
                                 for i, (s, (ok, cand)) in enumerate(zip(seqs, verdicts))))
        kept = [a + 1 for a in accepted]  # a failed sequence keeps its anchor's row until it leaves
        if saved is not None and min(kept) < b:
            self.batch.replay(self.target, saved, verify, kept)
        self.batch.rows.commit(kept)
        self.batch.compact()
        good = [i for i in range(len(seqs)) if i not in failed]
        self.record([seqs[i] for i in good], b, [accepted[i] for i in good], [copies[i] for i in good])
        self.time(costs, b, context, not all(copies), seqs, tic)
        out = []
        for i, (s, ids) in enumerate(zip(seqs, verify.tolist())):
            if i in failed:
                out += s.fail(failed[i])
                continue
            s.stats.record(b, accepted[i], self.policy.fallback, bool(copies[i]))
            out += s.commit(ids, verify[i], features[i : i + 1], accepted[i], tokens[i], rows[i])
        return out

    def verdicts(self, seqs: List[BatchSequence], logits, verify, drafts, qs, failed: dict):
        """Each sequence's processed rows and lazy verdicts, evaluated once for the whole
        batch; a sequence whose processors or draws raise goes into ``failed`` (its verdicts
        a placeholder), found by evaluating one at a time when the batch's evaluation raises."""
        rows, verdicts = [], []
        empty = (mx.zeros((0,), dtype=mx.bool_), mx.zeros((1,), dtype=mx.int32))
        for i, s in enumerate(seqs):
            rows.append(None)
            verdicts.append(empty)
            if i in failed:
                continue
            try:
                rows[i] = processed_logprobs(logits[i], s.history, verify[i], s.processors)
                with s.stream:
                    verdicts[i] = verify_lazy(rows[i], drafts[i], qs[i], s.params)
            except Exception as e:
                failed[i] = e
        try:
            mx.eval(verdicts, verify)
        except Exception:
            for i in range(len(seqs)):
                try:
                    mx.eval(verdicts[i])
                except Exception as e:
                    failed[i] = e
            mx.eval(verify)
        return rows, verdicts

    def copies(self, seqs: List[BatchSequence], b: int) -> List[Optional[List[int]]]:
        """Each sequence's copy for a block of ``b`` (None: it drafts).  A copy is taken where
        the sequence's copies are expected to be accepted further than the batch's drafts
        (a policy without an acceptance estimate, a fixed block size: always)."""
        if b == 1 or not self.lookup:
            return [None] * len(seqs)
        out = []
        drafter = getattr(self.policy, "acceptance", None)
        drafted = adaptive.expected_tokens(drafter.rates(), b) if drafter is not None else 0.0
        for s in seqs:
            copy = s.copier.draft(b - 1)
            if copy and adaptive.expected_tokens(s.copies.rates(), b) <= drafted:
                copy = []
            out.append(copy or None)
        return out

    def draft(self, seqs: List[BatchSequence], b: int, copies: List[Optional[List[int]]], failed: dict):
        """Each sequence's b - 1 draft tokens and the rows q they were drawn from (None when
        greedy): its copy (one-hot rows), or what ``propose`` picks from one drafter pass
        over every block, drawn from its own stream.  One whose draw raises goes into
        ``failed`` with a placeholder draft (its anchor repeated)."""
        mask = self.drafter.config.mask_token_id
        blocks = mx.array([[s.anchor] + [mask] * (b - 1) for s in seqs])
        hidden = self.hidden(seqs, blocks) if not all(copies) else None
        drafts, qs = [], []
        for i, s in enumerate(seqs):
            if copies[i]:  # no drafter pick: nothing drawn from its key
                draft = mx.array(copies[i], dtype=mx.int32)
                q = None if s.params.greedy else one_hot_rows(draft, self.drafter.config.vocab_size)
            else:
                try:
                    with s.stream:
                        draft, q = propose(self.drafter, hidden[i : i + 1], mx.array(s.anchor), s.params)
                        mx.eval(draft)  # a draw that raises does so here, its own failure
                except Exception as e:
                    failed[i] = e
                    draft, q = mx.full((b - 1,), s.anchor, dtype=mx.int32), None
            drafts.append(draft.astype(mx.int32))
            qs.append(q)
        return drafts, qs

    def hidden(self, seqs: List[BatchSequence], blocks: mx.array) -> mx.array:
        """The drafter's hidden states over every sequence's block, with its own context."""
        contexts = [s.context.fed() for s in seqs]
        if self.batch_drafter:
            return draft_hidden(self.drafter, blocks, contexts)
        return mx.concatenate([self.drafter(blocks[i : i + 1], c) for i, c in enumerate(contexts)])

    def record(self, seqs: List[BatchSequence], b: int, accepted: List[int],
               copies: List[Optional[List[int]]]):
        """The policy learns from every sequence's draft, but counts a plain step once; a
        copy teaches only its own sequence's copies."""
        if b == 1:
            self.policy.record(1, 0)
            return
        for s, a, copy in zip(seqs, accepted, copies):
            if copy:
                s.copies.record(b, a)
            else:
                self.policy.record(b, a)

    def time(self, costs, b: int, context: int, drafted: bool, seqs: List[BatchSequence],
             tic: float):
        """Tell ``BatchCosts`` what the cycle took: a plain step or a cycle of copies only
        always; a drafted cycle when the drafter also ran in the cycle before for these
        sequences (it runs for every sequence, copying ones too; after plain steps, copies
        only or a join it first reads the rows not yet fed: not this draft's work)."""
        uids = {s.uid for s in seqs}
        drafted = b > 1 and drafted
        if isinstance(costs, BatchCosts) and (not drafted or uids <= set(self.drafted)):
            costs.observe(b, context, time.perf_counter() - tic, drafted)
        self.drafted = uids if drafted else ()
