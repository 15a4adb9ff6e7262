"""`dflash2-mlx serve` with continuous batching, as a real process driven by the openai
client: requests that run together share one batched draft and verify pass, and each one
still gets exactly its single-stream reply (greedy, and seeded sampled with a fixed block
size), whatever joins or leaves the batch around it; the queue, the usage and the DFlash
metadata stay as they are one request at a time."""

import asyncio
import json
import subprocess
import threading

import httpx
import pytest
from mlx_lm.sample_utils import make_logits_processors
from openai import OpenAI

from dflash2_mlx.backend.settings import SettingsStore
from dflash2_mlx.eval.bench_serve import BASELINE, BATCHED, markdown, percentile, ratios, summarize
from dflash2_mlx.generate import load, stream_generate
from helpers import (CHAT, NO_EOS, all_four_replies, cut_inside_an_emoji, greedy_ids, metrics, serve_command,
                     start_server, stop_server, wait_idle)
from tiny_models import make_drafter, make_target, on_worker, worker_reference

MAX_BATCH = 4
QUEUE = 2
BLOCK = 4  # fixed: every cycle drafts, and a seeded sampled reply is its single stream's


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch-server")
    target = on_worker(make_target, root / "models" / "tiny", alphabet="abcd", seed=3)
    drafter = on_worker(accepting_drafter, root / "drafter", target)
    settings = root / "model_settings.json"
    # The batch drafts every block: so does each request's single stream here (no copies).
    SettingsStore(settings).set("tiny", dflash_enabled=True, dflash_draft_model=str(drafter),
                                dflash_block_size=BLOCK, dflash_copies=False)
    proc, base = start_server(root, ["--model-dir", root / "models", "--settings", settings,
                                     "--queue-size", QUEUE, "--max-batch", MAX_BATCH,
                                     "--log-level", "warning"])
    yield {"base": base, "target": target, "drafter": drafter, "proc": proc, "root": root}
    stop_server(proc)


@pytest.fixture(scope="module")
def reference(server):
    ref = worker_reference(server["target"], server["drafter"])
    return lambda prompt, **kw: ref(prompt, block_size=BLOCK, lookup=False, **kw)


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server["base"] + "/v1", api_key="unused", max_retries=0, timeout=120)


def accepting_drafter(path, target):
    """A random drafter that is right now and then (a drafter that never is would leave
    every sequence's acceptance untested), as tests/test_batch.py picks one."""
    for seed in range(10, 60):
        make_drafter(path, target, seed=seed)
        model, tokenizer, drafter = load(str(target), str(path))
        last = None
        for last in stream_generate(model, tokenizer, "abcab dcba", drafter, max_tokens=24,
                                    block_size=BLOCK, lookup=False):
            pass
        if 1.2 < last.tau < BLOCK - 0.5:
            return path
    raise AssertionError("no drafter seed accepts some drafts")


def bias(logit_bias):
    return make_logits_processors(logit_bias={int(k): v for k, v in logit_bias.items()})


def together(calls):
    """Run ``calls`` (functions) at once, each on its own thread; their results in order."""
    results, errors = [None] * len(calls), []
    start = threading.Barrier(len(calls))

    def run(i):
        try:
            start.wait()
            results[i] = calls[i]()
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


