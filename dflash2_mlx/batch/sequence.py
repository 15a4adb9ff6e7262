"""One sequence of a batch: its state between cycles (``BatchSequence``), its first token,
what it keeps of each verified block, and the tokens it emits (``Response``)."""

from dataclasses import dataclass
from typing import Callable, List, Optional

import mlx.core as mx

from .. import adaptive
from ..loop.cycle import CycleStats
from ..loop.draft_context import DraftContext
from ..loop.lookup import Lookup
from ..loop.random_keys import RandomStream
from ..request.sampling import SamplingParams, processed_logprobs, sample


@dataclass
class Response:
    """One emitted token of one sequence; the last one has ``finish_reason`` set
    ("stop": a stop token, emitted here too; "length": max_tokens; "error": its own
    sampling or logits processors raised ``error``, and ``token`` is no token)."""
    uid: int
    token: int
    logprobs: mx.array
    from_draft: bool
    finish_reason: Optional[str]
    stats: CycleStats
    cache: Optional[list] = None  # with return_caches: the finished sequence's target cache
    context: Optional[DraftContext] = None  # ... and its draft context
    error: Optional[Exception] = None  # finish_reason "error": what raised


@dataclass
class BatchSequence:
    uid: int
    prompt: mx.array
    params: SamplingParams
    processors: Optional[List[Callable]]
    max_tokens: float
    stop_tokens: frozenset
    stream: RandomStream  # its own PRNG key (sampled sequences only)
    prompt_cache: Optional[list]  # a reused prefix's target cache, until it joins
    context: Optional[DraftContext]
    cached_tokens: int
    history: Optional[mx.array] = None  # committed tokens: the logits processors' input
    anchor: int = 0
    emitted: int = 0
    stats: Optional[CycleStats] = None
    finish: Optional[str] = None
    last: Optional[Response] = None  # its latest response
    copier: Optional[Lookup] = None  # every token it has read (copies on)
    copies: Optional[adaptive.Acceptance] = None  # ... and how far its copies were accepted

    def start(self, drafter, draft_window: Optional[int], draft_sink: int, largest: int):
        """Ready to join: its draft context (a reused prefix's, or a new one), stats, history."""
        self.context = self.context or DraftContext(drafter, draft_window, draft_sink)
        self.stats = CycleStats(largest)
        self.history = self.prompt

    def first_token(self, logits: mx.array, copies_largest: Optional[int]) -> List[Response]:
        """The token after its prompt, sampled from the prompt's last ``logits`` with its own
        stream; with ``copies_largest`` (copies on) it starts reading its tokens for copies."""
        logprobs = processed_logprobs(logits, self.prompt[:-1], self.prompt[-1:], self.processors)
        with self.stream:
            self.anchor = int(sample(logprobs, self.params)[0].item())
        if copies_largest is not None:
            self.copier = Lookup(self.prompt.tolist() + [self.anchor])
            self.copies = adaptive.Acceptance.copies(copies_largest)
        return self.emit([self.anchor], logprobs, 0)

    def commit(self, ids: List[int], block: mx.array, features: mx.array, accepted: int,
               token: int, logprobs: mx.array) -> List[Response]:
        """Keep its verified ``block`` (``ids`` on the host) up to the ``accepted`` drafts,
        their target ``features`` in its draft context; ``token`` is the next anchor.
        The responses of the drafts and the token."""
        kept = accepted + 1
        self.context.add(features[:, :kept])
        self.history = mx.concatenate([self.history, block[:kept].astype(self.history.dtype)])
        new = ids[1:kept] + [token]
        if self.copier is not None:
            self.copier.extend(new)
        self.anchor = token
        return self.emit(new, logprobs, accepted)

    def emit(self, tokens: List[int], logprobs: mx.array, drafted: int) -> List[Response]:
        """A response per token (the first ``drafted`` from the draft), up to its end."""
        out = []
        for j, token in enumerate(tokens):
            self.emitted += 1
            if token in self.stop_tokens:
                self.finish = "stop"
            elif self.emitted >= self.max_tokens:
                self.finish = "length"
            self.last = Response(self.uid, token, logprobs[j], j < drafted, self.finish, self.stats)
            out.append(self.last)
            if self.finish:
                break
        return out

    def fail(self, error: Exception) -> List[Response]:
        """Its own draws or processors raised: it ends alone (the rest of the batch goes on)."""
        self.finish = "error"
        self.last = Response(self.uid, -1, None, False, "error", self.stats, error=error)
        return [self.last]
