"""The five benchmark prompt sets shipped with the package (GSM8K, MATH-500, HumanEval, MBPP,
MT-Bench; sources and licenses: ``bench_data/SOURCES.md``) and where the bench finds them."""

import os
from pathlib import Path
from typing import List

BENCH_FILES = ("gsm8k_test", "math500", "humaneval", "mbpp_test", "mt_bench")
BENCH_DIR_ENV = "DFLASH2_MLX_BENCH_DIR"
SHIPPED_BENCH_DIR = Path(__file__).resolve().parent / "bench_data"


def default_bench_dir() -> Path:
    """``$DFLASH2_MLX_BENCH_DIR`` when set, else the prompt sets shipped in the package."""
    env = os.environ.get(BENCH_DIR_ENV)
    return Path(env) if env else SHIPPED_BENCH_DIR


def default_bench_files() -> List[Path]:
    """The five prompt sets of ``default_bench_dir``; a ValueError names the directory and
    what it lacks."""
    where = default_bench_dir()
    files = [where / f"{name}.jsonl" for name in BENCH_FILES]
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise ValueError(f"{where} lacks the prompt set(s) {', '.join(absent)}: "
                         f"give --bench FILE (repeat) or point ${BENCH_DIR_ENV} elsewhere")
    return files
