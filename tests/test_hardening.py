"""The server against a hostile client (issue 41): options out of the model's range, a
sampler that raises, fields of the wrong kind, settings edited wrong while serving, a
disk tier with bad files, dropped clients and big bodies; in-process engines and a real
`dflash2-mlx serve` on loopback."""

import asyncio
import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import mlx.core as mx
import pytest
from mlx_lm.sample_utils import apply_top_k, make_logits_processors

from dflash2_mlx.backend.engine import Engine, InvalidOption
from dflash2_mlx.request.arguments import MAX_SEED
from dflash2_mlx.backend.settings import ModelSettings, SettingsStore
from dflash2_mlx.backend.solo import own_random
from dflash2_mlx.loop.random_keys import RandomStream, swap_key
from helpers import CHAT, NO_EOS, serve_command, start_server, stop_server
from tiny_models import make_drafter, make_target, on_worker, worker_reference

PROMPT = "hello world"
KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
WINDOW = 6000  # the served model's context window
QUEUE, MAX_BATCH = 2, 2


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening")
    target = on_worker(make_target, root / "models" / "tiny")
    drafter = on_worker(make_drafter, root / "drafter", target)
    return root, target, drafter


@pytest.fixture(scope="module")
def reference(models):
    _, target, drafter = models
    return worker_reference(target, drafter)


@pytest.fixture(scope="module")
def engine(models):
    _, target, drafter = models
    e = Engine(target, ModelSettings(dflash_enabled=True, dflash_draft_model=str(drafter)),
               model_id="tiny", max_queue=4, max_batch=2)
    run(e.start())
    yield e
    run(e.stop())


@pytest.fixture(scope="module")
def server(models):
    root, target, drafter = models
    settings = root / "model_settings.json"
    SettingsStore(settings).set("tiny", dflash_enabled=True, dflash_draft_model=str(drafter),
                                max_context_window=WINDOW)
    proc, base = start_server(root, ["--model-dir", root / "models", "--settings", settings,
                                     "--queue-size", QUEUE, "--max-batch", MAX_BATCH, "--log-level", "warning"],
                              env={**os.environ, "DFLASH2_MLX_API_KEY": KEY})
    yield {"base": base, "settings": settings, "proc": proc, "root": root, "drafter": drafter}
    stop_server(proc)


def post(server, path, body, **kw):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server["base"] + path, content=data, timeout=60,
                      headers={"content-type": "application/json", **AUTH}, **kw)


def chat(server, **body):
    return post(server, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 4, **body})


def serves(server):
    r = chat(server)
    assert r.status_code == 200, r.text


def refused(engine, param, **options):
    """The option is refused when the stream is made, naming ``param``."""
    with pytest.raises(InvalidOption) as e:
        engine.stream_generate(PROMPT, max_tokens=2, **options)
    assert e.value.param == param, str(e.value)
    return str(e.value)


# 1. logit_bias --------------------------------------------------------------------------
def test_logit_bias_ids_outside_the_vocabulary_are_refused(engine, reference):
    v = engine.vocab_size
    for key in (str(v), "99999999", v, -1, "-1", "-99999999", "x", "1.5"):
        message = refused(engine, "logit_bias", logit_bias={key: 1.0})
        assert f"0..{v - 1}" in message
    for value in (float("nan"), float("inf"), "1"):
        refused(engine, "logit_bias", logit_bias={"5": value})
    # The last id of the vocabulary is one, and the engine still serves.
    bias = {str(v - 1): 5.0}
    got = run(engine.generate(PROMPT, max_tokens=4, logit_bias=bias)).text
    assert got == reference(PROMPT, max_tokens=4, logits_processors=make_logits_processors(logit_bias={v - 1: 5.0}))


# 2. sampling options bounded up front, random state restored -----------------------------
def test_sampling_options_past_the_vocabulary_are_refused(engine, reference):
    v = engine.vocab_size
    assert "1.." in refused(engine, "top_k", temperature=1.0, top_k=v)
    refused(engine, "top_k", temperature=1.0, top_k=10 ** 9)
    refused(engine, "min_tokens_to_keep", temperature=1.0, min_p=0.1, min_tokens_to_keep=v + 1)
    refused(engine, "min_tokens_to_keep", temperature=1.0, min_p=0.1, min_tokens_to_keep=2 ** 62)
    refused(engine, "temperature", temperature=float("nan"))
    refused(engine, "top_p", temperature=1.0, top_p=float("nan"))
    refused(engine, "repetition_penalty", repetition_penalty=float("inf"))
    refused(engine, "presence_penalty", presence_penalty="high")
    refused(engine, "top_k", top_k=True)
    assert "0..18446744073709551615" in refused(engine, "seed", seed=MAX_SEED + 1)
    refused(engine, "seed", seed=-1)
    # What is in range still runs: the largest top_k, the whole vocabulary kept, the largest seed.
    kw = dict(max_tokens=4, top_k=v - 1, min_p=0.1, min_tokens_to_keep=v, seed=MAX_SEED)
    assert run(engine.generate(PROMPT, temperature=1.0, **kw)).text == reference(PROMPT, temp=1.0, **kw)


