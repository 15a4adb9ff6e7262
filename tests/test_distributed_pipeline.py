"""A target split into a pipeline (``distributed/pipeline.py``) under the DFlash loop: the
tokens of 2 ranks on 127.0.0.1 equal one process's (greedy: plain mlx-lm decoding; sampled
with a seed: DFlash in one process), on every rank, for the built-in llama target (our own
staged layer loop) and a tiny hybrid qwen3_5 (mlx-lm's pipeline(), recurrent rollback); the
drafter's input crosses the ranks as one H-wide all_sum per target pass.  The ranks run
``tests/dist_pipeline_ranks.py``."""

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import gemma

from dflash2_mlx.distributed import pipeline
from dflash2_mlx.distributed.local import launch
from dflash2_mlx.generate import load, stream_generate
from dflash2_mlx.request.prompt import encode_prompt
from tiny_models import make_drafter, make_target

ROOT = Path(__file__).resolve().parent.parent
RANKS = str(ROOT / "tests" / "dist_pipeline_ranks.py")
SMOL_PROMPT = "Write a haiku about the sea."
TINY_PROMPT = "abcabc hello abc"


def run_ranks(target, draft, runs, n=2, timeout=240):
    """Every rank's JSON lines (one per run, then its layer range), after all exit 0."""
    cfg = {"target": target and str(target), "draft": draft and str(draft), "runs": runs}
    results = launch(n, [sys.executable, RANKS, json.dumps(cfg)], timeout=timeout, cwd=str(ROOT))
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exited {r.returncode}: {r.stderr[-3000:]}"
    return [[json.loads(line) for line in r.stdout.splitlines()] for r in results]


def plain_tokens(model, tokenizer, prompt, max_tokens):
    """mlx-lm's own greedy decoding, up to and including the first EOS."""
    out = []
    for t, _ in generate_step(encode_prompt(tokenizer, prompt), model, max_tokens=max_tokens):
        out.append(int(t))
        if out[-1] in tokenizer.eos_token_ids:
            break
    return out


def dflash_tokens(model, tokenizer, drafter, run):
    return [r.token for r in stream_generate(
        model, tokenizer, run["prompt"], drafter, max_tokens=run["max_tokens"],
        block_size=run["block_size"], temp=run.get("temp", 0.0), seed=run.get("seed"),
        lookup=run.get("lookup", True))]


def check_ranks(lines, runs, expected, model, drafter):
    """Every rank's tokens are the expected ones; each target pass issued one all_gather
    (the final hidden state) and one all_sum of an H-wide row per token (the drafter's
    input), and nothing else was summed but "auto"'s few agreed ints; the ranks' layer
    ranges tile the target, and each holds and read its own layers' weights only."""
    hidden, depth = drafter.config.hidden_size, len(model.layers)
    whole_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    for rank_lines in lines:
        for i, run in enumerate(runs):
            got = rank_lines[i]
            assert got["tokens"] == expected[i], (got["rank"], run)
            gathers = got["all_gather"]
            sums = [s for s in got["all_sum"] if len(s) == 3]
            assert all(len(s) == 1 and s[0] <= 4 for s in got["all_sum"] if len(s) != 3)
            assert len(sums) == len(gathers) > 0
            assert all(s == g and s[0] == 1 and s[-1] == hidden for s, g in zip(sums, gathers))
    ranges = sorted((ls[-1]["start"], ls[-1]["stop"]) for ls in lines)
    assert ranges[0][0] == 0 and ranges[-1][1] == depth
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    for ls in lines:  # a rank holds the weights of its own layers only, and read no others
        held = ls[-1]
        assert held["param_layers"] == held["stop"] - held["start"]
        assert held["rank_bytes"] < whole_bytes
        assert held["active_bytes"] <= held["rank_bytes"] + held["drafter_bytes"] + 2**20


@pytest.fixture(scope="module")
def smol():
    return load()


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline_qwen3_5")
    target = make_target(root / "target", "qwen3_5", scale=4.0)
    draft = make_drafter(root / "drafter", target)  # taps layers 1 and 2: one on each rank
    model, tokenizer, drafter = load(str(target), str(draft))
    return target, draft, model, tokenizer, drafter


def expected_tokens(model, tokenizer, drafter, runs):
    return [plain_tokens(model, tokenizer, r["prompt"], r["max_tokens"]) if not r.get("temp")
            else dflash_tokens(model, tokenizer, drafter, r) for r in runs]


def test_llama_two_ranks_match_one_process(smol):
    """SmolLM2 (llama: our own staged loop) on 2 ranks: greedy = plain mlx-lm, sampled with
    a seed = DFlash in one process."""
    model, tokenizer, drafter = smol
    runs = [dict(prompt=SMOL_PROMPT, max_tokens=16, block_size=5),
            dict(prompt=SMOL_PROMPT, max_tokens=12, block_size=8, temp=0.8, seed=3)]
    lines = run_ranks(None, None, runs)
    check_ranks(lines, runs, expected_tokens(model, tokenizer, drafter, runs),
                model, drafter)


