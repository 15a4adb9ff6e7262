"""One generation as the eval commands record it (its tokens, generation timing and draft
statistics), plain ``mlx_lm.stream_generate`` or DFlash through the public
``stream_generate``, and ``RunTally``, the sum of such runs."""

from typing import Dict, List, Optional

import mlx.core as mx
import mlx_lm
from mlx_lm.sample_utils import make_sampler

from ..generate import stream_generate


def record(tokens: List[int], last) -> dict:
    """A run's tokens and generation timing (the tokens after the first over the time after
    the first, as mlx-lm counts them) from its last response."""
    n = last.generation_tokens if last else 0
    seconds = n / last.generation_tps if last and last.generation_tps else 0.0
    return {"tokens": tokens, "generation_tokens": n, "seconds": seconds}


def run_plain(model, tokenizer, ids: List[int], temp: float, max_tokens: int, seed: int) -> dict:
    """One plain ``mlx_lm.stream_generate`` run: tokens and generation timing."""
    mx.random.seed(seed)
    tokens, last = [], None
    for last in mlx_lm.stream_generate(model, tokenizer, mx.array(ids), max_tokens=max_tokens,
                                       sampler=make_sampler(temp)):
        tokens.append(int(last.token))
    return record(tokens, last)


def run_dflash(model, tokenizer, drafter, ids: List[int], temp: float, max_tokens: int,
               block_size, seed: int, lookup: bool = False, tree: Optional[int] = None) -> dict:
    """One DFlash run through the public ``stream_generate``: tokens, timing, draft stats
    (``tree``: verifying trees of that many nodes)."""
    tokens, last = [], None
    for last in stream_generate(model, tokenizer, ids, drafter, max_tokens=max_tokens,
                                temp=temp, block_size=block_size, seed=seed, lookup=lookup,
                                verify_mode="tree" if tree else "dflash", tree_budget=tree):
        tokens.append(int(last.token))
    out = record(tokens, last)
    out.update(cycles=last.cycles if last else 0,
               acceptance_counts=list(last.acceptance_counts) if last else [],
               block_sizes=dict(last.block_sizes) if last else {},
               shadows=last.shadows if last else 0, copies=last.copies if last else 0)
    return out


class RunTally:
    """Tokens, time, cycles and per-position acceptance that add up over runs."""

    def __init__(self):
        self.tokens, self.seconds, self.cycles, self.runs, self.shadows, self.copies = 0, 0.0, 0, 0, 0, 0
        self.positions: List[int] = []
        self.block_sizes: Dict[int, int] = {}

    def add(self, run: dict):
        self.runs += 1
        self.tokens += run["generation_tokens"]
        self.seconds += run["seconds"]
        self.cycles += run.get("cycles", 0)
        self.shadows += run.get("shadows", 0)
        self.copies += run.get("copies", 0)
        counts = run.get("acceptance_counts", [])
        if len(counts) > len(self.positions):
            self.positions += [0] * (len(counts) - len(self.positions))
        for i, c in enumerate(counts):
            self.positions[i] += c
        for b, n in run.get("block_sizes", {}).items():
            self.block_sizes[int(b)] = self.block_sizes.get(int(b), 0) + n

    def merge(self, other: "RunTally"):
        self.add({"generation_tokens": other.tokens, "seconds": other.seconds,
                  "cycles": other.cycles, "acceptance_counts": other.positions,
                  "block_sizes": other.block_sizes, "shadows": other.shadows, "copies": other.copies})
        self.runs += other.runs - 1

    def tau(self) -> Optional[float]:
        """Accepted draft tokens + the bonus token, per cycle (None before any cycle)."""
        return (sum(self.positions) + self.cycles) / self.cycles if self.cycles else None

    def result(self) -> dict:
        out = {"runs": self.runs, "tokens": self.tokens, "seconds": self.seconds,
               "tokens_per_s": self.tokens / self.seconds if self.seconds else None}
        if self.cycles:
            out.update(cycles=self.cycles, tau=self.tau(),
                       acceptance_by_position=[c / self.cycles for c in self.positions],
                       block_sizes=dict(sorted(self.block_sizes.items())), shadows=self.shadows,
                       copies=self.copies)
        return out
