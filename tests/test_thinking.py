"""Thinking models: a template that opens a think block makes the reply's text up to the
close tag reasoning, returned apart in each API's own field (OpenAI ``reasoning_content``,
Anthropic thinking blocks, Ollama ``thinking``, Responses reasoning items), whole and
streamed; the switch reaches the template from each API (``chat_template_kwargs`` /
``reasoning_effort``, ``thinking``, ``think``, ``reasoning.effort``); and the draft
statistics are split into thinking and answer.  The model: ``tiny_models.thinking_pair``,
whose greedy reply is "hm</think>ok" after a prompt that opened the block, "ok" after one
that closed it."""

import asyncio
import json

import httpx
import pytest

from dflash2_mlx.backend.engine import Engine
from dflash2_mlx.backend.settings import ModelSettings
from dflash2_mlx.backend.thinking import ThinkSplitter
from helpers import start_server, stop_server
from tiny_models import on_worker, thinking_pair

CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("cuts", [[1], [2, 5, 9], list(range(1, 24))])
@pytest.mark.parametrize("thinking", [True, False])
def test_the_splitter_finds_tags_cut_anywhere(cuts, thinking):
    text = ("plan <b> a</th" if thinking else "") + "</think>\n\nthe <thi answer<think>more</think> end"
    if not thinking:
        text = "no tags < here <think>x</think>\ny"
    pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)]) if i < j] if cuts[-1] < len(text) else [text]
    s = ThinkSplitter("<think>", "</think>", thinking)
    reasoning, answer = "", ""
    for p in pieces:
        r, a = s.add(p)
        reasoning, answer = reasoning + r, answer + a
    r, a = s.flush()
    reasoning, answer = reasoning + r, answer + a
    if thinking:
        assert (reasoning, answer) == ("plan <b> a</thmore", "the <thi answer end")
    else:
        assert (reasoning, answer) == ("x", "no tags < here \ny")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return on_worker(thinking_pair, tmp_path_factory.mktemp("thinking"))


def test_the_engine_splits_reasoning_and_counts_each_part(pair):
    target, drafter = pair
    engine = Engine(target, ModelSettings(dflash_enabled=True, dflash_draft_model=str(drafter), dflash_block_size=4),
                    model_id="t")
    asyncio.run(engine.start())
    try:
        c = asyncio.run(engine.chat(CHAT, max_tokens=20))
        assert (c.reasoning, c.text, c.finish_reason) == ("hm", "ok", "stop")
        assert c.completion_tokens == 6  # h m </think> o k <eos>
        seg = c.segments
        assert seg["thinking"]["tokens"] + seg["answer"]["tokens"] == c.completion_tokens
        assert seg["thinking"]["cycles"] + seg["answer"]["cycles"] == c.cycles
        off = asyncio.run(engine.chat(CHAT, max_tokens=20, chat_template_kwargs={"enable_thinking": False}))
        assert (off.reasoning, off.text, off.segments) == ("", "ok", None)

        async def pieces():
            out = []
            async for chunk in engine.stream_chat(CHAT, max_tokens=20):
                out.append((chunk.reasoning, chunk.text))
            return out

        streamed = asyncio.run(pieces())
        assert "".join(r for r, _ in streamed) == "hm" and "".join(t for _, t in streamed) == "ok"
        cut = asyncio.run(engine.chat(CHAT, max_tokens=2))  # all reasoning: cut inside the block
        assert (cut.reasoning, cut.text, cut.finish_reason) == ("hm", "", "length")
    finally:
        asyncio.run(engine.stop())


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):
    target, drafter = pair
    root = tmp_path_factory.mktemp("thinking-server")
    proc, base = start_server(root, ["-m", target, "-d", drafter, "--log-level", "warning"])
    yield base
    stop_server(proc)


