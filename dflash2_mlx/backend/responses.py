"""OpenAI's Responses API: ``POST /v1/responses`` (one JSON body, or server-sent events
``event: TYPE`` / ``data: {...}`` with sequence numbers), ``GET`` and ``DELETE
/v1/responses/{id}``.

A request's input items become chat-template messages and its function tools OpenAI's
chat tools (``responses_wire.py``); the engine serves them as it serves a chat, and the
reply's chunks become output items (``OutputBuilder``, which also gives the stream events
that build them: a streamed reply and a whole one are one pipeline). Responses are kept
(unless ``store`` is false) in a bounded store in memory, the least recently used dropped
first, so that ``previous_response_id`` can continue a conversation: the earlier input and
output items go before the new input (its instructions do not, as with OpenAI's).
Errors use OpenAI's body, the server's default shape.
"""

import collections
import json
import logging
import time
from typing import List, Optional

from fastapi import Request
from fastapi.responses import StreamingResponse

from .http import engine_for, mapped_errors, parse, until_disconnect
from .protocol import APIError
from .responses_wire import ResponsesRequest, new_item_id, response_body, template_messages
from .telemetry import tell
from .wire import EngineError

log = logging.getLogger("dflash2_mlx.server")
MAX_STORED = 256  # responses kept for previous_response_id and GET, per server


class ResponseStore:
    """The latest responses (their bodies and conversation items), the least recently used
    dropped first."""

    def __init__(self, max_entries: int = MAX_STORED):
        self.max_entries = max_entries
        self.entries = collections.OrderedDict()

    def put(self, response: dict, items: list):
        self.entries[response["id"]] = (response, items)
        self.entries.move_to_end(response["id"])
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)

    def get(self, rid: str) -> Optional[tuple]:
        entry = self.entries.get(rid)
        if entry is not None:
            self.entries.move_to_end(rid)
        return entry

    def delete(self, rid: str) -> bool:
        return self.entries.pop(rid, None) is not None


def text_part(text: str, logprobs: Optional[List[dict]]) -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


