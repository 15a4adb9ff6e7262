"""`dflash2-mlx serve` as a real process on loopback, driven by the official openai client
and raw HTTP: parity with generate(), parameters, errors, disconnects, queueing."""

import asyncio
import contextlib
import json
import os
import subprocess
import threading
import time

import httpx
import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.sample_utils import make_logits_processors
from openai import OpenAI

from dflash2_mlx.adaptive import COPY_LARGEST
from dflash2_mlx.backend.settings import SettingsStore
from dflash2_mlx.request.sampling import xtc_special_tokens
from helpers import (CHAT, NO_EOS, all_four_replies, counters, cut_inside_an_emoji, free_port, greedy_ids, metrics,
                     serve_command, start_server, stop_server, wait_idle)
from tiny_models import make_drafter, make_target, on_worker, worker_reference

WINDOW = 6000  # the tiny model's context window in these tests
MAX_BATCH = 2  # requests the server runs at once (batched); more wait in its queue of 1


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    target = on_worker(make_target, root / "models" / "tiny")
    drafter = on_worker(make_drafter, root / "drafter", target)
    settings = root / "model_settings.json"
    SettingsStore(settings).set("tiny", dflash_enabled=True, dflash_draft_model=str(drafter),
                                max_context_window=WINDOW)
    proc, base = start_server(root, ["--model-dir", root / "models", "--settings", settings,
                                     "--queue-size", "1", "--max-batch", MAX_BATCH, "--log-level", "warning"])
    yield {"base": base, "target": target, "drafter": drafter, "settings": settings, "proc": proc,
           "root": root, "log": root / "server.log"}
    stop_server(proc)


@pytest.fixture(scope="module")
def reference(server):
    return worker_reference(server["target"], server["drafter"])


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server["base"] + "/v1", api_key="unused", max_retries=0, timeout=60)


