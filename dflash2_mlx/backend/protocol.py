"""The OpenAI wire format: validated request bodies, response and chunk bodies, error bodies."""

import time
import uuid
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .options import OPTION_NAMES

# The engine's options a request body names as the engine does; logprobs (and with echo,
# prompt_logprobs) each request type maps from OpenAI's own fields.
SAME_NAMED = tuple(n for n in OPTION_NAMES if n not in ("logprobs", "prompt_logprobs"))


MAX_STOPS = 16


def check_stops(v):
    """A request's stop strings: at most MAX_STOPS (every API's stop field)."""
    if isinstance(v, list) and len(v) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop strings")
    return v


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Request(BaseModel):
    # Strict: "0.5" is not a temperature. Unknown OpenAI options are accepted and ignored.
    model_config = ConfigDict(extra="allow", strict=True)

    model: Optional[str] = Field(None, min_length=1)  # None: the default model (is_default)
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    min_tokens_to_keep: Optional[int] = Field(None, ge=1)
    xtc_probability: Optional[float] = Field(None, ge=0, le=1)
    xtc_threshold: Optional[float] = Field(None, ge=0, le=0.5)
    stop: Optional[Union[str, List[str]]] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[Dict[str, Any]] = None
    n: int = Field(1, ge=1, le=1)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    logit_bias: Optional[Dict[str, float]] = None
    user: Optional[str] = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        return check_stops(v)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for k, b in (v or {}).items():
            if not (k.isascii() and k.isdigit()):
                raise ValueError(f"logit_bias keys are token ids (0 or more), got {k!r}")
            if not -100 <= b <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b}")
        return v

    def options(self) -> dict:
        """Engine generation options (``RequestOptions``'s names): only those the client set."""
        return {k: getattr(self, k) for k in SAME_NAMED if getattr(self, k) is not None}

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


def _prompts(prompt) -> list:
    """A completions prompt as a list of prompts (a batch is a list of texts or id lists)."""
    batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    return list(prompt) if batch else [prompt]


class CompletionRequest(_Request):
    # A text, token ids, or a batch of either (one choice each, in order; lm-eval sends these)
    prompt: Union[str, List[int], List[str], List[List[int]]]
    max_tokens: Optional[int] = Field(None, ge=0)  # 0: the prompt scored alone (with echo)
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=5)  # OpenAI's legacy completions: at most 5
    suffix: Optional[str] = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if any(len(one) == 0 for one in _prompts(v)):  # "", [] and a batch's empty one
            raise ValueError("the prompt is empty")
        return v

    @model_validator(mode="after")
    def _scoring(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 generates nothing: it takes echo (the prompt scored alone)")
        if self.stream and len(self.prompts) > 1:
            raise ValueError("a stream takes one prompt")
        return self

    @property
    def prompts(self) -> list:
        """The request's prompts: each a text or a list of token ids."""
        return _prompts(self.prompt)

    def options(self) -> dict:
        out = super().options()
        if self.logprobs is not None:  # the engine's option: how many alternatives go with each token
            out["logprobs"] = self.logprobs
            if self.echo:  # and with each prompt token
                out["prompt_logprobs"] = self.logprobs
        return out

    @field_validator("suffix")
    @classmethod
    def _unsupported(cls, v, info):
        if v:
            raise ValueError(f"{info.field_name} is not supported by this server")
        return v


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[Dict[str, Any]]]] = None  # None: an assistant's (tool calls)

    @model_validator(mode="after")
    def _shape(self):
        """What a chat template reads from a message is of the kind it expects (OpenAI's)."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (text or text parts)")
        for part in self.content if isinstance(self.content, list) else ():
            if part.get("type") != "text":
                raise ValueError("only text content parts are supported")
            if not isinstance(part.get("text", ""), str):
                raise ValueError("a text part's text is a string")
        extra = self.model_extra or {}
        if self.role == "tool" and not isinstance(extra.get("tool_call_id"), str):
            raise ValueError("a tool message needs its tool_call_id (a string)")
        calls = extra.get("tool_calls")
        if calls is not None and (not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls)):
            raise ValueError("tool_calls is a list of tool calls (objects)")
        return self

    def as_template_input(self) -> dict:
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):  # [{"type": "text", "text": ...}] parts -> text
            out["content"] = "".join(p.get("text", "") for p in self.content)
        out.setdefault("content", "")
        return out


def check_tools(tools):
    """OpenAI function specs: ``{"type": "function", "function": {"name": ..., ...}}``."""
    for tool in tools or ():
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ValueError('a tool is {"type": "function", "function": {...}}')
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError("a tool's function needs its name (a string)")
        if not isinstance(function.get("parameters", {}), dict):
            raise ValueError("a tool's function parameters are a JSON schema (an object)")
    return tools


class ChatRequest(_Request):
    messages: List[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    chat_template_kwargs: Optional[Dict[str, Any]] = None  # template variables, as mlx_lm.server and vLLM take them
    # OpenAI's: "none" turns the template's thinking off (enable_thinking), any other level on
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None

    def template_kwargs(self) -> Optional[dict]:
        """The template variables: ``chat_template_kwargs``, with ``reasoning_effort`` as
        enable_thinking where those do not set it."""
        out = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            out.setdefault("enable_thinking", self.reasoning_effort != "none")
        return out or self.chat_template_kwargs

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        return check_tools(v)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def options(self) -> dict:
        out = super().options()
        if self.logprobs:  # the engine's option: how many alternatives go with each token
            out["logprobs"] = self.top_logprobs or 0
        if self.max_completion_tokens is not None and self.max_tokens is None:
            out["max_tokens"] = self.max_completion_tokens
        return out

    def template_messages(self) -> List[dict]:
        return [m.as_template_input() for m in self.messages]


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a text (``add_special_tokens`` as the tokenizer's own) or chat
    messages (rendered with the chat template, the generation prompt added). Messages sent
    as the ``prompt`` count as messages: lm-eval's chat-template requests send them so."""
    model_config = ConfigDict(extra="allow", strict=True)
    model: Optional[str] = Field(None, min_length=1)
    prompt: Optional[Union[str, List[Message]]] = None
    messages: Optional[List[Message]] = None
    add_special_tokens: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send a prompt or messages (one of them)")
        if isinstance(self.prompt, list):
            self.prompt, self.messages = None, self.prompt
        return self

    def template_messages(self) -> List[dict]:
        return [m.as_template_input() for m in self.messages]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: Optional[str] = Field(None, min_length=1)
    tokens: List[int]


