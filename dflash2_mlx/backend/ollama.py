"""Ollama's API over the engine pool: ``POST /api/chat``, ``POST /api/generate`` (NDJSON
streams by default, as Ollama's; one JSON body with ``"stream": false``), ``GET /api/tags``,
``POST /api/show``, ``GET /api/ps``, ``GET /api/version`` and the ``GET``/``HEAD /`` probe.
Managing models (pull, push, create, copy, delete, blobs) and embeddings answer 501: this
server serves the models of its --model / --model-dir and its settings file.

A thin adapter (``ollama_wire.py`` has the bodies): the request becomes chat-template
messages, OpenAI-style tools and engine options, and runs through the same engine calls as
the OpenAI routes. Errors are Ollama's ``{"error": "message"}``; a model name may carry a
``:latest`` tag.
"""

import json
import time
from importlib import metadata
from typing import Optional

from fastapi import Request
from fastapi.responses import PlainTextResponse

from .http import engine_for, error_shape, mapped_errors, read_json, until_disconnect, validated
from .pool import NoDefaultModel, UnknownModel
from .protocol import APIError, dflash_stats, new_id
from .sse import framed_response
from .telemetry import tell
from .ollama_models import LATEST, model_entry, running_entry, show_body, tagged
from .ollama_wire import (ChatRequest, GenerateRequest, ShowRequest, chat_line, closing, error_body,
                          generate_line, loaded_line, unsupported)
from .wire import collect

OLLAMA_VERSION = "0.12.0"  # the Ollama release whose API this follows (clients gate features on it)
NDJSON = "application/x-ndjson"
MANAGING = "it serves the models of its --model / --model-dir and settings file"
UNSUPPORTED = {  # route -> (methods, what, why)
    "/api/pull": (["POST"], "pulling models", MANAGING),
    "/api/push": (["POST"], "pushing models", MANAGING),
    "/api/create": (["POST"], "creating models", MANAGING),
    "/api/copy": (["POST"], "copying models", MANAGING),
    "/api/delete": (["DELETE"], "deleting models", MANAGING),
    "/api/blobs/{digest}": (["HEAD", "POST"], "model blobs", MANAGING),
    "/api/embed": (["POST"], "embeddings", "it serves text generation"),
    "/api/embeddings": (["POST"], "embeddings", "it serves text generation"),
}


@error_shape("/api/")
def render(e: APIError) -> dict:
    return error_body(e)


def add_routes(app, pool):
    """Register this API's routes on app."""
    _add_probes(app)
    _add_chat(app, pool)
    _add_generate(app, pool)
    _add_model_routes(app, pool)
    for path, (methods, what, why) in UNSUPPORTED.items():
        app.add_api_route(path, _refusal(what, why), methods=methods, include_in_schema=False)


def _refusal(what: str, why: str):
    async def refuse():
        raise APIError(501, unsupported(what, why), code="not_supported")
    return refuse


def _add_probes(app):
    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def probe():  # what Ollama answers, and what clients look for
        return PlainTextResponse("Ollama is running")

    @app.get("/api/version")
    async def version():
        return {"version": OLLAMA_VERSION, "dflash2_mlx": _package_version()}


def _package_version() -> str:
    try:
        return metadata.version("dflash2-mlx")
    except metadata.PackageNotFoundError:
        return "unknown"


# Models -------------------------------------------------------------------------------
def resolved(pool, name: Optional[str]) -> str:
    """The model id an Ollama name means: an id or alias, with or without ``:latest``."""
    try:
        return pool.resolve(name)
    except UnknownModel:
        if name and name.endswith(LATEST):
            try:
                return pool.resolve(name[: -len(LATEST)])
            except UnknownModel:
                pass
        raise APIError(404, f"model '{name}' not found", param="model", code="model_not_found") from None
    except NoDefaultModel as e:
        raise APIError(400, str(e), param="model") from None


class _Named:
    def __init__(self, model: str):
        self.model = model


