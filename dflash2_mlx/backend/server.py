"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over an engine pool.

``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming or
one JSON body), ``GET /health``, ``GET /metrics`` (engine stats), and vLLM's tokenizer routes
``GET /tokenizer_info``, ``POST /tokenize``, ``POST /detokenize`` (lm-eval finds them). Each
model runs up to ``max_batch`` requests at once (DFlash ones batched, see ``engine.py``); a
full queue answers 503 at once (a batch of prompts counts one request each). Errors use OpenAI's body
``{"error": {"message", "type", "param", "code"}}``. A client that disconnects stops its
generation. Request bodies are JSON: a body sent with another Content-Type (text/plain, a
form) gets 415; no Content-Type at all is read as JSON. With an API key (``api_key``) every
route but ``/health`` needs ``Authorization: Bearer KEY``; otherwise 401.
"""

import asyncio
import logging
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..calibration import exactness
from ..model.checkpoint import resolved_here
from . import anthropic, follow, ollama, openapi, responses
from .http import engine_for, error_response, key_matches, mapped_errors, parse, unknown_model, until_disconnect
from .pool import EnginePool, UnknownModel
from .protocol import (APIError, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, chat_response,
                       completion_response, dflash_stats, new_id, validation_error)
from .settings import SettingsError
from .worker import worker as default_worker
from .sse import chat_events, completion_events, sse_response
from .telemetry import EngineHeaders, tell
from .wire import collect

log = logging.getLogger("dflash2_mlx.server")
TTL_POLL_S = 1.0


def create_app(pool: EnginePool, preload=(), api_key: Optional[str] = None) -> FastAPI:
    app = FastAPI(title="dflash2-mlx", lifespan=_lifespan(pool, preload))
    app.state.pool = pool
    app.add_middleware(EngineHeaders)
    _add_api_key(app, api_key)
    _add_error_handlers(app)
    _add_status_routes(app, pool, api_key)
    _add_generation_routes(app, pool)
    _add_tokenizer_routes(app, pool)
    anthropic.add_routes(app, pool)
    responses.add_routes(app, pool)
    ollama.add_routes(app, pool)
    openapi.describe(app)
    return app


def _lifespan(pool: EnginePool, preload):
    """Load the preloaded models, expire idle ones while serving, and stop them all at the end."""
    @asynccontextmanager
    async def lifespan(app):
        for model_id in preload:
            await pool.get(model_id)
        reaper = asyncio.create_task(_expire_idle(pool))
        yield
        reaper.cancel()
        await pool.stop()
        lockstep = follow.current()
        if lockstep is not None and lockstep.rank == 0:  # here: uvicorn re-raises SIGTERM after this
            await asyncio.wrap_future(default_worker().submit(lockstep.finish))

    return lifespan


def _add_api_key(app: FastAPI, api_key: Optional[str]):
    """With an API key, every route but /health answers 401 without it."""
    if api_key:
        app.add_middleware(APIKey, key=api_key)


class APIKey:
    """The API key check as a plain ASGI middleware: ``@app.middleware("http")`` runs the
    route behind a wrapper that keeps the client's disconnect from it, so a dropped
    non-streaming request would generate to its end."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health" or key_matches(Headers(scope=scope), self.key):
            return await self.app(scope, receive, send)
        e = APIError(401, "a valid API key is needed: Authorization: Bearer KEY (or x-api-key: KEY)",
                     code="invalid_api_key")
        await error_response(scope["path"], e, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


def _add_error_handlers(app: FastAPI):
    """Every error in the shape of the API its route belongs to (``http.error_shape``)."""
    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return error_response(request.url.path, e)

    @app.exception_handler(RequestValidationError)
    async def request_validation(request, e):
        return error_response(request.url.path, validation_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        # Its headers stay: a 405 names the methods the route takes (Allow).
        return error_response(request.url.path, APIError(e.status_code, str(e.detail), type=kind),
                              headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal(request, e):
        log.exception("request failed")
        return error_response(request.url.path, APIError(500, f"internal error: {e}", type="server_error"))


def _add_status_routes(app: FastAPI, pool: EnginePool, api_key: Optional[str]):
    """/health, /metrics and the model list."""
    @app.get("/health")
    async def health(request: Request):
        problem = pool.settings_problem()
        out = {"status": "degraded" if problem else "ok", "loaded_models": list(pool.engines),
               "active_requests": pool.has_active_requests()}
        lockstep = follow.current()
        if lockstep is not None:  # a distributed server: whether every rank is still there
            out["distributed"] = lockstep.health()
            out["status"] = out["status"] if lockstep.lost is None else "error"
        if problem and api_key and not key_matches(request.headers, api_key):
            # The settings file's path and its parse error are the operator's to see.
            out["problem"] = "the settings file cannot be used; serving with the last good settings"
        elif problem:
            out["problem"] = f"{problem}; serving with the last good settings"
        return out

    @app.get("/metrics")
    async def metrics():
        return {"models": pool.get_stats(), "active_requests": pool.has_active_requests()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(pool, m) for m in pool.model_ids()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        try:
            return _model_card(pool, pool.resolve(model_id))
        except UnknownModel:
            raise unknown_model(model_id) from None


def _add_generation_routes(app: FastAPI, pool: EnginePool):
    """/v1/chat/completions and /v1/completions."""
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse(request, ChatRequest)
        engine = await engine_for(pool, body)
        rid = new_id("chatcmpl")
        with mapped_errors():
            ids = await engine.off_loop(engine.encode_chat, body.template_messages(), body.tools,
                                        body.template_kwargs())
            chunks = engine.stream_ids(ids, body.tools, chat=True, request_id=rid, **body.options())
            tell(request, engine.settings.engine(len(ids)))
            if body.stream:
                return sse_response(chat_events(rid, body, chunks), engine, rid)
            completion = await until_disconnect(request, collect(chunks), engine, rid)
        tell(request, dflash_stats(completion))
        return chat_response(rid, body.model, completion, bool(body.logprobs))

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, CompletionRequest)
        engine = await engine_for(pool, body)
        rid = new_id("cmpl")
        prompts = body.prompts
        most = engine.max_queue + engine.max_running()
        if len(prompts) > most:  # each prompt is one request: more than this is never taken
            raise APIError(400, f"a batch of {len(prompts)} prompts is more than this server takes at "
                           f"once ({most})", param="prompt")
        with mapped_errors():
            encoded = await engine.off_loop(lambda: [engine.encode(p) for p in prompts])
            echoed = await engine.off_loop(_echoed, engine, prompts) if body.echo else None
            tell(request, engine.settings.engine(len(encoded[0])))
            if body.stream:
                chunks = engine.stream_ids(encoded[0], request_id=rid, **body.options())
                return sse_response(completion_events(rid, body, chunks, echoed and echoed[0]), engine, rid)
            # A batch of prompts runs side by side (the engine batches them where it can); one
            # that fails fails the request, and stops the others.
            rids = [rid if i == 0 else f"{rid}-{i}" for i in range(len(prompts))]
            streams = [engine.stream_ids(ids, request_id=r, **body.options()) for ids, r in zip(encoded, rids)]
            completions = await until_disconnect(request, asyncio.gather(*map(collect, streams)), engine, *rids)
        tell(request, dflash_stats(completions[0]))
        return completion_response(rid, body.model, completions, body.logprobs is not None, echoed)


def _add_tokenizer_routes(app: FastAPI, pool: EnginePool):
    """vLLM's /tokenizer_info, /tokenize and /detokenize."""
    @app.get("/tokenizer_info")
    async def tokenizer_info(model: Optional[str] = None):
        engine = await engine_for(pool, _Named(model))
        tok = engine.tokenizer
        return {"tokenizer_class": type(getattr(tok, "_tokenizer", tok)).__name__,
                "eos_token": tok.eos_token, "bos_token": tok.bos_token, "pad_token": tok.pad_token,
                "chat_template": getattr(tok, "chat_template", None),
                "model_max_length": engine.context_window}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await parse(request, TokenizeRequest)
        engine = await engine_for(pool, body)
        with mapped_errors():
            if body.messages is not None:
                ids = await engine.off_loop(engine.encode_chat, body.template_messages())
            else:
                ids = list(await engine.off_loop(lambda: engine.tokenizer.encode(
                    body.prompt, add_special_tokens=body.add_special_tokens)))
        out = {"count": len(ids), "max_model_len": engine.context_window, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = await engine.off_loop(lambda: [engine.tokenizer.decode([t]) for t in ids])
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await parse(request, DetokenizeRequest)
        engine = await engine_for(pool, body)
        with mapped_errors():
            return {"prompt": await engine.off_loop(lambda: engine.tokenizer.decode(engine.encode(body.tokens)))}


class _Named:
    """A request that names a model and nothing else (a query parameter's)."""

    def __init__(self, model: Optional[str]):
        self.model = model


def _model_card(pool: EnginePool, model_id: str) -> dict:
    """An OpenAI model entry plus ``dflash``: how the model's requests are decoded."""
    card = {"id": pool.public_name(model_id), "object": "model", "created": 0, "owned_by": "dflash2-mlx"}
    try:
        card["dflash"] = engine = pool.settings_of(model_id).engine()
        if engine["drafter"]:  # its name: where it lies on this machine is no client's business
            engine["drafter"] = Path(engine["drafter"]).name
    except SettingsError as e:
        card["dflash"] = {"error": str(e)}
        return card
    # Whether greedy replies are plain decoding's here (calibration/exactness.py), once measured (by
    # any surface: a model not loaded yet is named by the files it loads from).
    engine = pool.engines.get(model_id)
    if engine is not None and engine.model is not None:
        card["dflash"]["verify_rows"] = exactness.note(engine.model)
    else:
        where = resolved_here(pool.path_of(model_id))
        card["dflash"]["verify_rows"] = (exactness.note_of_source(exactness.source_of(where)) if where is not None
                                         else exactness.NOT_PROBED)
    if engine is not None:  # loaded: what it has served so far
        card["dflash"]["live"] = engine.live()
    return card


async def _expire_idle(pool: EnginePool):
    """Unload models idle past their ttl_seconds, checking every TTL_POLL_S."""
    while True:
        await asyncio.sleep(TTL_POLL_S)
        try:
            await pool.expire()
        except Exception:  # the server goes on; the next round tries again
            log.exception("unloading idle models failed")


def _echoed(engine, prompts) -> list:
    """What echo puts before each completion: the prompt as sent, token ids as text."""
    return [p if isinstance(p, str) else engine.tokenizer.decode(engine.encode(p)) for p in prompts]


def serve(pool: EnginePool, host: str = "127.0.0.1", port: int = 8000, preload=(),
          log_level: str = "info", api_key: Optional[str] = None):
    """Run the server until interrupted."""
    uvicorn.run(create_app(pool, preload, api_key), host=host, port=port, log_level=log_level)