def test_hybrid_two_ranks_match_one_process(hybrid):
    """A tiny qwen3_5 (linear-attention layers on both ranks; mlx-lm's pipeline()): the
    recurrent rollback replays on every rank together; greedy with copies on and off and
    "auto" (rank 0's block sizes, calibrated by both ranks together), and sampled with a seed."""
    target, draft, model, tokenizer, drafter = hybrid
    runs = [dict(prompt=TINY_PROMPT, max_tokens=30, block_size=5),
            dict(prompt=TINY_PROMPT, max_tokens=30, block_size=8, lookup=False),
            dict(prompt=TINY_PROMPT, max_tokens=30, block_size="auto"),
            dict(prompt=TINY_PROMPT, max_tokens=30, block_size=5, temp=1.0, seed=7)]
    lines = run_ranks(target, draft, runs)
    check_ranks(lines, runs, expected_tokens(model, tokenizer, drafter, runs),
                model, drafter)


def test_split_refuses_before_any_collective(tmp_path):
    """Fewer layers than ranks, and a family neither mlx-lm nor our loop pipelines: a clear
    ValueError from ``check`` (what ``split`` runs first)."""
    target = make_target(tmp_path / "t", "qwen3", layers=4)
    model, _ = mlx_lm.load(str(target))
    with pytest.raises(ValueError, match="4-layer target cannot be split over 8 ranks"):
        pipeline.check(model, 8)
    args = gemma.ModelArgs(model_type="gemma", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                           num_attention_heads=2, head_dim=16, rms_norm_eps=1e-6, vocab_size=40,
                           num_key_value_heads=1)
    with pytest.raises(ValueError, match="gemma target cannot be split into a pipeline"):
        pipeline.check(gemma.Model(args), 2)


def test_one_rank_split_is_the_whole_target(hybrid, tmp_path):
    """A split over a group of one runs every code path of a stage but the exchanges: the
    same tokens as the whole target, features H wide, and split twice is refused."""
    target, draft, model, tokenizer, drafter = hybrid
    split_model, _, split_drafter = load(str(target), str(draft))
    stage = pipeline.split(split_model, mx.distributed.init())
    assert (stage.start, stage.stop, stage.depth) == (0, 4, 4) and stage.recurrent
    with pytest.raises(ValueError, match="already split"):
        pipeline.split(split_model, mx.distributed.init())
    run = dict(prompt=TINY_PROMPT, max_tokens=20, block_size=5)
    assert dflash_tokens(split_model, tokenizer, split_drafter, run) == dflash_tokens(model, tokenizer, drafter, run)
    assert split_drafter.features_projected and not drafter.features_projected


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_block_sizes_and_copies(family, smol, hybrid):
    """Block sizes 2, 5 and 8, copies on and off, greedy and seeded sampling, and "auto"
    (greedy: a seeded sampled run's tokens depend on the block sizes, which rank 0 chooses
    from its own clock), on 2 ranks."""
    if family == "llama":
        (model, tokenizer, drafter), target, draft, prompt = smol, None, None, SMOL_PROMPT
    else:
        target, draft, model, tokenizer, drafter = hybrid
        prompt = TINY_PROMPT
    runs = [dict(prompt=prompt, max_tokens=24, block_size=b, lookup=lookup, temp=temp, seed=5)
            for b in (2, 5, 8) for lookup in (True, False) for temp in (0.0, 0.9)]
    runs += [dict(prompt=prompt, max_tokens=24, block_size="auto", lookup=lookup) for lookup in (True, False)]
    lines = run_ranks(target, draft, runs, timeout=240)
    check_ranks(lines, runs, expected_tokens(model, tokenizer, drafter, runs),
                model, drafter)


@pytest.mark.slow
def test_three_ranks_one_without_taps(hybrid):
    """3 ranks over the 4-layer hybrid (layers 2-3, 1, 0): the tapped layers 1 and 2 on two
    ranks, the third adding zeros to the all_sum; same tokens on every rank."""
    target, draft, model, tokenizer, drafter = hybrid
    runs = [dict(prompt=TINY_PROMPT, max_tokens=24, block_size=5),
            dict(prompt=TINY_PROMPT, max_tokens=24, block_size=8, temp=1.0, seed=11)]
    lines = run_ranks(target, draft, runs, n=3, timeout=240)
    assert sorted((ls[-1]["start"], ls[-1]["stop"]) for ls in lines) == [(0, 1), (1, 2), (2, 4)]
    check_ranks(lines, runs, expected_tokens(model, tokenizer, drafter, runs),
                model, drafter)


@pytest.mark.slow
def test_sliding_window_llama(tmp_path):
    """A tiny llama with sliding-window layers (our staged loop, a mask per kind of layer;
    verify passes that reach the window restore and replay) on 2 ranks = plain mlx-lm."""
    target = make_target(tmp_path / "target", "llama_sliding", scale=4.0)
    draft = make_drafter(tmp_path / "drafter", target)
    model, tokenizer, drafter = load(str(target), str(draft))
    runs = [dict(prompt=TINY_PROMPT, max_tokens=30, block_size=b) for b in (3, 8)]
    lines = run_ranks(target, draft, runs)
    check_ranks(lines, runs, expected_tokens(model, tokenizer, drafter, runs),
                model, drafter)