class OutputBuilder:
    """A reply's output items, built from its chunks: a reasoning item with a thinking
    model's reasoning, a message with the text, a function_call item per tool call (with
    ``parallel_tool_calls`` false, the first only).
    ``add`` and ``finish`` return the stream events (type, fields) that build the same items,
    in the order of OpenAI's (ResponseStreamEvent). Text that is only whitespace before
    anything else is held back (a model often writes a newline before its tool call)."""

    def __init__(self, parallel_tool_calls: bool = True, logprobs: bool = False):
        self.parallel, self.logprobs = parallel_tool_calls, logprobs
        self.items: List[dict] = []
        self.message: Optional[dict] = None  # the message being written
        self.text, self.entries = "", []
        self.held, self.held_entries = "", []
        self.calls = 0
        self.reasoning: Optional[dict] = None  # the reasoning item being written

    def add(self, chunk) -> List[tuple]:
        events = []
        if chunk.reasoning:
            events += self._reason(chunk.reasoning)
        if chunk.text or chunk.tool_calls:
            events += self._close_reasoning()
        if chunk.text or chunk.logprobs:
            events += self._text(chunk.text, chunk.logprobs if self.logprobs else [])
        for call in chunk.tool_calls:
            if self.parallel or not self.calls:
                events += self._call(call)
        return events

    def _text(self, text: str, entries: List[dict]) -> List[tuple]:
        if self.message is None and not (self.held + text).strip():
            self.held, self.held_entries = self.held + text, self.held_entries + entries
            return []
        events = self._open() if self.message is None else []
        text, entries = self.held + text, self.held_entries + entries
        self.held, self.held_entries = "", []
        self.text += text
        self.entries += entries
        return events + [("response.output_text.delta", {**self._where(), "content_index": 0, "delta": text,
                                                         "logprobs": entries})]

    def _reason(self, text: str) -> List[tuple]:
        events = []
        if self.reasoning is None:
            events += self._close("completed")
            self.reasoning = {"type": "reasoning", "id": new_item_id("rs"), "summary": [], "content": [],
                              "status": "in_progress", "text": ""}
            item = {k: v for k, v in self.reasoning.items() if k != "text"}
            events += [("response.output_item.added", {"output_index": len(self.items), "item": item}),
                       ("response.content_part.added", {"item_id": item["id"], "output_index": len(self.items),
                                                        "content_index": 0,
                                                        "part": {"type": "reasoning_text", "text": ""}})]
        self.reasoning["text"] += text
        return events + [("response.reasoning_text.delta", {"item_id": self.reasoning["id"],
                                                            "output_index": len(self.items),
                                                            "content_index": 0, "delta": text})]

    def _close_reasoning(self, status: str = "completed") -> List[tuple]:
        if self.reasoning is None:
            return []
        r, self.reasoning = self.reasoning, None
        part = {"type": "reasoning_text", "text": r["text"]}
        item = {"type": "reasoning", "id": r["id"], "summary": [], "content": [part], "status": status}
        where = {"item_id": r["id"], "output_index": len(self.items)}
        self.items.append(item)
        return [("response.reasoning_text.done", {**where, "content_index": 0, "text": r["text"]}),
                ("response.content_part.done", {**where, "content_index": 0, "part": part}),
                ("response.output_item.done", {"output_index": where["output_index"], "item": item})]

    def _where(self) -> dict:
        return {"item_id": self.message["id"], "output_index": len(self.items)}

    def _open(self) -> List[tuple]:
        self.message = {"type": "message", "id": new_item_id("msg"), "role": "assistant",
                        "status": "in_progress", "content": []}
        self.text, self.entries = "", []
        part = text_part("", [] if self.logprobs else None)
        return [("response.output_item.added", {"output_index": len(self.items), "item": self.message}),
                ("response.content_part.added", {**self._where(), "content_index": 0, "part": part})]

    def _close(self, status: str) -> List[tuple]:
        if self.message is None:
            return []
        part = text_part(self.text, self.entries if self.logprobs else None)
        where = self._where()
        item = {**self.message, "status": status, "content": [part]}
        self.items.append(item)
        self.message = None
        return [("response.output_text.done", {**where, "content_index": 0, "text": part["text"],
                                               "logprobs": self.entries}),
                ("response.content_part.done", {**where, "content_index": 0, "part": part}),
                ("response.output_item.done", {"output_index": where["output_index"], "item": item})]

    def _call(self, call: dict) -> List[tuple]:
        events = self._close("completed")
        self.held, self.held_entries = "", []
        self.calls += 1
        function = call["function"]
        item = {"type": "function_call", "id": new_item_id("fc"), "call_id": call["id"],
                "name": function["name"], "arguments": "", "status": "in_progress"}
        where = {"item_id": item["id"], "output_index": len(self.items)}
        done = {**item, "arguments": function["arguments"], "status": "completed"}
        self.items.append(done)
        return events + [("response.output_item.added", {"output_index": where["output_index"], "item": item}),
                         ("response.function_call_arguments.delta", {**where, "delta": function["arguments"]}),
                         ("response.function_call_arguments.done", {**where, "arguments": function["arguments"]}),
                         ("response.output_item.done", {"output_index": where["output_index"], "item": done})]

    def finish(self, status: str) -> List[tuple]:
        """Close the reply (``status``: "completed" or "incomplete"); a reply with nothing in
        it is one empty message."""
        events = self._close_reasoning(status)
        if not any(i["type"] != "reasoning" for i in self.items) and self.message is None:
            events = self._open()
            if self.held:  # the whitespace held back is all the text there is
                events += self._text("", [])
        return events + self._close(status)


def not_found(rid: str, param: Optional[str] = None) -> APIError:
    return APIError(404, f"No response found with id '{rid}' (responses are kept in this server's memory, "
                    f"the latest {MAX_STORED}; one made with store=false is not kept)",
                    param=param, code="not_found")


def earlier_items(store: ResponseStore, body: ResponsesRequest) -> list:
    """The conversation items of the response ``previous_response_id`` names."""
    if body.previous_response_id is None:
        return []
    entry = store.get(body.previous_response_id)
    if entry is None:
        e = not_found(body.previous_response_id, "previous_response_id")
        raise APIError(400, e.message, param="previous_response_id", code="previous_response_not_found")
    return entry[1]