def test_concurrent_greedy_replies_equal_generate(server, client, reference):
    """Mixed prompts and lengths, an early stop string and a client that hangs up mid-stream,
    all in one batch: every reply is its generate() text, streamed or not."""
    before = metrics(server)["models"].get("tiny", {})
    long_prompt = "tell me a long story about the sea and the sky and the ships " * 3
    full = reference("hello world", max_tokens=40)
    stop = full[12:15]
    asks = [  # (endpoint, request, the reference's prompt and options)
        ("chat", dict(messages=CHAT, max_tokens=24), (CHAT, dict(max_tokens=24))),
        ("text", dict(prompt=long_prompt, max_tokens=33, logit_bias=NO_EOS),
         (long_prompt, dict(max_tokens=33, logits_processors=bias(NO_EOS)))),
        ("text", dict(prompt="hey", max_tokens=5), ("hey", dict(max_tokens=5))),
        ("text", dict(prompt="hello world", max_tokens=40, stop=[stop]), None),
    ]

    def ask(endpoint, body, stream):
        if endpoint == "chat":
            if stream:
                chunks = list(client.chat.completions.create(model="tiny", stream=True, **body))
                return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason
            r = client.chat.completions.create(model="tiny", **body).choices[0]
            return r.message.content, r.finish_reason
        if stream:
            chunks = list(client.completions.create(model="tiny", stream=True, **body))
            return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        r = client.completions.create(model="tiny", **body).choices[0]
        return r.text, r.finish_reason

    def hang_up():
        """Read a few chunks of a long stream, then close the connection."""
        body = {"model": "tiny", "prompt": "abort me", "max_tokens": 3000, "stream": True, "logit_bias": NO_EOS}
        with httpx.stream("POST", server["base"] + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            return [next(lines, "END") for _ in range(6)]

    for stream in (False, True):
        calls = [lambda a=a: ask(a[0], a[1], stream) for a in asks] * 2  # more than MAX_BATCH: some queue
        calls = calls[: MAX_BATCH + QUEUE - 1] + [hang_up]
        got = together(calls)
        for (endpoint, body, ref), (text, finish) in zip(asks * 2, got[:-1]):
            if ref is None:  # the stop string
                assert (text, finish) == (full[: full.find(stop)], "stop")
            else:
                assert text == reference(ref[0], **ref[1]), body
                assert finish == "length"
        assert any('"text"' in line for line in got[-1]) and "END" not in got[-1], got[-1]
    after = wait_idle(server)["models"]["tiny"]
    assert after["aborted_requests"] == before.get("aborted_requests", 0) + 2
    assert after["peak_batch_size"] >= 3 and after["mean_batch_size"] > 1  # really batched
    assert after["mean_tau"] > 1.0  # drafts were accepted: the test checks the verify step too


def test_seeded_sampled_replies_equal_their_single_stream_in_a_batch(client, reference):
    """With a fixed block size a seeded sampled sequence draws from its own key: its reply
    is generate()'s with that seed, next to greedy and unseeded neighbours."""
    seeded = [dict(temperature=1.0, seed=7), dict(temperature=0.8, top_k=5, seed=3),
              dict(temperature=1.0, top_p=0.9, seed=11)]

    def ask(kw):
        extra = {k: kw.pop(k) for k in ("top_k", "min_p") if k in kw}  # not in the client's signature
        return client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, logit_bias=NO_EOS,
                                              extra_body=extra, **kw).choices[0].message.content

    got = together([lambda kw=kw: ask(dict(kw)) for kw in seeded + [dict(temperature=1.0)]])
    for kw, text in zip(seeded, got):
        want = reference(CHAT, max_tokens=20, temp=kw["temperature"], top_k=kw.get("top_k", 0),
                         top_p=kw.get("top_p", 1.0), seed=kw["seed"], logits_processors=bias(NO_EOS))
        assert text == want, kw
    assert len({*got[:3]}) > 1  # temperature is really applied


def test_sampled_replies_stay_well_formed(server, client):
    """Unseeded sampled requests, batched, with every sampling option: each reply is a
    complete OpenAI response whose usage counts its own tokens."""
    options = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8), dict(temperature=1.2, top_k=3),
               dict(temperature=0.9, min_p=0.1, presence_penalty=0.5)]

    def ask(kw):
        extra = {k: kw.pop(k) for k in ("top_k", "min_p") if k in kw}  # not in the client's signature
        return list(client.completions.create(model="tiny", prompt="once upon a time", max_tokens=30, stream=True,
                                              stream_options={"include_usage": True}, extra_body=extra, **kw))

    for chunks in together([lambda kw=kw: ask(dict(kw)) for kw in options]):
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] in ("length", "stop") and all(f is None for f in finishes[:-1])
        usage = chunks[-1].usage
        assert 1 <= usage.completion_tokens <= 30 and usage.prompt_tokens == len("once upon a time")
        if finishes[-1] == "length":
            assert usage.completion_tokens == 30
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert isinstance(text, str) and "\ufffd" not in text
        dflash = chunks[-1].model_extra["dflash"]
        assert sum(dflash["block_sizes"].values()) == dflash["cycles"]
        assert dflash["tau"] >= 1.0 or usage.completion_tokens == 1  # a first token <eos>: no cycle
    wait_idle(server)