def validation_error(e) -> APIError:
    """The first pydantic error as an OpenAI 400, naming the parameter."""
    err = e.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if not str(x).startswith(("function-", "tagged-"))]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    return APIError(400, f"invalid value for {param}: {msg}" if param else msg, param=loc[0] if loc else None)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(c) -> dict:
    """OpenAI's usage of a response (a Completion or the last Chunk), with the prompt tokens
    that came from the prefix cache."""
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": c.cached_tokens}}


def dflash_stats(c) -> dict:
    """How a response was decoded (DFlash on/off, drafter, block size) and its draft statistics."""
    out = {**c.engine, "tau": c.tau, "cycles": c.cycles, "block_sizes": c.block_sizes,
           "fallback": c.fallback, "shadows": c.shadows}
    if c.trees is not None:
        out["trees"] = c.trees
    if c.segments is not None:
        out["segments"] = c.segments
    return out


def chat_logprobs(entries: Optional[List[dict]]) -> Optional[dict]:
    """OpenAI chat's logprobs of some tokens (None: not asked for)."""
    return None if entries is None else {"content": entries}


def completion_logprobs(entries: Optional[List[dict]], offset: int = 0) -> Optional[dict]:
    """OpenAI's legacy completions logprobs of some tokens, the first at text offset ``offset``
    (an echoed prompt's first token has none: its logprob and top_logprobs are null)."""
    if entries is None:
        return None
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    top = [None if e["top_logprobs"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
           for e in entries]
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": top, "text_offset": offsets}


def chat_response(rid, model, completion, logprobs: bool = False) -> dict:
    message = {"role": "assistant", "content": completion.text}
    if completion.reasoning:  # vLLM's and DeepSeek's field, and mlx-lm's
        message["reasoning_content"] = message["reasoning"] = completion.reasoning
    if completion.tool_calls:
        message["tool_calls"] = completion.tool_calls
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": completion.finish_reason,
                     "logprobs": chat_logprobs(completion.logprobs if logprobs else None)}],
        "usage": usage(completion),
        "dflash": dflash_stats(completion),
    }


def chat_chunk(rid, model, created, delta: dict, finish_reason=None, logprobs=None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                         "logprobs": chat_logprobs(logprobs)}]}


def completion_response(rid, model, completions: list, logprobs: bool = False,
                        echoed: Optional[List[str]] = None) -> dict:
    """One choice per prompt; ``echoed``: the prompts' texts, put before their completions
    (their tokens' entries before the completions' too); usage and dflash of them all."""
    choices = []
    for i, c in enumerate(completions):
        text, entries = c.text, c.logprobs
        if echoed is not None:
            text, entries = echoed[i] + text, (c.prompt_logprobs or []) + entries
        choices.append({"index": i, "text": text, "finish_reason": c.finish_reason,
                        "logprobs": completion_logprobs(entries if logprobs else None)})
    out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
           "choices": choices, "usage": usage(completions[0]), "dflash": dflash_stats(completions[0])}
    if len(completions) > 1:  # OpenAI's usage is the request's; dflash stays per choice
        for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
            out["usage"][k] = sum(usage(c)[k] for c in completions)
        out["usage"]["prompt_tokens_details"]["cached_tokens"] = sum(c.cached_tokens for c in completions)
        out["dflash"] = [dflash_stats(c) for c in completions]
    return out


def completion_chunk(rid, model, created, text: str, finish_reason=None, logprobs=None, offset=0) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason,
                         "logprobs": completion_logprobs(logprobs, offset)}]}


def usage_chunk(rid, model, created, obj: str, last) -> dict:
    """The closing usage chunk of a stream, from its last Chunk."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(last), "dflash": dflash_stats(last)}
