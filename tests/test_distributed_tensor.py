"""A target split tensor-parallel over ring ranks on 127.0.0.1 (``distributed.tensor``):
the tokens rank 0 yields are one process's (greedy: plain mlx-lm decoding; sampled with a
seed: the single-process DFlash run with that seed), and what cannot run is refused with a
clear error on every rank, never a hang.  Ranks run ``tests/dist_ranks.py`` through
``distributed.local.launch``; each launch does several generations."""

import json
import subprocess
import sys
from pathlib import Path

import mlx_lm
import pytest

import dflash2_mlx as d
from dflash2_mlx import distributed
from dflash2_mlx.distributed import agree, fingerprint, tensor
from dflash2_mlx.distributed.local import launch
from dflash2_mlx.request.prompt import encode_prompt
from helpers import plain_tokens
from tiny_models import make_drafter, make_target

ROOT = Path(__file__).resolve().parent.parent
RANKS = str(ROOT / "tests" / "dist_ranks.py")
PROMPT, BUILTIN_PROMPT = "abcab dcba cab", "Write a short poem about the sea."


def run_ranks(n: int, *args, timeout: float = 240):
    return launch(n, [sys.executable, RANKS, *map(str, args)], timeout=timeout, grace=20, cwd=str(ROOT))


def generations(results) -> list:
    assert [r.returncode for r in results] == [0] * len(results), [r.stderr[-2000:] for r in results]
    assert all(r.stdout == "" for r in results[1:]), "only rank 0 prints"
    return [json.loads(line) for line in results[0].stdout.splitlines() if line.startswith("{")]


def greedy_reference(model, tokenizer, prompt, n: int) -> list:
    """Plain mlx-lm decoding, ending where stream_generate ends: at an EOS token or n tokens."""
    out = []
    for t in plain_tokens(model, encode_prompt(tokenizer, prompt).tolist(), n):
        out.append(t)
        if t in tokenizer.eos_token_ids:
            break
    return out


def sampled_reference(model, tokenizer, drafter, run: dict, n: int) -> list:
    return [r.token for r in d.stream_generate(model, tokenizer, run["prompt"], drafter, max_tokens=n,
                                               block_size=run["block_size"], temp=run["temp"],
                                               seed=run["seed"], lookup=run["lookup"])]


def check_against_one_process(runs, model, tokenizer, drafter, n: int):
    greedy = greedy_reference(model, tokenizer, runs[0]["prompt"], n)
    assert len(greedy) >= 8  # a reference long enough to tell drafts from the target's own
    for run in runs:
        if run["temp"] == 0:
            assert run["tokens"] == greedy, run
        elif run["block_size"] != "auto":  # auto's sampled text follows rank 0's timing
            assert run["tokens"] == sampled_reference(model, tokenizer, drafter, run, n), run


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny qwen3 target with 4 heads and 2 KV heads (splits over 2 ranks), its drafter."""
    root = tmp_path_factory.mktemp("tensor")
    make_target(root / "t", "qwen3", alphabet="abcd", seed=6, scale=4.0)
    make_drafter(root / "d", root / "t", seed=11)
    return root / "t", root / "d"


def test_tiny_target_on_two_ranks_matches_one_process(tiny_pair):
    """Block sizes 2, 5, 8 and auto, greedy and sampled with a seed, copies on and off: one
    launch, sixteen generations, each the single-process tokens."""
    target, draft = tiny_pair
    n = 24
    runs = generations(run_ranks(2, "--target", target, "--draft", draft, "--prompt", PROMPT,
                                 "--block-sizes", "2,5,8,auto", "--temps", "0,0.8", "--seed", 7,
                                 "--lookup", "on,off", "--max-tokens", n))
    assert len(runs) == 16 and {r["ranks"] for r in runs} == {2}
    model, tokenizer, drafter = d.load(str(target), str(draft))
    check_against_one_process(runs, model, tokenizer, drafter, n)


def test_builtin_pair_on_two_ranks_is_refused():
    """SmolLM2-135M has 9 heads and 3 KV heads: both ranks stop at load, naming them."""
    results = run_ranks(2, "--max-tokens", 4, timeout=180)
    for r in results:
        assert r.returncode == 1, r.stderr[-2000:]
        assert "9 attention heads" in r.stderr and "3 KV heads" in r.stderr and "over 2 ranks" in r.stderr
        assert r.stdout == ""


def test_checks_without_ranks():
    """What refuses a split, and what the ranks compare, in this process (no launch)."""
    model, _ = mlx_lm.load(_builtin_target(), lazy=True)
    assert tensor.problems(model, 3) == []
    assert tensor.problems(model, 2) == ["9 attention heads (num_attention_heads)",
                                         "3 KV heads (num_key_value_heads)"]
    with pytest.raises(ValueError, match="9 attention heads.*not divisible by 2"):
        distributed.split(model, _Group(2), "tensor")
    with pytest.raises(ValueError, match="mode 'ring'"):
        distributed.split(model, _Group(2), "ring")
    same = [[1, 2, 3, 4] * len(fingerprint.PARTS)] * 3
    assert fingerprint.differences(same) == []
    other = [row[:] for row in same]
    other[2][-1] = 9  # rank 2's drafter weights
    assert fingerprint.differences(other) == ["drafter weights: rank 2 differs from rank 0"]
    assert agree.agreed(d.adaptive.Fixed(4), _Group(2)).largest == 4  # fixed sizes need no collective


def _builtin_target() -> str:
    from dflash2_mlx.builtin.defaults import default_pair

    return default_pair()[0]


class _Group:
    """A group's size and rank, for the checks that issue no collective."""

    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def test_fingerprint_reads_names_sizes_and_samples(tmp_path, tiny_pair):
    """Another drafter of the same shapes digests differently; the same files under another
    directory digest the same."""
    target, draft = tiny_pair
    make_drafter(tmp_path / "d2", target, seed=12)
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in Path(draft).iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    base = fingerprint.digests(target, draft)
    assert fingerprint.digests(target, copy) == base
    changed = fingerprint.digests(target, tmp_path / "d2")
    assert [p for p in fingerprint.PARTS if changed[p] != base[p]] == ["drafter weights"]


