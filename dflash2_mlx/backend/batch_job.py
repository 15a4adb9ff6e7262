"""The batch job: DFlash requests that run at the same time share one ``BatchGenerator``
(``dflash2_mlx.batch``), stepped by one worker job. Each step lets the requests whose turn
came join, drops aborted ones, and runs one batched draft -> verify cycle for all; every
sequence keeps its own acceptance, so each stays lossless (greedy: its single-stream text).
A request that finds nothing running starts as a single stream (``solo.py``) and hands over
to the batch when another one asks to join."""

import collections
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Dict, List, Optional

from mlx_lm.models.cache import KVCache, RotatingKVCache

from ..batch import BatchGenerator, batch_policy
from ..batch.cache import batch_layers
from ..responses import detokenizer_after
from ..loop.cycle import CycleStats
from ..loop.target import UnsupportedTargetError, attach
from ..request.plan import Plan
from .admission import DONE, Request
from .options import decoding_plan
from .prefix_cache import PREFILL_CHUNK_SECONDS, Start, recurrent, recurrent_state, windowed
from .reply import Reply
from .solo import Carry, solo_job
from .wire import Chunk

log = logging.getLogger("dflash2_mlx.engine")


def batchable(model, drafter) -> bool:
    """Whether ``BatchGenerator`` takes this target (not one with quantized or chunked caches)."""
    try:
        batch_layers(attach(model, drafter))
        return True
    except UnsupportedTargetError as e:
        log.info("requests run one at a time, each its own stream: %s", e)
        return False


def block_policy(plan: Plan, model, drafter):
    """The batch's block size, from the settings' plan: a chain's fixed size, or "auto" (a
    verify mode of "adaptive" with a block size: the adaptive policy up to it, as
    ``stream_generate`` chooses for one stream); a tree's requests run chains of "auto" here."""
    if plan.verify == "chain" and not plan.auto:
        return plan.block_size
    if plan.verify == "chain" and plan.largest is not None:
        return batch_policy(attach(model, drafter), drafter, plan.largest)
    return "auto"


class Joined:
    """A request in the batch (worker thread only)."""

    def __init__(self, request: Request, push, start, reply: Reply, detokenizer, decoding: dict):
        self.request, self.push, self.start, self.reply = request, push, start, reply
        self.detokenizer, self.decoding = detokenizer, decoding
        self.tokens: List[int] = []  # every token the batch produced for it, in order
        self.n = 0  # completion tokens counted for the client
        self.last = None  # its latest Response
        self.finish: Optional[str] = None
        self.joined = time.perf_counter()
        self.first: Optional[float] = None  # when its first token came
        self.ids = request.ids  # the ids it joined with (the prompt, and a carry's tokens)
        self.before = None  # the last response of its single stream, if it was handed over

    def carry(self, c: Carry):
        """Go on from a single stream: its count, times, text state and draft statistics."""
        self.n, self.joined, self.first, self.reply, self.before = c.n, c.began, c.first, c.reply, c.last
        self.start.reused = c.reused  # what the client is told it reused: the prompt's
        for t in c.tokens:  # the text already sent: the detokenizer resumes after it
            self.detokenizer.add_token(t)
        self.detokenizer.last_segment  # read, so that the next segment starts after that text

    def stats(self, st):
        """Its draft statistics over both parts (``st``: the batch's for it)."""
        b = self.before
        if b is None or not b.cycles:
            return st
        out = CycleStats(max(len(b.acceptance_counts), len(st.position_accepted)) + 1)
        out.cycles = b.cycles + st.cycles
        out.total_accepted = sum(b.acceptance_counts) + st.total_accepted
        out.block_sizes = collections.Counter(b.block_sizes) + collections.Counter(st.block_sizes)
        for part in (b.acceptance_counts, st.position_accepted):
            for i, v in enumerate(part):
                out.position_accepted[i] += v
        out.fallback = st.fallback if st.cycles else b.fallback
        out.shadows = b.shadows + st.shadows
        return out


# A prompt with more tokens than this to read is read a chunk a step before it joins (the
# batch's cycles go on between), not at once inside the batch.
READ_AT_ONCE = 256
MIN_CHUNK_SECONDS = 0.02  # a chunk's least time: below it a chunk's fixed costs dominate
CHUNK_OF_CYCLE = 0.75  # a chunk read beside decoding requests, in their cycles


