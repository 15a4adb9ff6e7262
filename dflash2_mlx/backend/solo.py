"""Solo decoding: a request as its own stream on the worker, a token a step
(``dflash2_mlx.generate.stream_generate``), each stepped job with its own random key.
Requests the batch cannot serve run so; a batchable request that finds nothing running
starts so too (``solo``), and hands over to the batch when another request asks to join:
its caches through the prefix cache, its text state and counts in a ``Carry``."""

import logging
import time
from dataclasses import replace
from typing import List, Optional

from mlx_lm.models.cache import make_prompt_cache

from ..generate import stream_plan
from ..request.modes import verify_kind
from ..request.plan import Reuse
from ..responses import tree_report
from ..loop.random_keys import RandomStream, fresh_key
from ..loop.scoring import prompt_logprobs
from .admission import DONE, Request
from .prefix_cache import PrefixCache, Start
from .reply import Reply, prompt_entries
from .wire import Chunk

log = logging.getLogger("dflash2_mlx.engine")
# Replies up to this long to a scored prompt decode plain from the scoring pass's caches (a
# prefill saved outweighs what DFlash would save over so few tokens); longer ones draft.
SCORED_PLAIN_MAX = 16
# The memory tier a handover keeps its caches in when the engine's is off: room for any.
UNBOUNDED = 1 << 62


class Carry:
    """A solo request's state as it hands over to the batch."""

    def __init__(self, tokens: List[int], n: int, reply: Reply, began: float,
                 first: Optional[float], last, caches: PrefixCache, reused: int):
        self.tokens, self.n, self.reply, self.began, self.first, self.last = tokens, n, reply, began, first, last
        self.caches = caches  # where its caches are: the engine's prefix cache or its own
        self.reused = reused  # prompt tokens its single stream took from the prefix cache


def own_random(steps):
    """A stepped job with its own random key: jobs that take turns on the worker do not
    draw from each other's streams (a seeded request keeps its text)."""
    def job(*args):
        gen, stream = steps(*args), RandomStream(fresh_key())
        while True:
            with stream:
                try:
                    next(gen)
                except StopIteration:
                    return
            yield

    return job


def solo_steps(engine, request: Request, push, solo: bool = False):
    """The stepped job of one request (worker thread): push Chunks, then DONE."""
    return SoloStream(engine, request, push, solo).steps()


def solo_job(engine, request: Request, push, solo: bool = False):
    """Submit the request's single stream to the engine's worker; its future."""
    return engine.worker.submit(own_random(solo_steps), engine, request, push, solo)


class SoloStream:
    """One request decoded as a single stream. ``solo``: a batchable request alone for now,
    handed over to the batch when another one asks to join."""

    def __init__(self, engine, request: Request, push, solo: bool):
        self.engine, self.request, self.push, self.solo = engine, request, push, solo
        # The settings its plan was made under (its turn's), for the whole request.
        self.settings = request.settings or engine.settings
        self.n_prompt = len(request.ids)
        self.began = self.first = None
        self.last, self.finish, self.n = None, None, 0  # its latest response, finish, tokens
        self.start: Optional[Start] = None  # where its caches came from
        self.mode = None  # its verify mode
        self.decoding: dict = {}  # how it is decoded, as the client is told (ModelSettings.engine)
        self.reply: Optional[Reply] = None
        self.emitted: List[int] = []
        self.chunked = False  # whether its prompt is read in steps before its stream starts
        self.prefill_seconds = 0.0

    def steps(self):
        e, request, push = self.engine, self.request, self.push
        e.stats.move(active=1)
        request.push = push
        if request.aborted.is_set():
            e.stats.move(active=-1)
            push(Chunk(finish_reason="abort", prompt_tokens=self.n_prompt))
            push(DONE)
            self._end(None)
            return
        self.began = time.perf_counter()
        gen = None
        try:  # everything that can fail inside: a failure must still end the request (below)
            if e.lockstep is not None:  # the other ranks run it too (backend/follow.py)
                e.lockstep.announce(e, request)
            if self._begin():
                if (yield from self._prefill()):  # given up while its prompt was read
                    return
                gen = self._stream()
                yield from self._relay(gen)
        except Exception as ex:
            self.finish = "error"
            push(ex)
        finally:
            if gen is not None:
                gen.close()
            self._close()

    def _begin(self) -> bool:
        """Its start (the scoring pass's caches, or the prefix cache's); False when it
        generates nothing (a prompt scored alone)."""
        e, s, request, g = self.engine, self.settings, self.request, self.request.generation
        self.mode = s.verify_mode(self.n_prompt)
        self.decoding = e.decoding(self.n_prompt, s)
        drafting = self.mode != "off" and e.drafter is not None
        self.reply = Reply(e.tokenizer, request.options, request.tools, request.chat, request.ids)
        scored = None
        if request.options.prompt_logprobs is not None:
            entries, scored = scored_prompt(e, request.ids, request.options.prompt_logprobs)
            self.push(Chunk(prompt_tokens=self.n_prompt, prompt_logprobs=entries))
        if g.max_tokens == 0:  # scored, not continued
            self.finish = "length"
            self.push(Chunk(finish_reason="length", prompt_tokens=self.n_prompt, engine=self.decoding))
            return False
        # Plain decoding shows its penalties only the uncached tokens: no reuse with them.
        reuse = drafting or not set(g.penalties) - {"logit_bias"}
        if (scored is not None and reuse and all(c.is_trimmable() for c in scored)
                and g.max_tokens <= SCORED_PLAIN_MAX):
            # A short reply to a scored prompt (lm-eval's: one token) goes on from the
            # scoring pass's caches, plain: no second prefill of the prompt.
            self.mode, drafting = "off", False
            plain = {k: v for k, v in self.decoding.items() if k != "verify_rows"}
            self.decoding = {**plain, "dflash": False, "verify_mode": "off", "block_size": None}
            self.start = Start(scored, None, self.n_prompt - 1)
        else:
            self.start = e.prefix_cache.start(request.ids, e.model, e.drafter if drafting else None,
                                              s.draft_window, reuse=reuse, sink=s.draft_sink)
        # Penalties of plain decoding see only the uncached tokens (no reuse, no steps); the
        # ranks of a split target read the prompt in one go, together.
        self.chunked = reuse and e.lockstep is None
        return True

    def _prefill(self):
        """The prompt but its last token into the start's caches, a chunk a step (the
        last token is the stream's own, so its first token comes from fresh logits).  A
        generator; returns True when the request was given up meanwhile."""
        e, request = self.engine, self.request
        if not self.chunked:
            return False
        tic = time.perf_counter()
        for _ in e.prefix_cache.advance_steps(self.start, request.ids[:-1], e.model):
            self.prefill_seconds += time.perf_counter() - tic
            yield
            tic = time.perf_counter()
            if request.aborted.is_set():
                self.finish = "abort"
                self.push(Chunk(finish_reason="abort", prompt_tokens=self.n_prompt,
                                cached_tokens=self.start.reused, engine=self.decoding))
                return True
            if self.solo and e.batching.handover_wanted():  # another request must not wait for it
                self.finish = "handover"  # what it has read goes with it (``_close``)
                return True
        e.prefix_cache.read(request.ids[:-1], self.start)
        return False

    def _stream(self):
        """Its token generator, from the start's caches."""
        e, request = self.engine, self.request
        plan = request.plan if self.mode != "off" else replace(request.plan, verify="off")  # a scored prompt's
        return stream_plan(e.model, e.tokenizer, request.ids, e.drafter, plan,
                           Reuse(self.start.cache, self.start.context, self.start.tokens))

    def _relay(self, gen):
        """Each token through the reply into Chunks, a step each, until it finishes, is
        aborted, or (solo) hands over after a cycle."""
        e, request, reply, push = self.engine, self.request, self.reply, self.push
        for last in gen:
            self.last, self.n = last, last.generation_tokens
            if "verify_rows" in self.decoding and last.exactness:  # what it got (a first use probes)
                self.decoding = {**self.decoding, "verify_rows": last.exactness}
            self.first = self.first or time.perf_counter()
            self.emitted.append(last.token)
            e.prefix_cache.note(self.start, self.n_prompt + self.n)
            reply.token(last.token, last.logprobs, last.finish_reason)
            content, calls, self.finish, reasoning = reply.add(last.text, last.finish_reason, last.cycles)
            if content or calls or self.finish or reasoning:
                push(Chunk(text=content, reasoning=reasoning, finish_reason=self.finish, prompt_tokens=self.n_prompt,
                           completion_tokens=self.n, tool_calls=calls, tau=last.tau, cycles=last.cycles,
                           generation_tps=last.generation_tps, block_sizes=last.block_sizes,
                           fallback=last.fallback, cached_tokens=self.start.reused, engine=self.decoding,
                           shadows=last.shadows, logprobs=reply.take(), stop_sequence=reply.matcher.hit,
                           trees=tree_report(last) if verify_kind(self.mode) == "tree" else None,
                           segments=reply.segments(last.cycles) if self.finish else None))
            if self.finish:
                break
            yield
            stop = request.aborted.is_set()
            if e.lockstep is not None:  # rank 0's word, on every rank
                stop = e.lockstep.stop_here(stop)
            if stop:
                self.finish = "abort"
                push(Chunk(finish_reason="abort", prompt_tokens=self.n_prompt, completion_tokens=self.n,
                           cached_tokens=self.start.reused, engine=self.decoding))
                break
            if self.solo and e.batching.handover_wanted() and last.cycles:  # after a cycle: its τ counts one
                self.finish = "handover"
                break

    def _close(self):
        """Keep its caches, count its stats, and end it (or hand it over)."""
        e, finish, last = self.engine, self.finish, self.last
        # A handover keeps its caches even where the prefix cache's memory tier is off: in
        # one of its own (not by way of the disk tier).
        kept = e.prefix_cache if finish != "handover" or e.prefix_cache.budget > 0 else PrefixCache(UNBOUNDED)
        if self.start is not None and finish != "error":
            try:
                kept.store(self.request.ids + self.emitted, self.start)
            except Exception:  # a cache that cannot keep this request must not fail it
                log.exception("prefix cache: could not store the request's caches")
        e.stats.move(active=-1)
        if finish == "handover":
            self._end(Carry(self.emitted, self.n, self.reply, self.began, self.first, last, kept,
                            self.start.reused))
            return
        if last is not None:
            n = self.n
            e.stats.add(
                prompt_tokens=self.n_prompt, generation_tokens=n,
                prompt_seconds=self.prefill_seconds + (self.n_prompt / last.prompt_tps if last.prompt_tps else 0.0),
                generation_seconds=n / last.generation_tps if last.generation_tps else 0.0,
                cycles=last.cycles, tau=last.tau, position_accepted=last.acceptance_counts,
                block_sizes=last.block_sizes, fallback=last.fallback,
                # A plain fallback is the settings' (dflash_max_ctx), as the reply's engine says;
                # a short reply to a scored prompt goes on plain by design, not as a fallback.
                plain=self.settings.verify_mode(self.n_prompt) == "off" and e.drafter is not None,
                finish_reason=finish)
        else:
            e.stats.add(prompt_tokens=self.n_prompt, finish_reason=finish or "abort")
        # Ended before the client hears so: a next request sent on the reply's end finds the
        # engine idle and starts as a single stream, not as the batch a running one would make.
        self._end(None)
        self.push(DONE)

    def _end(self, carry: Optional[Carry]):
        if self.solo:
            if carry is None:
                self.request.done.set_result(None)
            self.engine.batching.solo_ended(self.request, carry)


def scored_prompt(engine, ids: List[int], top: int):
    """The prompt's logprob entries, and the target's caches of it but its last token."""
    cache = make_prompt_cache(engine.model)
    lps, tops = prompt_logprobs(engine.model, ids, top, cache=cache)
    return prompt_entries(engine.tokenizer, ids, lps, tops), cache