def test_full_queue_answers_503_before_the_stream(server):
    """MAX_BATCH streams run, QUEUE wait, the next is a 503 JSON error at once, and the
    waiting ones run when places free up; under a burst only 200s and 503s."""
    async def scenario():
        async with httpx.AsyncClient(base_url=server["base"], timeout=60) as http:
            long = {"model": "tiny", "prompt": "hello", "max_tokens": 3000, "stream": True, "logit_bias": NO_EOS}
            streams = [http.stream("POST", "/v1/completions", json=long) for _ in range(MAX_BATCH)]
            readers = []
            for s in streams:
                r = await s.__aenter__()
                readers.append(r.aiter_lines())  # kept: a dropped reader closes its stream
                await readers[-1].__anext__()
            short = {"model": "tiny", "prompt": "hello", "max_tokens": 6}
            queued = [asyncio.create_task(http.post("/v1/completions", json=short)) for _ in range(QUEUE)]
            for _ in range(400):
                if (await http.get("/metrics")).json()["models"]["tiny"]["queued_requests"] == QUEUE:
                    break
                await asyncio.sleep(0.025)
            full = await http.post("/v1/completions", json={**short, "stream": True})
            assert full.status_code == 503 and full.headers["content-type"].startswith("application/json")
            assert full.json()["error"]["code"] == "queue_full"
            assert not any(q.done() for q in queued)
            for s in streams:
                await s.__aexit__(None, None, None)
            for done in await asyncio.gather(*queued):
                assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 6

            async def burst(i):
                body = {"model": "tiny", "prompt": f"go {i}", "max_tokens": 12, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    return r.status_code, (await r.aread()).decode()

            results = await asyncio.gather(*(burst(i) for i in range(16)))
            assert {s for s, _ in results} == {200, 503}
            for status, text in results:
                if status == 503:
                    assert json.loads(text)["error"]["code"] == "queue_full"
                else:
                    assert '"error"' not in text and text.rstrip().endswith("data: [DONE]")

    asyncio.run(scenario())
    wait_idle(server)


def test_usage_and_dflash_metadata(server, client, reference):
    """Batched replies carry the engine, the block sizes and the prefix cache's cached tokens."""
    card = httpx.get(server["base"] + "/v1/models").json()["data"][0]
    assert card["dflash"]["block_size"] == BLOCK and card["dflash"]["dflash"] is True
    messages = [{"role": "user", "content": "tell me about the sea"}]

    def turn(history):
        return client.chat.completions.create(model="tiny", messages=history, max_tokens=16)

    other = [{"role": "user", "content": "something else entirely"}]
    first, _ = together([lambda: turn(messages), lambda: turn(other)])
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "and the sky"}]
    second, _ = together([lambda: turn(messages), lambda: turn(other)])
    assert second.choices[0].message.content == reference(messages, max_tokens=16)
    # The first turn's prompt (and as much of its reply as reads back the same) came from
    # the prefix cache.
    whole = first.usage.prompt_tokens + first.usage.completion_tokens
    assert first.usage.prompt_tokens < second.usage.prompt_tokens_details.cached_tokens <= whole
    for r in (first, second):
        dflash = r.model_extra["dflash"]
        assert dflash["dflash"] is True and dflash["block_size"] == BLOCK and dflash["verify_mode"] == "dflash"
        assert set(dflash["block_sizes"]) == {str(BLOCK)} and dflash["block_sizes"][str(BLOCK)] == dflash["cycles"]
        assert dflash["tau"] >= 1.0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_emoji_cut_by_max_tokens_in_a_batch(tmp_path):
    """The U+FFFD regression, batched: a reply cut inside an emoji leaves it out, streaming
    or not, while the four replies share the batch."""
    target = on_worker(make_target, tmp_path / "models" / "emoji", seed=2, scale=4.0, byte_level=True)
    drafter = on_worker(make_drafter, tmp_path / "drafter", target)
    ids, tokenizer = on_worker(greedy_ids, target, CHAT, 30)
    cut = cut_inside_an_emoji(ids, tokenizer)
    assert cut, tokenizer.convert_ids_to_tokens(ids)
    clean, whole = tokenizer.decode(ids[: cut - 1]), tokenizer.decode(ids[: cut + 1])
    settings = tmp_path / "model_settings.json"
    SettingsStore(settings).set("emoji", dflash_enabled=True, dflash_draft_model=str(drafter))
    proc, base = start_server(tmp_path, ["--model-dir", tmp_path / "models", "--settings", settings,
                                         "--max-batch", MAX_BATCH])
    try:
        for n, want in ((cut, clean), (cut + 1, whole)):
            assert together([lambda n=n: all_four_replies(base, n)] * 2) == [[want] * 4] * 2
        stats = httpx.get(base + "/metrics").json()["models"]["emoji"]
        assert stats["batching"] and stats["peak_batch_size"] >= 2
    finally:
        stop_server(proc)


