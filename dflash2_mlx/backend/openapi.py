"""The server's OpenAPI description, with what FastAPI cannot see: each POST route reads its
JSON body itself (to answer a malformed one in its own API's error shape), so its request
body and the errors it answers with are declared here, from the same pydantic models the
route validates with.  Client generators and fuzzers then see every field."""

from typing import Dict, Tuple

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from . import anthropic_wire, ollama_wire, protocol, responses_wire

# path -> (component prefix, the model the route validates its body with)
BODIES: Dict[str, Tuple[str, type]] = {
    "/v1/chat/completions": ("OpenAI", protocol.ChatRequest),
    "/v1/completions": ("OpenAI", protocol.CompletionRequest),
    "/v1/responses": ("Responses", responses_wire.ResponsesRequest),
    "/v1/messages": ("Anthropic", anthropic_wire.MessagesRequest),
    "/v1/messages/count_tokens": ("Anthropic", anthropic_wire.CountRequest),
    "/api/chat": ("Ollama", ollama_wire.ChatRequest),
    "/api/generate": ("Ollama", ollama_wire.GenerateRequest),
    "/api/show": ("Ollama", ollama_wire.ShowRequest),
    "/tokenize": ("", protocol.TokenizeRequest),
    "/detokenize": ("", protocol.DetokenizeRequest),
}

ERRORS = {
    "400": "The body is not valid JSON, or a field is missing, of the wrong kind or out of bounds "
           "(the error names it), in the API's own error shape.",
    "401": "An API key is set and the request does not carry it.",
    "404": "No such model.",
    "415": "The body is not application/json.",
    "503": "The model's queue is full, or the server is stopping.",
}


def _component(schemas: dict, prefix: str, model: type) -> str:
    """Put ``model``'s JSON schema (and the models it nests) into ``schemas`` under names
    with ``prefix`` (two APIs' "ChatRequest" stay apart); its component name."""
    template = f"#/components/schemas/{prefix}{{model}}"
    schema = model.model_json_schema(ref_template=template)
    for name, sub in schema.pop("$defs", {}).items():
        schemas[prefix + name] = sub
    schemas[prefix + model.__name__] = schema
    return prefix + model.__name__


def describe(app: FastAPI):
    """Make ``app.openapi()`` declare the request bodies and errors of the POST routes."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = spec.setdefault("components", {}).setdefault("schemas", {})
            for path, (prefix, model) in BODIES.items():
                post = spec.get("paths", {}).get(path, {}).get("post")
                if post is None:
                    continue
                name = _component(schemas, prefix, model)
                post["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}
                post.setdefault("responses", {}).update(
                    {code: {"description": text} for code, text in ERRORS.items()})
            for path, ops in spec.get("paths", {}).items():
                if "{model_id" in path and "get" in ops:  # a model named in the path may not exist
                    ops["get"].setdefault("responses", {}).update(
                        {code: {"description": ERRORS[code]} for code in ("401", "404")})
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi
