"""Anthropic's Messages wire format: the request body (validated strictly, as ``protocol``'s
OpenAI bodies are), its conversion to what the engine takes (chat-template messages, tools
in OpenAI's function format, engine options), and the reply's bodies (a message, the
stream's events, an error)."""

import json
import uuid
from typing import Any, Dict, List, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .protocol import APIError, dflash_stats

# The error type Anthropic names for each status (others: by their class, 4xx or 5xx).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}
# Content blocks this server reads; the others (images, documents, server tools) it refuses.
BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
MAX_STOP_SEQUENCES = 16


def error_body(e: APIError) -> dict:
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = ERROR_TYPES.get(e.status) or ("invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def as_blocks(value, what: str):
    """A string as one text block (Anthropic takes either); a list as it is."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise ValueError(f"{what} is a string or a list of content blocks")
    return value


class _Strict(BaseModel):
    # Strict: "0.5" is not a temperature. Fields Anthropic has and this server does not read
    # (cache_control, citations, metadata...) are accepted and ignored.
    model_config = ConfigDict(extra="allow", strict=True)


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class Block(_Strict):
    """One content block of a message: text, tool_use (an assistant's), tool_result (a
    user's), or a thinking block of an earlier turn (left out of the prompt)."""
    type: str
    text: Optional[str] = None
    id: Optional[str] = Field(None, min_length=1)
    name: Optional[str] = Field(None, min_length=1)
    input: Optional[Dict[str, Any]] = None
    tool_use_id: Optional[str] = Field(None, min_length=1)
    content: Optional[List[TextBlock]] = None
    is_error: bool = False

    @model_validator(mode="before")
    @classmethod
    def _result_text(cls, data):
        if isinstance(data, dict) and data.get("type") == "tool_result" and "content" in data:
            data = {**data, "content": as_blocks(data["content"], "a tool_result's content")}
        return data

    @model_validator(mode="after")
    def _shape(self):
        needs = {"text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",)}
        if self.type not in BLOCK_TYPES:
            raise ValueError(f"{self.type!r} content blocks are not supported by this server "
                             f"(it reads {', '.join(BLOCK_TYPES)})")
        missing = [f for f in needs.get(self.type, ()) if getattr(self, f) is None]
        if missing:
            raise ValueError(f"a {self.type} block needs {' and '.join(missing)}")
        return self


class MessageParam(_Strict):
    role: Literal["user", "assistant"]
    content: List[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v):
        return as_blocks(v, "content")

    @model_validator(mode="after")
    def _roles(self):
        mine = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}
        for b in self.content:
            if b.type not in mine[self.role]:
                raise ValueError(f"a {b.type} block belongs in a{'n' if self.role == 'user' else ''} "
                                 f"{'assistant' if self.role == 'user' else 'user'} message")
        return self


class ToolParam(_Strict):
    name: str = Field(min_length=1, max_length=128)
    description: Optional[str] = None
    input_schema: Dict[str, Any]
    type: Optional[Literal["custom"]] = None  # Anthropic's server tools (web search...) are not served


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = Field(None, min_length=1)
    disable_parallel_tool_use: bool = False


class ThinkingParam(_Strict):
    """Extended thinking: on or off (the template's enable_thinking); the budget is not read."""
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = Field(None, ge=0)


class CountRequest(_Strict):
    """What /v1/messages/count_tokens reads: what makes the prompt."""
    model: Optional[str] = Field(None, min_length=1)  # None: the default model
    messages: List[MessageParam] = Field(min_length=1)
    system: Optional[List[TextBlock]] = None
    tools: Optional[List[ToolParam]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[ThinkingParam] = None

    def template_kwargs(self) -> Optional[dict]:
        """``thinking`` as the chat template's enable_thinking (None: the template's default)."""
        if self.thinking is None or self.thinking.type == "adaptive":
            return None
        return {"enable_thinking": self.thinking.type == "enabled"}

    @field_validator("system", mode="before")
    @classmethod
    def _system(cls, v):
        return None if v is None else as_blocks(v, "system")

    @model_validator(mode="after")
    def _choice(self):
        c, names = self.tool_choice, [t.name for t in self.tools or ()]
        if c is not None and c.type == "tool" and c.name not in names:
            raise ValueError(f"tool_choice names the tool {c.name!r}, which is not among the tools")
        last = self.messages[-1]
        if last.role == "assistant" and any(b.type == "tool_use" for b in last.content):
            raise ValueError("a final assistant message (a prefill the reply continues) is text: "
                             "its tool uses need their tool results in a user message after it")
        return self

    @property
    def prefill(self) -> Optional[str]:
        """A final assistant message's text: the start of the reply, which the reply continues."""
        last = self.messages[-1]
        if last.role != "assistant":
            return None
        return text_of(b for b in last.content if b.type == "text") or None  # none: a new turn

    def template_tools(self) -> Optional[List[dict]]:
        """The tools the chat template is given, in OpenAI's function format: tool_choice
        "none" gives none, "tool" only the one it names (neither can be forced here)."""
        c, tools = self.tool_choice, self.tools or []
        if c is not None and c.type == "none":
            tools = []
        elif c is not None and c.type == "tool":
            tools = [t for t in tools if t.name == c.name]
        out = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                 "parameters": t.input_schema}} for t in tools]
        return out or None

    def template_messages(self) -> List[dict]:
        out = [{"role": "system", "content": text_of(self.system)}] if self.system else []
        for m in self.messages[:-1] if self.messages[-1].role == "assistant" else self.messages:
            out += user_turn(m.content) if m.role == "user" else [assistant_turn(m.content)]
        return out


