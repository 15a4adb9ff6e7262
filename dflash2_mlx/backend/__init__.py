"""The serving backend: models behind an OpenAI-compatible HTTP server, each one an
``Engine`` that admits, batches and decodes its requests on one MLX worker thread.

- ``server.py``: the FastAPI app and its routes; ``sse.py``: streamed responses as
  server-sent events; ``protocol.py``: OpenAI's request, response and error bodies;
- ``pool.py``: the models loaded at once (``EnginePool``: LRU, memory budget, idle TTL);
- ``settings.py``: per-model settings (oMLX's ``model_settings.json``); ``compat.py``:
  whether a drafter fits a target;
- ``engine.py``: ``Engine``, one loaded pair (lifecycle, encoding, the request surface);
- ``admission.py``: the line (first come first served, ``QueueFull``) and a request's stream;
- ``options.py``: typed request options (``RequestOptions``) and what a request runs with
  (``Generation``: the request's, else the model's settings, else the defaults);
- ``solo.py``: a request decoded as its own stream, and its handover to the batch;
- ``batch_job.py``: the batch job (continuous batching over ``dflash2_mlx.batch``);
- ``reply.py``: the text on its way out (stops, tool calls, logprobs), with ``stops.py``
  and ``tool_calls.py``; ``wire.py``: ``Chunk``, ``Completion`` and the engine's errors;
- ``prefix_cache.py`` (memory) and ``ssd_cache.py`` (disk): caches reused across requests;
- ``stats.py``: the counters ``/metrics`` reports; ``worker.py``: the one MLX thread.
- ``follow.py``: ``serve`` over ``mx.distributed`` ranks (``dflash2_mlx.distributed``): rank 0
  serves and tells the other ranks, which follow it through the same engine code.
"""

from .compat import is_compatible
from .engine import Chunk, Completion, Engine, EngineError, PromptTooLong, QueueFull
from .pool import EnginePool, PoolBusy, UnknownModel
from .settings import ModelSettings, SettingsError, SettingsStore

__all__ = ["Engine", "EnginePool", "ModelSettings", "SettingsStore", "SettingsError", "is_compatible",
           "Chunk", "Completion", "EngineError", "PromptTooLong", "QueueFull", "PoolBusy", "UnknownModel"]
