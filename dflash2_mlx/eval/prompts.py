"""The prompts the eval commands run: every prompt of jsonl sets (text or chat records), or
a seeded sample of each."""

import random
from pathlib import Path
from typing import Dict, Optional, Sequence

from ..train.data import read_prompts


def load_benches(paths: Sequence, limit: Optional[int] = None) -> Dict[str, list]:
    """{file stem: its first ``limit`` prompts (all by default)} for jsonl files."""
    return {Path(p).stem: [q for _, q in read_prompts(p, limit)] for p in paths}


def sample_prompts(paths: Sequence, samples: int, seed: int = 0) -> Dict[str, list]:
    """{file stem: ``samples`` prompts drawn at random (seeded) from each jsonl file}."""
    rng = random.Random(seed)
    out = {}
    for p in paths:
        prompts = [q for _, q in read_prompts(p)]
        idx = sorted(rng.sample(range(len(prompts)), min(samples, len(prompts))))
        out[Path(p).stem] = [prompts[i] for i in idx]
    return out
