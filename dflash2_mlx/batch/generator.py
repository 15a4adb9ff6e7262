"""``BatchGenerator``: continuous batching in mlx-lm's shape (``insert`` / ``remove`` /
``next`` / ``extract_cache``): sequences wait for a place, join between cycles (prefilled
together: ``join.py``), run one ``BatchCycle`` (``cycle.py``) per ``next``, and leave when
finished or aborted."""

from typing import Callable, List, Optional

import mlx.core as mx

from .. import adaptive, calibration
from ..adaptive import check_block_size
from ..loop.draft_context import DraftContext
from ..loop.random_keys import RandomStream, fresh_key
from ..loop.target import attach
from ..model.drafter import Drafter
from ..request.arguments import check
from ..request.sampling import SamplingParams
from .cache import TargetBatch, batch_layers
from .cycle import BatchCycle
from .join import prefill, prefill_groups
from .policy import batch_policy
from .sequence import BatchSequence, Response


class BatchGenerator:
    """Continuous batching of DFlash sequences: ``insert`` between calls, ``next`` runs
    the joiners' prefills and one batched draft -> verify -> accept cycle and returns the
    tokens it produced; ``remove`` aborts a sequence.  Not thread-safe: one MLX thread.

    ``block_size``: a number (every cycle), "auto" (the adaptive policy, fed with every
    sequence's acceptance, its costs those of the whole batch: ``BatchCosts``), or a policy
    object (one whose ``costs`` are ``BatchCosts`` is told the batch's size each cycle).
    ``batch_drafter``: one drafter pass for all blocks (else one per sequence).
    ``max_batch``: sequences that run together; more wait for a place.  ``lookup``: a
    sequence may verify a copy of its own earlier tokens instead of its draft."""

    def __init__(self, model, drafter: Drafter, *, block_size=adaptive.AUTO,
                 draft_window: Optional[int] = None, draft_sink: int = 0, prefill_step_size: int = 2048,
                 batch_drafter: bool = True, return_caches: bool = False,
                 max_batch: Optional[int] = None, lookup: bool = True):
        self.target = attach(model, drafter)
        self.drafter = drafter
        self.batch = TargetBatch(batch_layers(self.target))
        if hasattr(block_size, "record"):  # a batch policy (``batch.policy``), not a size
            self.policy = block_size
        else:
            block_size = check_block_size(drafter, block_size)
            self.policy = (batch_policy(self.target, drafter) if block_size == adaptive.AUTO
                           else calibration.policy(self.target, drafter, block_size))
        self.cycle = BatchCycle(self.target, drafter, self.batch, self.policy, batch_drafter, lookup)
        self.draft_window, self.draft_sink = draft_window, draft_sink
        self.prefill_step_size = prefill_step_size
        self.return_caches = return_caches
        self.max_batch = max_batch or float("inf")
        self.lookup = lookup
        self.waiting: List[BatchSequence] = []
        self.active: List[BatchSequence] = []  # in the batch's row order
        self._next_uid = 0

    def __len__(self):
        return len(self.waiting) + len(self.active)

    def insert(self, prompt, *, max_tokens: int = 256, params: SamplingParams = SamplingParams(),
               logits_processors: Optional[List[Callable]] = None, stop_tokens=(),
               seed: Optional[int] = None, prompt_cache: Optional[list] = None,
               draft_context: Optional[DraftContext] = None, cached_tokens: int = 0) -> int:
        """Queue a sequence (token ids); it joins at the next ``next``.  ``seed``: its own
        random stream, as ``mx.random.seed(seed)`` before a single stream.  A reused prefix:
        the first ``cached_tokens`` are already in ``prompt_cache`` and ``draft_context``."""
        prompt = mx.array(prompt, dtype=mx.uint32) if not isinstance(prompt, mx.array) else prompt
        if prompt.size == 0:
            raise ValueError("prompt is empty: give at least one token")
        check("max_tokens", max_tokens)
        if not 0 <= cached_tokens < prompt.size:
            raise ValueError(f"cached_tokens must leave at least the last prompt token to run, "
                             f"got {cached_tokens} of {prompt.size}")
        key = None
        if not params.greedy:
            key = seed if seed is not None else fresh_key()
        uid, self._next_uid = self._next_uid, self._next_uid + 1
        self.waiting.append(BatchSequence(
            uid, prompt, params, logits_processors, max_tokens if max_tokens > 0 else float("inf"),
            frozenset(stop_tokens), RandomStream(key), prompt_cache, draft_context, cached_tokens))
        return uid

    def remove(self, uid: int) -> bool:
        """Abort a sequence (waiting or running); False when there is none with ``uid``."""
        for i, s in enumerate(self.waiting):
            if s.uid == uid:
                del self.waiting[i]
                return True
        for i, s in enumerate(self.active):
            if s.uid == uid:
                self._keep([j for j in range(len(self.active)) if j != i])
                return True
        return False

    def extract_cache(self, uid: int):
        """A running sequence's (target cache, draft context) as a single stream's, e.g.
        for a prefix cache before ``remove``; the target cache holds every committed token
        but the newest (the next anchor)."""
        i = next(i for i, s in enumerate(self.active) if s.uid == uid)
        return self.batch.extract(i), self.active[i].context

    def next(self) -> List[Response]:
        """Admit waiting sequences (their first tokens), then one cycle for all."""
        out = self._admit()
        self._leave()
        out += self.cycle(self.active)
        self._leave()
        return out

    def close(self):
        """Keep the batch's acceptance as the pair's history (adaptive block sizes); where the
        batch's costs were a pair's first calibration, probe the target's exactness now."""
        calibration.remember(self.policy)
        calibration.exactness.probe_if_owed(self.policy, self.target.model)

    def _admit(self) -> List[Response]:
        """Prefill the waiting sequences (as many as there are places) and sample each
        one's first token; they join the batch.  Prompts of similar lengths are prefilled
        together (``prefill_groups``)."""
        places = int(min(len(self.waiting), self.max_batch - len(self.active)))
        joiners, self.waiting = self.waiting[:places], self.waiting[places:]
        copies_largest = max(self.policy.largest - 1, 1) if self.lookup else None
        out = []
        for group in prefill_groups([s.prompt.size - s.cached_tokens for s in joiners]):
            seqs = [joiners[i] for i in group]
            for s in seqs:
                s.start(self.drafter, self.draft_window, self.draft_sink, self.policy.largest)
            batch, last = prefill(self.target, self.batch.kinds, seqs, self.prefill_step_size)
            for s, logits in zip(seqs, last):
                try:  # one sequence's sampling that raises ends that sequence only
                    out += s.first_token(logits, copies_largest)
                except Exception as e:
                    out += s.fail(e)
            self.batch.extend(batch)
            self.active += seqs
        return out

    def _leave(self):
        """Finished sequences leave the batch (with return_caches their caches go with
        their last response)."""
        if not any(s.finish for s in self.active):
            return
        if self.return_caches:
            for i, s in enumerate(self.active):
                if s.finish:
                    s.last.cache, s.last.context = self.batch.extract(i), s.context
        self._keep([i for i, s in enumerate(self.active) if not s.finish])

    def _keep(self, indices: List[int]):
        self.batch.keep(indices)
        self.active = [self.active[i] for i in indices]