class Clock:
    """A reply's durations in ns, as Ollama counts them: the model's load, the prompt (up to
    the first piece of the reply), the reply (from its first piece to its last), the whole."""

    def __init__(self):
        self.start = time.perf_counter_ns()
        self.load = 0
        self.ready = self.first = self.end = None

    async def engine(self, pool, model_id: str):
        engine = pool.engines.get(model_id)
        was_running = engine is not None and engine.running
        began = time.perf_counter_ns()
        engine = await engine_for(pool, _Named(model_id))
        self.load = 0 if was_running else time.perf_counter_ns() - began
        return engine

    async def timed(self, chunks):
        self.ready = time.perf_counter_ns()
        async for chunk in chunks:
            self.end = time.perf_counter_ns()
            self.first = self.first or self.end
            yield chunk

    def durations(self) -> dict:
        end = self.end or time.perf_counter_ns()
        ready, first = self.ready or end, self.first or end
        return {"total_duration": end - self.start, "load_duration": self.load,
                "prompt_eval_duration": first - ready, "eval_duration": end - first}


async def _parse(request: Request, schema):
    # Ollama reads the body as JSON whatever its Content-Type (its docs' curl -d sends a form's)
    return validated(await read_json(request, any_content_type=True), schema)


def _line(obj) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


def _ndjson(lines, engine, rid):
    return framed_response(lines, engine, rid, lambda e: _line(error_body(e)), media_type=NDJSON)


async def _load_or_unload(pool, model_id: str, name: str, body, chat: bool) -> dict:
    """A request with nothing to generate loads its model (keep_alive 0: unloads it)."""
    if body.unloads:
        engine = pool.engines.get(model_id)
        if engine is not None and (engine.has_active_requests() or engine.settings.is_pinned):
            why = "it is pinned (is_pinned)" if engine.settings.is_pinned else "requests are running on it"
            raise APIError(409, f"model '{name}' is not unloaded: {why}", code="model_busy")
        await pool.unload(model_id)
        return loaded_line(name, chat, "unload")
    await engine_for(pool, _Named(model_id))
    return loaded_line(name, chat, "load")


def _options(body, engine, ids) -> dict:
    """The request's engine options; num_predict -1/-2: the room left in the context."""
    options = body.engine_options()
    if body.unlimited and engine.context_window:
        options["max_tokens"] = max(engine.context_window - len(ids), 0)
    return options


def _add_chat(app, pool):
    @app.post("/api/chat")
    async def chat(request: Request):
        clock = Clock()
        body = await _parse(request, ChatRequest)
        model_id = resolved(pool, body.model)
        name = body.model or tagged(pool.public_name(model_id))
        if not body.messages:
            return await _load_or_unload(pool, model_id, name, body, chat=True)
        engine = await clock.engine(pool, model_id)
        rid = new_id("ollama-chat")
        with mapped_errors():
            ids = await engine.off_loop(engine.encode_chat, body.template_messages(), body.tools,
                                        body.template_kwargs())
            chunks = clock.timed(engine.stream_ids(ids, body.tools, chat=True, request_id=rid,
                                                   **_options(body, engine, ids)))
            tell(request, engine.settings.engine(len(ids)))
            if body.stream:
                return _ndjson(_chat_lines(name, chunks, clock, body.logprobs), engine, rid)
            c = await until_disconnect(request, collect(chunks), engine, rid)
        tell(request, dflash_stats(c))
        return {**chat_line(name, c.text, c.tool_calls, c.logprobs if body.logprobs else None, c.reasoning),
                **closing(c, clock.durations())}


async def _chat_lines(name, chunks, clock, logprobs: bool):
    """The reply's lines; the first says how it is decoded (``dflash``), the last (closing)
    carries the draft statistics."""
    last, first = None, True
    async for last in chunks:
        entries = last.logprobs if logprobs else None
        if last.text or last.tool_calls or entries or last.reasoning:
            line = chat_line(name, last.text, last.tool_calls, entries, last.reasoning)
            yield _line({**line, "dflash": last.engine} if first else line)
            first = False
    if last is not None:
        yield _line({**chat_line(name, ""), **closing(last, clock.durations())})


