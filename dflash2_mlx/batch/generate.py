"""The batch's Python API: ``stream_batch_generate`` (each token's ``Response`` as it
comes) and ``batch_generate`` (every prompt's whole response, a ``BatchResult``)."""

import time
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Union

import mlx.core as mx

from .. import adaptive
from ..loop.cycle import CycleStats
from ..model.drafter import Drafter
from ..request.arguments import check_all
from ..request.prompt import encode_prompt
from ..request.sampling import SamplingParams
from .generator import BatchGenerator
from .sequence import Response


@dataclass
class BatchResult:
    """What ``batch_generate`` returns, in the prompts' order (stop tokens left out)."""
    texts: List[str]
    token_ids: List[List[int]]
    finish_reasons: List[str]
    stats: List[CycleStats]
    generation_tokens: int = 0
    generation_tps: float = 0.0  # all sequences' tokens per second of the whole run


def stream_batch_generate(model, tokenizer, prompts: Sequence, drafter: Drafter, *,
                          max_tokens: Union[int, List[int]] = 256, temp: float = 0.0,
                          top_p: float = 1.0, min_p: float = 0.0, top_k: int = 0,
                          min_tokens_to_keep: int = 1, xtc_probability: float = 0.0,
                          xtc_threshold: float = 0.1, xtc_special_tokens: Sequence[int] = (),
                          logits_processors: Optional[List[Callable]] = None,
                          block_size=adaptive.AUTO, seed: Optional[int] = None,
                          **kwargs) -> Iterator[Response]:
    """Generate from every prompt (text, token ids or chat messages) in one batch; yield
    each token's ``Response`` as it comes (``uid`` = the prompt's index).  ``seed``: the
    whole batch's random draws; sampling as in ``stream_generate``.  Other keywords go to
    ``BatchGenerator``."""
    check_all(seed=seed)
    if seed is not None:
        mx.random.seed(seed)
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = SamplingParams(temp=temp, top_p=top_p, min_p=min_p, top_k=top_k,
                            min_tokens_to_keep=min_tokens_to_keep, xtc_probability=xtc_probability,
                            xtc_threshold=xtc_threshold, xtc_special_tokens=tuple(xtc_special_tokens))
    gen = BatchGenerator(model, drafter, block_size=block_size, **kwargs)
    for prompt, limit in zip(prompts, limits):
        gen.insert(encode_prompt(tokenizer, prompt), max_tokens=limit, params=params,
                   logits_processors=logits_processors, stop_tokens=tokenizer.eos_token_ids)
    while len(gen):
        yield from gen.next()


def batch_generate(model, tokenizer, prompts: Sequence, drafter: Drafter, **kwargs) -> BatchResult:
    """Every prompt's whole response, generated together (keywords: ``stream_batch_generate``)."""
    n = len(prompts)
    tokens = [[] for _ in range(n)]
    finish, stats = [""] * n, [None] * n
    tic, total = time.perf_counter(), 0
    for r in stream_batch_generate(model, tokenizer, prompts, drafter, **kwargs):
        total += 1
        if r.finish_reason != "stop":
            tokens[r.uid].append(r.token)
        if r.finish_reason:
            finish[r.uid], stats[r.uid] = r.finish_reason, r.stats
    seconds = time.perf_counter() - tic
    return BatchResult([tokenizer.decode(t) for t in tokens], tokens, finish, stats, total,
                       total / seconds if seconds else 0.0)
