"""OpenAI's Responses wire format: the request body (``ResponsesRequest``), its input items
as the chat-template messages the engine takes, and the response object, in the shapes of
the ``openai`` SDK's ``Response`` types."""

import time
import uuid
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError, field_validator,
                      model_validator)
from typing_extensions import Annotated

from .protocol import check_stops, dflash_stats

# What include may ask for that this server gives; the rest name things it never makes
# (file search results, encrypted reasoning) and are ignored.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
TEXT_PARTS = ("input_text", "output_text")


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def parts_text(content, where: str) -> str:
    """A message's or a function output's content (a text, or text parts) as one text."""
    if isinstance(content, str):
        return content
    out = []
    for part in content:
        kind = part.get("type")
        if kind not in TEXT_PARTS:
            raise ValueError(f"only text content parts ({', '.join(TEXT_PARTS)}) are supported in "
                             f"{where}, not {kind!r}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"a {kind} part's text is a string")
        out.append(part["text"])
    return "".join(out)


class _Item(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # id, status: as the SDK sends them back


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, List[Dict[str, Any]]]

    @field_validator("content")
    @classmethod
    def _text(cls, v):
        parts_text(v, "a message")
        return v

    def normal(self) -> dict:
        return {"type": "message", "role": self.role, "content": parts_text(self.content, "a message")}


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str

    def normal(self) -> dict:
        return {"type": "function_call", "call_id": self.call_id, "name": self.name, "arguments": self.arguments}


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Union[str, List[Dict[str, Any]]]

    @field_validator("output")
    @classmethod
    def _text(cls, v):
        parts_text(v, "a function call's output")
        return v

    def normal(self) -> dict:
        return {"type": "function_call_output", "call_id": self.call_id,
                "output": parts_text(self.output, "a function call's output")}


class ReasoningItem(_Item):
    """An earlier reply's reasoning, as clients send it back: left out of the prompt (as
    thinking models' templates leave earlier turns' reasoning out)."""
    type: Literal["reasoning"]

    def normal(self) -> dict:
        return {"type": "reasoning"}


def _item_kind(v):
    return v.get("type", "message") if isinstance(v, dict) else None


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")],
                            Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]],
                      Discriminator(_item_kind)]
INPUT_ITEM = TypeAdapter(InputItem)


def check_function_tools(tools):
    """Function tools in the Responses shape: ``{"type": "function", "name", "description",
    "parameters"}`` (flat, not nested under "function")."""
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type")
        if kind != "function":
            raise ValueError(f"tools[{i}]: only function tools are supported by this server, not {kind!r}")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise ValueError(f"tools[{i}]: a function tool needs its name (a string)")
        if not isinstance(tool.get("parameters") or {}, dict):
            raise ValueError(f"tools[{i}]: parameters is a JSON schema (an object)")
        if not isinstance(tool.get("description") or "", str):
            raise ValueError(f"tools[{i}]: description is a string")
    return tools