def _add_generate(app, pool):
    @app.post("/api/generate")
    async def generate(request: Request):
        clock = Clock()
        body = await _parse(request, GenerateRequest)
        model_id = resolved(pool, body.model)
        name = body.model or tagged(pool.public_name(model_id))
        if not body.prompt and not body.context:
            return await _load_or_unload(pool, model_id, name, body, chat=False)
        engine = await clock.engine(pool, model_id)
        rid = new_id("ollama-generate")
        with mapped_errors(prompt_param="prompt"):
            ids = await engine.off_loop(_prompt_ids, engine, body)
            chunks = clock.timed(engine.stream_ids(ids, chat=not body.raw, request_id=rid,
                                                   **_options(body, engine, ids)))
            tell(request, engine.settings.engine(len(ids)))
            if body.stream:
                return _ndjson(_generate_lines(name, chunks, clock, body, engine, ids), engine, rid)
            c = await until_disconnect(request, collect(chunks), engine, rid)
        tell(request, dflash_stats(c))
        out = {**generate_line(name, c.text, c.logprobs if body.logprobs else None, c.reasoning),
               **closing(c, clock.durations())}
        if not body.raw:  # as Ollama: a raw prompt returns no context
            out["context"] = await engine.off_loop(_context, engine, ids, _said(engine, c.reasoning, c.text), c)
        return out


def _prompt_ids(engine, body: GenerateRequest) -> list:
    """The prompt as it is (raw), else the chat template's user turn (after ``system``),
    following the conversation's ``context`` when there is one."""
    if body.raw:
        return engine.encode(body.prompt)
    ids = engine.encode_chat(body.template_messages(), None, body.template_kwargs())
    if not body.context:
        return ids
    bos = engine.tokenizer.bos_token_id
    if bos is not None and ids and ids[0] == bos:  # one BOS, at the conversation's start
        ids = ids[1:]
    return engine.encode(body.context) + ids


def _said(engine, reasoning: str, text: str) -> str:
    """The reply as the conversation holds it: its reasoning closed by the think tag, then
    the answer (the whitespace between them is not kept)."""
    return f"{reasoning}{engine.tokenizer.think_end}{text}" if reasoning else text


def _context(engine, ids, text: str, last) -> list:
    """The conversation so far as token ids: the prompt's, then the reply's (its ``text``
    tokenized again) and the end of sequence that closed it (``last``: its last chunk)."""
    reply = list(engine.tokenizer.encode(text, add_special_tokens=False)) if text else []
    eos = engine.tokenizer.eos_token_id
    ended = last.finish_reason == "stop" and last.stop_sequence is None and eos is not None
    return list(ids) + reply + ([eos] if ended else [])


async def _generate_lines(name, chunks, clock, body: GenerateRequest, engine, ids):
    last, text, thought, first = None, [], [], True
    async for last in chunks:
        entries = last.logprobs if body.logprobs else None
        text.append(last.text)
        thought.append(last.reasoning)
        if last.text or entries or last.reasoning:
            line = generate_line(name, last.text, entries, last.reasoning)
            yield _line({**line, "dflash": last.engine} if first else line)
            first = False
    if last is None:
        return
    out = {**generate_line(name, ""), **closing(last, clock.durations())}
    if not body.raw:
        out["context"] = await engine.off_loop(_context, engine, ids, _said(engine, "".join(thought), "".join(text)),
                                               last)
    yield _line(out)


def _add_model_routes(app, pool):
    @app.get("/api/tags")
    async def tags():
        return {"models": [model_entry(pool, m) for m in pool.model_ids()]}

    @app.post("/api/show")
    async def show(request: Request):
        body = await _parse(request, ShowRequest)
        model_id = resolved(pool, body.model)
        return show_body(pool, model_id)

    @app.get("/api/ps")
    async def ps():
        return {"models": [running_entry(pool, m, e) for m, e in list(pool.engines.items()) if e.running]}
