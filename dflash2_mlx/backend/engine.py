"""One loaded model (target + optional drafter) behind the async surface a model manager
drives: ``start``/``stop``, ``generate``/``stream_generate``, ``chat``/``stream_chat``,
``count_chat_tokens``, ``get_stats``, ``has_active_requests`` and ``abort``.

Every MLX call runs on the backend's one worker thread (``worker.py``); the event loop only
tokenizes and moves text. Up to ``max_batch`` requests run at once, first come first served,
with at most ``max_queue`` waiting; one more is refused with QueueFull when its stream is
made, before any chunk (a request holds its place in the queue from then on). A prefix cache
(``prefix_cache.py``) lets a request start from the caches of an earlier one that shares
its first tokens.

Continuous batching: DFlash requests that run at the same time share one ``BatchGenerator``
(``batch.py``), stepped by one worker job: each step lets the requests that got their turn
join, drops aborted ones, and runs one batched draft -> verify cycle for all; every sequence
keeps its own acceptance, so each stays lossless (greedy: its single-stream text). A request
that finds nothing running starts as a single stream (a lone request runs at single-stream
speed, which the batch's bookkeeping does not reach); when another one asks to join, it hands
its caches over through the prefix cache and goes on in the batch from where it was. Requests
the batch cannot serve run as their own stepped job next to it, one token a step, each with
its own random key: plain decoding (no drafter, ``dflash_max_ctx``), targets the batch
refuses (sliding windows), ``max_batch`` 1 (the one-at-a-time server), and seeded sampled
requests with adaptive block sizes (the batch's block sizes depend on its other sequences,
and a seed promises its single-stream text).
"""

import asyncio
import collections
import gc
import itertools
import logging
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Dict, List, Optional, Sequence

from .prefix_cache import PrefixCache, Start
from .ssd_cache import DiskTier, default_ssd_cache_dir, pair_dir
from .settings import ModelSettings, first_set
from .stats import EngineStats
from .stops import StopMatcher
from .tool_calls import ToolCallSplitter
from .worker import worker as default_worker


class EngineError(RuntimeError):
    """The engine cannot take the request (not started, stopping)."""


class QueueFull(EngineError):
    """Too many requests are waiting for this model."""


class InvalidOption(ValueError):
    """A request option this model cannot honour; ``param`` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class PromptTooLong(ValueError):
    """The prompt has more tokens than the model's context window."""

    def __init__(self, tokens: int, limit: int):
        super().__init__(f"the prompt has {tokens} tokens; this model accepts at most {limit}")
        self.tokens, self.limit = tokens, limit


@dataclass
class Chunk:
    """A piece of a streamed response. The last one has ``finish_reason`` set:
    'stop' (end of sequence or a stop string), 'length', 'tool_calls' or 'abort'."""
    text: str
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tool_calls: List[dict] = field(default_factory=list)
    tau: float = 0.0
    cycles: int = 0
    generation_tps: float = 0.0
    block_sizes: Dict[int, int] = field(default_factory=dict)  # cycles per block size
    fallback: bool = False  # adaptive speculation is decoding plain for now
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    engine: dict = field(default_factory=dict)  # how this request is decoded (ModelSettings.engine)
    shadows: int = 0  # plain steps that carried a shadow probe (adaptive speculation)
    # With the request option logprobs: one entry per token of this piece, OpenAI's
    # {token, logprob, bytes, top_logprobs} (the target's log-probabilities, as mlx-lm's).
    logprobs: List[dict] = field(default_factory=list)
    # With the request option prompt_logprobs (first chunk only): one entry per prompt token,
    # the first with logprob and top_logprobs None (nothing comes before it).
    prompt_logprobs: Optional[List[dict]] = None


@dataclass
class Completion:
    """A whole response, as ``generate`` and ``chat`` return it."""
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    tool_calls: List[dict] = field(default_factory=list)
    tau: float = 0.0
    cycles: int = 0
    generation_tps: float = 0.0
    request_id: str = ""
    block_sizes: Dict[int, int] = field(default_factory=dict)
    fallback: bool = False
    cached_tokens: int = 0
    engine: dict = field(default_factory=dict)
    shadows: int = 0
    logprobs: List[dict] = field(default_factory=list)
    prompt_logprobs: Optional[List[dict]] = None


class _Turns:
    """First-come-first-served admission: ``max_running`` requests run, ``max_waiting`` may wait."""

    def __init__(self, max_waiting: int, max_running: int = 1):
        self.max_waiting = max_waiting
        self.max_running = max_running
        self.running = 0
        self.waiters = collections.deque()

    def reserve(self) -> asyncio.Future:
        """A place in line, taken now: a future that is done when it is this request's turn.
        Raises QueueFull when ``max_waiting`` are waiting already."""
        turn = asyncio.get_running_loop().create_future()
        if self.running < self.max_running and not self.waiters:
            self.running += 1
            turn.set_result(None)
        elif len(self.waiters) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiters)} requests are already waiting for this model")
        else:
            self.waiters.append(turn)
        return turn

    def resize(self, max_running: int):
        """Change the limit (a settings edit); a raised one lets waiters start now."""
        self.max_running = max_running
        while self.waiters and self.running < self.max_running:
            self.running += 1
            self.leave()

    def cancel(self, turn: asyncio.Future):
        """Give up a place: leave the line, or pass the turn on if it had come."""
        if turn in self.waiters:
            self.waiters.remove(turn)
        elif turn.done() and not turn.cancelled():
            self.leave()

    def leave(self):
        """A running request is done: its place goes to the first waiter (unless the limit
        has been lowered meanwhile)."""
        while self.waiters and self.running <= self.max_running:
            turn = self.waiters.popleft()
            if not turn.done():
                try:
                    turn.set_result(None)
                    return
                except RuntimeError:  # its event loop has closed
                    continue
        self.running -= 1


