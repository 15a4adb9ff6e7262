"""A thinking model's reasoning, split from its answer as each API shows it.

A chat template that opens a think block at the end of the prompt (Qwen3's ``<think>``, when
``enable_thinking`` is on) leaves the reply inside it: the text up to the close tag is
reasoning, the rest the answer; a reply may also open a block itself.  The tags are the
tokenizer's (mlx-lm's ``think_start`` / ``think_end``), and whether the prompt left one open
is decided on its token ids as mlx-lm's server decides it (the last start after the last end).
Text that may be the start of a tag is held back until the next piece tells."""

from typing import Optional, Sequence, Tuple


def opens_thinking(tokenizer, ids: Sequence[int]) -> bool:
    """Whether a chat prompt's ``ids`` end inside a think block its template opened."""
    if not getattr(tokenizer, "has_thinking", False) or not ids:
        return False
    return tokenizer.rfind_think_start(list(ids)) > tokenizer.rfind_think_end(list(ids))


class ThinkSplitter:
    """Text in, (reasoning, answer) out, across pieces that may cut a tag anywhere."""

    def __init__(self, start: str, end: str, thinking: bool):
        self.start, self.end = start, end
        self.thinking = thinking
        self.closes = 0  # think blocks closed so far
        self._held = ""
        # The answer's leading whitespace (after a close tag, before any answer) is left out.
        self._answer_began = not thinking
        self._answered = False

    @classmethod
    def for_reply(cls, tokenizer, prompt: Optional[Sequence[int]]) -> Optional["ThinkSplitter"]:
        """A splitter for a chat reply to ``prompt`` (None: the tokenizer has no think tags)."""
        if not getattr(tokenizer, "has_thinking", False) or prompt is None:
            return None
        return cls(tokenizer.think_start, tokenizer.think_end, opens_thinking(tokenizer, prompt))

    def add(self, text: str) -> Tuple[str, str]:
        reasoning, answer = "", ""
        buf, self._held = self._held + text, ""
        while buf:
            tag = self.end if self.thinking else self.start
            i = buf.find(tag)
            if i < 0:
                keep = _partial(buf, tag)
                out, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
                buf = ""
            else:
                out, buf = buf[:i], buf[i + len(tag) :]
            if self.thinking:
                reasoning += out
            else:
                answer += self._answer(out)
            if i >= 0:
                self.closes += self.thinking
                self.thinking = not self.thinking
                self._answer_began = self._answered
        return reasoning, answer

    def flush(self) -> Tuple[str, str]:
        held, self._held = self._held, ""
        return (held, "") if self.thinking else ("", self._answer(held))

    def _answer(self, text: str) -> str:
        if not self._answer_began:
            text = text.lstrip()
            self._answer_began = bool(text)
        self._answered |= bool(text)
        return text


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (to hold back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def segments(thought: Optional[tuple], tokens: int, cycles: int) -> Optional[dict]:
    """Draft statistics of a reply with both reasoning and an answer, split where the
    thinking ended (``thought``: tokens and cycles by then; the cycle that closed it counts
    as thinking)."""
    if thought is None or not cycles or thought[0] >= tokens:
        return None
    n, c = thought

    def part(n, c):
        return {"tokens": n, "cycles": c, "tau": n / c if c else 0.0}

    return {"thinking": part(n, c), "answer": part(tokens - n, cycles - c)}