def loaded_stats(server) -> dict:
    """/metrics of tiny, loaded first by a one-token request (so a test can run alone)."""
    r = httpx.post(server["base"] + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 200, r.text
    return metrics(server)["models"]["tiny"]


def healthy(server):
    r = httpx.get(server["base"] + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_models_listed(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"


def test_alias_and_default_model(server, client, reference):
    """A model_alias is the model's name in /v1/models and in replies (its id still works);
    with is_default (or as the only model served) a request may name no model."""
    store = SettingsStore(server["settings"])
    r = httpx.post(server["base"] + "/v1/completions", json={"prompt": "hello world", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["model"] == "tiny"
    store.set("tiny", model_alias="tiny-chat", is_default=True)
    try:
        assert [m.id for m in client.models.list().data] == ["tiny-chat"]
        assert client.models.retrieve("tiny").id == client.models.retrieve("tiny-chat").id == "tiny-chat"
        r = client.completions.create(model="tiny-chat", prompt="hello world", max_tokens=8)
        assert r.model == "tiny-chat" and r.choices[0].text == reference("hello world", max_tokens=8)
        r = httpx.post(server["base"] + "/v1/completions", json={"prompt": "hello world", "max_tokens": 8})
        assert r.status_code == 200 and r.json()["model"] == "tiny-chat"
        assert r.json()["choices"][0]["text"] == reference("hello world", max_tokens=8)
    finally:
        store.update("tiny", {"model_alias": None, "is_default": None})
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_non_streaming_equals_generate(client, reference):
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == reference(CHAT, max_tokens=24)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len("u:say hi.a:") and r.usage.completion_tokens == 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24


def test_chat_streaming_equals_generate(client, reference):
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference(CHAT, max_tokens=24)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # really streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].usage.prompt_tokens == 11
    dflash = chunks[-1].model_extra["dflash"]  # the draft statistics ride with the usage
    assert sum(dflash["block_sizes"].values()) == dflash["cycles"] > 0 and "fallback" in dflash
    assert 0 <= dflash["shadows"] <= dflash["block_sizes"].get("1", 0)


def test_chat_template_kwargs_are_taken(client, reference):
    # The tiny template reads no variables: the reply is the one without them.
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == reference(CHAT, max_tokens=12)


def test_completions_equal_generate(client, reference):
    r = client.completions.create(model="tiny", prompt="hello world", max_tokens=20)
    assert r.choices[0].text == reference("hello world", max_tokens=20)
    assert r.usage.prompt_tokens == 11 and r.usage.completion_tokens == 20
    text = "".join(c.choices[0].text for c in
                   client.completions.create(model="tiny", prompt="hello world", max_tokens=20, stream=True))
    assert text == r.choices[0].text


def test_sampling_parameters_are_honoured(server, client, reference):
    def chat(**kw):
        return client.chat.completions.create(model="tiny", messages=CHAT, **kw).choices[0]

    # A seed promises its text under a fixed block size (auto's sizes follow each process's clock).
    store = SettingsStore(server["settings"])
    store.update("tiny", {"dflash_block_size": 4})
    try:
        a, b = chat(max_tokens=16, temperature=1.0, seed=7), chat(max_tokens=16, temperature=1.0, seed=7)
        assert a.message.content == b.message.content == reference(CHAT, max_tokens=16, temp=1.0, seed=7,
                                                                   block_size=4)
        # mlx-lm's server options beyond OpenAI's: min_tokens_to_keep and XTC (sparing "\n" and EOS).
        xtc = dict(min_p=0.05, min_tokens_to_keep=2, xtc_probability=0.9, xtc_threshold=0.05)
        got = chat(max_tokens=16, temperature=1.0, seed=7, logit_bias={"1": -100}, extra_body=xtc)
        special = xtc_special_tokens(load(str(server["target"]))[1])
        ref = dict(max_tokens=16, temp=1.0, seed=7, xtc_special_tokens=special, block_size=4,
                   logits_processors=make_logits_processors(logit_bias={1: -100.0}))
        assert got.message.content == reference(CHAT, **ref, **xtc)
        assert got.message.content != reference(CHAT, **ref, **{**xtc, "xtc_probability": 0.0})
    finally:
        store.update("tiny", {"dflash_block_size": None})
    greedy = reference(CHAT, max_tokens=16)
    assert {chat(max_tokens=16, temperature=1.0, seed=s).message.content for s in (1, 2, 3)} - {greedy}
    # top_p keeps only the most likely token: sampling at T=1 becomes greedy.
    assert chat(max_tokens=16, temperature=1.0, top_p=1e-6, seed=3).message.content == greedy
    full = reference(CHAT, max_tokens=40)
    stop = full[12:15]
    cut = chat(max_tokens=40, stop=[stop, "qqqq"])
    assert cut.message.content == full[: full.find(stop)] and cut.finish_reason == "stop"
    assert client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5).usage.completion_tokens == 5


BAD_REQUESTS = [
    # (path, raw body, status, param or code fragment)
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, None),
    ("/v1/chat/completions", b"\xff\xfe not utf8", 400, None),
    ("/v1/chat/completions", b'["a", "list"]', 400, None),
    ("/v1/chat/completions", {"model": "nope", "messages": CHAT}, 404, "model_not_found"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model_not_found"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "xtc_threshold": 0.6}, 400, "xtc_threshold"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "top_logprobs": 2}, 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "logprobs": 6}, 400, "logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "xtc_probability": 2}, 400, "xtc_probability"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "min_tokens_to_keep": 0}, 400, "min_tokens_to_keep"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": "9"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "n": 2}, 400, "n"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "stop": 5}, 400, "stop"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "seed": 1.5}, 400, "seed"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a" * WINDOW}]},
     400, "context_length_exceeded"),
    ("/v1/chat/completions", {"model": "tiny", "stream": True,
                              "messages": [{"role": "user", "content": "a" * WINDOW}]}, 400, "context_length_exceeded"),
    ("/v1/completions", {"model": "tiny", "prompt": "b" * (WINDOW + 1)}, 400, "context_length_exceeded"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": WINDOW + 1, "stream": True}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": [3, 4, 100000]}, 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": [[3, 4], []]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [[3, 4], [5, 100000]], "echo": True}, 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"], "stream": True}, 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "echo": True, "logprobs": 6}, 400, "logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "chat_template_kwargs": [1]}, 400,
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "chat_template_kwargs": {"tokenize": False}},
     400, "chat_template_kwargs"),
]


