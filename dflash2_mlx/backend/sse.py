"""Server-sent events: a streamed response as OpenAI's ``data: {...}`` events, ended by
``data: [DONE]`` (or an error event), and the chunk events of chat and of completions."""

import json
import logging
import time
from typing import Optional

from fastapi.responses import StreamingResponse

from .protocol import (APIError, ChatRequest, CompletionRequest, chat_chunk, completion_chunk, dflash_stats, error_body,
                       usage_chunk)
from .wire import EngineError, QueueFull

log = logging.getLogger("dflash2_mlx.server")


def sse_response(events, engine, rid) -> StreamingResponse:
    async def body():
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
            yield "data: [DONE]\n\n"
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        except (QueueFull, EngineError) as e:
            yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
        except Exception as e:
            log.exception("stream failed")
            yield f"data: {json.dumps(error_body(f'internal error: {e}', 'server_error'))}\n\n"
        finally:
            engine.abort(rid)  # no-op once finished; stops the generation on a disconnect

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def framed_response(frames, engine, rid, error_frame, media_type: str = "text/event-stream") -> StreamingResponse:
    """A stream in an API's own event framing: ``frames`` yields each event's text; an error
    mid-stream is sent as ``error_frame(e: APIError)`` and ends it. The request is aborted at
    the end (a no-op once finished; it stops the generation on a disconnect). ``media_type``:
    the stream's (Ollama's is NDJSON)."""
    async def body():
        try:
            async for text in frames:
                yield text
        except APIError as e:
            yield error_frame(e)
        except (QueueFull, EngineError) as e:
            yield error_frame(APIError(503, str(e), type="server_error"))
        except Exception as e:
            log.exception("stream failed")
            yield error_frame(APIError(500, f"internal error: {e}", type="server_error"))
        finally:
            engine.abort(rid)

    return StreamingResponse(body(), media_type=media_type,
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def chat_events(rid, body: ChatRequest, chunks):
    """The chat stream: the role first (with ``dflash``: how the request is decoded), then
    the reply's deltas (reasoning as ``reasoning_content`` and mlx-lm's ``reasoning``), the
    last with ``dflash``'s draft statistics, then usage if asked for."""
    created = int(time.time())
    last, calls, first = None, 0, True
    async for last in chunks:
        if first:
            head = chat_chunk(rid, body.model, created, {"role": "assistant", "content": ""})
            yield {**head, "dflash": last.engine}
            first = False
        delta = {}
        if last.reasoning:
            delta["reasoning_content"] = delta["reasoning"] = last.reasoning
        if last.text:
            delta["content"] = last.text
        if last.tool_calls:
            delta["tool_calls"] = [{"index": calls + i, **c} for i, c in enumerate(last.tool_calls)]
            calls += len(last.tool_calls)
        if delta or last.finish_reason:
            out = chat_chunk(rid, body.model, created, delta, last.finish_reason,
                             last.logprobs if body.logprobs else None)
            yield {**out, "dflash": dflash_stats(last)} if last.finish_reason else out
    if body.include_usage and last is not None:
        yield usage_chunk(rid, body.model, created, "chat.completion.chunk", last)


async def completion_events(rid, body: CompletionRequest, chunks, echoed: Optional[str] = None):
    """The completion stream; its first chunk says how the request is decoded (``dflash``),
    its last carries the draft statistics."""
    created = int(time.time())
    last, offset, first = None, 0, True
    async for last in chunks:
        text, entries = last.text, last.logprobs
        if echoed is not None:  # the prompt leads the first chunk (its entries there too)
            text, entries, echoed = echoed + text, (last.prompt_logprobs or []) + entries, None
        out = completion_chunk(rid, body.model, created, text, last.finish_reason,
                               entries if body.logprobs is not None else None, offset)
        if last.finish_reason:
            out["dflash"] = dflash_stats(last)
        elif first:
            out["dflash"] = last.engine
        first = False
        yield out
        offset += sum(len(e["token"]) for e in entries)
    if body.include_usage and last is not None:
        yield usage_chunk(rid, body.model, created, "text_completion", last)
