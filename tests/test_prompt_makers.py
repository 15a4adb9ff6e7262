"""Training prompts stay clear of the benchmark sets: the contamination check, and the
domain-shaped prompt maker in scripts/ (distinct, no benchmark item)."""

import json
import subprocess
import sys
from pathlib import Path

from dflash2_mlx.train.contamination import BENCH, benchmark_ngrams, contaminated, ngrams

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def test_contamination_catches_a_copied_item_not_a_shared_form():
    row = json.loads((BENCH / "mbpp_test.jsonl").read_text().splitlines()[21])
    assert row["text"] == "Write a python function to find the largest prime factor of a given number."
    assert contaminated("Please help. " + row["text"] + " Thanks!")
    assert not contaminated("Write a python function to find the largest prime gap below a given number.")
    assert not contaminated("Write a python function to find the index of the last even element in a list.")
    assert ngrams("one two three") == set() and len(ngrams(" ".join(map(str, range(14))))) == 2
    assert len(benchmark_ngrams()) > 10_000


def test_domain_prompts_are_distinct_and_clear_of_the_benchmarks(tmp_path):
    out = tmp_path / "p.jsonl"
    # 3072 prompts with seed 1 once held two MBPP items word for word.
    subprocess.run([sys.executable, str(SCRIPTS / "make_domain_prompts.py"), str(out), "--n", "3072"],
                   check=True, capture_output=True, cwd=SCRIPTS)
    texts = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    assert len(texts) == len(set(texts)) == 3072
    assert not [t for t in texts if contaminated(t)]
