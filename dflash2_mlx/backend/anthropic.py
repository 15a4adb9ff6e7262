"""Anthropic's Messages API over the same engine as the OpenAI routes: ``POST /v1/messages``
(one message, or Anthropic's stream of events) and ``POST /v1/messages/count_tokens``.

A body is validated (``anthropic_wire.MessagesRequest``), turned into chat-template
messages, OpenAI-format tools and engine options, and run through ``encode_chat`` and
``stream_ids`` as a chat completion is; the engine's chunks become Anthropic's content
blocks (tool calls as tool_use blocks). Errors under /v1/messages answer in Anthropic's
shape (``error_shape``), a missing ``x-api-key`` too.
"""

import json

from fastapi import FastAPI, Request

from .anthropic_wire import (CountRequest, MessagesRequest, error_body, message, new_message_id, reply_content,
                             stop_fields, thinking_block, tool_use_block, usage)
from .http import engine_for, error_shape, mapped_errors, parse, until_disconnect
from .pool import EnginePool
from .protocol import APIError, dflash_stats
from .sse import framed_response
from .telemetry import tell
from .wire import collect


@error_shape("/v1/messages")
def render(e: APIError) -> dict:
    return error_body(e)


def add_routes(app: FastAPI, pool: EnginePool):
    """Register /v1/messages and /v1/messages/count_tokens on app."""
    @app.post("/v1/messages")
    async def messages(request: Request):
        body = await parse(request, MessagesRequest)
        engine = await engine_for(pool, body)
        mid, tools = new_message_id(), body.template_tools()
        with mapped_errors():
            ids = await engine.off_loop(engine.encode_chat, body.template_messages(), tools, body.template_kwargs(),
                                        body.prefill)
            chunks = engine.stream_ids(ids, tools, chat=True, request_id=mid, continues=body.prefill is not None,
                                       **body.options())
            tell(request, engine.settings.engine(len(ids)))
            if body.stream:
                return framed_response(events(mid, body, chunks), engine, mid, error_frame)
            c = await until_disconnect(request, collect(chunks), engine, mid)
        tell(request, dflash_stats(c))
        return message(mid, body.model, reply_content(c.text, c.tool_calls, body.one_tool_use, c.reasoning), c)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        body = await parse(request, CountRequest)
        engine = await engine_for(pool, body)
        with mapped_errors():
            ids = await engine.off_loop(engine.encode_chat, body.template_messages(), body.template_tools(),
                                        body.template_kwargs(), body.prefill)
        return {"input_tokens": len(ids)}


def frame(event: dict) -> str:
    """One server-sent event as Anthropic frames it: its type on the event line, then its body."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def error_frame(e: APIError) -> str:
    return frame(error_body(e))


async def events(mid: str, body: MessagesRequest, chunks):
    """The engine's chunks as Anthropic's stream: message_start (once the first chunk tells
    the prompt's cached tokens), a ping, each content block's start, deltas and stop,
    message_delta (stop reason, usage, the draft statistics) and message_stop."""
    blocks, last = Blocks(), None
    async for chunk in chunks:
        if last is None:
            yield frame({"type": "message_start", "message": message(mid, body.model, []) | {"usage": usage(chunk)},
                         "dflash": chunk.engine})  # how it is decoded, beside the message
            yield frame({"type": "ping"})
        last = chunk
        for event in blocks.add(last.text, last.tool_calls, body.one_tool_use, last.reasoning):
            yield frame(event)
    if last is None:  # the engine ends every stream with a chunk; this one had none
        raise APIError(500, "the reply ended before it began", type="server_error")
    for event in blocks.close(empty_text=True):
        yield frame(event)
    # The draft statistics ride in message_delta's namespaced extra field (clients ignore it).
    yield frame({"type": "message_delta", "delta": stop_fields(last), "usage": usage(last),
                 "dflash": dflash_stats(last)})
    yield frame({"type": "message_stop"})


class Blocks:
    """The content blocks of a stream, in the order the reply makes them: text grows the
    open text block; a tool call closes it and is a tool_use block of its own (its input in
    one input_json_delta: the engine hands over a call once it is whole)."""

    def __init__(self):
        self.count = 0  # blocks started
        self.open_text = False
        self.open_thinking = False
        self.thoughts = 0  # thinking blocks started
        self.tool_uses = 0

    def add(self, text: str, calls, one_tool_use: bool, reasoning: str = ""):
        if reasoning:
            if not self.open_thinking:
                yield from self.close()
                yield self._start(thinking_block(""))
                self.open_thinking = True
                self.thoughts += 1
            yield {"type": "content_block_delta", "index": self.count - 1,
                   "delta": {"type": "thinking_delta", "thinking": reasoning}}
        if text or calls:
            yield from self._close_thinking()
        if text:
            if not self.open_text:
                yield self._start({"type": "text", "text": ""})
                self.open_text = True
            yield {"type": "content_block_delta", "index": self.count - 1,
                   "delta": {"type": "text_delta", "text": text}}
        for call in calls:
            if one_tool_use and self.tool_uses:
                continue
            self.tool_uses += 1
            yield from self.close()
            use = tool_use_block(call)
            yield self._start({**use, "input": {}})
            yield {"type": "content_block_delta", "index": self.count - 1,
                   "delta": {"type": "input_json_delta", "partial_json": json.dumps(use["input"], ensure_ascii=False)}}
            yield {"type": "content_block_stop", "index": self.count - 1}

    def _close_thinking(self):
        if self.open_thinking:
            self.open_thinking = False
            yield {"type": "content_block_delta", "index": self.count - 1,
                   "delta": {"type": "signature_delta", "signature": ""}}
            yield {"type": "content_block_stop", "index": self.count - 1}

    def close(self, empty_text: bool = False):
        """Stop the open block; ``empty_text``: a reply with no text or tool block gets an empty text one."""
        yield from self._close_thinking()
        if empty_text and self.count == self.thoughts:
            yield self._start({"type": "text", "text": ""})
            self.open_text = True
        if self.open_text:
            self.open_text = False
            yield {"type": "content_block_stop", "index": self.count - 1}

    def _start(self, block: dict) -> dict:
        self.count += 1
        return {"type": "content_block_start", "index": self.count - 1, "content_block": block}
