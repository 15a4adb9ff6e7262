"""Batched DFlash: several sequences drafted together and verified in one target pass.

Each cycle picks one block size b for the batch (fixed, or the adaptive policy fed with
every sequence's acceptance), drafts every sequence's block [anchor, MASK...], verifies all
blocks in ONE target pass over [S, b] rows, and lets each sequence keep its own accepted
prefix plus the target's bonus token, with its own sampling parameters, logits processors,
random stream, max_tokens and stop tokens.  Sequences join between cycles (prefilled
together, see below) and leave (finished or aborted).

The batched caches and the batched drafter pass are in ``batch_cache.py``.

Copies (``lookup.py``): a sequence whose last tokens occurred before verifies the tokens
that followed them then instead of its draft, within the batch's block (no propose for it;
at T>0 its rows q are one-hot), where its own copies' acceptance promises more than the
drafter's (a fixed block size always copies, as a single stream does).

Random draws: each sampled sequence owns a PRNG key, swapped in around its draws, so it
draws exactly what a single stream seeded the same way draws, whatever else is in the
batch; a sequence without a seed gets a key drawn from the global generator.

Lossless per sequence: every emitted token is the target's choice in the pass that verified
it (greedy) or passed rejection sampling against the target's own distribution (sampled),
exactly as in ``speculative.py``; the batch only changes which rows share a matmul.
"""

import time
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Union

import mlx.core as mx

from .. import adaptive
from ..adaptive import interp
from .cache import TargetBatch, batch_layers, draft_hidden
from ..loop.draft_context import DraftContext
from ..model.drafter import Drafter, propose
from ..loop.lookup import Lookup, one_hot_rows
from ..loop.sampling import SamplingParams, probs, processed_logprobs, sample
from ..loop.cycle import CycleStats
from ..loop.random_keys import fresh_key, swap_key
from ..loop.target import attach


# --- the batched cycle ------------------------------------------------------------------------

@dataclass
class Response:
    """One emitted token of one sequence; the last one has ``finish_reason`` set
    ("stop": a stop token, emitted here too; "length": max_tokens)."""
    uid: int
    token: int
    logprobs: mx.array
    from_draft: bool
    finish_reason: Optional[str]
    stats: CycleStats
    cache: Optional[list] = None  # with return_caches: the finished sequence's target cache
    context: Optional[DraftContext] = None  # ... and its draft context


@dataclass
class _Sequence:
    uid: int
    prompt: mx.array
    params: SamplingParams
    processors: Optional[List[Callable]]
    max_tokens: float
    stop_tokens: frozenset
    key: Optional[int]  # its PRNG key (sampled sequences only)
    prompt_cache: Optional[list]  # a reused prefix's target cache, until it joins
    context: Optional[DraftContext]
    cached_tokens: int
    history: Optional[mx.array] = None  # committed tokens: the logits processors' input
    anchor: int = 0
    emitted: int = 0
    stats: Optional[CycleStats] = None
    finish: Optional[str] = None
    last: Optional[Response] = None  # its latest response
    copier: Optional[Lookup] = None  # every token it has read (copies on)
    copies: Optional[adaptive.Acceptance] = None  # ... and how far its copies were accepted


def accept_lazy(logprobs: mx.array, draft: Optional[mx.array], q: Optional[mx.array],
                params: SamplingParams):
    """One sequence's accept rule as lazy arrays (ok [n], candidates [n + 1]), so a batch
    is evaluated at once; ``pick`` reads them.  The same rule and the same draws as
    ``verify_greedy`` / ``verify_sampled`` (a uniform per draft, then one categorical over
    the vocabulary, i.e. argmax of the row plus one gumbel draw); ``draft`` None is a plain
    step, drawn as ``sample`` draws it."""
    if draft is None:
        return mx.zeros((0,), dtype=mx.bool_), sample(logprobs, params)
    n = draft.shape[0]
    if params.greedy:
        target_tokens = mx.argmax(logprobs, axis=-1)
        return draft == target_tokens[:n], target_tokens
    p = probs(logprobs, params)
    idx = draft[:, None]
    p_d = mx.take_along_axis(p[:n], idx, axis=-1)[:, 0]
    q_d = mx.take_along_axis(q, idx, axis=-1)[:, 0]
    ok = mx.random.uniform(shape=(n,)) * q_d < p_d
    noise = mx.random.gumbel(shape=(p.shape[-1],))
    # Row i < n: the residual max(p - q, 0) after a rejection at i; row n: the bonus row p.
    candidates = mx.concatenate([mx.log(mx.maximum(p[:n] - q, 0)), mx.log(p[n:])])
    return ok, mx.argmax(candidates + noise, axis=-1)


