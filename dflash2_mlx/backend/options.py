"""A request's options, typed (in the spirit of mlx-lm server's ``SamplingArguments`` and
``GenerationArguments``): ``RequestOptions`` is what a request set, checked when its stream
is made (so the caller learns which option is wrong); ``Generation`` is what it runs with:
each option its own, else the model's setting, else the default."""

import math
from dataclasses import asdict, dataclass, fields
from typing import Dict, Optional, Sequence, Union

from mlx_lm.sample_utils import make_logits_processors

from ..request.arguments import ArgumentError, check_all, real
from ..request.modes import verify_kind
from ..request.plan import Plan
from ..request.sampling import SamplingParams, xtc_special_tokens
from .settings import ModelSettings, first_set
from .wire import InvalidOption

# The most alternatives a request may ask to see next to each token's log-probability.
MAX_TOP_LOGPROBS = 20
# The sampling options follow the rules every surface shares (``request/arguments.py``), under
# the APIs' names where they differ from Python's; the penalties, which only the server
# takes, are finite numbers.
API_NAMES = {"temp": "temperature"}
PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")
# A penalty at its neutral value builds no logits processor.
NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class RequestOptions:
    """The generation options a request may set (OpenAI's names); None: not set."""
    max_tokens: Optional[int] = None  # 0: nothing generated (a prompt scored alone)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    min_tokens_to_keep: Optional[int] = None
    xtc_probability: Optional[float] = None  # XTC spares "\n" and EOS, as mlx-lm's server does
    xtc_threshold: Optional[float] = None
    seed: Optional[int] = None
    stop: Union[str, Sequence[str], None] = None
    logprobs: Optional[int] = None  # alternatives to report with each token's log-probability
    prompt_logprobs: Optional[int] = None  # the same for each prompt token, in the first chunk
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[Dict] = None

    @classmethod
    def parse(cls, params: dict) -> "RequestOptions":
        """The options of keyword arguments; TypeError names any this engine does not know."""
        unknown = set(params) - set(OPTION_NAMES)
        if unknown:
            raise TypeError(f"unknown generation option(s): {', '.join(sorted(unknown))}")
        return cls(**params)

    def check_max_tokens(self):
        n = self.max_tokens
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
            raise InvalidOption("max_tokens", f"max_tokens is a number of tokens, 0 or more; got {n!r}")

    def check_max_tokens_fit(self, context_window: Optional[int], prompt_tokens: int = 0):
        """The prompt and the tokens asked for fit the context window together."""
        if context_window and (self.max_tokens or 0) > context_window:
            raise InvalidOption("max_tokens", f"max_tokens {self.max_tokens} is beyond this "
                                f"model's context window of {context_window} tokens")
        if context_window and prompt_tokens + (self.max_tokens or 0) > context_window:
            raise InvalidOption("max_tokens", f"the prompt's {prompt_tokens} tokens and max_tokens "
                                f"{self.max_tokens} are more than this model's context window of "
                                f"{context_window} tokens")

    def check_logprobs(self):
        for name in ("logprobs", "prompt_logprobs"):
            top = getattr(self, name)
            if top is not None and (not isinstance(top, int) or isinstance(top, bool)
                                    or not 0 <= top <= MAX_TOP_LOGPROBS):
                raise InvalidOption(name, f"{name} is the number of alternatives to report, "
                                    f"0..{MAX_TOP_LOGPROBS}; got {top!r}")

    def check_values(self, vocab_size: Optional[int]):
        """Every option of the right kind and within what the model can take (a sampler
        given a top_k past the vocabulary, or a bias on a token it does not have, fails
        inside MLX, after the request has started)."""
        try:
            check_all(labels=API_NAMES, temp=self.temperature, top_p=self.top_p, min_p=self.min_p,
                      top_k=self.top_k, min_tokens_to_keep=self.min_tokens_to_keep,
                      xtc_probability=self.xtc_probability, xtc_threshold=self.xtc_threshold, seed=self.seed)
        except ArgumentError as e:
            raise InvalidOption(e.name, str(e)) from None
        for name in PENALTIES:
            v = getattr(self, name)
            if v is not None and not real(v):
                raise InvalidOption(name, f"{name} is a finite number; got {v!r}")
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            raise InvalidOption("repetition_penalty", f"repetition_penalty is above 0; got {self.repetition_penalty}")
        check_logit_bias(self.logit_bias, vocab_size)

    @property
    def scoring(self) -> bool:
        """The request scores its prompt (prompt logprobs, or nothing generated)."""
        return self.prompt_logprobs is not None or self.max_tokens == 0


OPTION_NAMES = tuple(f.name for f in fields(RequestOptions))