class ResponsesRequest(BaseModel):
    # Strict: "0.5" is not a temperature. Unknown options (user, service_tier, ...) are ignored.
    model_config = ConfigDict(extra="allow", strict=True)

    model: Optional[str] = Field(None, min_length=1)
    input: Union[str, List[Any]]  # the items: checked one by one (_input)
    instructions: Optional[str] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Union[Literal["none", "auto", "required"], Dict[str, Any]] = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    include: Optional[List[str]] = None
    stream: bool = False
    store: bool = True
    previous_response_id: Optional[str] = Field(None, min_length=1)
    metadata: Optional[Dict[str, str]] = None
    text: Optional[Dict[str, Any]] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    background: Optional[bool] = None
    conversation: Optional[Any] = None
    prompt: Optional[Any] = None
    reasoning: Optional[Dict[str, Any]] = None  # effort "none": the template's thinking off
    # This server's own options, as its chat route takes them
    stop: Optional[Union[str, List[str]]] = None
    seed: Optional[int] = None
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    logit_bias: Optional[Dict[str, float]] = None

    @field_validator("input")
    @classmethod
    def _input(cls, v):
        """Each item as its own type; an item's error names the item and its field."""
        if len(v) == 0:
            raise ValueError("the input is empty")
        if isinstance(v, str):
            return v
        items = []
        for i, item in enumerate(v):
            if not isinstance(item, dict):
                raise ValueError(f"input[{i}]: an item is an object (a message, a function_call or a "
                                 "function_call_output)")
            try:
                items.append(INPUT_ITEM.validate_python(item))
            except ValidationError as e:
                err = e.errors()[0]
                where = ".".join(str(k) for k in err["loc"][1:])  # after the item's kind
                raise ValueError(f"input[{i}]{'.' + where if where else ''}: "
                                 f"{err['msg'].removeprefix('Value error, ')}") from None
        if all(item.type == "reasoning" for item in items):
            raise ValueError("the input has only reasoning items (left out of the prompt): add a message")
        return items

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        return check_function_tools(v)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        if v == "required" or isinstance(v, dict):
            raise ValueError("this server cannot force a tool call (the model decides): use 'auto' or 'none'")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v):
        if v and (len(v) > 16 or any(len(k) > 64 or len(s) > 512 for k, s in v.items())):
            raise ValueError("at most 16 pairs, keys of at most 64 characters, values of at most 512")
        return v

    @field_validator("text")
    @classmethod
    def _text(cls, v):
        kind = ((v or {}).get("format") or {}).get("type", "text")
        if kind != "text":
            raise ValueError(f"only plain text output is supported (text.format type 'text'), not {kind!r}")
        return v

    @field_validator("background", "conversation", "prompt")
    @classmethod
    def _unsupported(cls, v, info):
        if v:
            raise ValueError(f"{info.field_name} is not supported by this server")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        return check_stops(v)

    @model_validator(mode="after")
    def _top_needs_include(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs needs include: [{LOGPROBS_INCLUDE!r}]")
        return self

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def input_items(self) -> List[dict]:
        """The input as items of one normal form (a message's content one text)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [item.normal() for item in self.input]

    def engine_tools(self) -> Optional[List[dict]]:
        """The tools in OpenAI's chat shape, as the chat template and the tool-call parser
        take them (none with tool_choice "none": the model is not offered them)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                  if t.get(k) is not None}} for t in self.tools]

    def template_kwargs(self) -> Optional[dict]:
        """``reasoning.effort`` as the template's enable_thinking ("none": off; any other: on)."""
        effort = (self.reasoning or {}).get("effort")
        return None if effort is None else {"enable_thinking": effort != "none"}

    def options(self) -> dict:
        """Engine options (``RequestOptions``' names): only those the client set."""
        out = {k: getattr(self, k) for k in ("temperature", "top_p", "stop", "seed", "top_k", "min_p", "logit_bias")
               if getattr(self, k) is not None}
        if self.max_output_tokens is not None:
            out["max_tokens"] = self.max_output_tokens
        if self.logprobs:
            out["logprobs"] = self.top_logprobs or 0
        return out


def template_messages(items: List[dict], instructions: Optional[str] = None) -> List[dict]:
    """Conversation items (normal form, or output items) as chat-template messages:
    instructions first as a system message, a developer message as a system one, function
    calls as the tool_calls of an assistant message (the one just before them, if any), a
    function call's output as a "tool" message."""
    out = [{"role": "system", "content": instructions}] if instructions is not None else []
    names = {}
    for item in items:
        kind = item.get("type", "message")
        if kind == "reasoning":
            continue
        if kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            names[item["call_id"]] = item["name"]
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            message = {"role": "tool", "tool_call_id": item["call_id"],
                       "content": parts_text(item["output"], "a function call's output")}
            if item["call_id"] in names:
                message["name"] = names[item["call_id"]]
            out.append(message)
        else:
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": parts_text(item["content"], "a message")})
    return out


def usage(c) -> dict:
    """The Responses API's usage of a reply (its last chunk), the prefix cache's tokens as
    cached_tokens. cache_write_tokens is 0: the prefix cache keeps prompts as its budget
    allows, with no write a request asks for (OpenAI's counts explicit cache writes)."""
    details = {"cached_tokens": c.cached_tokens, "cache_write_tokens": 0}
    return {"input_tokens": c.prompt_tokens, "input_tokens_details": details,
            "output_tokens": c.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": (c.segments or {}).get("thinking", {}).get("tokens", 0)},
            "total_tokens": c.prompt_tokens + c.completion_tokens}


def echoed_tools(body: ResponsesRequest) -> List[dict]:
    return [{"type": "function", "name": t["name"], "description": t.get("description"),
             "parameters": t.get("parameters"), "strict": t.get("strict")} for t in body.tools or ()]


def response_body(rid: str, body: ResponsesRequest, created: int, output: List[dict], status: str,
                  last=None, error: Optional[dict] = None) -> dict:
    """A response object (``status`` "in_progress", "completed", "incomplete" or "failed";
    ``last``: the reply's last chunk, for usage and the draft statistics)."""
    out = {"id": rid, "object": "response", "created_at": created, "status": status, "error": error,
           "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
           "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
           "model": body.model, "output": output, "parallel_tool_calls": body.parallel_tool_calls,
           "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
           "store": body.store, "temperature": body.temperature, "text": {"format": {"type": "text"}},
           "tool_choice": body.tool_choice, "tools": echoed_tools(body), "top_p": body.top_p,
           "top_logprobs": body.top_logprobs, "truncation": body.truncation or "disabled",
           "metadata": body.metadata or {}, "usage": None}
    if status in ("completed", "incomplete"):
        out["completed_at"] = int(time.time())
    if last is not None:
        out["usage"], out["dflash"] = usage(last), dflash_stats(last)
    return out
