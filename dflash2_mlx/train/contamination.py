"""Keep the benchmark sets out of training data: a text that shares 13 consecutive words
with any prompt of the five shipped benchmark sets (the GPT-3 paper's contamination test) is
dropped.  Word 13-grams catch a copied item but not a shared form ("Write a python function
to find the ..."), which is what the domain-shaped prompts are meant to share."""

import re
from functools import lru_cache
from typing import FrozenSet

from ..builtin.bench_sets import SHIPPED_BENCH_DIR as BENCH
from .data import read_prompts

N = 13


def ngrams(text: str, n: int = N) -> set:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


@lru_cache(maxsize=None)
def benchmark_ngrams() -> FrozenSet[tuple]:
    """Every word 13-gram of the prompts of the shipped benchmark sets."""
    out = set()
    for path in sorted(BENCH.glob("*.jsonl")):
        for _, p in read_prompts(path):
            out |= ngrams(p if isinstance(p, str) else " ".join(str(m["content"]) for m in p))
    return frozenset(out)


def contaminated(text: str) -> bool:
    return not ngrams(text).isdisjoint(benchmark_ngrams())