@pytest.mark.slow
@pytest.mark.timeout(460)  # three ranks of the built-in pair share two cores
def test_builtin_pair_on_three_ranks_matches_one_process():
    n = 32
    # A real model's split at the smallest block and the drafter's own, greedy and sampled.
    # Block 5, auto (the ranks calibrating together) and the lookup off run over the tensor
    # split's whole matrix in test_tiny_target_on_two_ranks_matches_one_process.
    runs = generations(run_ranks(3, "--prompt", BUILTIN_PROMPT, "--chat", "--block-sizes", "2,8",
                                 "--temps", "0,0.7", "--seed", 5, "--lookup", "on", "--max-tokens", n,
                                 timeout=400))
    assert len(runs) == 4 and {r["ranks"] for r in runs} == {3}
    model, tokenizer, drafter = d.load()
    check_against_one_process(runs, model, tokenizer, drafter, n)


@pytest.mark.slow
def test_mismatched_drafter_is_refused_at_start(tiny_pair, tmp_path):
    target, draft = tiny_pair
    make_drafter(tmp_path / "other", target, seed=12)
    results = run_ranks(2, "--target", target, "--draft", draft, "--rank-draft", f"1:{tmp_path / 'other'}")
    for r in results:
        assert r.returncode == 1, r.stderr[-2000:]
        assert "do not hold the same model files" in r.stderr
        assert "drafter weights: rank 1 differs from rank 0" in r.stderr
        assert r.stdout == ""


@pytest.mark.slow
def test_killed_rank_ends_the_others_with_an_error(tiny_pair):
    """Rank 1 leaves after 5 tokens of a long generation: rank 0 stops non-zero, saying so,
    within the launch's grace period (``launch`` kills whatever outlives it: None)."""
    target, draft = tiny_pair
    results = run_ranks(2, "--target", target, "--draft", draft, "--prompt", PROMPT, "--max-tokens", 400,
                        "--block-sizes", 4, "--lookup", "off", "--die-rank", 1, "--die-after", 5)
    assert results[1].returncode == 3
    assert results[0].returncode == 1, results[0].stderr[-2000:]
    assert "another rank stopped mid-run" in results[0].stderr


@pytest.mark.slow
def test_cli_generate_distributed_tensor(tiny_pair):
    """``dflash2-mlx generate --distributed tensor`` as mlx.launch runs it: rank 0 prints the
    one-process text, rank 1 nothing."""
    target, draft = tiny_pair
    argv = [str(Path(sys.executable).parent / "dflash2-mlx"), "generate", "--model", str(target), "--draft", str(draft),
            "--prompt", PROMPT, "--ignore-chat-template", "--max-tokens", "16", "--block-size", "4",
            "--distributed", "tensor"]
    results = launch(2, argv, timeout=240, grace=20, cwd=str(ROOT))
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    one = subprocess.run(argv[:-2], capture_output=True, text=True, timeout=240, cwd=str(ROOT))
    assert one.returncode == 0, one.stderr[-2000:]
    assert results[0].stdout == one.stdout and one.stdout.strip()
    assert results[1].stdout == ""
