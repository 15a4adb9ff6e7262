"""One loaded model (target + optional drafter) behind the async surface a model manager
drives: ``start``/``stop``, ``generate``/``stream_generate``, ``chat``/``stream_chat``,
``count_chat_tokens``, ``get_stats``, ``has_active_requests`` and ``abort``.

Every MLX call runs on the backend's one worker thread (``worker.py``); tokenizing runs on a
thread of its own (``off_loop``: a long prompt would stall every route meanwhile); the event
loop only moves text. Up to ``max_batch`` requests run at once, first come first served,
with at most ``max_queue`` waiting (``admission.py``). A request's options are checked when
its stream is made (``options.py``). A prefix cache (``prefix_cache.py``) lets a request
start from the caches of an earlier one that shares its first tokens.

DFlash requests that run at the same time share one batch (``batch_job.py``); a request
that finds nothing running starts as a single stream and hands over to the batch when
another one asks to join (``solo.py``). Requests the batch cannot serve run as their own
stepped job next to it, one token a step, each with its own random key: plain decoding (no
drafter, ``dflash_max_ctx``), targets the batch refuses (quantized caches), ``max_batch`` 1
(the one-at-a-time server), ``dflash_exact`` (the batch has no exact mode), and seeded sampled requests with adaptive block sizes (the
batch's block sizes depend on its other sequences, and a seed promises its single-stream
text). Both paths put their text through the same reply pipeline (``reply.py``) and hand
the caller ``Chunk``s and ``Completion``s (``wire.py``).
"""

import asyncio
import gc
import itertools
import logging
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import AsyncIterator, List, Optional, Sequence

import mlx.core as mx

from ..adaptive import check_block_size
from ..generate import load
from ..calibration import exactness
from ..model.checkpoint import resolve
from ..request.prompt import TemplateVariableError, chat_ids
from . import follow
from .admission import Admission, Request, in_event_loop
from .batch_job import Batching, batchable
from .options import RequestOptions, decoding_plan, generation, sampling_params
from .prefix_cache import PrefixCache
from .settings import ModelSettings, drafter_name, first_set
from .solo import solo_job
from .ssd_cache import DiskTier, default_ssd_cache_dir, pair_dir
from .stats import EngineStats
from .tool_calls import template_messages
from .wire import Chunk, Completion, EngineError, InvalidOption, PromptTooLong, QueueFull, collect
from .worker import worker as default_worker

# The engine's surface: callers import Chunk, Completion and the errors from here.
__all__ = ["Engine", "Chunk", "Completion", "EngineError", "InvalidOption", "PromptTooLong", "QueueFull"]

# The counters the model listings show beside a model's settings (``Engine.live``).
LIVE = ("requests", "active_requests", "queued_requests", "generation_tokens", "cycles", "mean_tau",
        "last_tau", "generation_tps", "plain_fallbacks", "adaptive_fallbacks")

log = logging.getLogger("dflash2_mlx.engine")
_ids = itertools.count(1)
# One thread for every engine's tokenizing: prompts are encoded one at a time, off the loop.
TOKENIZING = ThreadPoolExecutor(1, thread_name_prefix="dflash2-tokenize")