def test_a_draw_that_raises_leaves_the_global_key_as_it_was():
    """mlx-lm's samplers are compiled with the global key as input and output: one that
    raises while tracing leaves a key that cannot be read. The stream puts the outer back."""
    mx.random.seed(7)
    outer = mx.random.state[0].tolist()
    logits = mx.zeros((1, 10))
    with pytest.raises(Exception):
        with RandomStream(123):
            apply_top_k(logits, 10)
    assert mx.random.state[0].tolist() == outer
    mx.random.uniform(shape=(2,)).tolist()  # draws again

    def steps():
        yield
        apply_top_k(logits, 10)

    job = own_random(steps)()
    next(job)  # its key drawn from the global one, which is back between its steps
    outer = mx.random.state[0].tolist()
    with pytest.raises(Exception):
        next(job)
    assert mx.random.state[0].tolist() == outer
    assert swap_key(5) == (outer[0] << 32) | outer[1]


# 7. fields of the wrong kind, limits summed, what a client may see ------------------------
def user(content):
    return [{"role": "user", "content": content}]


def tool(function):
    return [{"type": "function", "function": function}]


REFUSED = [
    # (body over a chat request's, param the 400 names)
    ({"messages": user([{"type": "text", "text": 5}])}, "messages"),
    ({"messages": user([{"type": "text", "text": ["a"]}])}, "messages"),
    ({"messages": user(None)}, "messages"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages"),
    ({"messages": [*CHAT, {"role": "assistant", "content": None, "tool_calls": "lookup"}]}, "messages"),
    ({"tools": [{"type": "function", "function": "lookup"}]}, "tools"),
    ({"tools": tool({"description": "no name"})}, "tools"),
    ({"tools": tool({"name": "f", "parameters": [1]})}, "tools"),
    ({"seed": 2 ** 64}, "seed"),
    ({"seed": -1}, "seed"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"33": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"temperature": 1.0, "top_k": 33}, "top_k"),
    ({"temperature": 1.0, "min_p": 0.1, "min_tokens_to_keep": 10 ** 12}, "min_tokens_to_keep"),
    ({"max_tokens": WINDOW - 5}, "max_tokens"),  # fits alone, not with the prompt
]


@pytest.mark.parametrize("extra,param", REFUSED)
def test_malformed_chat_requests_are_400s_naming_the_field(server, extra, param):
    r = chat(server, **extra)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    if param == "seed":
        assert "0..18446744073709551615" in error["message"]
    serves(server)


def test_a_body_nested_deep_is_a_400(server):
    deep = b'{"model": "tiny", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = post(server, "/v1/chat/completions", deep)
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"], r.text
    serves(server)


def test_a_completions_batch_the_queue_never_takes_is_a_400(server):
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": ["a"] * (QUEUE + MAX_BATCH + 1), "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": ["a"] * (QUEUE + MAX_BATCH), "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == QUEUE + MAX_BATCH, r.text


def test_clients_see_neither_the_drafters_path_nor_the_settings_path(server):
    r = httpx.get(server["base"] + "/v1/models", headers=AUTH)
    assert r.status_code == 200
    card = r.json()["data"][0]
    assert card["dflash"]["drafter"] == server["drafter"].name
    assert str(server["root"]) not in r.text
    text = server["settings"].read_text()
    try:
        server["settings"].write_text("{ not json")
        anyone = httpx.get(server["base"] + "/health")
        assert anyone.json()["status"] == "degraded"
        assert str(server["settings"]) not in anyone.text and "Expecting" not in anyone.text
        operator = httpx.get(server["base"] + "/health", headers=AUTH)
        assert str(server["settings"]) in operator.text
    finally:
        server["settings"].write_text(text)
    assert httpx.get(server["base"] + "/health").json()["status"] == "ok"


