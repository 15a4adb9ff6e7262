"""Training prompts stay clear of the benchmark sets: the contamination check, and the
domain-shaped prompt maker of the recipe (scripts/recipe/make_domain_prompts.py: distinct,
no benchmark item)."""

import json

from dflash2_mlx.train.contamination import BENCH, benchmark_ngrams, contaminated, ngrams
from scripts.recipe.make_domain_prompts import domain_prompts


def test_contamination_catches_a_copied_item_not_a_shared_form():
    row = json.loads((BENCH / "mbpp_test.jsonl").read_text().splitlines()[21])
    assert row["text"] == "Write a python function to find the largest prime factor of a given number."
    assert contaminated("Please help. " + row["text"] + " Thanks!")
    assert not contaminated("Write a python function to find the largest prime gap below a given number.")
    assert not contaminated("Write a python function to find the index of the last even element in a list.")
    assert ngrams("one two three") == set() and len(ngrams(" ".join(map(str, range(14))))) == 2
    assert len(benchmark_ngrams()) > 10_000


def test_domain_prompts_are_distinct_and_clear_of_the_benchmarks():
    # 3072 prompts with seed 1 once held two MBPP items word for word.
    texts, _ = domain_prompts(3072, seed=1)
    assert len(texts) == len(set(texts)) == 3072
    assert not [t for t in texts if contaminated(t)]