def prefill_share(waiting: int) -> float:
    """Of the time, what chunks longer than a cycle take while requests decode, with
    ``waiting`` prompts to read (the one read now included): the batch's cycles count as one
    part and each prompt in line as one, so a long prompt alone gets half (its first token
    within about twice its time alone: a smaller share starves it, its client gives up, and
    a retry starts over), and a line of n long prompts is read in about n + 1 times one's
    time alone, not 2n (the last in line would outwait its client)."""
    return waiting / (waiting + 1)

FIRST_CHUNK = 8  # tokens of a prompt's first chunk in the batch: at a long context a token is slow


@dataclass
class Reading:
    """A request whose prompt is being read into its start's caches before it joins."""
    request: Request
    push: object
    carry: Optional[Carry]
    ids: List[int]
    start: object
    steps: object  # the generator reading the prompt, a chunk a step (None: made when its turn comes)
    long: bool = False  # more than READ_AT_ONCE tokens to read: one such prompt is read at a time
    aside: bool = False  # waiting for another long prompt, its admission turn passed on


class Batching:
    """One engine's batch: the request running solo for now, those waiting to join, and
    the job that steps the batch while it has requests."""

    def __init__(self, engine):
        self.engine = engine
        self.job: Optional[Future] = None  # the job stepping the batch, while it has requests
        self.joins = []  # (request, push, carry) waiting to join the batch, under lock
        self.solo: Optional[Request] = None  # a batchable request alone until others come
        self.lock = threading.Lock()
        self.cycle_seconds: Optional[float] = None  # the last cycle's time, while requests decode
        self.owed = 0.0  # seconds of cycles the decoding requests get before the next chunk

    def chunk_seconds(self) -> float:
        """How long a chunk of a prompt being read takes: under one cycle of the requests
        decoding meanwhile (each of their gaps is then under two cycles, not a cycle and a
        long chunk), ``PREFILL_CHUNK_SECONDS`` with none decoding."""
        if self.cycle_seconds is None:
            return PREFILL_CHUNK_SECONDS
        return min(PREFILL_CHUNK_SECONDS, max(MIN_CHUNK_SECONDS, CHUNK_OF_CYCLE * self.cycle_seconds))

    def takes(self, request: Request) -> bool:
        """Whether the request joins the batch (see the engine's docstring for who does not)."""
        e, plan = self.engine, request.plan
        if not e.batchable or e.max_running() < 2 or plan is None or plan.verify == "off":
            return False
        if request.options.scoring or plan.exact:  # scoring, and exact verify rows: solo
            return False
        # A seeded sampled request gets its single-stream text: in the batch only where the
        # batch drafts and copies exactly as its single stream would (a fixed block size).
        fixed = plan.verify == "chain" and not plan.auto
        return fixed or not request.generation.seeded_sampled

    def join(self, request: Request, push) -> Future:
        """Hand the request to the batch job (starting one when none runs); the future is
        done when the job is done with the request."""
        request.done = Future()
        with self.lock:
            if self.job is None and self.solo is None and not self.joins and not request.generation.seeded_sampled:
                # A seeded request stays out: its key cannot be handed over mid-stream.
                self.solo = request
                self.engine.admission.track(solo_job(self.engine, request, push, True))
            else:
                self.joins.append((request, push, None))
                if self.solo is None:
                    self._start()
        return request.done

    def handover_wanted(self) -> bool:
        """Another request waits to join: the solo one should hand over."""
        return bool(self.joins)

    def solo_ended(self, request: Request, carry: Optional[Carry]):
        """The solo request has finished, or (``carry``) goes on in the batch, first in line."""
        with self.lock:
            if carry is not None:
                self.joins.insert(0, (request, request.push, carry))
            if self.solo is request:
                self.solo = None
            if self.joins:
                self._start()

    def _start(self):
        """Start the batch job if none runs (under lock)."""
        if self.job is None:
            self.job = self.engine.worker.submit(self._steps)
            self.engine.admission.track(self.job)

    def _steps(self):
        """The batch job (worker thread): each step, the requests whose turn came join,
        aborted ones leave, then one cycle for all; it ends when no request is left.  Its
        BatchGenerator lives as long as the job, as a single stream's state lives as long
        as its request: made with the settings of the moment, its adaptive block sizes
        seeded from the pair's history and folded back into it at the end."""
        joined: Dict[int, Joined] = {}  # uid -> request
        reading: List[Reading] = []  # requests whose prompts are read a chunk a step, not in yet
        gen = None
        while True:
            with self.lock:
                joins, self.joins = collections.deque(self.joins), []
                if not joins and not joined and not reading:
                    self.job = None
                    if gen is not None:
                        gen.close()
                    return
            try:
                gen = gen or self._generator()
                while joins:
                    self._insert(gen, joined, reading, *joins[0])
                    joins.popleft()
                self._read(gen, joined, reading)
                for uid, j in list(joined.items()):
                    if j.request.aborted.is_set():
                        j.finish = "abort"
                        j.push(Chunk(finish_reason="abort", prompt_tokens=len(j.request.ids), completion_tokens=j.n,
                                     cached_tokens=j.start.reused, engine=j.decoding))
                        self._leave(gen, joined, uid)
                if joined:
                    tic = time.perf_counter()
                    self._cycle(gen, joined)
                    took = time.perf_counter() - tic
                    self.cycle_seconds = took if joined else None
                    self.owed = max(0.0, self.owed - took)
                else:
                    self.cycle_seconds, self.owed = None, 0.0
            except Exception as e:  # the batch is in an unknown state: its requests fail
                log.exception("batched generation failed")
                for uid in list(joined):
                    joined[uid].finish = "error"
                    joined[uid].push(e)
                    self._done(joined.pop(uid))
                for request, push, _ in joins:  # not in the batch yet
                    self._refuse(request, push, "error", e)
                for r in reading:
                    self._refuse(r.request, r.push, "error", e)
                reading.clear()
                gen = None
            yield

    def _generator(self) -> BatchGenerator:
        e = self.engine
        plan = decoding_plan(e.settings, e.drafter)  # the settings' (its requests' own: ``_enter``)
        return BatchGenerator(e.model, e.drafter, block_size=block_policy(plan, e.model, e.drafter),
                              draft_window=plan.draft_window, draft_sink=plan.draft_sink,
                              return_caches=True, lookup=plan.lookup)

    def _insert(self, gen, joined: Dict[int, Joined], reading: list, request: Request, push,
                carry: Optional[Carry] = None):
        """Put a request into the batch: its prefix-cache start, sampling and stops.  A
        request handed over from its single stream (``carry``) goes on after its tokens.  A
        prompt longer than a chunk is read first, a chunk a step (``_read``)."""
        if request.aborted.is_set():
            self._refuse(request, push, "abort", Chunk(finish_reason="abort", prompt_tokens=len(request.ids)))
            return
        e, s = self.engine, self.engine.settings
        ids = request.ids + (carry.tokens if carry else [])
        try:
            start = (carry.caches if carry else e.prefix_cache).start(
                ids, e.model, e.drafter, s.draft_window, sink=s.draft_sink)
        except Exception as ex:
            self._refuse(request, push, "error", ex)
            return
        # A long prompt is read a chunk a step; so is any prompt of a sliding-window target,
        # whose prompt is kept once read (``PrefixCache.read``: the turn's end cannot serve it).
        unread = len(ids) - 1 - start.tokens
        if (unread > READ_AT_ONCE or (windowed(start.cache) and unread > 0)) and e.lockstep is None:
            long = unread > READ_AT_ONCE
            r = Reading(request, push, carry, ids, start, None, long=long)
            # A long prompt that waits its turn looks the prefix cache up again when it comes:
            # the prompt read before it may begin as it does (``_share``).
            if carry is not None or not long or not any(x.long for x in reading):
                r.steps = self._chunks(r)
            reading.append(r)
            return
        self._enter(gen, joined, request, push, carry, ids, start)

    def _read(self, gen, joined: Dict[int, Joined], reading: list):
        """One chunk of each prompt being read; a prompt read to its last token enters the
        batch, a request given up meanwhile leaves before it.  While requests decode, a chunk
        that took longer than their cycle (at a long context one token does) is followed by
        cycles only, until the chunks had their share of the time (``prefill_share``): the
        decoding requests' gaps stay a cycle but in one step out of many."""
        turn, share = self._readers(reading), prefill_share(len(reading))
        if joined and self.owed > 0:
            turn = [r for r in turn if r.request.aborted.is_set()]  # only those leaving
        for r in turn:
            if r.request.aborted.is_set():
                reading.remove(r)
                self._keep_read(r)
                self._refuse(r.request, r.push, "abort", Chunk(finish_reason="abort", prompt_tokens=len(r.request.ids)))
                continue
            tic = time.perf_counter()
            try:
                if r.steps is None:  # its turn came
                    s = self.engine.settings
                    r.start = self.engine.prefix_cache.again(r.start, r.ids, self.engine.model, self.engine.drafter,
                                                             s.draft_window, s.draft_sink)
                    r.steps = self._chunks(r)
                next(r.steps)
                took = time.perf_counter() - tic
                if joined and self.cycle_seconds is not None and took > self.cycle_seconds:
                    self.owed += took * (1 - share) / share
            except StopIteration:
                reading.remove(r)
                self._share(r, reading)
                self.engine.prefix_cache.read(r.ids[:-1], r.start)
                self._enter(gen, joined, r.request, r.push, r.carry, r.ids, r.start)
            except Exception as ex:
                reading.remove(r)
                self._refuse(r.request, r.push, "error", ex)

    def _chunks(self, r: Reading):
        """The generator that reads ``r``'s prompt a chunk a step."""
        return self.engine.prefix_cache.advance_steps(r.start, r.ids[:-1], self.engine.model,
                                                      seconds=self.chunk_seconds, first=FIRST_CHUNK)

    def _share(self, r: Reading, reading: list):
        """A long prompt just read that a prompt waiting in line begins with goes to the prefix
        cache now, not at the end of its turn: the one waiting then reads only the rest (an
        agent's clients send the same long context together; read once each, the last in
        line outwaits its client)."""
        read = r.ids[:r.start.tokens]
        for w in reading:
            if w.long and w.steps is None and _common(read, w.ids) > w.start.reused + READ_AT_ONCE:
                self._keep_read(r)
                return

    def _readers(self, reading: list) -> list:
        """The prompts read this step: the short ones, and the first of the long ones.  The
        other long ones wait their turn (read at once, each would take as long as all of them)
        and pass their admission turns on meanwhile, so short requests are not held behind
        them; requests given up are listed too, to leave."""
        first = next((r for r in reading if r.long), None)
        out = []
        for r in reading:
            waits = r.long and r is not first
            if waits != r.aside:
                r.aside = waits
                self.engine.admission.step_aside(r.request, waits)
            if not waits or r.request.aborted.is_set():
                out.append(r)
        return out

    def _keep_read(self, r: Reading):
        """A prompt given up while read: what was read goes to the prefix cache (a client
        that timed out and asks again goes on from there, as a single stream's would)."""
        if r.start.tokens > r.start.reused:
            try:
                self.engine.prefix_cache.store(r.ids[:r.start.tokens], r.start)
            except Exception:  # a cache that cannot keep it must not fail the batch
                log.exception("prefix cache: could not store a prompt given up while read")

    def _enter(self, gen, joined: Dict[int, Joined], request: Request, push, carry: Optional[Carry],
               ids: List[int], start):
        e, plan = self.engine, request.plan
        try:
            uid = gen.insert(
                ids, max_tokens=plan.max_tokens - (carry.n if carry else 0), params=plan.params,
                logits_processors=plan.logits_processors, stop_tokens=e.tokenizer.eos_token_ids,
                seed=plan.seed, prompt_cache=start.cache if start.tokens else None,
                draft_context=start.context, cached_tokens=start.tokens)
        except Exception as ex:
            self._refuse(request, push, "error", ex)
            return
        e.stats.move(active=1)
        j = Joined(request, push, start, Reply(e.tokenizer, request.options, request.tools, request.chat, request.ids),
                   detokenizer_after(e.tokenizer, request.ids if request.continues else ()),
                   e.decoding(len(request.ids)))
        j.ids = ids
        if carry is not None:
            j.carry(carry)
        joined[uid] = j

    def _refuse(self, request: Request, push, finish: str, item):
        """A request that ends before it is in the batch: ``item`` is its last message."""
        self.engine.stats.add(prompt_tokens=len(request.ids), finish_reason=finish)
        push(item)
        push(DONE)
        request.done.set_result(None)

    def _cycle(self, gen, joined: Dict[int, Joined]):
        """One ``gen.next()``: each response through its request's text pipeline, as a
        single stream does; finished requests leave."""
        ended = []
        self.engine.stats.batch_step(len(joined))
        for r in gen.next():
            j = joined[r.uid]
            if r.error is not None:  # its own sampling raised: it fails, the batch goes on
                log.error("request failed in the batch: %r", r.error)
                j.finish = "error"
                j.push(r.error)
                self._done(joined.pop(r.uid))  # it has left the batch, its caches unkept
                continue
            j.tokens.append(r.token)
            j.last = r
            if j.finish:  # tokens of a cycle past a stop string: in the cache, not the reply
                continue
            now = time.perf_counter()
            j.first = j.first or now
            j.n += 1
            if r.finish_reason != "stop":  # a stop token is not part of the text
                j.detokenizer.add_token(r.token)
            if r.finish_reason:
                j.detokenizer.finalize()
            j.reply.token(r.token, r.logprobs, r.finish_reason)
            st = j.stats(r.stats)
            content, calls, j.finish, reasoning = j.reply.add(j.detokenizer.last_segment, r.finish_reason, st.cycles)
            if content or calls or j.finish or reasoning:
                j.push(Chunk(text=content, reasoning=reasoning, finish_reason=j.finish, prompt_tokens=len(j.request.ids),
                             completion_tokens=j.n, tool_calls=calls, tau=st.tau, cycles=st.cycles,
                             generation_tps=j.n / max(now - j.first, 1e-9),
                             block_sizes=dict(sorted(st.block_sizes.items())), fallback=st.fallback,
                             cached_tokens=j.start.reused, engine=j.decoding, shadows=st.shadows,
                             logprobs=j.reply.take(), stop_sequence=j.reply.matcher.hit,
                             segments=j.reply.segments(st.cycles) if j.finish else None))
            if j.finish:
                ended.append(r.uid)
        for uid in ended:
            self._leave(gen, joined, uid)

    def _leave(self, gen, joined: Dict[int, Joined], uid: int):
        """A request is done: its caches go to the prefix cache, it leaves the batch."""
        j = joined.pop(uid)
        try:
            if j.last is None:  # no token yet: nothing to keep
                pass
            elif j.last.finish_reason:  # the batch ended it: it has left, its caches with it
                self._store(j, j.last.cache, j.last.context)
            else:
                self._store(j, *gen.extract_cache(uid))
        except Exception:  # a cache that cannot keep this request must not fail it
            log.exception("prefix cache: could not store the request's caches")
        gen.remove(uid)
        self._done(j)

    def _store(self, j: Joined, cache, context):
        """Keep a batch sequence's caches (every token it committed, in order) for reuse."""
        n = next((c.offset for c in cache if isinstance(c, (KVCache, RotatingKVCache))), 0)
        start = Start(cache, context, tokens=n)
        if recurrent(cache):
            # Recurrent states: the batch replays them to exactly the committed tokens, which
            # are all known unless a stop token cut the cycle (``store`` checks the count).
            start.held = (n, recurrent_state(cache))
        self.engine.prefix_cache.store(j.ids + j.tokens, start)

    def _done(self, j: Joined):
        """The request's stats, its last message, and its place freed."""
        stats = self.engine.stats
        stats.move(active=-1)
        n_prompt, st = len(j.request.ids), j.stats(j.last.stats) if j.last is not None else None
        if st is not None:
            end = time.perf_counter()
            stats.add(prompt_tokens=n_prompt, generation_tokens=j.n,
                      prompt_seconds=j.first - j.joined, generation_seconds=end - j.first,
                      cycles=st.cycles, tau=st.tau, position_accepted=st.position_accepted,
                      block_sizes=st.block_sizes, fallback=st.fallback, finish_reason=j.finish)
        else:
            stats.add(prompt_tokens=n_prompt, finish_reason=j.finish or "abort")
        j.push(DONE)
        j.request.done.set_result(None)


def _common(a: list, b: list) -> int:
    """How many tokens ``a`` and ``b`` begin with alike."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
