"""Data-parallel drafter training over mx.distributed ring ranks on 127.0.0.1: N ranks at
the same global batch and seed reach the parameters of one process (records split, random
draws shared, loss sums and counts added up before dividing), rank 0 alone writes, a run
stopped and resumed equals the run that did not stop, a rank that dies ends the others with
an error, and the command line under a launch."""

import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from typer.testing import CliRunner

from dflash2_mlx.cli.main import app
from dflash2_mlx.distributed.local import launch
from dflash2_mlx.loop.target import attach
from dflash2_mlx.model.checkpoint import load_drafter, save_drafter
from dflash2_mlx.train import data, init, objective, trainer
from dflash2_mlx.train.ranks import Ranks, check_config, params_digest, share_of
from tiny_models import make_target

ROOT = Path(__file__).resolve().parent.parent
RANKS = str(ROOT / "tests" / "dist_train_ranks.py")
PROMPTS = ["the cat sat", "a dog ran far", "sun and moon", "big red box", "one two three",
           "hello world", "slow green sea", "quiet night"]
# Responses cut to different lengths: the ranks' shares hold different numbers of blocks
# and label weights, so a plain average of per-rank means would not be the batch's mean.
CUTS = [5, 24, 9, 17, 24, 4, 13, 24]
CONFIG = dict(steps=3, lr=3e-3, warmup=0.1, batch_size=4, grad_accum=2, max_anchors=8,
              min_block_size=3, seed=5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("dtrain")
    make_target(root / "target", "qwen3", scale=4.0)
    with open(root / "prompts.jsonl", "w") as f:
        for p in PROMPTS:
            f.write(json.dumps({"text": p}) + "\n")
    model, tok = mlx_lm.load(str(root / "target"))
    data.generate_dataset(model, tok, root / "prompts.jsonl", root / "full.jsonl",
                          max_tokens=24, batch_size=4, progress=False)
    with open(root / "data.jsonl", "w") as f:
        for r, cut in zip(data.read_dataset(root / "full.jsonl"), CUTS):
            f.write(json.dumps(dict(r, response_ids=r["response_ids"][:cut])) + "\n")
    cfg = init.new_drafter_config(model, version=2, num_layers=1, block_size=6,
                                  mask_token_id=init.default_mask_token_id(tok, 33),
                                  target_layer_ids=[1, 2], selector_rank=8, selector_top_k=4)
    save_drafter(init.new_drafter(cfg, seed=0), root / "init")
    v1 = init.new_drafter_config(model, version=1, num_layers=1, block_size=5,
                                 mask_token_id=cfg.mask_token_id, target_layer_ids=[1, 3])
    save_drafter(init.new_drafter(v1, seed=2), root / "init-v1")  # last tap = last layer
    return root, model, data.read_dataset(root / "data.jsonl")


def params(drafter):
    return {k: np.array(v) for k, v in tree_flatten(drafter.parameters())}


def single(tiny, out, drafter="init", records=None, **config):
    root, model, every = tiny
    return trainer.train(model, load_drafter(str(root / drafter)), records or every, out,
                         trainer.TrainConfig(**{**CONFIG, **config}))


def run_ranks(tiny, tmp_path, runs, n=2, timeout=240, target="target"):
    root = tiny[0]
    spec = {"target": str(root / target), "drafter": str(root / "init"),
            "data": str(root / "data.jsonl"), "runs": runs}
    path = tmp_path / f"spec-{len(list(tmp_path.glob('spec-*')))}.json"
    path.write_text(json.dumps(spec))
    results = launch(n, [sys.executable, RANKS, str(path)], timeout=timeout, grace=30, cwd=str(ROOT))
    lines = [[json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")] for r in results]
    return results, lines


def assert_close(a, b):
    """Equal up to summation order: AdamW's normalised step turns the rounding of a gradient
    entry near zero into a difference of a small fraction of one step (lr 3e-3), far below
    what a wrongly weighted or missing share of the batch moves (whole steps everywhere)."""
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-4, err_msg=k)


def assert_same_history(run, ref):
    """The logged metrics are the whole batch's."""
    def history(d):
        return json.loads((d / "final/training_state/state.json").read_text())["state"]["history"]
    for h, r in zip(history(run), history(ref), strict=True):
        assert set(h) == set(r)
        for k in set(h) - {"sec"}:
            assert abs(h[k] - r[k]) < 1e-4 * max(1.0, abs(r[k])), (k, h[k], r[k])


def test_split_batch_gives_the_whole_batch_gradient(tiny):
    """The loss arithmetic in one process: two halves of a batch, each divided by the
    whole batch's counts, sum to the whole batch's loss, metrics and gradient."""
    root, model, records = tiny
    drafter = load_drafter(str(root / "init"))
    target = attach(model, drafter)
    cfg = trainer.TrainConfig(**CONFIG)
    seqs = trainer.DataStream(records, cfg, trainer.TrainState()).seqs[:4]
    draws = trainer.draw(np.random.default_rng(1), seqs, cfg, 6)
    whole = trainer.build_blocks(target, drafter, seqs, draws, cfg)
    halves = [trainer.build_blocks(target, drafter, seqs, draws, cfg, share=s) for s in ((0, 2), (2, 4))]
    assert sum(h.anchors.size for h in halves) == whole.anchors.size
    assert halves[0].anchors.size != halves[1].anchors.size
    parts = [objective.loss_parts(drafter, h)[0] for h in halves]

    def stacked(p):
        return mx.concatenate([mx.stack([v[0] for v in p.values()]), mx.stack([v[1] for v in p.values()])])

    (full, fm), fg = nn.value_and_grad(drafter, lambda b: objective.loss(drafter, b))(whole)
    grads, metrics = [], []
    for i, h in enumerate(halves):
        other = mx.stop_gradient(stacked(parts[1 - i]))
        fn = nn.value_and_grad(drafter, lambda b: objective.combine(
            *objective.loss_parts(drafter, b), reduce=lambda x: x + other, scale=2))
        (_, m), g = fn(h)
        grads.append(dict(tree_flatten(g)))
        metrics.append(m)
    # A plain average of the halves' own means is not the whole batch's loss.
    own = [objective.loss(drafter, h)[0].item() for h in halves]
    assert abs((own[0] + own[1]) / 2 - full.item()) > 1e-3
    for m in metrics:
        for k in fm:
            assert abs(m[k].item() - fm[k].item()) < 1e-5, k
    for k, v in tree_flatten(fg):
        np.testing.assert_allclose(np.array((grads[0][k] + grads[1][k]) / 2), np.array(v),
                                   rtol=1e-4, atol=1e-6, err_msg=k)


def test_shares_and_bad_settings():
    assert Ranks().share(4) is None and not Ranks().distributed
    assert [share_of(r, 3, 6) for r in range(3)] == [(0, 2), (2, 4), (4, 6)]
    with pytest.raises(ValueError, match="not divisible"):
        check_config(2, 3, 0.0)
    with pytest.raises(ValueError, match="feature cache"):
        check_config(2, 4, 1.0)
    check_config(1, 3, 1.0)


def test_two_ranks_equal_one_process_and_resume(tiny, tmp_path):
    """One launch: a 3-step run on per-rank run directories, then a run stopped after
    step 2 and resumed to step 3 in a shared directory."""
    shared = str(tmp_path / "b")
    results, lines = run_ranks(tiny, tmp_path, [
        {"out": str(tmp_path / "a-{rank}"), "config": CONFIG},
        {"out": shared, "config": {**CONFIG, "stop_after": 2}},
        {"out": shared, "config": CONFIG}])
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    assert not (tmp_path / "a-1").exists()  # rank 1 wrote nothing
    assert (tmp_path / "a-0" / "final").is_dir()
    for run in range(3):  # every rank holds the same parameters
        assert lines[0][run]["digest"] == lines[1][run]["digest"]
    got = load_drafter(str(tmp_path / "a-0" / "final"))
    assert params_digest(got) == lines[0][0]["digest"]
    one = single(tiny, tmp_path / "one")
    assert_close(params(got), params(one))
    start = params(load_drafter(str(tiny[0] / "init")))
    assert not np.allclose(start["fc.weight"], params(got)["fc.weight"])
    assert_same_history(tmp_path / "a-0", tmp_path / "one")
    # Stopped at step 2 and resumed: the run that did not stop, exactly.
    assert lines[0][2]["digest"] == lines[0][0]["digest"]


@pytest.mark.slow
def test_a_dying_rank_ends_the_other_and_the_run_resumes(tiny, tmp_path):
    cfg = {**CONFIG, "steps": 4, "save_every": 2}
    results, _ = run_ranks(tiny, tmp_path, [{"out": str(tmp_path / "c"), "config": cfg,
                                             "end_after": {"1": 3}}])
    assert results[1].returncode == 3
    assert results[0].returncode not in (0, None), results[0].stderr[-3000:]  # ended by itself
    assert "another rank ended" in results[0].stderr
    assert (tmp_path / "c" / "step-000002").is_dir() and not (tmp_path / "c" / "final").exists()
    # With the rerun, a micro-batch whose share on one rank has no block (a sequence
    # with no prompt and a 2-token response has no anchor): that rank adds nothing.
    records = tiny[2] + [{"id": 99, "prompt_ids": [], "response_ids": tiny[2][0]["response_ids"][:2]}]
    with open(tmp_path / "more.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    pairs = {**CONFIG, "batch_size": 2}
    results, lines = run_ranks(tiny, tmp_path, [
        {"out": str(tmp_path / "c"), "config": cfg}, {"out": str(tmp_path / "d"), "config": cfg},
        {"out": str(tmp_path / "k"), "config": pairs, "data": str(tmp_path / "more.jsonl")}])
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    assert lines[0][0]["digest"] == lines[0][1]["digest"] == lines[1][0]["digest"]
    assert lines[0][2]["digest"] == lines[1][2]["digest"]
    assert_close(params(load_drafter(str(tmp_path / "k" / "final"))),
                 params(single(tiny, tmp_path / "one-k", records=records, **pairs)))
    assert_same_history(tmp_path / "k", tmp_path / "one-k")
    state = json.loads((tmp_path / "c/final/training_state/state.json").read_text())["state"]
    assert [h["step"] for h in state["history"]] == [1, 2, 3, 4]
    assert_close(params(load_drafter(str(tmp_path / "c" / "final"))),
                 params(single(tiny, tmp_path / "one", **cfg)))


@pytest.mark.slow
def test_ranks_that_disagree_stop_with_a_clear_error(tiny, tmp_path):
    """A checkpoint only rank 0 can see (run directories not shared), another target on
    rank 1, then other batch
    splits (three ranks, 2 of the 6 sequences of each micro-batch each; a DFlash v1
    drafter distilled from the target's distribution)."""
    single(tiny, tmp_path / "e-0", stop_after=1)
    results, _ = run_ranks(tiny, tmp_path, [{"out": str(tmp_path / "e-{rank}"), "config": CONFIG}])
    for r in results:
        assert r.returncode not in (0, None)
        assert "the ranks differ on the checkpoint step" in r.stderr, r.stderr[-2000:]
    shutil.copytree(tiny[0] / "target", tmp_path / "target-0")
    make_target(tmp_path / "target-1", "qwen3", seed=1, scale=4.0)
    results, _ = run_ranks(tiny, tmp_path, [{"out": str(tmp_path / "t"), "config": CONFIG}],
                           target=str(tmp_path / "target-{rank}"))
    for r in results:
        assert r.returncode not in (0, None)
        assert "the ranks differ on the target" in r.stderr, r.stderr[-2000:]
    three = {**CONFIG, "batch_size": 6, "grad_accum": 1}
    distill = {**CONFIG, "batch_size": 6, "distill": 0.5, "min_block_size": 0}
    results, lines = run_ranks(tiny, tmp_path, [
        {"out": str(tmp_path / "f"), "config": three},
        {"out": str(tmp_path / "h"), "config": distill, "drafter": str(tiny[0] / "init-v1")}], n=3)
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    assert_close(params(load_drafter(str(tmp_path / "f" / "final"))),
                 params(single(tiny, tmp_path / "g", **three)))
    assert_close(params(load_drafter(str(tmp_path / "h" / "final"))),
                 params(single(tiny, tmp_path / "i", drafter="init-v1", **distill)))
    assert_same_history(tmp_path / "h", tmp_path / "i")
    kl = json.loads((tmp_path / "h/final/training_state/state.json").read_text())["state"]["history"]
    assert all(h["kl"] > 0 for h in kl)


def cli_args(root, out, *extra):
    return ["train", "--model", str(root / "target"), "--data", str(root / "data.jsonl"),
            "--out", str(out), "--layers", "1", "--block-size", "4", "--target-layer", "1",
            "--target-layer", "3", "--selector-rank", "8", "--steps", "3", "--batch-size", "4",
            "--max-anchors", "8", "--log-every", "1", *extra]


@pytest.mark.slow
def test_cli_under_a_launch(tiny, tmp_path):
    root = tiny[0]
    cmd = [sys.executable, "-m", "dflash2_mlx.cli.main"]
    results = launch(2, cmd + cli_args(root, tmp_path / "run"), timeout=240, grace=30, cwd=str(ROOT))
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    assert "step 3" in results[0].stdout and "drafter:" in results[0].stdout
    assert results[1].stdout.strip() == ""
    assert len((tmp_path / "run" / "log.jsonl").read_text().splitlines()) == 3
    res = CliRunner().invoke(app, cli_args(root, tmp_path / "one"))
    assert res.exit_code == 0, res.output
    assert_close(params(load_drafter(str(tmp_path / "run" / "final"))),
                 params(load_drafter(str(tmp_path / "one" / "final"))))
    # Settings several ranks cannot train with: every rank says so and exits 2.
    shutil.rmtree(tmp_path / "run")
    for extra, says in ((["--batch-size", "3"], "not divisible by the 2 ranks"),
                        (["--prompts", str(root / "prompts.jsonl")], "--data-only")):
        bad = cli_args(root, tmp_path / "run", *extra)
        for r in launch(2, cmd + bad, timeout=120, grace=30, cwd=str(ROOT)):
            assert r.returncode == 2 and says in r.stderr, r.stderr[-2000:]
