"""``bench distributed``: the collectives are counted as the ring sends them, the link model
adds latency per call and bytes over bandwidth, and the command runs end to end over local
ranks with the split target's T=0 text equal to one process's."""

import json
import subprocess
import sys

import mlx.core as mx
import pytest

from dflash2_mlx.eval.bench_distributed import LINKS, Traffic, link_model


def test_traffic_counts_what_each_op_sends():
    group = mx.distributed.init()  # one process: the ops are identities, the counts are not
    traffic = Traffic(size=3)
    traffic.install()
    try:
        x = mx.zeros((4, 8), dtype=mx.float32)  # 128 bytes
        mx.eval(mx.distributed.all_sum(x, group=group), mx.distributed.all_gather(x, group=group))
    finally:
        traffic.uninstall()
    assert mx.distributed.all_sum.__name__ != "counted"  # put back
    snap = traffic.snapshot()
    assert snap["calls"] == {"all_sum": 1, "all_gather": 1}
    assert snap["bytes"]["all_sum"] == pytest.approx(2 * 2 / 3 * 128)
    assert snap["bytes"]["all_gather"] == pytest.approx(2 * 128)
    assert sorted(map(tuple, snap["shapes"])) == [("all_gather", 128, 1), ("all_sum", 128, 1)]


def test_link_model_adds_latency_and_bandwidth():
    rows = {"plain": {"compute_s_per_token": 0.01, "calls_per_token": 100, "bytes_per_token": 1e6},
            "dflash": {"compute_s_per_token": 0.005, "calls_per_token": 40, "bytes_per_token": 2e6}}
    out = link_model(rows)
    for link, (latency, bandwidth) in LINKS.items():
        plain = 0.01 + 100 * latency + 1e6 / bandwidth
        dflash = 0.005 + 40 * latency + 2e6 / bandwidth
        assert out[link]["speedup"] == pytest.approx(plain / dflash)


@pytest.mark.slow
def test_bench_distributed_pipeline_runs(tmp_path):
    cmd = [sys.executable, "-m", "dflash2_mlx.cli.main", "bench", "distributed", "--mode", "pipeline",
           "--ranks", "2", "--samples", "1", "--max-tokens", "8", "--out", str(tmp_path), "--timeout", "200"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=260)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "bench-distributed-pipeline.json").read_text())
    runs = report["runs"]
    assert runs["plain"]["same_text_as_one_process"] == report["prompts"] == 5
    assert runs["dflash"]["same_text_as_one_process"] == 5
    assert runs["dflash"]["calls_per_token"] > 0 and runs["plain"]["bytes_per_token"] > 0
    assert "Thunderbolt 5" in (tmp_path / "bench-distributed-pipeline.md").read_text()
