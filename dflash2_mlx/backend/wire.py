"""What the engine hands its callers: ``Chunk`` (a piece of a streamed response) and
``Completion`` (a whole one), which share their fields (``Output``) and are built with
keywords, and the errors a request can meet (``EngineError``, ``QueueFull``,
``InvalidOption``, ``PromptTooLong``)."""

from dataclasses import dataclass, field
from typing import AsyncIterator, Dict, List, Optional


class EngineError(RuntimeError):
    """The engine cannot take the request (not started, stopping)."""


class QueueFull(EngineError):
    """Too many requests are waiting for this model."""


class InvalidOption(ValueError):
    """A request option this model cannot honour; ``param`` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class PromptTooLong(ValueError):
    """The prompt has more tokens than the model's context window."""

    def __init__(self, tokens: int, limit: int):
        super().__init__(f"the prompt has {tokens} tokens; this model accepts at most {limit}")
        self.tokens, self.limit = tokens, limit


@dataclass(kw_only=True)
class Output:
    """What a chunk and a whole response both carry: text, finish reason, token counts,
    tool calls, how the request was decoded and its draft statistics, log-probabilities."""
    text: str = ""
    reasoning: str = ""  # a thinking model's reasoning (the text of its think block), apart
    # 'stop' (end of sequence or a stop string), 'length', 'tool_calls' or 'abort'
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tool_calls: List[dict] = field(default_factory=list)
    tau: float = 0.0
    cycles: int = 0
    generation_tps: float = 0.0
    block_sizes: Dict[int, int] = field(default_factory=dict)  # cycles per block size
    fallback: bool = False  # adaptive speculation is decoding plain for now
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    engine: dict = field(default_factory=dict)  # how this request is decoded (ModelSettings.engine)
    shadows: int = 0  # plain steps that carried a shadow probe (adaptive speculation)
    trees: Optional[dict] = None  # verify mode tree: trees, nodes verified, depth accepted
    # A reply with reasoning and an answer: the draft statistics of each ({thinking, answer}:
    # tokens, cycles, tau), on the last chunk.
    segments: Optional[dict] = None
    # With the request option logprobs: one entry per token, OpenAI's
    # {token, logprob, bytes, top_logprobs} (the target's log-probabilities, as mlx-lm's).
    logprobs: List[dict] = field(default_factory=list)
    # With the request option prompt_logprobs: one entry per prompt token, the first with
    # logprob and top_logprobs None (nothing comes before it).
    prompt_logprobs: Optional[List[dict]] = None
    stop_sequence: Optional[str] = None  # the request's stop string that ended it, if one did


@dataclass(kw_only=True)
class Chunk(Output):
    """A piece of a streamed response. The last one has ``finish_reason`` set; only the
    first carries ``prompt_logprobs``."""


@dataclass(kw_only=True)
class Completion(Output):
    """A whole response, as ``generate`` and ``chat`` return it."""
    request_id: str = ""


async def collect(chunks: AsyncIterator[Chunk]) -> Completion:
    """A stream's chunks as one Completion: text, tool calls and logprobs joined, the rest
    from the last chunk."""
    text, reasoning, calls, logprobs, last, prompt = "", "", [], [], None, None
    async for last in chunks:
        text += last.text
        reasoning += last.reasoning
        calls += last.tool_calls
        logprobs += last.logprobs
        prompt = prompt or last.prompt_logprobs
    return Completion(text=text, reasoning=reasoning, segments=last.segments, finish_reason=last.finish_reason, prompt_tokens=last.prompt_tokens,
                      completion_tokens=last.completion_tokens, tool_calls=calls, tau=last.tau,
                      cycles=last.cycles, generation_tps=last.generation_tps, block_sizes=last.block_sizes,
                      fallback=last.fallback, cached_tokens=last.cached_tokens, engine=last.engine,
                      shadows=last.shadows, trees=last.trees, logprobs=logprobs, prompt_logprobs=prompt,
                      stop_sequence=last.stop_sequence)
