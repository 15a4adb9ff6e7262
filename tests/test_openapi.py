"""The OpenAPI description declares every POST route's request body (the models the routes
validate with) and the errors they answer with, and every reference in it resolves."""

import json
import re

from dflash2_mlx.backend.openapi import BODIES
from dflash2_mlx.backend.pool import EnginePool
from dflash2_mlx.backend.server import create_app


def test_every_post_route_declares_its_body_and_errors():
    spec = create_app(EnginePool(models={})).openapi()
    posts = {path: ops["post"] for path, ops in spec["paths"].items() if "post" in ops}
    assert set(posts) == set(BODIES)
    schemas = spec["components"]["schemas"]
    for path, op in posts.items():
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        prefix, model = BODIES[path]
        assert ref == f"#/components/schemas/{prefix}{model.__name__}"
        assert {"400", "404", "503"} <= set(op["responses"])
    model = next(ops["get"] for path, ops in spec["paths"].items() if path.startswith("/v1/models/{model_id"))
    assert {"200", "404"} <= set(model["responses"])
    chat = schemas["OpenAIChatRequest"]
    assert {"messages", "max_tokens", "temperature", "stream"} <= set(chat["properties"])
    assert "messages" in chat["required"]
    # Two APIs' "ChatRequest" stay apart, and nothing points at a missing component.
    assert {"OpenAIChatRequest", "OllamaChatRequest"} <= set(schemas)
    assert set(re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(spec))) <= set(schemas)