class _Request:
    def __init__(self, request_id: str, ids: List[int], params: dict, tools=None, chat: bool = False):
        self.id = request_id
        self.ids = ids
        self.params = params
        self.tools = tools
        self.chat = chat
        self.aborted = threading.Event()
        self.finished = False
        self.started = False  # its stream has been iterated
        self.turn: Optional[asyncio.Future] = None
        self.queued = False
        self.chunks: Optional[asyncio.Queue] = None
        self.done: Optional[Future] = None  # in the batch: set when the batch is done with it
        self.push = None  # its chunks' way out (set on the worker)


class _Reply:
    """A request's text on its way out (both decoding paths): stop strings, tool calls, and
    the finish reason the client sees."""

    def __init__(self, tokenizer, params: dict, tools, chat: bool):
        stop = params.get("stop") or []
        self.matcher = StopMatcher([stop] if isinstance(stop, str) else list(stop))
        self.tools = ToolCallSplitter(tokenizer, tools)
        self.made_calls = False
        self.tokenizer, self.top = tokenizer, params.get("logprobs")
        self.pending: List[dict] = []  # logprob entries of tokens not yet in a chunk
        # A chat reply leaves out its stop token and so its entry (as OpenAI's chat does); a
        # completion keeps it (as the legacy API and vLLM do): one entry per generated token,
        # which lm-eval's loglikelihood counts on.
        self.stop_entry = not chat

    def token(self, token: int, logprobs, finish_reason: Optional[str]):
        """Note a token's log-probabilities when the request asked for them."""
        if self.top is None or (finish_reason == "stop" and not self.stop_entry):
            return
        from ..model.selector import top_candidates

        top = []
        if self.top:
            idx, vals = top_candidates(logprobs, self.top)
            top = list(zip(idx.tolist(), vals.tolist()))
        self.pending.append(logprob_entry(self.tokenizer, token, logprobs[token].item(), top))

    def take(self) -> List[dict]:
        out, self.pending = self.pending, []
        return out

    def add(self, segment: str, finish_reason: Optional[str]):
        """A token's text and the generator's finish reason -> (content, calls, finish)."""
        if finish_reason == "length":  # a character cut by max_tokens is left out
            segment = segment.rstrip("\ufffd")
        text, hit = self.matcher.add(segment)
        finish = None
        if hit:
            finish = "stop"
        elif finish_reason:
            finish = finish_reason
            text += self.matcher.flush()
        content, raw_calls = self.tools.add(text)
        if finish:
            tail, more = self.tools.flush()
            content, raw_calls = content + tail, raw_calls + more
        calls = self.tools.format(raw_calls)
        self.made_calls |= bool(calls)
        if finish == "stop" and self.made_calls:
            finish = "tool_calls"
        return content, calls, finish


class _Joined:
    """A request in the batch (worker thread only)."""

    def __init__(self, request: _Request, push, start, reply: _Reply, detokenizer, engine: dict):
        self.request, self.push, self.start, self.reply = request, push, start, reply
        self.detokenizer, self.engine = detokenizer, engine
        self.tokens: List[int] = []  # every token the batch produced for it, in order
        self.n = 0  # completion tokens counted for the client
        self.last = None  # its latest Response
        self.finish: Optional[str] = None
        self.joined = time.perf_counter()
        self.first: Optional[float] = None  # when its first token came
        self.ids = request.ids  # the ids it joined with (the prompt, and a carry's tokens)
        self.before = None  # the last response of its single stream, if it was handed over

    def carry(self, c: "_Carry"):
        """Go on from a single stream: its count, times, text state and draft statistics."""
        self.n, self.joined, self.first, self.reply, self.before = c.n, c.began, c.first, c.reply, c.last
        self.start.reused = c.reused  # what the client is told it reused: the prompt's
        for t in c.tokens:  # the text already sent: the detokenizer resumes after it
            self.detokenizer.add_token(t)
        self.detokenizer.last_segment

    def stats(self, st):
        """Its draft statistics over both parts (``st``: the batch's for it)."""
        from ..loop.cycle import CycleStats

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


class _Carry:
    """A solo request's state as it hands over to the batch."""

    def __init__(self, tokens: List[int], n: int, reply: _Reply, began: float,
                 first: Optional[float], last, caches: PrefixCache, reused: int):
        self.tokens, self.n, self.reply, self.began, self.first, self.last = tokens, n, reply, began, first, last
        self.caches = caches  # where its caches are: the engine's prefix cache or its own
        self.reused = reused  # prompt tokens its single stream took from the prefix cache


def logprob_entry(tokenizer, token: int, logprob: Optional[float], top) -> dict:
    """OpenAI's {token, logprob, bytes, top_logprobs} of a token; ``top``: (id, logprob)
    pairs, most likely first (None: a prompt's first token, which nothing predicts)."""
    def entry(t, lp):
        text = tokenizer.decode([t])
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return dict(entry(token, logprob), top_logprobs=None if top is None else [entry(i, lp) for i, lp in top])