class MessagesRequest(CountRequest):
    max_tokens: int = Field(ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    stop_sequences: Optional[List[str]] = Field(None, max_length=MAX_STOP_SEQUENCES)
    stream: bool = False
    metadata: Optional[Dict[str, Any]] = None  # Anthropic's user id: not read here

    def options(self) -> dict:
        """Engine generation options (``RequestOptions``'s names): only those the client set."""
        out = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
               "top_k": self.top_k, "stop": self.stop_sequences}
        return {k: v for k, v in out.items() if v is not None}

    @property
    def one_tool_use(self) -> bool:
        return self.tool_choice is not None and self.tool_choice.disable_parallel_tool_use


def text_of(blocks) -> str:
    """Text blocks joined, as OpenAI's text parts are (``protocol.Message``)."""
    return "".join(b.text or "" for b in blocks or ())


def user_turn(blocks: List[Block]) -> List[dict]:
    """A user message as template messages: each tool_result a "tool" message (its
    tool_call_id the tool_use_id), the text between them a user message."""
    out, text = [], []
    for b in blocks:
        if b.type == "tool_result":
            if text:
                out.append({"role": "user", "content": "".join(text)})
                text = []
            content = text_of(b.content)
            out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                        "content": f"Error: {content}" if b.is_error else content})
        else:
            text.append(b.text)
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def assistant_turn(blocks: List[Block]) -> dict:
    """An assistant message as a template message: its text, and its tool_use blocks as
    OpenAI ``tool_calls`` (the input as a JSON string, as the OpenAI route passes them on)."""
    out = {"role": "assistant", "content": text_of(b for b in blocks if b.type == "text")}
    calls = [{"id": b.id, "type": "function",
              "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
             for b in blocks if b.type == "tool_use"]
    if calls:
        out["tool_calls"] = calls
    return out


# The reply -----------------------------------------------------------------------------
def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_use_block(call: dict) -> dict:
    """An engine's tool call (OpenAI-shaped) as a tool_use block; arguments that are not a
    JSON object go in whole under "arguments"."""
    function = call["function"]
    try:
        args = json.loads(function["arguments"])
    except (json.JSONDecodeError, TypeError):
        args = function["arguments"]
    return {"type": "tool_use", "id": call["id"], "name": function["name"],
            "input": args if isinstance(args, dict) else {"arguments": args}}


def stop_reason(c) -> str:
    """The engine's finish reason (of a Completion or the last Chunk) in Anthropic's terms."""
    if c.finish_reason == "tool_calls":
        return "tool_use"
    if c.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if c.stop_sequence is not None else "end_turn"


def stop_fields(c) -> dict:
    """``stop_reason`` and ``stop_sequence`` (the stop string, when one ended the reply)."""
    reason = stop_reason(c)
    return {"stop_reason": reason, "stop_sequence": c.stop_sequence if reason == "stop_sequence" else None}


def usage(c) -> dict:
    """Anthropic's usage: input_tokens leaves out the prompt tokens read from the prefix cache."""
    return {"input_tokens": c.prompt_tokens - c.cached_tokens, "output_tokens": c.completion_tokens,
            "cache_read_input_tokens": c.cached_tokens, "cache_creation_input_tokens": 0}


def message(mid: str, model: str, content: List[dict], c=None) -> dict:
    """A message body; without ``c`` (a Completion or last Chunk), the stream's first."""
    out = {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
           "stop_reason": None, "stop_sequence": None, "usage": None}
    if c is not None:
        out.update(stop_fields(c), usage=usage(c), dflash=dflash_stats(c))
    return out


def reply_content(text: str, calls: List[dict], one_tool_use: bool = False, reasoning: str = "") -> List[dict]:
    """A reply's content blocks: its reasoning as a thinking block (no signature: nothing
    signs it here), its text (if any, or if there is nothing else), then its tool uses."""
    uses = [tool_use_block(c) for c in (calls[:1] if one_tool_use else calls)]
    thought = [thinking_block(reasoning)] if reasoning else []
    return thought + ([{"type": "text", "text": text}] if text or not uses else []) + uses


def thinking_block(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": ""}
