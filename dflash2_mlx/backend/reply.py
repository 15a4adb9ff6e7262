"""A request's text on its way out, the same for a single stream and the batch: stop
strings (``stops.py``), a thinking model's reasoning (``thinking.py``), tool calls
(``tool_calls.py``), token log-probabilities as OpenAI's entries, and the finish reason the
client sees."""

from typing import List, Optional, Sequence

from ..kernels.selector import top_candidates
from .options import RequestOptions
from .stops import StopMatcher
from .thinking import ThinkSplitter, segments
from .tool_calls import ToolCallSplitter


class Reply:
    """One request's reply: each token's text and log-probabilities in, chunk contents out."""

    def __init__(self, tokenizer, options: RequestOptions, tools, chat: bool, prompt=None):
        """``prompt``: a chat request's token ids (whether its template opened a think block)."""
        stop = options.stop or []
        self.matcher = StopMatcher([stop] if isinstance(stop, str) else list(stop))
        self.tools = ToolCallSplitter(tokenizer, tools)
        self.made_calls = False
        self.tokenizer, self.top = tokenizer, options.logprobs
        self.pending: List[dict] = []  # logprob entries of tokens not yet in a chunk
        # A chat reply leaves out its stop token and so its entry (as OpenAI's chat does); a
        # completion keeps it (as the legacy API and vLLM do): one entry per generated token,
        # which lm-eval's loglikelihood counts on.
        self.stop_entry = not chat
        self.think = ThinkSplitter.for_reply(tokenizer, prompt) if chat else None
        self.tokens = 0
        self.thought = None  # (tokens, cycles) when the reasoning ended, if it did

    def token(self, token: int, logprobs, finish_reason: Optional[str]):
        """Note a token's log-probabilities when the request asked for them."""
        if self.top is None or (finish_reason == "stop" and not self.stop_entry):
            return
        top = []
        if self.top:
            idx, vals = top_candidates(logprobs, self.top)
            top = list(zip(idx.tolist(), vals.tolist()))
        self.pending.append(logprob_entry(self.tokenizer, token, logprobs[token].item(), top))

    def take(self) -> List[dict]:
        out, self.pending = self.pending, []
        return out

    def add(self, segment: str, finish_reason: Optional[str], cycles: int = 0):
        """A token's text and the generator's finish reason (``cycles``: the draft cycles so
        far) -> (content, calls, finish, reasoning)."""
        self.tokens += 1
        if finish_reason == "length":  # a character cut by max_tokens is left out
            segment = segment.rstrip("\ufffd")
        text, hit = self.matcher.add(segment)
        finish = None
        if hit:
            finish = "stop"
        elif finish_reason:
            finish = finish_reason
            text += self.matcher.flush()
        reasoning = ""
        if self.think is not None:
            closed = self.think.closes
            reasoning, text = self.think.add(text)
            if finish:
                more, tail = self.think.flush()
                reasoning, text = reasoning + more, text + tail
            if self.think.closes > closed and self.thought is None:
                self.thought = (self.tokens, cycles)
        content, raw_calls = self.tools.add(text)
        if finish:
            tail, more = self.tools.flush()
            content, raw_calls = content + tail, raw_calls + more
        calls = self.tools.format(raw_calls)
        self.made_calls |= bool(calls)
        if finish == "stop" and self.made_calls:
            finish = "tool_calls"
        return content, calls, finish, reasoning

    def segments(self, cycles: int) -> Optional[dict]:
        """The draft statistics split into thinking and answer, where the reply has both."""
        return segments(self.thought, self.tokens, cycles)


def logprob_entry(tokenizer, token: int, logprob: Optional[float], top) -> dict:
    """OpenAI's {token, logprob, bytes, top_logprobs} of a token; ``top``: (id, logprob)
    pairs, most likely first (None: a prompt's first token, which nothing predicts)."""
    def entry(t, lp):
        text = tokenizer.decode([t])
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return dict(entry(token, logprob), top_logprobs=None if top is None else [entry(i, lp) for i, lp in top])


def prompt_entries(tokenizer, ids: Sequence[int], logprobs, tops) -> List[dict]:
    """A prompt's entries: the first token's without a logprob, then one per later token."""
    return [logprob_entry(tokenizer, ids[0], None, None)] + [
        logprob_entry(tokenizer, t, lp, best) for t, lp, best in zip(ids[1:], logprobs, tops)]
