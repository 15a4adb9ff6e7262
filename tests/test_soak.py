"""The soak benchmark's one-minute version: the server on the built-in pair under mixed
traffic with faults (``dflash2-mlx bench soak``), its correctness lines asserted, never a
timing."""

import os
from pathlib import Path

import pytest

from dflash2_mlx.eval.soak import SoakConfig, run_soak

CORRECTNESS = ("greedy_replies_plain", "seeded_replies_repeat", "bad_requests_4xx_in_shape", "hang_ups_counted",
               "no_client_hung", "errors_only_at_the_kill", "disk_tier_within_budget",
               "disk_tier_serves_after_restart", "reload_applied_when_idle")


@pytest.mark.slow
def test_a_minute_of_mixed_traffic_with_faults_keeps_every_reply_right(tmp_path):
    # Long prompts of 520-600 tokens: their caches (24-28 MB) outgrow the 20 MB memory tier,
    # so the disk tier holds them for the restart.
    cfg = SoakConfig(minutes=1.0, clients=3, seed=1, max_tokens=10, short_inputs=4, long_inputs=1,
                     long_tokens=(520, 600), chats=1, turns=2, sampled_inputs=2, sample_s=2.0, prompt_chars=300)
    # The session's home: the built-in pair's costs, once calibrated by an earlier test, serve.
    report = run_soak(cfg, tmp_path, home=Path(os.environ["DFLASH2_MLX_HOME"]), say=lambda s: None)
    failed = {k: report["lines"][k] for k in CORRECTNESS if not report["lines"][k]["ok"]}
    assert not failed, (failed, report["differing"][:3], report["unshaped"][:3])
    counts = report["counts"]
    for kind in ("short", "sampled", "bad", "hang-up"):  # each check saw its traffic
        assert counts.get(kind, 0) > 0, counts
