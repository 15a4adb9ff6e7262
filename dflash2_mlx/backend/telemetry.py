"""How a response was decoded, in its HTTP headers: clients whose SDK drops the body's
``dflash`` block (the ollama client, Anthropic's ``get_final_message()``, a stream read only
for its text) still see it.

A route tells what it knows when it knows it (``tell``): the engine chosen for the prompt
before a stream starts, the draft statistics once a whole response is done; ``EngineHeaders``
(a plain ASGI middleware) adds them to the response's start as ``x-dflash-*`` headers:

    x-dflash-engine: dflash | plain      x-dflash-verify-mode: dflash | adaptive | tree | off
    x-dflash-drafter: its name           x-dflash-block-size: a number or auto
    x-dflash-tau, x-dflash-cycles        (whole responses only: a stream's come in its body)
"""

PREFIX = "x-dflash-"


def tell(request, info: dict):
    """Record ``info`` (``ModelSettings.engine``'s, or ``protocol.dflash_stats``') for the
    response's headers."""
    request.state.dflash = info


def headers_of(info: dict) -> list:
    out = {"engine": "dflash" if info.get("dflash") else "plain", "verify-mode": info.get("verify_mode"),
           "drafter": info.get("drafter"), "block-size": info.get("block_size")}
    if "tau" in info:
        out.update({"tau": f"{info['tau']:.3f}", "cycles": info.get("cycles")})
    return [(f"{PREFIX}{k}".encode(), str(v).encode("latin-1", "replace"))
            for k, v in out.items() if v is not None]


class EngineHeaders:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with(message):
            if message["type"] == "http.response.start":
                info = (scope.get("state") or {}).get("dflash")
                if info:
                    message = {**message, "headers": [*message.get("headers", []), *headers_of(info)]}
            await send(message)

        await self.app(scope, receive, send_with)
