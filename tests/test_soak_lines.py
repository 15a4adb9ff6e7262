"""The soak report's timing lines judge what they name: memory the server keeps (not the
caches of the long prompts in flight when a sample is taken), and token gaps over time (not
the mix of contexts decoding together).  Built from logged rows, no server."""

from dflash2_mlx.eval.soak import Soak, SoakConfig, failed_lines, markdown, rss_growth, summarize, unjudged_lines

GB = 2**30


def samples(lifetime, floor, peaks_at, n=100):
    """``n`` samples 5 s apart at ``floor`` bytes, lifted by 1.5 GB where ``peaks_at(i)``."""
    return [{"t": 5.0 * i, "lifetime": lifetime, "disk": 0, "rss": floor + (1.5 * GB if peaks_at(i) else 0)}
            for i in range(n)]


def test_rss_growth_follows_the_floor_not_the_long_prompts_in_flight():
    # Peaks (long prompts' caches) in 10% of the first fifth and 70% of the last: the
    # median would read +60%; the floor is flat.
    flat = samples(1, 2 * GB, lambda i: (i % 10 == 0) if i < 50 else (i % 10 < 7))
    assert abs(rss_growth(flat)[0]) < 0.01
    # A floor that creeps up by 10% is growth, peaks or none.
    creeping = [{**s, "rss": s["rss"] + int(0.2 * GB * s["t"] / 500)} for s in samples(2, 2 * GB, lambda i: i % 4 == 0)]
    assert rss_growth(flat + creeping)[1] > 0.05


def reply(t, seconds, gap, kind="chat"):
    return {"t": t, "kind": kind, "api": "openai-chat", "same": True, "ttft": 1.0, "seconds": seconds,
            "gaps": [gap] * 20, "during_kill": False}


def gap_line(tmp_path, last_alone_gap):
    soak = Soak(SoakConfig(minutes=60, kill=False, reload=False), tmp_path)
    soak.log.requests += [reply(60.0 * i + 30, 20, 0.5) for i in range(10)]  # the first ten minutes
    soak.log.requests += [reply(3000.0 + 60 * i + 30, 20, last_alone_gap) for i in range(10)]
    # In the last ten minutes a long prompt is in the server from 3300 s on: the replies
    # beside it, and its own, take their cycles at its context's cost.
    soak.log.long.append({"sent": 3300.0, "t": 3590.0})
    soak.log.requests += [reply(3320.0 + 20 * i, 15, 2.5) for i in range(12)]
    soak.log.requests.append(reply(3590.0, 290, 2.5, kind="long"))
    return summarize(soak, [], {}, None)["lines"]["p95_token_gap_stable"]


def test_the_gap_line_compares_replies_decoded_with_no_long_prompt_in_the_server(tmp_path):
    line = gap_line(tmp_path, 0.6)
    assert line["ok"] and line["value"] == [0.5, 0.6], line
    assert "all replies: 0.5, 2.5" in line["want"], line


def test_the_gap_line_fails_when_like_replies_slow_down(tmp_path):
    line = gap_line(tmp_path, 0.9)
    assert not line["ok"] and line["value"] == [0.5, 0.9], line


def lines_with_an_empty_first_window(tmp_path, minutes):
    """Replies only after the first window (a sixth of the run, at most ten minutes)."""
    soak = Soak(SoakConfig(minutes=minutes, kill=False, reload=False), tmp_path)
    span = minutes * 60
    soak.log.requests += [reply(span * (0.5 + i / 40), 5, 0.5, kind="short") for i in range(20)]
    soak.log.samples += samples(1, 2 * GB, lambda i: False)
    return summarize(soak, [], {}, None)


def test_a_smoke_run_too_short_for_its_windows_says_its_timing_lines_are_not_judged(tmp_path):
    # A one-minute run's windows are 10 s; its first short reply comes after that.
    report = lines_with_an_empty_first_window(tmp_path, 1)
    assert unjudged_lines(report) == ["p95_ttft_short_stable", "p95_token_gap_stable"], report["lines"]
    assert failed_lines(report) == [], report["lines"]
    assert "not judged" in markdown(report) and "| yes |" in markdown(report)


def test_an_hour_with_no_reply_in_a_window_fails_its_timing_lines(tmp_path):
    # An hour whose first ten minutes hold no reply stalled: that is not "not judged".
    report = lines_with_an_empty_first_window(tmp_path, 60)
    assert {"p95_ttft_short_stable", "p95_token_gap_stable"} <= set(failed_lines(report)), report["lines"]
    assert unjudged_lines(report) == [], report["lines"]
