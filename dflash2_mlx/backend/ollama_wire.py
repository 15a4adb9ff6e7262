"""Ollama's wire format: the request bodies of /api/chat, /api/generate and /api/show
(validated strictly, as ``protocol``'s OpenAI bodies are), their conversion to what the
engine takes (chat-template messages, tools in OpenAI's function format, engine options),
and the reply's bodies (NDJSON lines, the closing counters, errors)."""

import json
from datetime import datetime, timezone
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .options import MAX_TOP_LOGPROBS
from .protocol import APIError, check_stops, check_tools, dflash_stats

# num_predict's "no limit" values (-1: infinite, -2: fill the context): both run until the
# end of sequence or the context window.
UNLIMITED = (-1, -2)
UNLOAD = (0, "0", "0s", "0m", "0h")  # keep_alive values that unload (with no messages)


def error_body(e: APIError) -> dict:
    """Ollama's error body: ``{"error": "message"}``."""
    return {"error": e.message}


def unsupported(what: str, why: str) -> str:
    return f"this server does not support {what} ({why})"


class _Strict(BaseModel):
    # Strict: "0.5" is not a temperature. Fields Ollama has and this server does not read are
    # accepted and ignored, as Ollama ignores keys it does not know.
    model_config = ConfigDict(extra="allow", strict=True)


class Options(_Strict):
    """Ollama's runtime options. Those the engine has are mapped to it; the others Ollama
    knows are checked for their kind and ignored (they tune llama.cpp: threads, GPU layers,
    mirostat...); unknown keys are ignored, as Ollama does."""
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[int] = None  # negative (Ollama's -1): a random seed
    num_predict: Optional[int] = Field(None, ge=-2)
    stop: Optional[Union[str, List[str]]] = None
    repeat_penalty: Optional[float] = Field(None, gt=0)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    # Known to Ollama, no counterpart in this engine.
    num_ctx: Optional[int] = None
    num_keep: Optional[int] = None
    repeat_last_n: Optional[int] = None
    typical_p: Optional[float] = None
    tfs_z: Optional[float] = None
    mirostat: Optional[int] = None
    mirostat_tau: Optional[float] = None
    mirostat_eta: Optional[float] = None
    penalize_newline: Optional[bool] = None
    num_batch: Optional[int] = None
    num_gpu: Optional[int] = None
    main_gpu: Optional[int] = None
    num_thread: Optional[int] = None
    numa: Optional[bool] = None
    low_vram: Optional[bool] = None
    f16_kv: Optional[bool] = None
    logits_all: Optional[bool] = None
    vocab_only: Optional[bool] = None
    use_mmap: Optional[bool] = None
    use_mlock: Optional[bool] = None
    embedding_only: Optional[bool] = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        return check_stops(v)

    def engine_options(self) -> dict:
        """The engine's options (``RequestOptions``'s names) of those set; num_predict
        -1/-2 leaves max_tokens to the route (the room left in the context window)."""
        same = ("temperature", "top_p", "top_k", "min_p", "stop", "presence_penalty", "frequency_penalty")
        out = {k: getattr(self, k) for k in same if getattr(self, k) is not None}
        if self.seed is not None and self.seed >= 0:
            out["seed"] = self.seed
        if self.repeat_penalty is not None:
            out["repetition_penalty"] = self.repeat_penalty
        if self.num_predict is not None and self.num_predict not in UNLIMITED:
            out["max_tokens"] = self.num_predict
        return out


class _Generation(_Strict):
    """What /api/chat and /api/generate share."""
    model: Optional[str] = Field(None, min_length=1)  # None: the default model (is_default)
    format: Optional[Union[str, Dict[str, Any]]] = None
    options: Optional[Options] = None
    stream: bool = True  # Ollama streams unless told not to
    keep_alive: Optional[Union[int, float, str]] = None  # accepted: the settings' ttl_seconds rule
    think: Optional[Union[bool, str]] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("format")
    @classmethod
    def _format(cls, v):
        if v not in (None, ""):
            raise ValueError(unsupported("format (JSON mode, structured outputs)",
                                         "it cannot constrain a reply to JSON; ask for JSON in the prompt"))
        return v

    @field_validator("think")
    @classmethod
    def _think(cls, v):
        if v not in (None, True, False, "high", "medium", "low"):
            raise ValueError('think is true, false, "high", "medium" or "low"')
        return v

    @property
    def unlimited(self) -> bool:
        return bool(self.options and self.options.num_predict in UNLIMITED)

    @property
    def unloads(self) -> bool:
        return self.keep_alive in UNLOAD and not isinstance(self.keep_alive, bool)

    def engine_options(self) -> dict:
        out = self.options.engine_options() if self.options else {}
        if self.logprobs:  # the engine's option: how many alternatives go with each token
            out["logprobs"] = self.top_logprobs or 0
        return out

    def template_kwargs(self) -> Optional[dict]:
        """think -> the template's enable_thinking (Qwen3's and the like; a level is on);
        left out: the template's default.  The reasoning comes back apart (``thinking``)."""
        return None if self.think is None else {"enable_thinking": self.think is not False}


def no_images(v):
    if v:
        raise ValueError(unsupported("images", "it serves text models only, no vision"))
    return v


class CallFunction(_Strict):
    name: str = Field(min_length=1)
    arguments: Dict[str, Any]  # an object, as Ollama sends it