def test_logprobs_as_openai_returns_them(server, client):
    """Chat (logprobs / top_logprobs) and legacy completions (logprobs: n), streaming or not:
    one entry per reply token, the same both ways; none unless asked for."""
    ask = dict(model="tiny", messages=CHAT, max_tokens=10, logit_bias={"1": -100})
    whole = client.chat.completions.create(**ask, logprobs=True, top_logprobs=2).choices[0]
    entries = whole.logprobs.content
    assert len(entries) == 10 and "".join(e.token for e in entries) == whole.message.content
    for e in entries:  # greedy: the token is the most likely one
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == e.logprob >= e.top_logprobs[1].logprob
    streamed = [e for c in client.chat.completions.create(**ask, logprobs=True, top_logprobs=2, stream=True)
                for e in ((c.choices[0].logprobs.content or []) if c.choices and c.choices[0].logprobs else [])]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in entries]
    assert client.chat.completions.create(**ask).choices[0].logprobs is None
    r = httpx.post(server["base"] + "/v1/completions", json={"model": "tiny", "prompt": "abcd", "max_tokens": 10,
                                                             "logprobs": 2, "logit_bias": {"1": -100}})
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"] and len(lp["token_logprobs"]) == 10
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert all(1 <= len(t) <= 2 and max(t.values()) >= p for t, p in zip(lp["top_logprobs"], lp["token_logprobs"]))


