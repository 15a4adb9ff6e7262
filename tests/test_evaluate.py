"""Evaluation: the counting rules on a hand-checked case, offline hits against the runtime
forward and proposal per anchor, and a full tiny evaluation with its report files."""

import json

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from dflash2_mlx import stream_generate
from dflash2_mlx.eval import evaluate as E
from dflash2_mlx.eval.prompts import load_benches
from dflash2_mlx.model.drafter import propose
from dflash2_mlx.model.checkpoint import load_drafter
from dflash2_mlx.request.sampling import SamplingParams
from dflash2_mlx.loop.target import attach
from tiny_models import looping_pair, make_drafter, make_target


def test_conditional_recall_and_leading_by_hand():
    hits = np.array([[1, 1, 0, 1],
                     [1, 0, 1, 1],
                     [0, 1, 1, 1],
                     [1, 1, 1, 1]], bool)
    num, den = E.conditional_counts(hits)
    assert num.tolist() == [3, 2, 1, 1]
    assert den.tolist() == [4, 3, 2, 1]
    assert E.leading(hits).tolist() == [2, 1, 0, 4]
    t = E.RecallTally(4)
    t.add(hits, np.ones_like(hits), hits)
    r = t.result(version=2)
    assert r["recall_at_1"] == [0.75, 2 / 3, 0.5, 1.0]
    assert r["recall_at_k"] == [1.0] * 4
    assert r["tau_top1"] == pytest.approx(1 + 7 / 4)
    assert r["tau_oracle"] == 5.0 and r["tau_selector"] == r["tau_top1"]
    # A T=0 run visits anchor 0 (accepts 2: next anchor 3), then anchor 3 (accepts 4).
    assert E.loop_anchors(E.leading(hits)).tolist() == [0, 3]
    assert r["tau_loop"] == pytest.approx((3 + 5) / 2)
    assert E.loop_anchors(np.array([0, 0, 1, 0, 3, 0, 0])).tolist() == [0, 1, 2, 4]
    sub = E.RecallTally(4)
    sub.add(hits, hits, every_anchor=False)  # anchors left out: no run to follow
    assert sub.result(version=1)["tau_loop"] is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    make_target(root / "target", "qwen3", scale=4.0)
    make_drafter(root / "v1", root / "target", version=1, block_size=5)
    make_drafter(root / "v2", root / "target", version=2, block_size=5)
    for name, rows in (("alpha", [{"question": "the cat sat on"}, {"text": "a dog ran"}]),
                       ("beta", [{"turns": ["sun and moon", "again"]}])):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    model, tok = mlx_lm.load(str(root / "target"))
    return root, model, tok


@pytest.mark.parametrize("name", ["v1", "v2"])
def test_offline_hits_match_the_runtime_per_anchor(tiny, name):
    root, model, tok = tiny
    drafter = load_drafter(str(root / name))
    target = attach(model, drafter)
    (ids, start), = E.greedy_responses(model, tok, ["the cat sat on"], max_tokens=16)
    B, k = 5, 6
    hit1, hitk, hitsel = E.offline_hits(target, drafter, ids, start, B, k, chunk=4)
    anchors = list(range(start, len(ids) - B + 1))
    assert hit1.shape == (len(anchors), B - 1)
    _, feats = target(mx.array([ids]), None)
    for n, a in enumerate(anchors):
        cache = drafter.make_cache()
        drafter.append_context(feats[:, :a], cache)
        block = mx.array([[ids[a]] + [drafter.config.mask_token_id] * (B - 1)])
        hidden = drafter(block, cache)
        logits = np.array(drafter.logits(hidden[0, 1:]))
        truth = np.array(ids[a + 1 : a + B])
        order = np.argsort(-logits, axis=-1)
        assert hit1[n].tolist() == (order[:, 0] == truth).tolist()
        assert hitk[n].tolist() == (order[:, :k] == truth[:, None]).any(-1).tolist()
        if name == "v2":  # the tokens the runtime proposes at T=0
            tokens, _ = propose(drafter, hidden, mx.array(ids[a]), SamplingParams())
            assert hitsel[n].tolist() == (np.array(tokens) == truth).tolist()
        else:
            assert hitsel is None


def test_evaluate_reports_side_by_side(tiny, tmp_path):
    root, model, tok = tiny
    drafters = {n: load_drafter(str(root / n)) for n in ("v1", "v2")}
    benches = load_benches([root / "alpha.jsonl", root / "beta.jsonl"])
    assert benches == {"alpha": ["the cat sat on", "a dog ran"], "beta": ["sun and moon"]}
    report = E.evaluate(model, tok, drafters, benches, max_tokens=14, temps=(0.0, 1.0), top_k=6)
    for name, d in report["drafters"].items():
        assert d["block_size"] == 5 and set(d["benches"]) == {"alpha", "beta"}
        o = d["overall"]
        assert o["blocks"] == sum(b["blocks"] for b in d["benches"].values()) > 0
        assert 1.0 <= o["tau_top1"] <= o["tau_oracle"] <= 5.0
        assert all(0 <= r <= 1 for r in o["recall_at_1"] + o["recall_at_k"] if r is not None)
        for t in ("T=0", "T=1"):
            run = o["runs"][t]
            assert run["cycles"] > 0 and 1.0 <= run["tau"] <= 5.0
            rates = run["acceptance_by_position"]
            assert run["tau"] == pytest.approx(1 + sum(rates))
            assert all(x >= y for x, y in zip(rates, rates[1:]))  # accepting i needs i-1
        assert ("tau_selector" in o) == (name == "v2")
    paths = E.write_report(report, tmp_path)
    assert [p.name for p in paths] == ["report.json", "report.md", "recall.png", "acceptance.png"]
    assert all(p.stat().st_size > 0 for p in paths)
    md = (tmp_path / "report.md").read_text()
    assert "| v1 | alpha |" in md and "| v2 | **overall** |" in md
    assert json.loads((tmp_path / "report.json").read_text())["config"]["top_k"] == 6


def test_real_runs_measure_the_drafter_without_copies(tmp_path):
    """A target that repeats one token and a drafter that never proposes it: generate()
    would copy the repetition (accepted), but eval's runs draft every block, so τ is 1."""
    model, tok, drafter, _ = looping_pair(tmp_path)
    tally = E.real_runs(model, tok, drafter, ["abc"], temp=0.0, block_size=4, max_tokens=40)
    assert tally.cycles > 10 and tally.result()["tau"] == 1.0
    last = None
    for last in stream_generate(model, tok, "abc", drafter, max_tokens=40, block_size=4):
        pass
    assert last.copies > 0 and last.tau > 2.0