def test_bench_serve_rows_and_ratios():
    """The `bench serve` table from request records: aggregate over the row's wall time,
    per-stream speed after the first token, τ weighted by cycles, latency percentiles."""
    assert percentile([4, 1, 3, 2], 50) == 2.5 and percentile([1, 2, 3, 4, 5], 95) == pytest.approx(4.8)
    recs = [dict(sent=0.0, first=0.5, end=2.5, tokens=21, tau=2.0, cycles=10),
            dict(sent=1.0, first=1.5, end=4.0, tokens=11, tau=1.0, cycles=10)]
    row = summarize(recs, BATCHED, 2, {"mean_batch_size": 1.5})
    assert row["aggregate_tps"] == 32 / 4.0 and row["per_stream_tps"] == pytest.approx((10 + 4) / 2)
    assert row["tau"] == 1.5 and row["latency_p50"] == 2.75 and row["ttft_p50"] == 0.5
    base = summarize([dict(r, end=r["end"] * 2) for r in recs], BASELINE, 2)
    (q,) = ratios([row, base])
    assert q["streams"] == 2 and q["aggregate_tps"] == pytest.approx(2.0)
    assert q["latency_p95"] == pytest.approx(row["latency_p95"] / base["latency_p95"])
    report = {"config": dict(model="m", draft="d", requests=1, max_tokens=8, temp=0.0, block_size="auto",
                             max_batch=8),
              "machine": dict(platform="p", cpus=2, mlx="0", metal=False), "rows": [row, base],
              "ratios": [q], "parity_checked": 2, "mismatches": []}
    text = markdown(report)
    assert "| batched | 2 | 2 | 8.0 |" in text and "| one at a time | 2 |" in text
    assert "aggregate tok/s x2.00" in text and "2 of 2 prompts" in text


@pytest.mark.slow
def test_bench_serve_runs_both_servers(tmp_path):
    """`dflash2-mlx bench serve` end to end on the tiny pair: both servers, every row, the
    report files, and at T=0 the same replies from both."""
    on_worker(make_target, tmp_path / "target")
    on_worker(make_drafter, tmp_path / "drafter", tmp_path / "target")
    out = tmp_path / "out"
    args = ["bench", "serve", "-m", tmp_path / "target", "-d", tmp_path / "drafter", "-s", 1, "-s", 3,
            "-n", 2, "--max-tokens", 6, "-o", out]
    r = subprocess.run(serve_command() + [str(a) for a in args], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((out / "bench-serve.json").read_text())
    assert [(row["server"], row["streams"]) for row in report["rows"]] == [
        ("batched", 1), ("one at a time", 1), ("batched", 3), ("one at a time", 3)]
    assert all(row["requests"] == 2 * row["streams"] and row["tokens"] > 0 for row in report["rows"])
    assert report["parity_checked"] == 6 and report["mismatches"] == []
    assert "| batched | 3 | 6 |" in (out / "bench-serve.md").read_text() and "| batched | 3 | 6 |" in r.stdout
