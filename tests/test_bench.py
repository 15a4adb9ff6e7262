"""The benchmark on a tiny pair: report structure, T=0 parity check, the mismatch
detector, report files and the CLI."""

import json
import os
import subprocess
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from typer.testing import CliRunner

from dflash2_mlx.adaptive import COPY_LARGEST
from dflash2_mlx.builtin import bench_sets
from dflash2_mlx.cli.main import app
from dflash2_mlx.eval import bench as Bm
from dflash2_mlx.eval.profile import Timed, timed_cycles
from dflash2_mlx.eval.prompts import sample_prompts
from dflash2_mlx.generate import speculative_generate_step
from dflash2_mlx.loop.target import attach
from dflash2_mlx.model.checkpoint import load_drafter
from tiny_models import make_drafter, make_target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    make_target(root / "target", "qwen3", scale=4.0)
    make_drafter(root / "v1", root / "target", version=1, block_size=5)
    make_drafter(root / "v2", root / "target", version=2, block_size=5)
    for name, rows in (("alpha", [{"question": "the cat sat on"}, {"text": "a dog ran"},
                                  {"text": "sun"}]),
                       ("beta", [{"turns": ["sun and moon", "again"]}])):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    model, tok = mlx_lm.load(str(root / "target"))
    return root, model, tok


def test_first_mismatch():
    assert Bm.first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert Bm.first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert Bm.first_mismatch([1, 2, 3], [1, 2]) == 2
    assert Bm.first_mismatch([], [4]) == 0


def test_sample_prompts_is_seeded_and_bounded(tiny):
    root, _, _ = tiny
    files = [root / "alpha.jsonl", root / "beta.jsonl"]
    a = sample_prompts(files, 2, seed=3)
    assert list(a) == ["alpha", "beta"]
    assert len(a["alpha"]) == 2 and a["beta"] == ["sun and moon"]
    assert a == sample_prompts(files, 2, seed=3)


def test_run_bench_report_and_parity(tiny, tmp_path):
    root, model, tok = tiny
    drafters = {"DFlash v1": load_drafter(str(root / "v1")), "DFlash 2": load_drafter(str(root / "v2"))}
    benches = sample_prompts([root / "alpha.jsonl", root / "beta.jsonl"], 2, seed=0)
    logs = []
    report = Bm.run_bench(model, tok, drafters, benches, temps=(0.0, 1.0), max_tokens=12,
                          block_size=4, log=logs.append)
    assert report["methods"] == ["plain", "DFlash v1", "DFlash 2", "DFlash 2 adaptive",
                                 "DFlash 2 + copies", "DFlash 2 adaptive + copies"]
    assert report["mismatches"] == [] and report["t0_checked"] == 3 * 5
    assert set(report["results"]) == {"alpha", "beta", "overall"}
    for per_temp in report["results"].values():
        assert set(per_temp) == {"T=0", "T=1"}
        for res in per_temp.values():
            assert res["plain"]["speedup"] == pytest.approx(1.0)
            assert "tau" not in res["plain"]
            for m in ("DFlash v1", "DFlash 2"):
                r = res[m]
                assert 1.0 <= r["tau"] <= 4.0
                assert len(r["acceptance_by_position"]) == 3
                assert all(0.0 <= a <= 1.0 for a in r["acceptance_by_position"])
                # Acceptance at a position needs acceptance at every earlier one.
                acc = r["acceptance_by_position"]
                assert all(x >= y for x, y in zip(acc, acc[1:]))
                assert r["tau"] == pytest.approx(1 + sum(acc))
                assert r["tokens_per_s"] > 0 and r["speedup"] > 0
                assert r["block_sizes"] == {4: r["cycles"]} and r["shadows"] == 0
                assert r["copies"] == 0  # the drafter rows draft every block
            assert res["DFlash 2 + copies"]["block_sizes"] == {4: res["DFlash 2 + copies"]["cycles"]}
            assert 0 <= res["DFlash 2 + copies"]["copies"] <= res["DFlash 2 + copies"]["cycles"]
            for m, widest in (("DFlash 2 adaptive", 5), ("DFlash 2 adaptive + copies", COPY_LARGEST)):
                auto = res[m]  # drafts up to the trained 5, copies up to COPY_LARGEST rows
                assert sum(auto["block_sizes"].values()) == auto["cycles"] and max(auto["block_sizes"]) <= widest
                assert 0 <= auto["shadows"] <= auto["block_sizes"].get(1, 0)  # only plain steps carry one
    overall = report["results"]["overall"]["T=0"]["plain"]
    assert overall["runs"] == 3 and overall["tokens"] == sum(
        report["results"][b]["T=0"]["plain"]["tokens"] for b in ("alpha", "beta"))
    paths = Bm.write_report(report, tmp_path)
    assert [p.name for p in paths] == ["bench.json", "bench.md", "speed.png", "acceptance.png"]
    assert all(p.stat().st_size > 0 for p in paths)
    md = (tmp_path / "bench.md").read_text()
    assert "T=0 parity: all 15 DFlash outputs are identical" in md and "MISMATCH" not in md
    assert "Block sizes chosen by the adaptive rows" in md and "calibrated in" in md and "shadow probe" in md
    # The cycle breakdown of the last drafter at the fixed block size, in the report.
    cyc = report["cycle"]
    assert cyc["method"] == "DFlash 2" and cyc["block_size"] == 4 and cyc["tau"] >= 1.0
    assert all(cyc[k] > 0 for k in ("target_1", "target_4", "drafter", "propose", "cycle"))
    assert cyc["bookkeeping"] >= 0 and "Where a cycle's time goes" in md
    assert json.loads((tmp_path / "bench.json").read_text())["methods"] == report["methods"]


def test_mismatch_is_detected_and_reported_loudly(tiny, monkeypatch):
    root, model, tok = tiny
    drafters = {"DFlash 2": load_drafter(str(root / "v2"))}
    real = Bm.run_dflash

    def corrupted(*args, **kw):
        out = real(*args, **kw)
        out["tokens"] = out["tokens"][:3] + [(out["tokens"][3] + 1) % 30] + out["tokens"][4:]
        return out

    monkeypatch.setattr(Bm, "run_dflash", corrupted)
    logs = []
    report = Bm.run_bench(model, tok, drafters, {"alpha": ["the cat sat on"]}, temps=(0.0,),
                          max_tokens=10, adaptive=False, copies=False, log=logs.append)
    (bad,) = report["mismatches"]
    assert bad["method"] == "DFlash 2" and bad["position"] == 3 and bad["bench"] == "alpha"
    assert bad["plain_token"] != bad["method_token"]
    assert any("T=0 MISMATCH" in line for line in logs)
    md = Bm.markdown(report)
    assert "**T=0 MISMATCH: 1 of 1" in md and "## T=0 mismatches" in md


def test_mismatch_record_equal_outputs_is_none(tiny):
    _, _, tok = tiny
    assert Bm.mismatch_record(tok, "b", 0, "m", [5, 6], [5, 6]) is None