class ToolCall(_Strict):
    function: CallFunction


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: Optional[str] = None
    images: Optional[List[Any]] = None
    tool_calls: Optional[List[ToolCall]] = None
    tool_name: Optional[str] = None  # a tool message's: the tool whose result it is
    thinking: Optional[str] = None  # an earlier reply's thinking: left out of the prompt

    @field_validator("images")
    @classmethod
    def _images(cls, v):
        return no_images(v)

    @model_validator(mode="after")
    def _calls_are_assistants(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls belong in an assistant message")
        # As every other API here: only an assistant's (tool calls) may come without content.
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (text)")
        return self


class ChatRequest(_Generation):
    messages: List[Message] = Field(default_factory=list)  # none: load (or unload) the model
    tools: Optional[List[Dict[str, Any]]] = None

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        return check_tools(v) or None  # the python client sends [] for no tools

    def template_messages(self) -> List[dict]:
        return template_messages(self.messages)


class GenerateRequest(_Generation):
    prompt: Optional[str] = None  # none (and no context): load (or unload) the model
    system: Optional[str] = None
    template: Optional[str] = None
    suffix: Optional[str] = None
    context: Optional[List[int]] = None  # a previous reply's context: the conversation so far
    raw: bool = False  # the prompt as it is, no chat template
    images: Optional[List[Any]] = None

    @field_validator("images")
    @classmethod
    def _images(cls, v):
        return no_images(v)

    @field_validator("template")
    @classmethod
    def _template(cls, v):
        if v:
            raise ValueError(unsupported("template", "replies use the model's own chat template; send "
                                         "raw: true with a prompt templated your way"))
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v:
            raise ValueError(unsupported("suffix (fill in the middle)", "prompts are continued, not filled"))
        return v

    @model_validator(mode="after")
    def _raw(self):
        if self.raw and self.system:
            raise ValueError("a raw prompt takes no system message: put it in the prompt")
        if self.raw and self.context:
            raise ValueError("a raw prompt takes no context: put the conversation in the prompt")
        return self

    def template_messages(self) -> List[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [{"role": "user", "content": self.prompt or ""}]


class ShowRequest(_Strict):
    model: Optional[str] = Field(None, min_length=1)
    name: Optional[str] = Field(None, min_length=1)  # older clients' name for it
    verbose: bool = False

    @model_validator(mode="after")
    def _named(self):
        self.model = self.model or self.name
        if self.model is None:
            raise ValueError("model is required")
        return self


def template_messages(messages: List[Message]) -> List[dict]:
    """Ollama messages as chat-template input in OpenAI's shape (the OpenAI route's): tool
    calls get ids and JSON-text arguments, and each tool message the id of the call it
    answers (the first unanswered call of its tool_name, else the first unanswered one)."""
    out, pending, n = [], [], 0
    for m in messages:
        msg = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            msg["tool_calls"] = []
            for c in m.tool_calls:
                call_id, n = f"call_{n}", n + 1
                msg["tool_calls"].append({"id": call_id, "type": "function", "function": {
                    "name": c.function.name, "arguments": json.dumps(c.function.arguments, ensure_ascii=False)}})
                pending.append((call_id, c.function.name))
        if m.role == "tool":
            match = [p for p in pending if p[1] == m.tool_name] or pending or [(f"call_{n}", None)]
            if match[0] in pending:
                pending.remove(match[0])
            msg["tool_call_id"] = match[0][0]
            if m.tool_name:
                msg["name"] = m.tool_name
        out.append(msg)
    return out


def tool_calls(calls: List[dict]) -> List[dict]:
    """The engine's (OpenAI-shaped) tool calls as Ollama's: arguments an object (arguments
    the parser gave that are not a JSON object go in whole under "arguments")."""
    out = []
    for c in calls:
        function = c["function"]
        try:
            args = json.loads(function["arguments"])
        except (TypeError, json.JSONDecodeError):
            args = function["arguments"]
        out.append({"function": {"name": function["name"],
                                 "arguments": args if isinstance(args, dict) else {"arguments": args}}})
    return out


def timestamp(seconds: Optional[float] = None) -> str:
    """RFC 3339 in UTC, as Ollama's created_at and modified_at."""
    moment = datetime.now(timezone.utc) if seconds is None else datetime.fromtimestamp(seconds, timezone.utc)
    return moment.isoformat().replace("+00:00", "Z")


def done_reason(finish_reason: Optional[str]) -> str:
    return "length" if finish_reason == "length" else "stop"  # a reply with tool calls stops


def closing(last, durations: dict) -> dict:
    """The fields of a reply's last line: done, the reason, the counts and durations (ns),
    and the draft statistics (with the prompt tokens the prefix cache gave) under dflash."""
    return {"done": True, "done_reason": done_reason(last.finish_reason), **durations,
            "prompt_eval_count": last.prompt_tokens, "eval_count": last.completion_tokens,
            "dflash": {**dflash_stats(last), "cached_tokens": last.cached_tokens}}


def chat_line(model: str, content: str, calls=(), logprobs=None, thinking: str = "") -> dict:
    message = {"role": "assistant", "content": content}
    if thinking:
        message["thinking"] = thinking
    if calls:
        message["tool_calls"] = tool_calls(calls)
    out = {"model": model, "created_at": timestamp(), "message": message, "done": False}
    if logprobs:
        out["logprobs"] = logprobs
    return out


def generate_line(model: str, text: str, logprobs=None, thinking: str = "") -> dict:
    out = {"model": model, "created_at": timestamp(), "response": text, "done": False}
    if thinking:
        out["thinking"] = thinking
    if logprobs:
        out["logprobs"] = logprobs
    return out


def loaded_line(model: str, chat: bool, reason: str) -> dict:
    """The reply to a request with nothing to generate: the model loaded (or unloaded)."""
    body = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return {"model": model, "created_at": timestamp(), **body, "done": True, "done_reason": reason}