def test_echo_scores_prompts_as_lm_eval_asks(server):
    """lm-eval's loglikelihood request (its local-completions payload: a batch of token-id
    prompts, echo, logprobs 1, max_tokens 1, temperature 0) read the way lm-eval reads it
    (token_logprobs[ctxlen:-1]; greedy where each equals its top): the target's own
    teacher-forced figures, a choice per prompt; then text prompts, streaming, max_tokens 0."""
    model, tok = on_worker(load, str(server["target"]))
    prompts = [tok.encode("hello world how are"), tok.encode("say hi to me")]
    ctxlens = [3, 2]  # context tokens; the rest is the continuation scored
    r = httpx.post(server["base"] + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
        "echo": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts)) and len(body["dflash"]) == 2
    for choice, ids, ctxlen in zip(body["choices"], prompts, ctxlens):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert choice["text"].startswith(tok.decode(ids)) and lp["text_offset"][0] == 0
        rows = on_worker(lambda: target_logprobs(model, ids).tolist())
        want = [row[t] for row, t in zip(rows, ids[1:])]
        got = lp["token_logprobs"][ctxlen:-1]
        assert abs(sum(got) - sum(want[ctxlen - 1:])) < 1e-3
        greedy = all(g == max(top.values()) for g, top in zip(got, lp["top_logprobs"][ctxlen:-1]))
        assert greedy == all(max(range(len(row)), key=row.__getitem__) == t
                             for row, t in zip(rows[ctxlen - 1:], ids[ctxlen:]))
        one = httpx.post(server["base"] + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": ids, "max_tokens": 1, "logprobs": 1, "echo": True}).json()["choices"][0]
        assert one["logprobs"]["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-4)
    ask = {"model": "tiny", "prompt": "abcd", "max_tokens": 5, "logprobs": 2, "echo": True, "logit_bias": NO_EOS}
    whole = httpx.post(server["base"] + "/v1/completions", json=ask, timeout=60).json()["choices"][0]
    plain = httpx.post(server["base"] + "/v1/completions", json={**ask, "echo": False}, timeout=60).json()["choices"][0]
    assert whole["text"] == "abcd" + plain["text"]
    assert whole["logprobs"]["tokens"] == [tok.decode([t]) for t in tok.encode("abcd")] + plain["logprobs"]["tokens"]
    events = []
    with httpx.stream("POST", server["base"] + "/v1/completions", json={**ask, "stream": True}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    streamed = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(c["text"] for c in streamed) == whole["text"]
    assert [t for c in streamed for t in c["logprobs"]["tokens"]] == whole["logprobs"]["tokens"]
    assert [o for c in streamed for o in c["logprobs"]["text_offset"]] == whole["logprobs"]["text_offset"]
    scored = httpx.post(server["base"] + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "abcd", "max_tokens": 0, "echo": True, "logprobs": 0}).json()
    assert scored["choices"][0]["text"] == "abcd" and scored["usage"]["completion_tokens"] == 0
    assert scored["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(
        whole["logprobs"]["token_logprobs"][1:4], abs=1e-4)
    echoed = httpx.post(server["base"] + "/v1/completions", timeout=60,
                        json={**ask, "logprobs": None}).json()["choices"][0]
    assert echoed["text"] == whole["text"] and echoed["logprobs"] is None


def test_tokenizer_routes_as_vllm_serves_them(server):
    """vLLM's /tokenizer_info, /tokenize (text or chat messages) and /detokenize, which
    lm-eval uses when a server has them; a server of one model needs no model name."""
    _, tok = on_worker(load, str(server["target"]))
    base = server["base"]
    info = httpx.get(base + "/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["model_max_length"] == WINDOW
    assert info["chat_template"] == tok.chat_template
    assert httpx.get(base + "/tokenizer_info", params={"model": "tiny"}).json() == info
    got = httpx.post(base + "/tokenize", json={"prompt": "hello world", "add_special_tokens": False,
                                               "return_token_strs": True}).json()
    assert got["tokens"] == tok.encode("hello world", add_special_tokens=False) and got["count"] == len(got["tokens"])
    assert "".join(got["token_strs"]) == "hello world" and got["max_model_len"] == WINDOW
    chat = httpx.post(base + "/tokenize", json={"model": "tiny", "messages": CHAT}).json()
    assert chat["tokens"] == tok.apply_chat_template(CHAT, add_generation_prompt=True)
    as_prompt = httpx.post(base + "/tokenize", json={"prompt": CHAT, "add_special_tokens": False}).json()
    assert as_prompt["tokens"] == chat["tokens"]  # lm-eval's --apply_chat_template sends them so
    assert httpx.post(base + "/detokenize", json={"tokens": got["tokens"]}).json() == {"prompt": "hello world"}
    for path, body, param in (("/tokenize", {}, None), ("/tokenize", {"prompt": "a", "messages": CHAT}, None),
                              ("/detokenize", {"tokens": [3, 100000]}, None),
                              ("/tokenize", {"model": "nope", "prompt": "a"}, "model")):
        r = httpx.post(base + path, json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
    r = httpx.post(base + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "tiny"


def target_logprobs(model, ids):
    """The target's log-probability rows after each prefix of ``ids`` (one pass)."""
    logits = model(mx.array([ids]))[0, :-1].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


@pytest.mark.parametrize("path,body,status,what", BAD_REQUESTS)
def test_bad_requests_get_openai_errors(server, path, body, status, what):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server["base"] + path, content=data, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if what is not None:
        assert what in (error["param"] or "", error["code"] or "")
    healthy(server)


def test_unknown_route_and_method(server):
    r = httpx.get(server["base"] + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.get(server["base"] + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["message"]
    assert r.headers.get("allow") == "POST"  # the methods it takes (RFC 9110)


def test_server_still_serves_after_bad_requests(client, reference):
    r = client.completions.create(model="tiny", prompt="hello world", max_tokens=8)
    assert r.choices[0].text == reference("hello world", max_tokens=8)


def test_disconnect_stops_generation(server):
    before = metrics(server)["models"]["tiny"]
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 5000, "stream": True, "logit_bias": NO_EOS}
    with httpx.stream("POST", server["base"] + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(8)]
        assert any('"content"' in line for line in got)
        assert metrics(server)["active_requests"]
    after = wait_idle(server)["models"]["tiny"]  # closed: the generation must stop
    assert after["aborted_requests"] == before["aborted_requests"] + 1
    assert after["generation_tokens"] - before["generation_tokens"] < 5000


def test_full_queue_answers_503_and_queued_request_completes(server):
    async def scenario():
        async with httpx.AsyncClient(base_url=server["base"], timeout=60) as http:
            long = {"model": "tiny", "prompt": "hello", "max_tokens": 5000, "stream": True, "logit_bias": NO_EOS}
            async with contextlib.AsyncExitStack() as streams:
                readers = []  # kept: a line reader dropped unfinished closes its stream
                for _ in range(MAX_BATCH):  # every running place taken
                    running = await streams.enter_async_context(http.stream("POST", "/v1/completions", json=long))
                    readers.append(running.aiter_lines())
                    await readers[-1].__anext__()
                queued = asyncio.create_task(http.post(
                    "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 6}))
                for _ in range(400):
                    if (await http.get("/metrics")).json()["models"]["tiny"]["queued_requests"] == 1:
                        break
                    await asyncio.sleep(0.025)
                t = time.perf_counter()
                full = await http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
                refused_in = time.perf_counter() - t
                assert full.status_code == 503, full.text
                assert full.json()["error"]["code"] == "queue_full" and refused_in < 2.0
                assert not queued.done()
            done = await queued  # the long streams closed: the queued request runs
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 6

    asyncio.run(scenario())
    wait_idle(server)
    healthy(server)


def test_two_concurrent_clients_both_complete(client, reference):
    prompts = {"a": [{"role": "user", "content": "first one"}], "b": [{"role": "user", "content": "second"}]}
    results, errors = {}, []

    def ask(key):
        try:
            r = client.chat.completions.create(model="tiny", messages=prompts[key], max_tokens=20)
            results[key] = r.choices[0].message.content
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(k,)) for k in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert results == {k: reference(p, max_tokens=20) for k, p in prompts.items()}


def test_metrics_report_engine_stats(server):
    stats = metrics(server)["models"]["tiny"]
    assert stats["loaded"] and stats["drafter"] == server["drafter"].name  # its name, not its path
    assert stats["requests"] >= 10 and stats["generation_tokens"] > 100 and stats["cycles"] > 0
    assert stats["mean_tau"] >= 1.0 and len(stats["acceptance_by_position"]) == COPY_LARGEST - 1  # auto: copies up to 15 rows
    assert sum(stats["block_sizes"].values()) == stats["cycles"] and "adaptive_fallbacks" in stats
    assert stats["rejected_requests"] >= 1 and stats["generation_tps"] > 0


def test_prefix_cache_across_chat_turns(server, client, reference):
    """A second turn reuses the first one's caches: same text as generate(), cached tokens
    reported as OpenAI does, hits and bytes in /metrics."""
    before = loaded_stats(server)
    messages = [{"role": "user", "content": "tell me about the sea"}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "and the sky"}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16)
    assert second.choices[0].message.content == reference(messages, max_tokens=16)
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens
    after = metrics(server)["models"]["tiny"]
    assert after["prefix_cache_hits"] > before["prefix_cache_hits"]
    assert 0 < after["prefix_cache_bytes"] <= after["prefix_cache_budget_bytes"]


def test_load_test_answers_only_200_or_503_before_the_stream(server):
    """16 concurrent streaming clients on a queue of 1: every refusal is a 503 JSON error,
    never a 200 whose stream carries an error."""
    async def client(http, i):
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"go {i}"}], "max_tokens": 12,
                "stream": True}
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            text = (await r.aread()).decode()
            return r.status_code, r.headers.get("content-type", ""), text

    async def scenario():
        async with httpx.AsyncClient(base_url=server["base"], timeout=120) as http:
            return await asyncio.gather(*(client(http, i) for i in range(16)))

    results = asyncio.run(scenario())
    assert {status for status, _, _ in results} <= {200, 503}
    assert any(status == 503 for status, _, _ in results) and any(status == 200 for status, _, _ in results)
    for status, kind, text in results:
        if status == 503:
            assert kind.startswith("application/json") and json.loads(text)["error"]["code"] == "queue_full"
        else:
            assert '"error"' not in text and text.rstrip().endswith("data: [DONE]")
    wait_idle(server)
    healthy(server)


def test_models_show_the_engine_they_run(server, client):
    card = httpx.get(server["base"] + "/v1/models").json()["data"][0]
    # The drafter by its name: its path on this machine is not shown (issue 41).
    verify_rows = card["dflash"].pop("verify_rows")  # the probe's verdict, once measured here
    card["dflash"].pop("live", None)  # what it has served, once loaded (tested below)
    assert verify_rows == "not probed on this machine" or verify_rows.startswith(("exact", "not row-exact"))
    assert card["dflash"] == {"dflash": True, "drafter": server["drafter"].name, "verify_mode": "dflash",
                              "block_size": "auto"}
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4)
    assert r.model_extra["dflash"]["dflash"] is True and r.model_extra["dflash"]["block_size"] == "auto"


BAD_BODIES = [
    # (content type, raw body, status, what the error names)
    ("text/plain", json.dumps({"model": "tiny", "messages": CHAT}).encode(), 415, "unsupported_media_type"),
    ("application/x-www-form-urlencoded", b"model=tiny", 415, "unsupported_media_type"),
    ("application/json", b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
     400, "messages"),
]


@pytest.mark.parametrize("kind,body,status,what", BAD_BODIES)
def test_bodies_that_are_not_json_text(server, kind, body, status, what):
    r = httpx.post(server["base"] + "/v1/chat/completions", content=body, headers={"content-type": kind})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert what in (error["param"] or "", error["code"] or "")
    assert "tokeniz" not in error["message"].lower() and "internal" not in error["message"]


def test_setting_impossible_for_the_drafter_is_a_4xx_and_keeps_the_model(server, client):
    store = SettingsStore(server["settings"])
    before = loaded_stats(server)["requests"]
    data = json.loads(server["settings"].read_text())
    data["models"]["tiny"]["dflash_block_size"] = 99  # written by hand: the CLI refuses it
    server["settings"].write_text(json.dumps(data))
    try:
        r = httpx.post(server["base"] + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dflash_block_size", r.text
        assert "tiny" in httpx.get(server["base"] + "/health").json()["loaded_models"]
        assert metrics(server)["models"]["tiny"]["requests"] == before  # not reloaded: stats kept
    finally:
        store.update("tiny", {"dflash_block_size": None})
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_corrupted_settings_file_keeps_the_last_good_settings(server, client, reference):
    good = server["settings"].read_text()
    server["settings"].write_text(good[: len(good) // 2])  # a torn file
    try:
        health = httpx.get(server["base"] + "/health").json()
        assert health["status"] == "degraded" and "not valid JSON" in health["problem"]
        r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8)
        assert r.choices[0].message.content == reference(CHAT, max_tokens=8)
        r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8)
        assert r.model_extra["dflash"]["drafter"] == server["drafter"].name  # still with the drafter
    finally:
        server["settings"].write_text(good)
    healthy(server)
    lines = [x for x in server["log"].read_text().splitlines() if "last good settings" in x]
    assert len(lines) == 1 and "Traceback" not in server["log"].read_text()


def test_serve_with_a_corrupted_settings_file_is_one_line(server, tmp_path):
    bad = tmp_path / "model_settings.json"
    bad.write_text('{"models": {')
    r = subprocess.run(serve_command() + ["serve", "--model-dir", str(server["root"] / "models"), "--settings",
                                          str(bad), "--preload", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert len([x for x in r.stderr.splitlines() if x.startswith("error:")]) == 1 and "not valid JSON" in r.stderr


@pytest.mark.parametrize("args,message", [("[1]", "must be a JSON object"), ("{x}", "invalid JSON")])
def test_serve_with_bad_chat_template_args_says_why(server, args, message):
    r = subprocess.run(serve_command() + ["serve", "--model-dir", str(server["root"] / "models"),
                                          "--chat-template-args", args, "--port", str(free_port())],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--chat-template-args" in r.stderr and message in r.stderr


def test_api_key_locks_every_route_but_health(server, tmp_path):
    key = "s3cret-key-for-tests"
    proc, base = start_server(tmp_path, ["--model-dir", server["root"] / "models", "--settings", server["settings"]],
                              env={**os.environ, "DFLASH2_MLX_API_KEY": key})
    try:
        assert httpx.get(base + "/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            r = httpx.get(base + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=headers)
            assert r.status_code == 401
        good = OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=60)
        assert good.completions.create(model="tiny", prompt="hi", max_tokens=3).usage.completion_tokens == 3
        assert key not in httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {key}"}).text
    finally:
        stop_server(proc)
    assert key not in (tmp_path / "server.log").read_text()


def test_manager_edits_settings_file(server, client, reference):
    store = SettingsStore(server["settings"])
    store.set("tiny", dflash_enabled=False)  # a model manager turns DFlash off
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12)
    assert r.choices[0].message.content == reference(CHAT, max_tokens=12)  # plain decoding, same text
    stats = metrics(server)["models"]["tiny"]
    assert stats["drafter"] is None and stats["cycles"] == 0  # reloaded without the drafter
    store.set("tiny", max_context_window=8)
    r = httpx.post(server["base"] + "/v1/completions", json={"model": "tiny", "prompt": "nine char"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_reply_cut_inside_an_emoji_is_the_same_streaming_or_not(tmp_path):
    """A byte-level tokenizer writes an emoji as two tokens; a max_tokens that ends between
    them leaves the cut emoji out of the reply, streaming or not (no U+FFFD)."""
    # Seed 2 (sharp logits): the tiny model's greedy reply has an emoji after some plain text.
    target = on_worker(make_target, tmp_path / "models" / "emoji", seed=2, scale=4.0, byte_level=True)
    ids, tokenizer = on_worker(greedy_ids, target, CHAT, 30)
    cut = cut_inside_an_emoji(ids, tokenizer)
    assert cut, tokenizer.convert_ids_to_tokens(ids)
    clean, whole = tokenizer.decode(ids[: cut - 1]), tokenizer.decode(ids[: cut + 1])
    assert clean and "\ufffd" not in whole and len(whole) == len(clean) + 1 and ord(whole[-1]) > 0xFFFF
    assert tokenizer.decode(ids[:cut]).endswith("\ufffd")  # what max_tokens=cut leaves undecodable
    proc, base = start_server(tmp_path, ["--model-dir", tmp_path / "models",
                                         "--settings", tmp_path / "model_settings.json"])
    try:
        assert all_four_replies(base, cut) == [clean] * 4
        assert all_four_replies(base, cut + 1) == [whole] * 4
    finally:
        stop_server(proc)


def test_tool_call_arguments_reach_the_template_as_objects():
    """As mlx_lm.server does: JSON-text arguments become the object (a template's tojson
    then writes them once); text that is not JSON stays; the request's messages are untouched."""
    import jinja2

    from dflash2_mlx.backend.tool_calls import template_messages

    sent = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                {"id": "b", "type": "function", "function": {"name": "g", "arguments": "not json"}}]}]
    out = template_messages(sent)
    calls = out[1]["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"x": 1} and calls[1]["function"]["arguments"] == "not json"
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}' and out[0] is sent[0]
    env = jinja2.Environment()
    env.filters["tojson"] = json.dumps
    rendered = env.from_string("{{ m.tool_calls[0].function.arguments | tojson }}").render(m=out[1])
    assert rendered == '{"x": 1}'


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": CHAT}),
    ("/v1/completions", {"prompt": "hello world"}),
    ("/v1/messages", {"messages": CHAT}),
    ("/v1/responses", {"input": "say hi"}),
    ("/api/chat", {"messages": CHAT}),
    ("/api/generate", {"prompt": "hello world"}),
])
def test_every_api_tells_the_engine_in_its_headers(server, path, body):
    """Clients whose SDK drops the body's dflash block still see how a response was decoded:
    the engine before a stream starts, the draft statistics with a whole response."""
    SettingsStore(server["settings"]).set("tiny", dflash_enabled=True, dflash_draft_model=str(server["drafter"]),
                                          max_context_window=WINDOW)  # as the server started (a test edits them)
    limit = {"/v1/responses": "max_output_tokens", "/api/chat": None, "/api/generate": None}.get(path, "max_tokens")
    body = {**body, "model": "tiny", **({limit: 12} if limit else {"options": {"num_predict": 12}})}
    whole = httpx.post(server["base"] + path, json={**body, "stream": False}, timeout=60)
    assert whole.status_code == 200, whole.text
    h = whole.headers
    assert h["x-dflash-engine"] == "dflash" and h["x-dflash-verify-mode"] == "dflash"
    assert h["x-dflash-drafter"] == server["drafter"].name and h["x-dflash-block-size"] == "auto"
    assert float(h["x-dflash-tau"]) >= 1.0 and int(h["x-dflash-cycles"]) > 0
    with httpx.stream("POST", server["base"] + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["x-dflash-engine"] == "dflash"
        assert r.headers["x-dflash-drafter"] == server["drafter"].name and "x-dflash-tau" not in r.headers
        r.read()


def test_tools_the_template_cannot_render_are_a_400(server):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    r = httpx.post(server["base"] + "/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": CHAT, "tools": tools, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "does not render tools" in r.json()["error"]["message"]


def test_model_listings_show_live_counters_and_no_paths(server):
    """/v1/models and Ollama's /api/ps show what a loaded model has served (requests, τ,
    tokens), and no listing or stats route shows where the drafter lies on the server."""
    ask = {"model": "tiny", "messages": CHAT, "max_tokens": 6}
    assert httpx.post(server["base"] + "/v1/chat/completions", timeout=60, json=ask).status_code == 200  # loaded
    wait_idle(server)
    before = httpx.get(server["base"] + "/v1/models").json()["data"][0]["dflash"]["live"]["requests"]
    r = httpx.post(server["base"] + "/v1/chat/completions", timeout=60, json=ask)
    assert r.status_code == 200, r.text
    wait_idle(server)
    live = httpx.get(server["base"] + "/v1/models").json()["data"][0]["dflash"]["live"]
    assert live["requests"] == before + 1 and live["generation_tokens"] > 0 and live["active_requests"] == 0
    ps = httpx.get(server["base"] + "/api/ps").json()["models"]
    assert ps and ps[0]["dflash"]["live"]["requests"] == live["requests"]
    for route in ("/v1/models", "/api/ps", "/health", "/api/tags", "/metrics"):
        text = httpx.get(server["base"] + route).text
        assert str(server["drafter"].parent) not in text, route


def test_a_scored_prompt_is_no_fallback_in_the_response_nor_in_metrics(server):
    """One definition of "fallback": a short reply to a scored prompt (echo + logprobs) goes
    on plain by design; neither its dflash block nor /metrics calls it a fallback."""
    before = counters(metrics(server), "tiny")
    r = httpx.post(server["base"] + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "abcd", "max_tokens": 1, "logprobs": 1, "echo": True})
    assert r.status_code == 200, r.text
    assert r.json()["dflash"]["fallback"] is False
    after = counters(wait_idle(server), "tiny")
    assert after["plain_fallbacks"] == before["plain_fallbacks"]
    assert after["adaptive_fallbacks"] == before["adaptive_fallbacks"]