log = logging.getLogger("dflash2_mlx.engine")
# Replies up to this long to a scored prompt decode plain from the scoring pass's caches (a
# prefill saved outweighs what DFlash would save over so few tokens); longer ones draft.
SCORED_PLAIN_MAX = 16
_DONE = object()
_ids = itertools.count(1)

# OpenAI-style request options -> stream_generate / logits processor options.
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "min_tokens_to_keep",
                 "xtc_probability", "xtc_threshold", "seed", "stop", "logprobs", "prompt_logprobs",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")


class Engine:
    def __init__(self, model_path, settings: Optional[ModelSettings] = None, *,
                 draft: Optional[str] = None, model_id: Optional[str] = None,
                 max_queue: int = 8, default_max_tokens: int = 512, worker=None,
                 prefix_cache_gb: float = 1.0, max_batch: int = 8,
                 chat_template_args: Optional[dict] = None, ssd_cache_dir=None):
        self.model_path = str(model_path)
        self.chat_template_args = dict(chat_template_args or {})  # template variables by default
        self.settings = settings or ModelSettings()
        if draft is not None:
            self.settings.dflash_enabled, self.settings.dflash_draft_model = True, draft
        self.model_id = model_id or Path(self.model_path).name
        self.max_queue = max_queue
        self.default_max_tokens = default_max_tokens
        self.tokenizer = None
        self.context_window: Optional[int] = None
        self.vocab_size: Optional[int] = None
        self._worker = worker or default_worker()
        self._model = self._drafter = None
        self.max_batch = max_batch
        self._turns = _Turns(max_queue, self._max_batch())
        self._batchable = False  # the target's caches can be batched (set at load)
        self._batch_job = None  # the job stepping the batch, while it has requests
        self._joins = []  # (request, push, carry) waiting to join the batch, under _batch_lock
        self._solo = None  # a batchable request running as a single stream until others come
        self._batch_lock = threading.Lock()
        self._requests = {}
        self._jobs = set()
        self._stats = EngineStats()
        self.prefix_cache_gb = prefix_cache_gb  # the server's, where the settings give none
        self.prefix_cache = PrefixCache(0)
        self.ssd_cache_dir = Path(ssd_cache_dir).expanduser() if ssd_cache_dir else default_ssd_cache_dir()
        self._pair_dir: Optional[Path] = None  # this pair's disk-tier directory (set at load)
        self.update_settings(self.settings)  # sizes the prefix cache
        self._stopping = False
        self.last_used = time.monotonic()

    # Lifecycle ------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._model is not None and not self._stopping

    def update_settings(self, settings: ModelSettings):
        """New settings that need no reload (``load_key`` unchanged): sampling defaults,
        template variables and the like apply from the next request, the prefix cache's
        size from its next entry."""
        self.settings = settings
        self.prefix_cache.budget = settings.prefix_cache_bytes(self.prefix_cache_gb)
        self.prefix_cache.max_entries = settings.dflash_in_memory_cache_max_entries
        self._sync_disk()

    def _sync_disk(self):
        """The prefix cache's disk tier as the settings say (once the pair is loaded)."""
        size, disk = self.settings.ssd_cache_bytes(), self.prefix_cache.disk
        if not size or self._pair_dir is None:
            self.prefix_cache.disk = None
        elif disk is None or disk.root != self._pair_dir:
            try:
                self.prefix_cache.disk = DiskTier(self._pair_dir, size)
            except OSError as e:  # the model still serves, from memory only
                log.error("prefix cache: no disk tier at %s (%s)", self._pair_dir, e)
                self.prefix_cache.disk = None
        else:
            disk.resize(size)

    async def start(self):
        """Load the target and drafter on the worker thread (a no-op when running)."""
        if self._model is not None:
            return
        self._stopping = False
        await asyncio.wrap_future(self._worker.submit(self._load))
        self.last_used = time.monotonic()

    def _load(self):
        from ..generate import check_block_size, load
        from ..model.checkpoint import resolve

        target_dir = resolve(self.model_path)
        draft_dir = resolve(self.settings.draft) if self.settings.draft else None
        model, tokenizer, drafter = load(str(target_dir), draft_dir and str(draft_dir),
                                         **self.settings.load_kwargs())
        if drafter is not None and self.settings.dflash_block_size is not None:
            check_block_size(drafter, self.settings.dflash_block_size)
        self._model, self.tokenizer, self._drafter = model, tokenizer, drafter
        self._batchable = drafter is not None and _batchable(model, drafter)
        self.context_window = self.settings.max_context_window or _config_value(model, "max_position_embeddings")
        self.vocab_size = _config_value(model, "vocab_size")
        self._pair_dir = pair_dir(self.ssd_cache_dir, target_dir, draft_dir, self.settings.load_kwargs())
        self._sync_disk()

    async def stop(self):
        """Abort every request, wait for the worker to let go, and free the models."""
        self._stopping = True
        self.abort()
        while True:  # a finished job may still be listed: its loop closed before it ended
            pending = [j for j in self._jobs if not j.done()]
            if not pending:
                break
            await asyncio.wait([asyncio.wrap_future(j) for j in pending])
        self._jobs.clear()
        await asyncio.wrap_future(self._worker.submit(self._free))

    def _free(self):
        import mlx.core as mx

        self._model = self._drafter = None
        self.prefix_cache.close()  # to the disk tier, if there is one
        self.prefix_cache.disk, self._pair_dir = None, None
        gc.collect()
        mx.clear_cache()

    # Requests -------------------------------------------------------------------------
    def has_active_requests(self) -> bool:
        return bool(self._requests)

    def abort(self, request_id: Optional[str] = None) -> int:
        """Stop one request (or all); returns how many were told to stop."""
        hit = [r for r in self._requests.values() if request_id in (None, r.id)]
        for r in hit:
            r.aborted.set()
        return len(hit)

    def get_stats(self) -> dict:
        stats = self._stats.snapshot()
        stats.update(model=self.model_id, loaded=self._model is not None,
                     drafter=self.settings.draft, max_queue=self.max_queue,
                     max_batch=self._max_batch(), batching=self._batchable and self._max_batch() > 1,
                     engine=self.settings.engine(), **self.prefix_cache.stats())
        return stats

    def encode(self, prompt) -> List[int]:
        """Token ids of a text prompt, as ``dflash2_mlx.generate`` encodes it."""
        self._check_running()
        if isinstance(prompt, str):
            tok = self.tokenizer
            add_special = tok.bos_token is None or not prompt.startswith(tok.bos_token)
            return list(tok.encode(prompt, add_special_tokens=add_special))
        if isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < (self.vocab_size or float("inf"))]
            if bad:
                raise ValueError(f"token id(s) {bad[:5]} are outside the vocabulary (size {self.vocab_size})")
            return list(prompt)
        raise TypeError("prompt must be text or a list of token ids")

    def encode_chat(self, messages: List[dict], tools: Optional[List[dict]] = None,
                    chat_template_kwargs: Optional[dict] = None) -> List[int]:
        """Token ids of chat messages rendered with the chat template (tools included);
        ``chat_template_kwargs``: the request's template variables (e.g.
        ``{"enable_thinking": False}``), over the model's and the engine's
        (``ModelSettings.template_variables``)."""
        self._check_running()
        from ..generate import TemplateVariableError, chat_ids

        variables = self.settings.template_variables(chat_template_kwargs, self.chat_template_args)
        try:
            return chat_ids(self.tokenizer, messages, tools=tools, template_kwargs=variables)
        except TemplateVariableError as e:
            raise InvalidOption("chat_template_kwargs", str(e)) from None

    async def count_chat_tokens(self, messages: List[dict], tools: Optional[List[dict]] = None,
                                chat_template_kwargs: Optional[dict] = None) -> int:
        return len(self.encode_chat(messages, tools, chat_template_kwargs))

    async def generate(self, prompt, **params) -> Completion:
        return await _collect(self.stream_generate(prompt, **params))

    async def chat(self, messages: List[dict], tools: Optional[List[dict]] = None, **params) -> Completion:
        return await _collect(self.stream_chat(messages, tools, **params))

    def stream_generate(self, prompt, *, request_id: Optional[str] = None, **params) -> AsyncIterator[Chunk]:
        """Stream a completion of ``prompt`` (text or token ids). Options: max_tokens,
        temperature, top_p, top_k, min_p, min_tokens_to_keep, xtc_probability, xtc_threshold
        (XTC spares "\n" and EOS, as mlx-lm's server does), seed, stop,
        presence/frequency/repetition penalties, logit_bias, logprobs (the number of most
        likely alternatives, 0..20, to report with each token's log-probability; the
        stop token's included), prompt_logprobs (the same for each prompt token, in the
        first chunk). ``max_tokens=0`` generates nothing (a prompt scored alone).
        Raises PromptTooLong, QueueFull, InvalidOption or EngineError."""
        return self._stream(self.encode(prompt), params, request_id)

    def stream_chat(self, messages: List[dict], tools: Optional[List[dict]] = None, *,
                    request_id: Optional[str] = None, chat_template_kwargs: Optional[dict] = None,
                    **params) -> AsyncIterator[Chunk]:
        """Stream the assistant's reply; with ``tools`` (OpenAI function specs) they go to
        the chat template, and tool calls come back in ``Chunk.tool_calls``."""
        if "prompt_logprobs" in params:
            raise TypeError("prompt_logprobs is an option of stream_generate (a chat's prompt is its template's)")
        return self._stream(self.encode_chat(messages, tools, chat_template_kwargs), params, request_id, tools, True)

    def _check_running(self):
        if not self.running:
            raise EngineError(f"model {self.model_id} is not running")

    def _stream(self, ids, params, request_id, tools=None, chat=False):
        unknown = set(params) - set(SAMPLING_KEYS)
        if unknown:
            raise TypeError(f"unknown generation option(s): {', '.join(sorted(unknown))}")
        if not ids:
            raise ValueError("the prompt is empty")
        n = params.get("max_tokens")
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
            raise InvalidOption("max_tokens", f"max_tokens is a number of tokens, 0 or more; got {n!r}")
        if self.context_window and len(ids) > self.context_window:
            raise PromptTooLong(len(ids), self.context_window)
        if self.context_window and (params.get("max_tokens") or 0) > self.context_window:
            raise InvalidOption("max_tokens", f"max_tokens {params['max_tokens']} is beyond this "
                                f"model's context window of {self.context_window} tokens")
        self._check_running()
        for name in ("logprobs", "prompt_logprobs"):
            top = params.get(name)
            if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20):
                raise InvalidOption(name, f"{name} is the number of alternatives to report, 0..20; got {top!r}")
        from ..loop.sampling import SamplingParams

        try:  # here, not when the request runs: the caller learns which option is wrong
            SamplingParams(**self._sampling(params))
        except ValueError as e:
            name = str(e).split()[0]
            raise InvalidOption("temperature" if name == "temp" else name, str(e)) from None
        request = _Request(request_id or f"req-{next(_ids)}", ids, params, tools, chat)
        if request.id in self._requests:
            raise EngineError(f"request id {request.id} is already in use")
        if _in_event_loop():  # else (a stream made outside the loop) on its first step
            self._admit(request)
        chunks = self._serve(request)
        weakref.finalize(chunks, self._drop_unstarted, request)
        return chunks

    def _admit(self, request: _Request):
        """Take the request's place in line, or refuse it with QueueFull."""
        self._turns.resize(self._max_batch())
        try:
            request.turn = self._turns.reserve()
        except QueueFull:
            self._stats.move(rejected=1)
            raise QueueFull(f"{self.max_queue} requests are already waiting for model {self.model_id}") from None
        request.queued = not request.turn.done()
        self._stats.move(queued=int(request.queued))
        self._requests[request.id] = request

    def _unqueue(self, request: _Request):
        if request.queued:
            request.queued = False
            self._stats.move(queued=-1)

    def _release(self, request: _Request):
        """Free the place of a request that never reached the worker."""
        self._unqueue(request)
        self._requests.pop(request.id, None)
        if request.turn is not None:
            self._turns.cancel(request.turn)

    def _drop_unstarted(self, request: _Request):
        """A stream dropped before it was iterated (its response never started)."""
        if not request.started:
            self._release(request)

    async def _serve(self, request: _Request) -> AsyncIterator[Chunk]:
        request.started = True
        loop = asyncio.get_running_loop()
        request.chunks = asyncio.Queue()
        job = None
        try:
            if request.turn is None:
                self._admit(request)
            await request.turn
            self._unqueue(request)
            self._check_running()
            self.last_used = time.monotonic()

            def push(item):
                _call_soon(loop, request.chunks.put_nowait, item)

            if self._batched(request):
                job = self._join_batch(request, push)
            else:
                job = self._worker.submit(_own_random(self._steps), request, push)
            self._jobs.add(job)
            job.add_done_callback(lambda f: _call_soon(loop, self._finished, request, f))
            while True:
                item = await request.chunks.get()
                if item is _DONE:  # the worker's last act for this request
                    self._finished(request, job)
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            request.aborted.set()  # a consumer that stops early stops the generation
            if job is None:  # never reached the worker
                self._release(request)

    def _finished(self, request: _Request, job):
        """Free the request's turn: when its consumer sees the end, or (if the consumer
        has gone) when the worker's job completes. Runs once."""
        if request.finished:
            return
        request.finished = True
        self._jobs.discard(job)
        self._requests.pop(request.id, None)
        self._turns.leave()
        self.last_used = time.monotonic()

    # Request options ------------------------------------------------------------------
    def _max_batch(self) -> int:
        return max(1, first_set(self.settings.max_batch, self.max_batch))

    def _max_tokens(self, p: dict) -> int:
        return first_set(p.get("max_tokens"), self.settings.max_tokens, self.default_max_tokens)

    def _sampling(self, p: dict) -> dict:
        s = self.settings
        xtc, special = first_set(p.get("xtc_probability"), 0.0), ()
        if xtc:
            from ..loop.sampling import xtc_special_tokens

            special = tuple(xtc_special_tokens(self.tokenizer))
        return dict(temp=first_set(p.get("temperature"), s.temperature, 0.0),
                    top_p=first_set(p.get("top_p"), s.top_p, 1.0),
                    top_k=first_set(p.get("top_k"), s.top_k, 0),
                    min_p=first_set(p.get("min_p"), s.min_p, 0.0),
                    min_tokens_to_keep=first_set(p.get("min_tokens_to_keep"), 1),
                    xtc_probability=xtc, xtc_threshold=first_set(p.get("xtc_threshold"), 0.1),
                    xtc_special_tokens=special)

    def _block_policy(self):
        """The batch's block size: fixed, "auto", or (verify mode "adaptive" with a block
        size) the adaptive policy up to it, as ``stream_generate`` chooses for one stream."""
        s = self.settings
        mode = s.verify_mode(0)
        if mode == "dflash" and s.dflash_block_size is not None:
            return s.dflash_block_size
        if mode == "adaptive" and s.dflash_block_size is not None:
            from ..batch import batch_policy
            from ..loop.target import attach

            return batch_policy(attach(self._model, self._drafter), self._drafter, s.dflash_block_size)
        return "auto"

    def _batched(self, request: _Request) -> bool:
        """Whether the request joins the batch (see the module docstring for who does not)."""
        s = self.settings
        mode = s.verify_mode(len(request.ids))
        if not self._batchable or self._max_batch() < 2 or mode == "off":
            return False
        p = request.params
        if p.get("prompt_logprobs") is not None or p.get("max_tokens") == 0:  # scoring: solo
            return False
        # A seeded sampled request gets its single-stream text: in the batch only where the
        # batch drafts and copies exactly as its single stream would (a fixed block size).
        fixed = mode == "dflash" and s.dflash_block_size is not None
        sampled = self._sampling(request.params)["temp"] > 0
        return fixed or not (sampled and request.params.get("seed") is not None)

    # The batch --------------------------------------------------------------------------
    def _join_batch(self, request: _Request, push) -> Future:
        """Hand the request to the batch job (starting one when none runs); the future is
        done when the job is done with the request."""
        request.done = Future()
        p = request.params
        seeded = self._sampling(p)["temp"] > 0 and p.get("seed") is not None
        with self._batch_lock:
            if self._batch_job is None and self._solo is None and not self._joins and not seeded:
                # A seeded request stays out: its key cannot be handed over mid-stream.
                self._solo = request
                self._track(self._worker.submit(_own_random(self._steps), request, push, True))
            else:
                self._joins.append((request, push, None))
                if self._solo is None:
                    self._start_batch()
        return request.done

    def _start_batch(self):
        """Start the batch job if none runs (under _batch_lock)."""
        if self._batch_job is None:
            self._batch_job = self._worker.submit(self._batch_steps)
            self._track(self._batch_job)

    def _track(self, job: Future):
        self._jobs = {j for j in self._jobs if not j.done()}
        self._jobs.add(job)

    def _solo_ended(self, request: _Request, carry: Optional["_Carry"]):
        """The solo request has finished, or (``carry``) goes on in the batch, first in line."""
        with self._batch_lock:
            if carry is not None:
                self._joins.insert(0, (request, request.push, carry))
            if self._solo is request:
                self._solo = None
            if self._joins:
                self._start_batch()

    def _batch_steps(self):
        """The batch job (worker thread): each step, the requests whose turn came join,
        aborted ones leave, then one cycle for all; it ends when no request is left.  Its
        BatchGenerator lives as long as the job, as a single stream's state lives as long
        as its request: made with the settings of the moment, its adaptive block sizes
        seeded from the pair's history and folded back into it at the end."""
        joined: Dict[int, _Joined] = {}  # uid -> request
        gen = None
        while True:
            with self._batch_lock:
                joins, self._joins = collections.deque(self._joins), []
                if not joins and not joined:
                    self._batch_job = None
                    if gen is not None:
                        gen.close()
                    return
            try:
                gen = gen or self._batch_generator()
                while joins:
                    self._join(gen, joined, *joins[0])
                    joins.popleft()
                for uid, j in list(joined.items()):
                    if j.request.aborted.is_set():
                        j.finish = "abort"
                        j.push(Chunk("", "abort", len(j.request.ids), j.n, cached_tokens=j.start.reused,
                                     engine=j.engine))
                        self._leave(gen, joined, uid)
                if joined:
                    self._batch_cycle(gen, joined)
            except Exception as e:  # the batch is in an unknown state: its requests fail
                log.exception("batched generation failed")
                for uid in list(joined):
                    joined[uid].finish = "error"
                    joined[uid].push(e)
                    self._done(joined.pop(uid))
                for request, push, _ in joins:  # not in the batch yet
                    self._refuse(request, push, "error", e)
                gen = None
            yield

    def _batch_generator(self):
        from ..batch import BatchGenerator

        return BatchGenerator(self._model, self._drafter, block_size=self._block_policy(),
                              draft_window=self.settings.draft_window, draft_sink=self.settings.draft_sink,
                              return_caches=True, lookup=self.settings.dflash_copies)

    def _join(self, gen, joined: Dict[int, "_Joined"], request: _Request, push,
              carry: Optional["_Carry"] = None):
        """Put a request into the batch: its prefix-cache start, sampling and stops.  A
        request handed over from its single stream (``carry``) goes on after its tokens."""
        from mlx_lm.sample_utils import make_logits_processors

        from ..loop.sampling import SamplingParams

        if request.aborted.is_set():
            self._refuse(request, push, "abort", Chunk("", "abort", len(request.ids)))
            return
        p, s = request.params, self.settings
        ids = request.ids + (carry.tokens if carry else [])
        try:
            start = (carry.caches if carry else self.prefix_cache).start(
                ids, self._model, self._drafter, s.draft_window, sink=s.draft_sink)
            penalties = _penalties(p, s)
            uid = gen.insert(
                ids, max_tokens=self._max_tokens(p) - (carry.n if carry else 0),
                params=SamplingParams(**self._sampling(p)),
                logits_processors=make_logits_processors(**penalties) if penalties else None,
                stop_tokens=self.tokenizer.eos_token_ids, seed=p.get("seed"),
                prompt_cache=start.cache if start.tokens else None, draft_context=start.context,
                cached_tokens=start.tokens)
        except Exception as e:
            self._refuse(request, push, "error", e)
            return
        self._stats.move(active=1)
        j = _Joined(request, push, start, _Reply(self.tokenizer, p, request.tools, request.chat),
                    self.tokenizer.detokenizer, s.engine(len(request.ids)))
        j.ids = ids
        if carry is not None:
            j.carry(carry)
        joined[uid] = j

    def _refuse(self, request: _Request, push, finish: str, item):
        """A request that ends before it is in the batch: ``item`` is its last message."""
        self._stats.add(prompt_tokens=len(request.ids), finish_reason=finish)
        push(item)
        push(_DONE)
        request.done.set_result(None)

    def _batch_cycle(self, gen, joined: Dict[int, "_Joined"]):
        """One ``gen.next()``: each response through its request's text pipeline, as
        ``_steps`` does for one stream; finished requests leave."""
        ended = []
        self._stats.batch_step(len(joined))
        for r in gen.next():
            j = joined[r.uid]
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
            content, calls, j.finish = j.reply.add(j.detokenizer.last_segment, r.finish_reason)
            if content or calls or j.finish:
                st = j.stats(r.stats)
                j.push(Chunk(content, j.finish, len(j.request.ids), j.n, calls, st.tau, st.cycles,
                             j.n / max(now - j.first, 1e-9), dict(sorted(st.block_sizes.items())),
                             st.fallback, j.start.reused, j.engine, st.shadows, j.reply.take()))
            if j.finish:
                ended.append(r.uid)
        for uid in ended:
            self._leave(gen, joined, uid)

    def _leave(self, gen, joined: Dict[int, "_Joined"], uid: int):
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

    def _store(self, j: "_Joined", cache, context):
        """Keep a batch sequence's caches (every token it committed, in order) for reuse."""
        from mlx_lm.models.cache import KVCache

        from .prefix_cache import Start, recurrent_state

        n = next((c.offset for c in cache if isinstance(c, KVCache)), 0)
        start = Start(cache, context, tokens=n)
        if not all(c.is_trimmable() for c in cache):
            # Recurrent states: the batch replays them to exactly the committed tokens, which
            # are all known unless a stop token cut the cycle (``store`` checks the count).
            start.held = (n, recurrent_state(cache))
        self.prefix_cache.store(j.ids + j.tokens, start)

    def _done(self, j: "_Joined"):
        """The request's stats, its last message, and its place freed."""
        self._stats.move(active=-1)
        n_prompt, st = len(j.request.ids), j.stats(j.last.stats) if j.last is not None else None
        if st is not None:
            end = time.perf_counter()
            self._stats.add(prompt_tokens=n_prompt, generation_tokens=j.n,
                            prompt_seconds=j.first - j.joined, generation_seconds=end - j.first,
                            cycles=st.cycles, tau=st.tau, position_accepted=st.position_accepted,
                            block_sizes=st.block_sizes, fallback=st.fallback,
                            finish_reason=j.finish)
        else:
            self._stats.add(prompt_tokens=n_prompt, finish_reason=j.finish or "abort")
        j.push(_DONE)
        j.request.done.set_result(None)

    # On the worker thread -------------------------------------------------------------
    def _steps(self, request: _Request, push, solo: bool = False):
        """Generate one request, a token per step; push Chunks, then _DONE.  ``solo``: a
        batchable request alone for now, handed over to the batch when another one asks to
        join (its caches through the prefix cache, its text state with it)."""
        from mlx_lm.sample_utils import make_logits_processors

        from ..generate import stream_generate

        p, s = request.params, self.settings
        n_prompt = len(request.ids)
        self._stats.move(active=1)
        request.push = push
        if request.aborted.is_set():
            self._stats.move(active=-1)
            push(Chunk("", "abort", n_prompt))
            push(_DONE)
            self._solo_end(request, solo, None)
            return
        began, first = time.perf_counter(), None
        last, finish, n = None, None, 0
        gen = start = mode = None
        emitted = []
        try:  # everything that can fail inside: a failure must still end the request (below)
            mode = s.verify_mode(n_prompt)
            engine = s.engine(n_prompt)
            drafting = mode != "off" and self._drafter is not None
            penalties = _penalties(p, s)
            reply = _Reply(self.tokenizer, p, request.tools, request.chat)
            limit = self._max_tokens(p)
            scored = None
            if p.get("prompt_logprobs") is not None:
                entries, scored = self._prompt_logprobs(request.ids, p["prompt_logprobs"])
                push(Chunk("", None, n_prompt, prompt_logprobs=entries))
            if limit == 0:  # scored, not continued
                finish = "length"
                push(Chunk("", finish, n_prompt, engine=engine))
                return
            # Plain decoding shows its penalties only the uncached tokens: no reuse with them.
            reuse = drafting or not set(penalties) - {"logit_bias"}
            if (scored is not None and reuse and all(c.is_trimmable() for c in scored)
                    and limit <= SCORED_PLAIN_MAX):
                # A short reply to a scored prompt (lm-eval's: one token) goes on from the
                # scoring pass's caches, plain: no second prefill of the prompt.
                mode, drafting = "off", False
                engine = {**engine, "dflash": False, "verify_mode": "off", "block_size": None}
                start = Start(scored, None, n_prompt - 1)
            else:
                start = self.prefix_cache.start(request.ids, self._model, self._drafter if drafting else None,
                                                s.draft_window, reuse=reuse, sink=s.draft_sink)
            gen = stream_generate(
                self._model, self.tokenizer, request.ids, self._drafter,
                max_tokens=limit, **self._sampling(p),
                logits_processors=make_logits_processors(**penalties) if penalties else None,
                block_size=s.dflash_block_size, verify_mode=mode, seed=p.get("seed"),
                draft_window=s.draft_window, draft_sink=s.draft_sink, prompt_cache=start.cache,
                draft_context=start.context, cached_tokens=start.tokens, lookup=s.dflash_copies)
            for last in gen:
                n = last.generation_tokens
                first = first or time.perf_counter()
                emitted.append(last.token)
                self.prefix_cache.note(start, len(request.ids) + n)
                reply.token(last.token, last.logprobs, last.finish_reason)
                content, calls, finish = reply.add(last.text, last.finish_reason)
                if content or calls or finish:
                    push(Chunk(content, finish, n_prompt, n, calls, last.tau, last.cycles,
                               last.generation_tps, last.block_sizes, last.fallback,
                               start.reused, engine, last.shadows, reply.take()))
                if finish:
                    break
                yield
                if request.aborted.is_set():
                    finish = "abort"
                    push(Chunk("", "abort", n_prompt, n, cached_tokens=start.reused, engine=engine))
                    break
                if solo and self._joins and last.cycles:  # after a cycle: its τ counts one
                    finish = "handover"
                    break
        except Exception as e:
            finish = "error"
            push(e)
        finally:
            if gen is not None:
                gen.close()
            # A handover keeps its caches even where the prefix cache's memory tier is off: in
            # one of its own (not by way of the disk tier).
            kept = self.prefix_cache if finish != "handover" or self.prefix_cache.budget > 0 else PrefixCache(1 << 62)
            if start is not None and finish != "error":
                try:
                    kept.store(request.ids + emitted, start)
                except Exception:  # a cache that cannot keep this request must not fail it
                    log.exception("prefix cache: could not store the request's caches")
            self._stats.move(active=-1)
            if finish == "handover":
                self._solo_end(request, solo, _Carry(emitted, n, reply, began, first, last, kept, start.reused))
                return
            if last is not None:
                self._stats.add(
                    prompt_tokens=n_prompt, generation_tokens=n,
                    prompt_seconds=n_prompt / last.prompt_tps if last.prompt_tps else 0.0,
                    generation_seconds=n / last.generation_tps if last.generation_tps else 0.0,
                    cycles=last.cycles, tau=last.tau, position_accepted=last.acceptance_counts,
                    block_sizes=last.block_sizes, fallback=last.fallback,
                    plain=mode == "off" and self._drafter is not None, finish_reason=finish)
            else:
                self._stats.add(prompt_tokens=n_prompt, finish_reason=finish or "abort")
            push(_DONE)
            self._solo_end(request, solo, None)

    def _prompt_logprobs(self, ids: List[int], top: int):
        """The prompt's logprob entries, and the target's caches of it but its last token."""
        from mlx_lm.models.cache import make_prompt_cache

        from ..loop.scoring import prompt_logprobs

        cache = make_prompt_cache(self._model)
        lps, tops = prompt_logprobs(self._model, ids, top, cache=cache)
        entries = [logprob_entry(self.tokenizer, ids[0], None, None)] + [
            logprob_entry(self.tokenizer, t, lp, best) for t, lp, best in zip(ids[1:], lps, tops)]
        return entries, cache

    def _solo_end(self, request: _Request, solo: bool, carry: Optional["_Carry"]):
        if solo:
            if carry is None:
                request.done.set_result(None)
            self._solo_ended(request, carry)


NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def _penalties(p: dict, s: ModelSettings) -> dict:
    """The request's penalties (else the model's) and logit bias as ``make_logits_processors``
    options; a neutral penalty builds no processor (a plain request keeps its prefix reuse)."""
    out = {}
    for k, neutral in NEUTRAL.items():
        v = first_set(p.get(k), getattr(s, k, None), neutral)
        if v != neutral:
            out[k] = v
    if p.get("logit_bias"):
        out["logit_bias"] = {int(k): float(v) for k, v in p["logit_bias"].items()}
    return out


def _batchable(model, drafter) -> bool:
    """Whether ``BatchGenerator`` takes this target (not one with sliding-window caches)."""
    from ..batch.cache import batch_layers
    from ..loop.target import UnsupportedTargetError, attach

    try:
        batch_layers(attach(model, drafter))
        return True
    except UnsupportedTargetError as e:
        log.info("requests run one at a time, each its own stream: %s", e)
        return False


def _own_random(steps):
    """A stepped job with its own random key: jobs that take turns on the worker do not
    draw from each other's streams (a seeded request keeps its text)."""
    from ..loop.random_keys import fresh_key, swap_key

    def job(*args):
        gen, key = steps(*args), fresh_key()
        while True:
            outer = swap_key(key)
            try:
                next(gen)
            except StopIteration:
                return
            finally:
                key = swap_key(outer)
            yield

    return job


def _call_soon(loop, fn, *args):
    """Run ``fn`` on the event loop; if that loop has closed, run it here."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        try:
            fn(*args)
        except RuntimeError:
            pass


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def _config_value(model, key: str) -> Optional[int]:
    """``key`` from the target's model args (or their nested text_config)."""
    args = getattr(model, "args", None)
    for obj in (args, getattr(args, "text_config", None)):
        value = obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)
        if value:
            return int(value)
    return None


async def _collect(chunks: AsyncIterator[Chunk]) -> Completion:
    text, calls, logprobs, last, prompt = "", [], [], None, None
    async for last in chunks:
        text += last.text
        calls += last.tool_calls
        logprobs += last.logprobs
        prompt = prompt or last.prompt_logprobs
    return Completion(text, last.finish_reason, last.prompt_tokens, last.completion_tokens,
                      calls, last.tau, last.cycles, last.generation_tps,
                      block_sizes=last.block_sizes, fallback=last.fallback,
                      cached_tokens=last.cached_tokens, engine=last.engine, shadows=last.shadows,
                      logprobs=logprobs, prompt_logprobs=prompt)