class Engine:
    """One model served: its settings, its loaded pair, its line of requests and its batch."""

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
        self.max_batch = max_batch
        # The loaded pair (set at load, on the worker): the jobs of solo.py and batch_job.py read these.
        self.model = self.drafter = self.tokenizer = None
        self.context_window: Optional[int] = None
        self.vocab_size: Optional[int] = None
        self.batchable = False  # the target's caches can be batched
        self.worker = worker or default_worker()
        self.stats = EngineStats()  # the counters ``get_stats`` reports
        self.admission = Admission(self.stats, max_queue, self.model_id)
        self.batching = Batching(self)
        self.prefix_cache_gb = prefix_cache_gb  # the server's, where the settings give none
        self.prefix_cache = PrefixCache(0)
        self.ssd_cache_dir = Path(ssd_cache_dir).expanduser() if ssd_cache_dir else default_ssd_cache_dir()
        self._pair_dir: Optional[Path] = None  # this pair's disk-tier directory (set at load)
        self.update_settings(self.settings)  # sizes the prefix cache
        self._stopping = False
        self.lockstep = follow.current()  # a distributed server's rank (None: one process)

    # Lifecycle ------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.model is not None and not self._stopping

    @property
    def last_used(self) -> float:
        """When a request last started or ended (or the model loaded): the idle clock."""
        return self.admission.last_used

    @last_used.setter
    def last_used(self, value: float):
        self.admission.last_used = value

    def decoding(self, prompt_tokens: int, settings: Optional[ModelSettings] = None) -> dict:
        """How a request of ``prompt_tokens`` is decoded, as its replies tell the client: the
        settings' engine, and with DFlash whether its verify rows are exact here."""
        out = (settings or self.settings).engine(prompt_tokens)
        if out["dflash"]:
            out["verify_rows"] = exactness.note(self.model)
        return out

    def max_running(self) -> int:
        """Requests that run at once: the settings' max_batch, else the engine's (1 when
        distributed: the followers run each request in lockstep, one at a time)."""
        if self.lockstep is not None:
            return 1
        return max(1, first_set(self.settings.max_batch, self.max_batch))

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
        if self.model is not None:
            return
        self._stopping = False
        await asyncio.wrap_future(self.worker.submit(self._load))
        self.last_used = time.monotonic()

    def _load(self):
        target_dir = resolve(self.model_path)
        draft_dir = resolve(self.settings.draft) if self.settings.draft else None
        kwargs = self.settings.load_kwargs()
        if self.lockstep is not None:
            self.lockstep.loading(self)
            kwargs.update(self.lockstep.load_kwargs())
        model, tokenizer, drafter = load(str(target_dir), draft_dir and str(draft_dir), **kwargs)
        if drafter is not None and self.settings.dflash_block_size is not None:
            check_block_size(drafter, self.settings.dflash_block_size)
        self.model, self.tokenizer, self.drafter = model, tokenizer, drafter
        self.batchable = drafter is not None and batchable(model, drafter)
        self.context_window = self.settings.max_context_window or _config_value(model, "max_position_embeddings")
        self.vocab_size = _config_value(model, "vocab_size")
        self._pair_dir = pair_dir(self.ssd_cache_dir, target_dir, draft_dir, self.settings.load_kwargs())
        self._sync_disk()

    async def stop(self):
        """Abort every request, wait for the worker to let go, and free the models."""
        self._stopping = True
        self.abort()
        await self.admission.settle()
        await asyncio.wrap_future(self.worker.submit(self._free))

    def _free(self):
        if self.lockstep is not None and self.model is not None:
            self.lockstep.freeing(self)
        self.model = self.drafter = None
        self.prefix_cache.close()  # to the disk tier, if there is one
        self.prefix_cache.disk, self._pair_dir = None, None
        gc.collect()
        mx.clear_cache()

    # Requests -------------------------------------------------------------------------
    def has_active_requests(self) -> bool:
        return bool(self.admission.requests)

    def abort(self, request_id: Optional[str] = None) -> int:
        """Stop one request (or all); returns how many were told to stop."""
        return self.admission.abort(request_id)

    def get_stats(self) -> dict:
        stats = self.stats.snapshot()
        stats.update(model=self.model_id, loaded=self.model is not None,
                     drafter=drafter_name(self.settings.draft), max_queue=self.max_queue,
                     max_batch=self.max_running(), batching=self.batchable and self.max_running() > 1,
                     engine=self.settings.engine(), **self.prefix_cache.stats())
        return stats

    def live(self) -> dict:
        """What this model has served so far, for the model listings (``/v1/models``,
        Ollama's ``/api/ps``): its requests now and in all, τ, tokens and fallbacks."""
        s = self.stats.snapshot()
        return {k: s[k] for k in LIVE}

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
                    chat_template_kwargs: Optional[dict] = None, prefill: Optional[str] = None) -> List[int]:
        """Token ids of chat messages rendered with the chat template (tools included);
        ``chat_template_kwargs``: the request's template variables (e.g.
        ``{"enable_thinking": False}``), over the model's and the engine's
        (``ModelSettings.template_variables``); ``prefill``: the start of the assistant's
        reply, which the reply continues (``request.prompt.chat_ids``).  Tool-call arguments reach the
        template as objects (``tool_calls.template_messages``)."""
        self._check_running()
        variables = self.settings.template_variables(chat_template_kwargs, self.chat_template_args)
        try:
            ids = chat_ids(self.tokenizer, template_messages(messages), prefill, tools=tools,
                           template_kwargs=variables)
            if tools and ids == chat_ids(self.tokenizer, template_messages(messages), prefill,
                                         template_kwargs=variables):
                # The model would never see them, and a client would wait for calls that cannot come.
                raise InvalidOption("tools", f"this model's chat template does not render tools ({len(tools)} "
                                    "given): send the request without them, or serve the model with a "
                                    "template that has a tools section")
            return ids
        except TemplateVariableError as e:
            raise InvalidOption("chat_template_kwargs", str(e)) from None

    async def count_chat_tokens(self, messages: List[dict], tools: Optional[List[dict]] = None,
                                chat_template_kwargs: Optional[dict] = None) -> int:
        return len(await self.off_loop(self.encode_chat, messages, tools, chat_template_kwargs))

    async def off_loop(self, fn, *args):
        """``fn(*args)`` (tokenizing, detokenizing) on the tokenizing thread: the event loop
        serves other requests meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(TOKENIZING, fn, *args)

    async def generate(self, prompt, **params) -> Completion:
        return await collect(self.stream_generate(prompt, **params))

    async def chat(self, messages: List[dict], tools: Optional[List[dict]] = None, **params) -> Completion:
        return await collect(self.stream_chat(messages, tools, **params))

    def stream_generate(self, prompt, *, request_id: Optional[str] = None, **params) -> AsyncIterator[Chunk]:
        """Stream a completion of ``prompt`` (text or token ids). Options: those of
        ``RequestOptions`` (max_tokens, temperature, top_p, top_k, min_p,
        min_tokens_to_keep, xtc_probability, xtc_threshold, seed, stop,
        presence/frequency/repetition penalties, logit_bias, logprobs: 0..20
        alternatives with each token's log-probability, the stop token's included;
        prompt_logprobs: the same for each prompt token, in the first chunk).
        ``max_tokens=0`` generates nothing (a prompt scored alone).
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

    def stream_ids(self, ids: List[int], tools: Optional[List[dict]] = None, *, chat: bool = False,
                   request_id: Optional[str] = None, continues: bool = False, **params) -> AsyncIterator[Chunk]:
        """Stream a completion of ids already encoded (``encode`` or ``encode_chat``, e.g. by
        ``off_loop``); ``chat``: the reply of a chat (tool calls parsed from it);
        ``continues``: the ids end in a prefill that the reply's text goes on from."""
        return self._stream(self.encode(ids), params, request_id, tools, chat, continues)

    def _check_running(self):
        if not self.running:
            raise EngineError(f"model {self.model_id} is not running")

    def _stream(self, ids, params, request_id, tools=None, chat=False, continues=False):
        options = RequestOptions.parse(params)
        if not ids:
            raise ValueError("the prompt is empty")
        options.check_max_tokens()
        if self.context_window and len(ids) > self.context_window:
            raise PromptTooLong(len(ids), self.context_window)
        options.check_max_tokens_fit(self.context_window, len(ids))
        self._check_running()
        options.check_logprobs()
        options.check_values(self.vocab_size)
        # Here, not when the request runs: the caller learns which option is wrong.
        sampling_params(options, self.settings, self.tokenizer, self.vocab_size)
        request = Request(request_id or f"req-{next(_ids)}", ids, options, tools, chat, continues)
        if request.id in self.admission.requests:
            raise EngineError(f"request id {request.id} is already in use")
        if in_event_loop():  # else (a stream made outside the loop) on its first step
            self.admission.admit(request, self.max_running())
        chunks = self.admission.serve(request, self.max_running, self._begin)
        weakref.finalize(chunks, self.admission.drop_unstarted, request)
        return chunks

    def settle(self, request: Request):
        """What the request runs with, fixed when its turn comes: its options under the
        settings of the moment (``generation``), and the one ``Plan`` it is decoded by (none
        for a prompt only scored: it decodes nothing)."""
        s = request.settings = self.settings  # the request's, whatever later edits bring
        g = request.generation = generation(request.options, s, self.default_max_tokens, self.tokenizer,
                                            self.vocab_size)
        request.plan = None if g.max_tokens == 0 else decoding_plan(s, self.drafter, len(request.ids), g,
                                                                    request.continues)

    def _begin(self, request: Request, push) -> Future:
        """The request's turn has come: it joins the batch or runs as its own stream."""
        self._check_running()
        self.last_used = time.monotonic()
        self.settle(request)
        if self.batching.takes(request):
            return self.batching.join(request, push)
        return solo_job(self, request, push)


def _config_value(model, key: str) -> Optional[int]:
    """``key`` from the target's model args (or their nested text_config)."""
    args = getattr(model, "args", None)
    for obj in (args, getattr(args, "text_config", None)):
        value = obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)
        if value:
            return int(value)
    return None