def pick(ok: List[bool], candidates: List[int]):
    """Accepted drafts (up to the first rejection) and the token drawn after them."""
    accepted = next((i for i, m in enumerate(ok) if not m), len(ok))
    return accepted, candidates[accepted]


def prefill_groups(lengths: List[int], slack: float = 1.25) -> List[List[int]]:
    """Which joiners are prefilled together (indices): by length, a group grows while its
    padded rows stay within ``slack`` times its real ones (a padding row is wasted work; on
    a CPU long prompts gain little from sharing a pass, short ones a lot)."""
    groups, group = [], []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        rows = sum(lengths[j] for j in group) + lengths[i]
        if group and lengths[i] * (len(group) + 1) > slack * rows:
            groups.append(group)
            group = []
        group.append(i)
    return groups + [group] if group else groups


class BatchCosts:
    """The pair's single-stream cost model (``adaptive.CostModel``) as a batch of
    ``streams`` sequences sees it, for the adaptive policy: a cycle with block b verifies
    S * b rows and drafts S blocks, so its base cost is the model's at S * b rows (the lines
    extended past the largest calibrated block along their last slope), and each sequence's
    own context adds its attention cost.  One sequence: the model itself.

    With ``timing`` (``adaptive.Timing``) each cycle is priced at what the batch's cycles of
    its kind, size and stream count really took (``observe``): the extension past the
    calibrated rows, and a batch's per-sequence work, are guesses (8 streams here, decode
    tok/s over two rounds: 80-86 timed, 68-70 priced by the lines alone, plain steps 66-72)."""

    def __init__(self, costs, timing=None):
        self.costs, self.streams, self.timing = costs, 1, timing

    def cycle(self, b: int, context: int) -> float:
        raw = self._raw(b, context, True)
        if self.timing is None:
            return raw
        return raw * self.timing.ratio(self.kind(b, True), b, raw, f"batch{self.streams}")

    def observe(self, b: int, context: int, seconds: float, drafted: bool = True):
        """A cycle of block ``b`` took ``seconds`` (``drafted`` False: every sequence verified
        a copy, no drafter pass).  What one kind shows moves the others' prices too (at first
        a batch times only the kind it runs: its per-sequence work, priced on one kind alone,
        sent 4 streams here to plain steps, then back)."""
        if self.timing is not None:
            self.timing.record(self.kind(b, drafted), b, seconds, self._raw(b, context, drafted),
                               f"batch{self.streams}")

    def kind(self, b: int, drafted: bool) -> str:
        return f"batch{self.streams}-{adaptive.kind(b, copy=not drafted)}"

    def _raw(self, b: int, context: int, drafted: bool) -> float:
        seconds = self._part(self.costs.target, b, context)
        if b > 1 and drafted:
            seconds += self._part(self.costs.drafter, b, context)
        return seconds

    def _part(self, points: dict, b: int, context: int) -> float:
        S = self.streams
        return _rows_base(points, S * b) + S * interp(points, b)[1] * context


def _rows_base(points: dict, rows: int) -> float:
    keys = sorted(points)
    if rows <= keys[-1] or len(keys) < 2:
        return interp(points, rows)[0]
    lo, hi = keys[-2], keys[-1]
    per_row = max(0.0, (points[hi][0] - points[lo][0]) / (hi - lo))
    return points[hi][0] + per_row * (rows - hi)