def check_logit_bias(bias, vocab_size: Optional[int]):
    """A logit bias maps token ids of the vocabulary (0 .. vocab_size - 1) to finite numbers:
    an id past it would index outside the logits (inside MLX), a negative one from its end."""
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise InvalidOption("logit_bias", f"logit_bias maps token ids to numbers; got {type(bias).__name__}")
    top = vocab_size - 1 if vocab_size else None
    for k, v in bias.items():
        token = k if isinstance(k, int) and not isinstance(k, bool) else None
        if isinstance(k, str) and k.isascii() and k.isdigit():
            token = int(k)
        if token is None or token < 0 or (top is not None and token > top):
            allowed = f"0..{top}" if top is not None else "0 or more"
            raise InvalidOption("logit_bias", f"logit_bias keys are token ids of this model's vocabulary "
                                f"({allowed}); got {k!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise InvalidOption("logit_bias", f"logit_bias values are finite numbers; got {v!r} for {k!r}")


@dataclass(frozen=True)
class Generation:
    """What a request runs with: its sampling, logits processors' options and token limit."""
    sampling: SamplingParams
    penalties: Dict  # make_logits_processors options (neutral penalties left out)
    max_tokens: int
    seed: Optional[int] = None

    @property
    def seeded_sampled(self) -> bool:
        """A seeded sampled request: it promises its single-stream text."""
        return self.sampling.temp > 0 and self.seed is not None

    def logits_processors(self):
        return make_logits_processors(**self.penalties) if self.penalties else None


def sampling_params(o: RequestOptions, s: ModelSettings, tokenizer,
                    vocab_size: Optional[int] = None) -> SamplingParams:
    """The request's sampling (else the model's, else the default); InvalidOption names
    an option out of range (of its own, or past the model's ``vocab_size`` tokens)."""
    xtc, special = first_set(o.xtc_probability, 0.0), ()
    if xtc:
        special = tuple(xtc_special_tokens(tokenizer))
    try:
        params = SamplingParams(temp=first_set(o.temperature, s.temperature, 0.0),
                                top_p=first_set(o.top_p, s.top_p, 1.0),
                                top_k=first_set(o.top_k, s.top_k, 0),
                                min_p=first_set(o.min_p, s.min_p, 0.0),
                                min_tokens_to_keep=first_set(o.min_tokens_to_keep, 1),
                                xtc_probability=xtc, xtc_threshold=first_set(o.xtc_threshold, 0.1),
                                xtc_special_tokens=special)
    except ArgumentError as e:
        raise InvalidOption(API_NAMES.get(e.name, e.name), str(e)) from None
    if vocab_size and params.top_k >= vocab_size:
        raise InvalidOption("top_k", f"top_k keeps fewer tokens than this model's vocabulary of {vocab_size} "
                            f"(0: off, else 1..{vocab_size - 1}); got {params.top_k}")
    if vocab_size and params.min_tokens_to_keep > vocab_size:
        raise InvalidOption("min_tokens_to_keep", f"min_tokens_to_keep is 1..{vocab_size} (this model's "
                            f"vocabulary); got {params.min_tokens_to_keep}")
    return params


def penalties(o: RequestOptions, s: ModelSettings) -> dict:
    """The request's penalties (else the model's) and logit bias as ``make_logits_processors``
    options; a neutral penalty builds no processor (a plain request keeps its prefix reuse)."""
    out = {}
    for k, neutral in NEUTRAL.items():
        v = first_set(getattr(o, k), getattr(s, k, None), neutral)
        if v != neutral:
            out[k] = v
    if o.logit_bias:
        out["logit_bias"] = {int(k): float(v) for k, v in o.logit_bias.items()}
    return out


def generation(o: RequestOptions, s: ModelSettings, default_max_tokens: int, tokenizer,
               vocab_size: Optional[int] = None) -> Generation:
    """What the request runs with under the settings ``s``."""
    return Generation(sampling=sampling_params(o, s, tokenizer, vocab_size), penalties=penalties(o, s),
                      max_tokens=first_set(o.max_tokens, s.max_tokens, default_max_tokens), seed=o.seed)


def decoding_plan(s: ModelSettings, drafter, prompt_tokens: int = 0, g: Optional[Generation] = None,
                  continues: bool = False) -> Plan:
    """How a request of ``prompt_tokens`` is decoded under the settings ``s``, with its own
    sampling, limit and seed (``g``; without it, the settings' decoding alone, as a batch's
    block policy reads it): one ``Plan``, as ``stream_generate`` makes one of its arguments."""
    mode = s.verify_mode(prompt_tokens)
    asked = {} if g is None else dict(max_tokens=g.max_tokens, seed=g.seed, logits_processors=g.logits_processors(),
                                       **asdict(g.sampling))
    return Plan.of(drafter, verify_mode=mode, block_size=s.dflash_block_size,
                   tree_budget=(s.dflash_tree_budget or "auto") if verify_kind(mode) == "tree" else None,
                   exact=s.dflash_exact, lookup=s.dflash_copies, continues=continues, draft_window=s.draft_window,
                   draft_sink=s.draft_sink, **asked)