def test_cli_bench_writes_report_and_exit_code(tiny, tmp_path):
    root, _, _ = tiny
    out = tmp_path / "out"
    args = ["bench", "--model", str(root / "target"), "--drafter-v2", str(root / "v2"),
            "--bench", str(root / "alpha.jsonl"), "--samples", "1", "--max-tokens", "8",
            "--temp", "0", "--out", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "| DFlash 2 |" in res.output and "| DFlash 2 adaptive |" in res.output
    assert "v1 column is skipped" in res.output
    assert (out / "bench.md").is_file() and (out / "speed.png").is_file()
    res = CliRunner().invoke(app, ["bench", "--model", str(root / "target"), "--out", str(out)])
    assert res.exit_code != 0


def test_the_five_prompt_sets_ship_with_their_sources(monkeypatch, tmp_path):
    monkeypatch.delenv(bench_sets.BENCH_DIR_ENV, raising=False)
    files = bench_sets.default_bench_files()
    assert [f.parent for f in files] == [bench_sets.SHIPPED_BENCH_DIR] * 5
    sources = (bench_sets.SHIPPED_BENCH_DIR / "SOURCES.md").read_text()
    sets = sample_prompts(files, 1000)
    for f in files:
        assert f.name in sources
        assert len(sets[f.stem]) >= 80 and all(isinstance(p, str) and p for p in sets[f.stem])
    for license in ("MIT", "CC-BY-4.0", "Apache-2.0"):
        assert license in sources
    monkeypatch.setenv(bench_sets.BENCH_DIR_ENV, str(tmp_path))
    with pytest.raises(ValueError, match=f"{tmp_path} lacks the prompt set.*gsm8k_test.jsonl"):
        bench_sets.default_bench_files()


@pytest.mark.slow  # the built-in pair's whole bench in a process; run_bench's report: the tests above
def test_readme_bench_command_runs_on_a_tiny_setting(tmp_path):
    """The README's command as a real process, with the built-in pair and the shipped
    prompt sets; only the sample count, token budget and temperatures are cut down."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert "dflash2-mlx bench --samples 2 --max-tokens 64 --out bench-out" in readme
    r = subprocess.run(["dflash2-mlx", "bench", "--samples", "1", "--max-tokens", "2", "--temp", "0",
                        "--out", str(tmp_path / "bench-out")], capture_output=True, text=True,
                       timeout=360, cwd=tmp_path,
                       env={k: v for k, v in os.environ.items() if k != bench_sets.BENCH_DIR_ENV})
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "bench-out" / "bench.json").read_text())
    assert report["config"]["benches"] == {b: 1 for b in bench_sets.BENCH_FILES}
    assert report["methods"] == ["plain", "DFlash v1", "DFlash 2", "DFlash 2 adaptive",
                                 "DFlash 2 + copies", "DFlash 2 adaptive + copies"]
    assert report["mismatches"] == []
    assert "T=0 parity: all 25 DFlash outputs are identical" in r.stdout


def test_sweep_rows_and_adaptive_vs_best_fixed(tiny):
    root, model, tok = tiny
    drafters = {"DFlash 2": load_drafter(str(root / "v2"))}
    report = Bm.run_bench(model, tok, drafters, {"alpha": ["the cat sat on"]}, temps=(0.0,),
                          max_tokens=8, block_size=4, sweep=(2, 4, 1))
    assert report["methods"] == ["plain", "DFlash 2", "DFlash 2 block 1", "DFlash 2 block 2",
                                 "DFlash 2 adaptive", "DFlash 2 + copies", "DFlash 2 adaptive + copies"]
    overall = report["results"]["overall"]["T=0"]
    assert overall["DFlash 2 block 2"]["block_sizes"] == {2: overall["DFlash 2 block 2"]["cycles"]}
    best, tps, ratio = Bm.best_fixed(overall, "DFlash 2", "DFlash 2 adaptive")
    assert tps == max(overall[m]["tokens_per_s"] for m in report["methods"][1:4])
    assert ratio == pytest.approx(overall["DFlash 2 adaptive"]["tokens_per_s"] / tps)
    assert f"the best fixed block size ({best}" in Bm.markdown(report)
    with pytest.raises(ValueError, match="sweep block size 9 is impossible"):
        Bm.dflash_runs(drafters, 4, True, sweep=(9,))


def test_timed_cycles_split_real_cycles_without_changing_them(tiny):
    """The bookkeeping figure: real generations with each target and drafter pass timed
    as it finishes; the timing wrappers leave the tokens as they are."""
    root, model, tok = tiny
    drafter = load_drafter(str(root / "v2"))
    target = attach(model, drafter)
    ids = mx.array(tok.encode("the cat sat on the mat"))
    t = timed_cycles(target, drafter, ids, block_size=4, tokens=12, runs=2)
    assert all(t[k] > 0 for k in ("append", "drafter", "propose", "verify", "total"))
    assert 0 <= t["bookkeeping"] < t["total"]
    assert t["append"] <= t["bookkeeping"]  # the append is part of it
    plain = [x[0] for x in speculative_generate_step(ids, target, drafter, max_tokens=12, block_size=4)]
    times = dict.fromkeys(("a", "b", "c", "d"), 0.0)
    timed = Timed(target, times, "a", "b", lambda i, c: i)
    assert timed.verifiers.block.target is timed  # its verify passes are timed, not only its prefill
    wrapped = [x[0] for x in speculative_generate_step(
        ids, timed, Timed(drafter, times, "c", "d", lambda i, c: i), max_tokens=12, block_size=4)]
    assert wrapped == plain and times["b"] > 0 and times["d"] > 0


def test_tree_rows_and_the_oracle_bound_them(tiny):
    """Tree rows verify trees as deep as the drafter's block; the oracle row (T=0) is the
    τ no tree of that depth over the top 16 can pass, and the chains' τ stay below it."""
    root, model, tok = tiny
    drafters = {"DFlash 2": load_drafter(str(root / "v2"))}
    benches = {"alpha": ["the cat sat on", "a dog ran"]}
    report = Bm.run_bench(model, tok, drafters, benches, temps=(0.0,), max_tokens=16, block_size=3,
                          adaptive=False, copies=False, trees=(4, 16))
    assert report["methods"] == ["plain", "DFlash 2", "DFlash 2 tree 4", "DFlash 2 tree 16"]
    assert report["mismatches"] == []
    assert set(report["oracle"]) == {"3", "5"}  # the chain's block and the drafter's
    res = report["results"]["overall"]["T=0"]
    assert res["DFlash 2"]["tau"] <= report["oracle"]["3"] + 1e-9
    for n in (4, 16):
        assert res[f"DFlash 2 tree {n}"]["tau"] <= report["oracle"]["5"] + 1e-9
    assert "Oracle (T=0)" in Bm.markdown(report)