def batch_policy(target, drafter, largest: Optional[int] = None) -> adaptive.Adaptive:
    """The adaptive policy of a batch: the pair's history, its ``BatchCosts`` measured or
    cached, with this process's timing of them (shared with single streams, and saved with
    theirs when the batch closes)."""
    return adaptive.policy(target, drafter, adaptive.AUTO, largest=largest, priced=BatchCosts)


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
        if hasattr(block_size, "record"):
            self.policy = block_size
        else:
            from ..generate import check_block_size

            block_size = check_block_size(drafter, block_size)
            self.policy = (batch_policy(self.target, drafter) if block_size == adaptive.AUTO
                           else adaptive.policy(self.target, drafter, block_size))
        self.draft_window, self.draft_sink = draft_window, draft_sink
        self.prefill_step_size = prefill_step_size
        self.batch_drafter = batch_drafter
        self.return_caches = return_caches
        self.max_batch = max_batch or float("inf")
        self.lookup = lookup
        self.waiting: List[_Sequence] = []
        self.active: List[_Sequence] = []  # in the batch's row order
        self._next_uid = 0
        self._drafted = ()  # the sequences of the last cycle, if it drafted (``_time``)

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
        if max_tokens == 0 or max_tokens < -1:
            raise ValueError(f"max_tokens must be positive (or -1 for no limit), got {max_tokens}")
        if not 0 <= cached_tokens < prompt.size:
            raise ValueError(f"cached_tokens must leave at least the last prompt token to run, "
                             f"got {cached_tokens} of {prompt.size}")
        key = None
        if not params.greedy:
            key = seed if seed is not None else fresh_key()
        uid, self._next_uid = self._next_uid, self._next_uid + 1
        self.waiting.append(_Sequence(
            uid, prompt, params, logits_processors, max_tokens if max_tokens > 0 else float("inf"),
            frozenset(stop_tokens), key, prompt_cache, draft_context, cached_tokens))
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
        out += self._cycle()
        self._leave()
        return out

    def close(self):
        """Keep the batch's acceptance as the pair's history (adaptive block sizes)."""
        adaptive.remember(self.policy)

    # -- joining ------------------------------------------------------------------------
    def _admit(self) -> List[Response]:
        """Prefill the waiting sequences (as many as there are places) and sample each
        one's first token; they join the batch.  Prompts of similar lengths are prefilled
        together (``prefill_groups``)."""
        places = int(min(len(self.waiting), self.max_batch - len(self.active)))
        joiners, self.waiting = self.waiting[:places], self.waiting[places:]
        out = []
        for group in prefill_groups([s.prompt.size - s.cached_tokens for s in joiners]):
            seqs = [joiners[i] for i in group]
            batch, last = self._prefill(seqs)
            for s, logits in zip(seqs, last):
                logprobs = processed_logprobs(logits, s.prompt[:-1], s.prompt[-1:], s.processors)
                with _KeyScope(s):
                    s.anchor = int(sample(logprobs, s.params)[0].item())
                if self.lookup:
                    s.copier = Lookup(s.prompt.tolist() + [s.anchor])
                    s.copies = adaptive.Acceptance.copies(max(self.policy.largest - 1, 1))
                out += self._emit(s, [s.anchor], logprobs, 0)
            self.batch.extend(batch)
            self.active += seqs
        return out

    def _prefill(self, seqs: List[_Sequence]):
        """One target pass per chunk of the sequences' uncached prompt tokens, right-padded
        (a padding row comes after a sequence's real rows, so they never see it; it is a
        hole once the pass is committed).  Their caches, and each one's last logits."""
        batch = TargetBatch(self.batch.kinds)
        for s in seqs:
            batch.add(s.prompt_cache)
            s.prompt_cache = None
            s.context = s.context or DraftContext(self.drafter, self.draft_window, self.draft_sink)
            s.stats = CycleStats(self.policy.largest)
            s.history = s.prompt
        rest = [s.prompt[s.cached_tokens:].tolist() for s in seqs]
        last = [None] * len(seqs)
        width = max(1, self.prefill_step_size // len(seqs))  # rows per pass, all sequences
        for start in range(0, max(len(r) for r in rest), width):
            chunks = [r[start : start + width] for r in rest]
            w = max(len(c) for c in chunks)
            ids = mx.array([c + [0] * (w - len(c)) for c in chunks], dtype=mx.uint32)
            kept = [len(c) for c in chunks]
            logits, features = batch.forward(self.target, ids, None if min(kept) == w else kept)
            batch.rows.commit(kept)
            for i, s in enumerate(seqs):
                if kept[i]:
                    s.context.add(features[i : i + 1, : kept[i]])
                if kept[i] and start + kept[i] == len(rest[i]):
                    last[i] = logits[i, kept[i] - 1 : kept[i]]
            mx.eval(last, [c.state for c in batch.layers])
        return batch, last

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

    # -- one cycle ---------------------------------------------------------------------
    def _cycle(self) -> List[Response]:
        seqs = self.active
        if not seqs:
            return []
        costs = getattr(self.policy, "costs", None)
        if isinstance(costs, BatchCosts):
            costs.streams = len(seqs)
        context = max(s.history.size for s in seqs)
        b = self.policy.block_size(context)
        tic = time.perf_counter()
        anchors = mx.array([s.anchor for s in seqs], dtype=mx.int32)[:, None]
        drafts, qs = [], []
        copies = self._copies(b)
        if b > 1:
            mask = self.drafter.config.mask_token_id
            blocks = mx.array([[s.anchor] + [mask] * (b - 1) for s in seqs])
            hidden = self._draft(blocks) if not all(copies) else None
            for i, s in enumerate(seqs):
                if copies[i]:  # no drafter pick: nothing drawn from its key
                    draft = mx.array(copies[i], dtype=mx.int32)
                    q = None if s.params.greedy else one_hot_rows(draft, self.drafter.config.vocab_size)
                else:
                    with _KeyScope(s):
                        draft, q = propose(self.drafter, hidden[i : i + 1], mx.array(s.anchor),
                                           s.params)
                drafts.append(draft.astype(mx.int32))
                qs.append(q)
            verify = mx.concatenate([anchors, mx.stack(drafts)], axis=1)
        else:
            verify = anchors
        # Verify: one target pass over every sequence's block.
        saved = self.batch.snapshot()
        logits, features = self.batch.forward(self.target, verify)
        rows, lazy = [], []
        for i, s in enumerate(seqs):
            rows.append(processed_logprobs(logits[i], s.history, verify[i], s.processors))
            with _KeyScope(s):
                lazy.append(accept_lazy(rows[i], drafts[i] if drafts else None,
                                        qs[i] if drafts else None, s.params))
        # Accept: one evaluation for the whole batch, then each sequence's prefix on the host.
        mx.eval(lazy, verify)
        accepted, bonus = zip(*(pick(ok.tolist(), cand.tolist()) for ok, cand in lazy))
        kept = [a + 1 for a in accepted]
        if saved is not None and min(kept) < b:
            self.batch.replay(self.target, saved, verify, kept)
        self.batch.rows.commit(kept)
        self.batch.compact()
        self._record(b, accepted, copies)
        self._time(costs, b, context, not all(copies), seqs, tic)
        out = []
        for i, (s, ids) in enumerate(zip(seqs, verify.tolist())):
            s.context.add(features[i : i + 1, : kept[i]])
            s.history = mx.concatenate([s.history, verify[i, : kept[i]].astype(s.history.dtype)])
            s.stats.record(b, accepted[i], self.policy.fallback, bool(copies[i]))
            new = ids[1 : kept[i]] + [bonus[i]]
            if s.copier is not None:
                s.copier.extend(new)
            out += self._emit(s, new, rows[i], accepted[i])
            s.anchor = bonus[i]
        return out

    def _copies(self, b: int) -> List[Optional[List[int]]]:
        """Each sequence's copy for a block of ``b`` (None: it drafts).  A copy is taken where
        the sequence's copies are expected to be accepted further than the batch's drafts
        (a policy without an acceptance estimate, a fixed block size: always)."""
        if b == 1 or not self.lookup:
            return [None] * len(self.active)
        out = []
        drafter = getattr(self.policy, "acceptance", None)
        drafted = adaptive.expected_tokens(drafter.rates(), b) if drafter is not None else 0.0
        for s in self.active:
            copy = s.copier.draft(b - 1)
            if copy and adaptive.expected_tokens(s.copies.rates(), b) <= drafted:
                copy = []
            out.append(copy or None)
        return out

    def _time(self, costs, b: int, context: int, drafted: bool, seqs, tic: float):
        """Tell ``BatchCosts`` what the cycle took: a plain step or a cycle of copies only
        always; a drafted cycle when the drafter also ran in the cycle before for these
        sequences (it runs for every sequence, copying ones too; after plain steps, copies
        only or a join it first reads the rows not yet fed: not this draft's work)."""
        uids = {s.uid for s in seqs}
        drafted = b > 1 and drafted
        if isinstance(costs, BatchCosts) and (not drafted or uids <= set(self._drafted)):
            costs.observe(b, context, time.perf_counter() - tic, drafted)
        self._drafted = uids if drafted else ()

    def _draft(self, blocks: mx.array) -> mx.array:
        contexts = [s.context.fed() for s in self.active]
        if self.batch_drafter:
            return draft_hidden(self.drafter, blocks, contexts)
        return mx.concatenate([self.drafter(blocks[i : i + 1], c) for i, c in enumerate(contexts)])

    def _record(self, b: int, accepted: List[int], copies: List[Optional[List[int]]]):
        """The policy learns from every sequence's draft, but counts a plain step once; a
        copy teaches only its own sequence's copies."""
        if b == 1:
            self.policy.record(1, 0)
            return
        for s, a, copy in zip(self.active, accepted, copies):
            if copy:
                s.copies.record(b, a)
            else:
                self.policy.record(b, a)

    def _emit(self, s: _Sequence, tokens: List[int], logprobs: mx.array, drafted: int):
        out = []
        for j, token in enumerate(tokens):
            s.emitted += 1
            if token in s.stop_tokens:
                s.finish = "stop"
            elif s.emitted >= s.max_tokens:
                s.finish = "length"
            s.last = Response(s.uid, token, logprobs[j], j < drafted, s.finish, s.stats)
            out.append(s.last)
            if s.finish:
                break
        return out

    # -- leaving -----------------------------------------------------------------------
    def _keep(self, indices: List[int]):
        self.batch.keep(indices)
        self.active = [self.active[i] for i in indices]


class _KeyScope:
    """Around a sampled sequence's draws: its own PRNG key in, the global one back."""

    def __init__(self, seq: _Sequence):
        self.seq, self.outer = seq, None

    def __enter__(self):
        if self.seq.key is not None:
            self.outer = swap_key(self.seq.key)

    def __exit__(self, *exc):
        if self.seq.key is not None:
            self.seq.key = swap_key(self.outer)


# --- the Python API ----------------------------------------------------------------------------

@dataclass
class BatchResult:
    """What ``batch_generate`` returns, in the prompts' order (stop tokens left out)."""
    texts: List[str]
    token_ids: List[List[int]]
    finish_reasons: List[str]
    stats: List[CycleStats]
    generation_tokens: int = 0
    generation_tps: float = 0.0  # all sequences' tokens per second of the whole run


def stream_batch_generate(model, tokenizer, prompts: Sequence, drafter: Drafter, *,
                          max_tokens: Union[int, List[int]] = 256, temp: float = 0.0,
                          top_p: float = 1.0, min_p: float = 0.0, top_k: int = 0,
                          min_tokens_to_keep: int = 1, xtc_probability: float = 0.0,
                          xtc_threshold: float = 0.1, xtc_special_tokens: Sequence[int] = (),
                          logits_processors: Optional[List[Callable]] = None,
                          block_size=adaptive.AUTO, seed: Optional[int] = None,
                          **kwargs) -> Iterator[Response]:
    """Generate from every prompt (text, token ids or chat messages) in one batch; yield
    each token's ``Response`` as it comes (``uid`` = the prompt's index).  ``seed``: the
    whole batch's random draws; sampling as in ``stream_generate``.  Other keywords go to
    ``BatchGenerator``."""
    from ..generate import encode_prompt

    if seed is not None:
        mx.random.seed(seed)
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = SamplingParams(temp=temp, top_p=top_p, min_p=min_p, top_k=top_k,
                            min_tokens_to_keep=min_tokens_to_keep, xtc_probability=xtc_probability,
                            xtc_threshold=xtc_threshold, xtc_special_tokens=tuple(xtc_special_tokens))
    gen = BatchGenerator(model, drafter, block_size=block_size, **kwargs)
    for prompt, limit in zip(prompts, limits):
        gen.insert(encode_prompt(tokenizer, prompt), max_tokens=limit, params=params,
                   logits_processors=logits_processors, stop_tokens=tokenizer.eos_token_ids)
    while len(gen):
        yield from gen.next()


def batch_generate(model, tokenizer, prompts: Sequence, drafter: Drafter, **kwargs) -> BatchResult:
    """Every prompt's whole response, generated together (keywords: ``stream_batch_generate``)."""
    n = len(prompts)
    tokens = [[] for _ in range(n)]
    finish, stats = [""] * n, [None] * n
    tic, total = time.perf_counter(), 0
    for r in stream_batch_generate(model, tokenizer, prompts, drafter, **kwargs):
        total += 1
        if r.finish_reason != "stop":
            tokens[r.uid].append(r.token)
        if r.finish_reason:
            finish[r.uid], stats[r.uid] = r.finish_reason, r.stats
    seconds = time.perf_counter() - tic
    return BatchResult([tokenizer.decode(t) for t in tokens], tokens, finish, stats, total,
                       total / seconds if seconds else 0.0)