def post(base, path, body):
    r = httpx.post(base + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def events(base, path, body) -> list:
    """A stream's JSON payloads (server-sent events or NDJSON lines)."""
    out = []
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            line = line.removeprefix("data: ")
            if line.startswith("{"):
                out.append(json.loads(line))
    return out


def test_openai_chat(server):
    body = {"model": "t", "messages": CHAT, "max_tokens": 20}
    m = post(server, "/v1/chat/completions", body)
    message = m["choices"][0]["message"]
    assert (message["reasoning_content"], message["reasoning"], message["content"]) == ("hm", "hm", "ok")
    assert set(m["dflash"]["segments"]) == {"thinking", "answer"}
    chunks = events(server, "/v1/chat/completions", body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "hm"
    assert "".join(d.get("content") or "" for d in deltas) == "ok"
    # How it is decoded on the first chunk, the draft statistics on the last.
    assert chunks[0]["dflash"]["dflash"] is True and chunks[-1]["dflash"]["cycles"] > 0
    for off in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        message = post(server, "/v1/chat/completions", {**body, **off})["choices"][0]["message"]
        assert "reasoning_content" not in message and message["content"] == "ok"


def test_anthropic_messages(server):
    body = {"model": "t", "messages": CHAT, "max_tokens": 20}
    m = post(server, "/v1/messages", body)
    assert m["content"] == [{"type": "thinking", "thinking": "hm", "signature": ""}, {"type": "text", "text": "ok"}]
    kinds, thought, text = [], "", ""
    for e in events(server, "/v1/messages", body):
        if e["type"] == "content_block_start":
            kinds.append(e["content_block"]["type"])
        elif e["type"] == "content_block_delta":
            thought += e["delta"].get("thinking", "")
            text += e["delta"].get("text", "")
    assert (kinds, thought, text) == (["thinking", "text"], "hm", "ok")
    off = post(server, "/v1/messages", {**body, "thinking": {"type": "disabled"}})
    assert off["content"] == [{"type": "text", "text": "ok"}]


def test_ollama_chat_and_generate(server):
    body = {"model": "t", "messages": CHAT, "stream": False}
    m = post(server, "/api/chat", body)["message"]
    assert (m["thinking"], m["content"]) == ("hm", "ok")
    lines = events(server, "/api/chat", body)
    assert "".join(x["message"].get("thinking", "") for x in lines) == "hm"
    assert lines[0]["dflash"]["dflash"] is True and lines[-1]["dflash"]["cycles"] > 0  # first and last
    assert "thinking" not in post(server, "/api/chat", {**body, "think": False})["message"]
    g = post(server, "/api/generate", {"model": "t", "prompt": "hi", "stream": False, "think": True})
    assert (g["thinking"], g["response"]) == ("hm", "ok")
    # Its context holds the reasoning too, as the conversation had it.
    said = post(server, "/detokenize", {"model": "t", "tokens": g["context"]})["prompt"]
    assert said.removesuffix("<eos>").endswith("<think>hm</think>ok"), said


def test_responses_reasoning_items(server):
    body = {"model": "t", "input": "hi", "max_output_tokens": 20}
    r = post(server, "/v1/responses", body)
    kinds = [i["type"] for i in r["output"]]
    assert kinds == ["reasoning", "message"]
    assert r["output"][0]["content"] == [{"type": "reasoning_text", "text": "hm"}]
    assert r["output"][1]["content"][0]["text"] == "ok"
    assert r["usage"]["output_tokens_details"]["reasoning_tokens"] == 3  # h m </think>
    streamed = events(server, "/v1/responses", body)
    assert "".join(e["delta"] for e in streamed if e["type"] == "response.reasoning_text.delta") == "hm"
    assert streamed[0]["response"]["dflash"]["dflash"] is True and streamed[-1]["response"]["dflash"]["cycles"] > 0
    assert [i["type"] for i in streamed[-1]["response"]["output"]] == ["reasoning", "message"]
    # The reasoning item goes back with the conversation (left out of the prompt).
    again = post(server, "/v1/responses", {**body, "input": r["output"] + [{"role": "user", "content": "hi"}]})
    assert again["output"][-1]["content"][0]["text"] == "ok"
    off = post(server, "/v1/responses", {**body, "reasoning": {"effort": "none"}})
    assert [i["type"] for i in off["output"]] == ["message"]


def test_requests_decoded_together_split_their_own_reasoning(server):
    """Concurrent requests share the batch (one alone hands over to it): each reply's
    reasoning is its own, thinking on or off."""
    from concurrent.futures import ThreadPoolExecutor

    bodies = [{"model": "t", "messages": CHAT, "max_tokens": 20,
               **({"chat_template_kwargs": {"enable_thinking": False}} if i % 2 else {})} for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda b: post(server, "/v1/chat/completions", b), bodies))
    for i, r in enumerate(replies):
        m = r["choices"][0]["message"]
        assert (m.get("reasoning_content", ""), m["content"]) == ("" if i % 2 else "hm", "ok")
    assert max(httpx.get(server + "/metrics").json()["models"]["t"]["peak_batch_size"], 0) >= 2