def status_of(last) -> str:
    return "incomplete" if last is not None and last.finish_reason == "length" else "completed"


def add_routes(app, pool):
    """Register this API's routes on app."""
    store = app.state.responses = ResponseStore()

    @app.post("/v1/responses")
    async def create(request: Request):
        body = await parse(request, ResponsesRequest)
        items = earlier_items(store, body) + body.input_items()
        engine = await engine_for(pool, body)
        rid = new_item_id("resp")
        tools = body.engine_tools()
        with mapped_errors(prompt_param="input"):
            ids = await engine.off_loop(engine.encode_chat, template_messages(items, body.instructions), tools,
                                        body.template_kwargs())
            chunks = engine.stream_ids(ids, tools, chat=True, request_id=rid, **body.options())
            decoding = engine.settings.engine(len(ids))
            reply = Reply(rid, body, store, items, decoding)
            tell(request, decoding)
            if body.stream:
                return event_stream(reply.events(chunks), engine, rid)
            out = await until_disconnect(request, reply.whole(chunks), engine, rid)
        if out.get("dflash"):
            tell(request, out["dflash"])
        return out

    @app.get("/v1/responses/{rid}")
    async def retrieve(rid: str):
        entry = store.get(rid)
        if entry is None:
            raise not_found(rid)
        return entry[0]

    @app.delete("/v1/responses/{rid}")
    async def delete(rid: str):
        if not store.delete(rid):
            raise not_found(rid)
        return {"id": rid, "object": "response", "deleted": True}


class Reply:
    """One request's reply: its chunks into output items, as one body or as events, and the
    response kept for a later ``previous_response_id``."""

    def __init__(self, rid: str, body: ResponsesRequest, store: ResponseStore, items: list,
                 decoding: Optional[dict] = None):
        """``decoding``: how the request is decoded (``ModelSettings.engine``), told on the
        stream's first event; the draft statistics come with its last."""
        self.rid, self.body, self.store, self.items = rid, body, store, items
        self.decoding = decoding
        self.created = int(time.time())
        self.output = OutputBuilder(body.parallel_tool_calls, body.logprobs)

    def done(self, last) -> dict:
        response = response_body(self.rid, self.body, self.created, self.output.items, status_of(last), last)
        if self.body.store:
            self.store.put(response, self.items + self.output.items)
        return response

    async def whole(self, chunks) -> dict:
        last = None
        async for last in chunks:
            self.output.add(last)
        self.output.finish(status_of(last))
        return self.done(last)

    async def events(self, chunks):
        """The stream's events (type, fields); a failure on the way is a response.failed."""
        start = response_body(self.rid, self.body, self.created, [], "in_progress")
        if self.decoding is not None:
            start["dflash"] = self.decoding
        yield "response.created", {"response": start}
        yield "response.in_progress", {"response": start}
        last = None
        try:
            async for last in chunks:
                for event in self.output.add(last):
                    yield event
        except (APIError, EngineError, ValueError) as e:
            yield self.failed(str(e))
            return
        except Exception as e:
            log.exception("stream failed")
            yield self.failed(f"internal error: {e}")
            return
        for event in self.output.finish(status_of(last)):
            yield event
        response = self.done(last)
        yield f"response.{response['status']}", {"response": response}

    def failed(self, message: str) -> tuple:
        error = {"code": "server_error", "message": message}
        return "response.failed", {"response": response_body(self.rid, self.body, self.created, self.output.items,
                                                             "failed", error=error)}


def event_stream(events, engine, rid) -> StreamingResponse:
    """Server-sent events ``event: TYPE`` / ``data: {..., "type", "sequence_number"}``; the
    generation stops when the client goes away."""
    async def body():
        try:
            number = 0
            async for kind, fields in events:
                yield f"event: {kind}\ndata: {json.dumps({'type': kind, **fields, 'sequence_number': number})}\n\n"
                number += 1
        finally:
            engine.abort(rid)  # no-op once finished

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
