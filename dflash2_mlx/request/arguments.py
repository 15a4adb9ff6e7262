"""The rules for generation arguments: one rule and one message per argument, whichever
surface it came through (Python's ``generate`` / ``stream_generate`` and ``SamplingParams``,
the CLI, every API of the server).  An API's own caps, such as OpenAI's temperature <= 2 or
Anthropic's <= 1, stay in its adapter; what the rules refuse, no surface takes.

A broken rule raises ``ArgumentError``, a ValueError naming the argument (under the name the
surface uses: the server's ``temperature`` is Python's ``temp``)."""

import math
from typing import Any, Callable, Dict, Optional, Tuple

# mx.random.seed takes an unsigned 64-bit seed.
MAX_SEED = (1 << 64) - 1


class ArgumentError(ValueError):
    """A generation argument no surface takes; ``name`` is the argument."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


def real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def between(lo, hi) -> Callable[[Any], bool]:
    return lambda v: real(v) and lo <= v <= hi


# name -> (holds, what it is); the message: "<name> is <what it is>; got <value>".
RULES: Dict[str, Tuple[Callable[[Any], bool], str]] = {
    "temp": (lambda v: real(v) and v >= 0, "a finite number, 0 or more (0: greedy)"),
    "top_p": (between(0, 1), "in [0, 1] (0 and 1: off, as in mlx-lm)"),
    "min_p": (between(0, 1), "in [0, 1] (0: off)"),
    "top_k": (lambda v: whole(v) and v >= 0, "a whole number, 0 or more (0: off)"),
    "min_tokens_to_keep": (lambda v: whole(v) and v >= 1, "a whole number, 1 or more"),
    "xtc_probability": (between(0, 1), "in [0, 1] (0: off)"),
    "xtc_threshold": (between(0, 0.5), "in [0, 0.5]"),
    "seed": (lambda v: whole(v) and 0 <= v <= MAX_SEED, f"a whole number in 0..{MAX_SEED} (2**64 - 1)"),
    # The server also takes 0 (a prompt scored alone): its own range, in its options.
    "max_tokens": (lambda v: whole(v) and (v >= 1 or v == -1), "a whole number of tokens, 1 or more (-1: no limit)"),
    "exact": (lambda v: isinstance(v, bool), "true or false"),
    "lookup": (lambda v: isinstance(v, bool), "true or false"),
    "continues": (lambda v: isinstance(v, bool), "true or false"),
}


def check(name: str, value, label: Optional[str] = None):
    """``value`` if it keeps ``name``'s rule, else ArgumentError (named ``label``: the
    surface's name for it, where that differs)."""
    holds, what = RULES[name]
    if not holds(value):
        label = label or name
        raise ArgumentError(label, f"{label} is {what}; got {value!r}")
    return value


def check_all(labels: Optional[Dict[str, str]] = None, **values):
    """Every argument given (None: not set) against its rule."""
    for name, value in values.items():
        if value is not None:
            check(name, value, (labels or {}).get(name))


def check_messages(messages: list, label: str = "messages"):
    """Chat messages: each an object with a role (text) and its content (text, or a list of
    parts), as chat templates read them; ArgumentError names the first that is not."""
    for i, m in enumerate(messages):
        where = f"{label}[{i}]"
        if not isinstance(m, dict):
            raise ArgumentError(label, f"{where} is a message object with a role and content; got {m!r}")
        if not isinstance(m.get("role"), str):
            raise ArgumentError(label, f"{where} has no role (a text such as 'user')")
        content = m.get("content")
        if content is None and not m.get("tool_calls"):
            raise ArgumentError(label, f"{where} ({m['role']}) has no content")
        if content is not None and not isinstance(content, (str, list)):
            raise ArgumentError(label, f"{where}: content is text or a list of parts; got {type(content).__name__}")
