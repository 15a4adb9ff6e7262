"""What every API's routes share: reading a JSON body, finding the engine a request names,
mapping engine exceptions to statuses, aborting on a client's disconnect, the API key, and
answering errors in the shape of the API a route belongs to.

Each wire format (OpenAI, Anthropic, Ollama) is a thin adapter over the same engine; an
adapter that answers errors in its own shape registers it with ``error_shape(prefix)``, and
every error under that path prefix (a 400 from validation, a 401 without the key, a 404, a
503 from the queue, a 500) is rendered by it.  Routes under no registered prefix answer in
OpenAI's shape.
"""

import asyncio
import hmac
import json
from typing import Callable, List, Tuple

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from ..request.arguments import ArgumentError
from .pool import EnginePool, NoDefaultModel, PoolBusy, UnknownModel
from .protocol import APIError, validation_error
from .settings import SettingsError
from .wire import EngineError, InvalidOption, PromptTooLong, QueueFull

MAX_BODY_BYTES = 16 * 1024 * 1024
DISCONNECT_POLL_S = 0.25

ERROR_SHAPES: List[Tuple[str, Callable[[APIError], dict]]] = []


def error_shape(prefix: str):
    """Register ``render(e: APIError) -> body`` for the routes under ``prefix``."""
    def register(render):
        ERROR_SHAPES.append((prefix, render))
        ERROR_SHAPES.sort(key=lambda p: -len(p[0]))  # the longest prefix wins
        return render
    return register


def error_response(path: str, e: APIError, headers=None) -> JSONResponse:
    for prefix, render in ERROR_SHAPES:
        if path.startswith(prefix):
            return JSONResponse(render(e), status_code=e.status, headers=headers)
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def key_matches(headers, key: str) -> bool:
    """``Authorization: Bearer KEY`` (OpenAI, Ollama) or ``x-api-key: KEY`` (Anthropic)."""
    scheme, _, given = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode()):
        return True
    other = headers.get("x-api-key")
    return other is not None and hmac.compare_digest(other.strip().encode(), key.encode())


def json_content_type(request: Request) -> bool:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return not kind or kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def surrogate_path(value, path=()):
    """The location of the first string with a lone UTF-16 surrogate, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = surrogate_path(v, path + (k,))
        if found is not None:
            return found
    return None


def unknown_model(model_id: str) -> APIError:
    return APIError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")


async def read_json(request: Request, any_content_type: bool = False) -> dict:
    """The request's body as a JSON object, bounded in size and checked for valid Unicode
    (``any_content_type``: read as JSON whatever its Content-Type says, as Ollama does)."""
    if not any_content_type and not json_content_type(request):
        raise APIError(415, "the request body must be JSON: send it with Content-Type: application/json",
                       code="unsupported_media_type")
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        raise APIError(413, f"request body over {MAX_BODY_BYTES} bytes")
    raw = bytearray()
    async for part in request.stream():  # a body sent without its length stops at the bound too
        raw += part
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"request body over {MAX_BODY_BYTES} bytes")
    try:
        return loaded(raw)
    except RecursionError:
        raise APIError(400, "the request body is nested too deep") from None


def loaded(raw: bytes) -> dict:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    where = surrogate_path(data)
    if where is not None:
        param = ".".join(str(k) for k in where)
        raise APIError(400, f"invalid value for {param}: text with a lone UTF-16 surrogate "
                       "(not valid Unicode)", param=str(where[0]))
    return data


def validated(data: dict, schema):
    """``data`` as ``schema`` (a pydantic model): a 400 naming the first bad field."""
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deep") from None


async def parse(request: Request, schema):
    return validated(await read_json(request), schema)


async def engine_for(pool: EnginePool, body):
    """The engine of the model the request names (an id, an alias, or none: the default);
    ``body.model`` becomes the name the replies show."""
    try:
        model_id = pool.resolve(body.model)
    except UnknownModel:
        raise unknown_model(body.model) from None
    except NoDefaultModel as e:
        raise APIError(400, str(e), param="model") from None
    body.model = body.model or pool.public_name(model_id)
    try:
        return await pool.get(model_id)
    except UnknownModel:
        raise unknown_model(model_id) from None
    except PoolBusy as e:
        raise APIError(503, str(e), type="server_error", code="server_busy") from None
    except SettingsError as e:
        raise APIError(400, f"the settings of {model_id} cannot be used: {e}", param=e.param,
                       code="invalid_model_settings") from None
    except (ValueError, OSError) as e:
        raise APIError(500, f"model {model_id} failed to load: {e}", type="server_error") from None


class mapped_errors:
    """Engine exceptions -> API error statuses (``prompt_param``: the field a too-long prompt
    is blamed on)."""

    def __init__(self, prompt_param: str = "messages"):
        self.prompt_param = prompt_param

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is None or isinstance(e, APIError):
            return False
        if isinstance(e, InvalidOption):
            raise APIError(400, str(e), param=e.param) from None
        if isinstance(e, ArgumentError):
            raise APIError(400, str(e), param=e.name) from None
        if isinstance(e, PromptTooLong):
            raise APIError(400, str(e), param=self.prompt_param, code="context_length_exceeded") from None
        if isinstance(e, QueueFull):
            raise APIError(503, f"server busy: {e}", type="server_error", code="queue_full") from None
        if isinstance(e, EngineError):
            raise APIError(503, str(e), type="server_error") from None
        if isinstance(e, (ValueError, TypeError)):
            raise APIError(400, str(e)) from None
        return False


async def until_disconnect(request: Request, work, engine, *rids):
    """Await ``work``; if the client goes away first, or the work fails (one prompt of a
    batch), abort its requests (a no-op for those already finished)."""
    task = asyncio.ensure_future(work)
    finished = False
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                result = task.result()
                finished = True
                return result
            if await request.is_disconnected():
                raise APIError(499, "client disconnected")
    finally:
        if not finished:
            for rid in rids:
                engine.abort(rid)
            task.cancel()