# 6. settings edited wrong while serving, an empty API key --------------------------------
def health(server, headers=AUTH) -> dict:
    r = httpx.get(server["base"] + "/health", headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("field,value", [("temperature", "hot"), ("max_batch", 0), ("dflash_verify_mode", "wat")])
def test_a_wrong_value_in_the_settings_keeps_the_last_good_ones(server, reference, field, value):
    serves(server)  # loaded with good settings
    good = server["settings"].read_text()
    data = json.loads(good)
    data["models"]["tiny"][field] = value  # written by hand: the CLI refuses it
    server["settings"].write_text(json.dumps(data))
    try:
        state = health(server)
        assert state["status"] == "degraded" and field in state["problem"], state
        r = chat(server, max_tokens=8)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == reference(CHAT, max_tokens=8)
    finally:
        server["settings"].write_text(good)
    assert health(server)["status"] == "ok"


def test_a_settings_path_that_becomes_a_directory(server):
    serves(server)
    path, aside = server["settings"], server["settings"].with_name("aside.json")
    path.rename(aside)
    path.mkdir()
    try:
        state = health(server, headers={})
        assert state["status"] == "degraded"
        serves(server)
        assert httpx.get(server["base"] + "/v1/models", headers=AUTH).status_code == 200
    finally:
        path.rmdir()
        aside.rename(path)
    assert health(server)["status"] == "ok"


def test_an_empty_api_key_is_refused_at_start(server, tmp_path):
    for key in ("", "  "):
        done = subprocess.run(serve_command() + ["serve", "--model-dir", str(server["root"] / "models"),
                                                 "--settings", str(server["settings"]), "--port", "0"],
                              env={**os.environ, "DFLASH2_MLX_API_KEY": key}, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2 and "API key is empty" in done.stderr, done.stderr


# 3. dropped clients, big bodies, tokenizing off the loop ---------------------------------
def metrics_of(server) -> dict:
    return httpx.get(server["base"] + "/metrics", headers=AUTH).json()["models"]["tiny"]


def idle_metrics(server, bound_s=30.0) -> dict:
    """tiny's stats once no request is active (within ``bound_s``)."""
    deadline = time.time() + bound_s
    while time.time() < deadline:
        m = httpx.get(server["base"] + "/metrics", headers=AUTH).json()
        if not m["active_requests"]:
            return m["models"]["tiny"]
        time.sleep(0.05)
    raise AssertionError(f"generation did not stop: {m}")


def test_a_dropped_non_streaming_request_stops_generating(server):
    """As a dropped stream does (behind the API key: its check must not hide the disconnect)."""
    serves(server)
    before = metrics_of(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server["base"] + "/v1/chat/completions", headers=AUTH, timeout=1.0,
                   json={"model": "tiny", "messages": CHAT, "max_tokens": 5000, "logit_bias": NO_EOS})
    after = idle_metrics(server)
    assert after["aborted_requests"] == before["aborted_requests"] + 1
    assert after["generation_tokens"] - before["generation_tokens"] < 5000


def test_a_body_over_the_bound_without_its_length_is_a_413(server):
    def chunks():
        for _ in range(17):
            yield b" " * (1 << 20)
    r = httpx.post(server["base"] + "/v1/chat/completions", content=chunks(), timeout=60,
                   headers={"content-type": "application/json", **AUTH})
    assert r.status_code == 413, r.text
    serves(server)


def test_tokenizing_leaves_the_event_loop_free(engine):
    """A long prompt is encoded off the loop: other tasks run while it is."""
    messages = [{"role": "user", "content": "abc " * 200_000}]

    async def scenario():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        start = ticks
        ids = await engine.off_loop(engine.encode_chat, messages)
        during = ticks - start
        task.cancel()
        return ids, during

    ids, during = run(scenario())
    assert len(ids) > 800_000 and during > 1


# The load test: valid and malformed requests into a running batch (last: it stops the server)
def test_malformed_requests_into_a_running_batch_touch_no_valid_reply(server, reference):
    """Every valid reply equals its reply alone, every malformed request is a 4xx, none a
    500; afterwards the server serves, and SIGTERM stops it."""
    prompts = [f"{w} and then {v}" for w in ("red", "blue", "green") for v in ("up", "down", "away", "in")]
    alone = {p: reference(p, max_tokens=24) for p in prompts}
    bad = [body for body, _ in REFUSED] * 2

    def valid(prompt):
        r = post(server, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 24})
        return prompt, r.status_code, r.json()

    def malformed(extra):
        return chat(server, **extra).status_code

    failed = metrics_of(server)["failed_requests"]
    with ThreadPoolExecutor(QUEUE + MAX_BATCH) as good_pool, ThreadPoolExecutor(4) as bad_pool:
        goods = [good_pool.submit(valid, p) for p in prompts]
        bads = [bad_pool.submit(malformed, b) for b in bad]
        goods, bads = [f.result() for f in goods], [f.result() for f in bads]
    for prompt, status, body in goods:
        assert status == 200, body
        assert body["choices"][0]["text"] == alone[prompt], prompt
    assert all(400 <= s < 500 for s in bads), bads
    assert metrics_of(server)["failed_requests"] == failed  # none began and failed inside
    serves(server)
    server["proc"].terminate()
    assert server["proc"].wait(timeout=30) is not None
