"""Tool calls in generated chat text, found with the tokenizer's own markers and parser
(mlx-lm's ``TokenizerWrapper.tool_call_start`` / ``tool_call_end`` / ``tool_parser``)."""

import json
import uuid
from typing import List, Tuple

from .stops import StopMatcher


class ToolCallSplitter:
    """Separates streamed text into content and raw tool-call texts."""

    def __init__(self, tokenizer, tools):
        self.start = getattr(tokenizer, "tool_call_start", None)
        self.end = getattr(tokenizer, "tool_call_end", None)
        self.parser = getattr(tokenizer, "tool_parser", None)
        self.tools = tools
        self.enabled = bool(tools and getattr(tokenizer, "has_tool_calling", False)
                            and self.start and self.parser)
        self._outside = StopMatcher([self.start] if self.enabled else [])
        self._inside = None  # text of the tool call being generated

    def add(self, piece: str) -> Tuple[str, List[str]]:
        """(content to emit, completed raw tool calls)."""
        if not self.enabled:
            return piece, []
        content, calls = "", []
        while piece:
            if self._inside is None:
                out, hit = self._outside.add(piece)
                content += out
                if not hit:
                    return content, calls
                rest = self._outside.text_after_stop
                self._outside = StopMatcher([self.start])
                self._inside, piece = "", rest
            else:
                self._inside += piece
                piece = ""
                if self.end and self.end in self._inside:
                    call, piece = self._inside.split(self.end, 1)
                    calls.append(call)
                    self._inside = None
        return content, calls

    def flush(self) -> Tuple[str, List[str]]:
        if not self.enabled:
            return "", []
        if self._inside is not None:
            call, self._inside = self._inside, None
            return "", [call] if call.strip() else []
        return self._outside.flush(), []

    def format(self, raw_calls: List[str]) -> List[dict]:
        """OpenAI ``tool_calls`` entries; calls the parser cannot read are dropped."""
        out = []
        for raw in raw_calls:
            try:
                parsed = self.parser(raw, self.tools)
            except (ValueError, json.JSONDecodeError):
                continue
            for call in parsed if isinstance(parsed, list) else [parsed]:
                args = call.get("arguments", {})
                out.append({
                    "id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": call.get("name", ""),
                                 "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)},
                })
        return out


def template_messages(messages: List[dict]) -> List[dict]:
    """Messages as chat templates read them: an assistant's tool-call ``arguments`` sent as
    JSON text (OpenAI's wire form) become the object they encode, as mlx_lm.server and
    transformers' templates expect (a template that writes ``arguments | tojson`` would
    otherwise quote the text again).  Text that is not JSON stays text."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if not calls:
            out.append(m)
            continue
        fixed = []
        for c in calls:
            function = c.get("function") if isinstance(c, dict) else None
            args = function.get("arguments") if isinstance(function, dict) else None
            if isinstance(args, str):
                try:
                    c = {**c, "function": {**function, "arguments": json.loads(args)}}
                except json.JSONDecodeError:
                    pass
            fixed.append(c)
        out.append({**m, "tool_calls": fixed})
    return out
