"""Ollama's API on `dflash2-mlx serve`, driven by the official ollama client: chat and
generate (streamed and not, raw, context) equal to generate()'s tokens at T=0, a tool-call
round trip, options, logprobs, the model routes (list, show, ps, version, the / probe),
loading and unloading, and errors in Ollama's shape (bad options, unknown models,
unsupported routes and fields, the API key).

The server runs the built-in pair (SmolLM2-135M-Instruct and its shipped drafter) behind an
API key. SmolLM2's own chat template has no tools, so the model is served from a directory
that links its files and gives it a template that renders plain chats as SmolLM2's does and
also tools, tool calls and tool results, with mlx-lm's json_tools parser for the calls."""

import json
import os
from pathlib import Path

import httpx
import ollama
import pytest

from dflash2_mlx.builtin.defaults import default_pair
from dflash2_mlx.generate import load, stream_generate
from dflash2_mlx.request.prompt import chat_ids
from helpers import plain_tokens, start_server, stop_server, tool_variant
from tiny_models import on_worker

MODEL = "smol"
KEY = "ollama-test-key"
N = 8  # tokens a reply may have in these tests
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# SmolLM2's template, after the tools (when there are some) as a system message; an
# assistant's tool calls as <tool_call>{...}</tool_call> lines (arguments text or an object), a tool's
# result as a "tool" turn.
TOOL_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\nYou call tools by writing <tool_call>{\"name\": ..., "
    "\"arguments\": ...}</tool_call>. Tools:\\n' }}"
    "{%- for tool in tools %}{{ tool.function | tojson }}{{ '\\n' }}{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if loop.first and message.role != 'system' %}{{ '<|im_start|>system\\n" + SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content }}"
    "{%- for call in message.tool_calls or [] %}{{ '<tool_call>\\n{\"name\": \"' + call.function.name "
    "+ '\", \"arguments\": ' + (call.function.arguments if call.function.arguments is string "
    "else call.function.arguments | tojson) + '}\\n</tool_call>' }}{%- endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHAT = [{"role": "user", "content": "say hi"}]
GREEDY = {"temperature": 0, "num_predict": N}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("ollama")
    target, drafter = default_pair()
    served = tool_variant(Path(target), root / MODEL, TOOL_TEMPLATE)
    proc, base = start_server(root, ["--model", f"{MODEL}={served}", "--draft", drafter,
                                     "--settings", root / "model_settings.json", "--log-level", "warning"],
                              env={**os.environ, "DFLASH2_MLX_API_KEY": KEY})
    yield {"base": base, "served": served, "root": root}
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server["base"], headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


@pytest.fixture(scope="module")
def reference(server):
    """The served model loaded here (on the MLX worker thread): generate()'s greedy tokens."""
    model, tokenizer, _ = on_worker(load, str(server["served"]))

    def greedy(messages, n=N, tools=None):
        """The greedy reply's tokens (the end of sequence left out) and its text."""
        if tools is None:
            ids = on_worker(lambda: [r.token for r in stream_generate(model, tokenizer, messages, max_tokens=n)])
        else:
            ids = on_worker(plain_tokens, model, chat_ids(tokenizer, messages, tools=tools), n)
        ids = [t for t in ids[: ids.index(tokenizer.eos_token_id)]] if tokenizer.eos_token_id in ids else ids
        return ids, tokenizer.decode(ids)

    return {"greedy": greedy, "tokenizer": tokenizer}


def post(server, path, body, key=KEY):
    return httpx.post(server["base"] + path, json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"} if key else {})


def test_chat_equals_generate(client, reference):
    ids, text = reference["greedy"](CHAT)
    r = client.chat(model=MODEL, messages=CHAT, options=GREEDY)
    assert r.message.role == "assistant" and r.message.content == text
    assert r.done and r.done_reason == ("length" if len(ids) == N else "stop")
    assert r.eval_count == len(ids) + (r.done_reason == "stop") and r.model == MODEL
    prompt = chat_ids(reference["tokenizer"], CHAT)
    assert r.prompt_eval_count == len(prompt)
    assert r.total_duration >= r.eval_duration > 0 and r.prompt_eval_duration > 0


def test_streamed_chat_is_ndjson_and_equals_generate(server, client, reference):
    _, text = reference["greedy"](CHAT)
    parts = list(client.chat(model=f"{MODEL}:latest", messages=CHAT, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == text
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].eval_count == N
    assert parts[-1].model == f"{MODEL}:latest"  # the name as the request gave it
    # On the wire: one JSON object a line, and the draft statistics beside Ollama's counters.
    with httpx.stream("POST", server["base"] + "/api/chat", timeout=120, headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "messages": CHAT, "options": GREEDY}) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    last = lines[-1]
    assert last["done"] and {"tau", "cycles", "cached_tokens"} <= set(last["dflash"])
    assert last["dflash"]["cached_tokens"] > 0  # the same prompt again: the prefix cache's
    assert "".join(x["message"]["content"] for x in lines) == text


def test_generate_streamed_and_not_equal_the_chat(client, reference):
    ids, text = reference["greedy"](CHAT)
    r = client.generate(model=MODEL, prompt=CHAT[0]["content"], options=GREEDY)
    assert r.response == text and r.eval_count == len(ids) + (r.done_reason == "stop") and r.done
    parts = list(client.generate(model=MODEL, prompt=CHAT[0]["content"], options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == text and parts[-1].done
    prompt = chat_ids(reference["tokenizer"], CHAT)
    for context in (r.context, parts[-1].context):  # the conversation so far, to go on from
        assert list(context[: len(prompt)]) == prompt and len(context) > len(prompt)
    more = client.generate(model=MODEL, prompt="and again", context=r.context, options={**GREEDY, "num_predict": 2})
    assert more.prompt_eval_count > len(r.context) and more.eval_count == 2


def test_raw_generate_takes_the_prompt_as_it_is(client, reference):
    tok = reference["tokenizer"]
    rendered = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    _, text = reference["greedy"](CHAT)
    r = client.generate(model=MODEL, prompt=rendered, raw=True, options=GREEDY)
    assert r.response == text and r.prompt_eval_count == len(chat_ids(tok, CHAT))
    assert r.context is None  # as Ollama: a raw prompt returns no context
    r = client.generate(model=MODEL, prompt="The capital of France is", raw=True, options={**GREEDY, "num_predict": 3})
    assert r.prompt_eval_count == len(tok.encode("The capital of France is")) and r.eval_count == 3


def test_options_stop_and_logprobs(client, reference):
    _, text = reference["greedy"](CHAT)
    assert "!" in text  # what the stop string below cuts at
    # Ollama's own knobs (mirostat), unknown keys, seed -1 (random) and think: false are taken.
    r = client.chat(model=MODEL, messages=CHAT, think=False,
                    options={**GREEDY, "stop": ["!"], "mirostat": 0, "nonsense": 1, "seed": -1})
    assert r.message.content == text[: text.index("!")] and r.done_reason == "stop"
    r = client.chat(model=MODEL, messages=CHAT, options=GREEDY, logprobs=True, top_logprobs=2)
    assert len(r.logprobs) == r.eval_count and all(len(e.top_logprobs) == 2 for e in r.logprobs)
    assert "".join(e.token for e in r.logprobs) == r.message.content


def weather_chat():
    """Two rounds of asking the weather (each a call to get_weather and its result), then a
    third question: the model copies the pattern and calls the tool."""
    messages = []
    for city in ("Paris", "Rome"):
        messages += [{"role": "user", "content": f"What is the weather in {city}?"},
                     {"role": "assistant", "content": "",
                      "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": city}}}]},
                     {"role": "tool", "tool_name": "get_weather", "content": "sunny"},
                     {"role": "assistant", "content": "It is sunny."}]
    return messages + [{"role": "user", "content": "What is the weather in Lima?"}]


def as_openai(messages):
    """What the server's template gets for Ollama messages: OpenAI's shape (ids, JSON text)."""
    out, n = [], 0
    for m in messages:
        m = {**m, "content": m.get("content") or ""}
        if "tool_calls" in m:
            m["tool_calls"] = [{"id": f"call_{n + i}", "type": "function", "function": {
                "name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
                for i, c in enumerate(m["tool_calls"])]
            n += len(m["tool_calls"])
        out.append(m)
    return out


def test_tool_call_round_trip(client, reference):
    messages = weather_chat()
    r = client.chat(model=MODEL, messages=messages, tools=[WEATHER], options={**GREEDY, "num_predict": 40})
    call = r.message.tool_calls[0].function
    assert (call.name, dict(call.arguments)) == ("get_weather", {"city": "Lima"})
    assert r.message.content == "" and r.done_reason == "stop"
    tok = reference["tokenizer"]
    assert r.prompt_eval_count == len(chat_ids(tok, as_openai(messages), tools=[WEATHER]))
    streamed = list(client.chat(model=MODEL, messages=messages, tools=[WEATHER], stream=True,
                                options={**GREEDY, "num_predict": 40}))
    assert [c.function.name for p in streamed for c in p.message.tool_calls or []] == ["get_weather"]
    # The call and its result go back; the reply is generate()'s for the same conversation.
    messages += [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": call.name, "arguments": dict(call.arguments)}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "rainy"}]
    ids, text = reference["greedy"](as_openai(messages), n=N, tools=[WEATHER])
    r = client.chat(model=MODEL, messages=messages, tools=[WEATHER], options=GREEDY)
    assert r.message.content == text and not r.message.tool_calls
    assert r.eval_count == len(ids) + (r.done_reason == "stop")  # the end of sequence counts


def test_model_routes(server, client):
    listed = client.list().models
    assert [m.model for m in listed] == [f"{MODEL}:latest"]
    details = listed[0].details
    assert (details.format, details.family, details.parameter_size) == ("mlx", "llama", "135M")
    assert listed[0].size > 100_000_000 and len(listed[0].digest) == 64
    shown = client.show(MODEL)
    assert shown.capabilities == ["completion", "tools"] and "<tool_call>" in shown.template
    assert shown.modelinfo["general.architecture"] == "llama" and shown.modelinfo["llama.context_length"] > 0
    assert client.show(f"{MODEL}:latest").details.family == "llama"
    client.chat(model=MODEL, messages=CHAT, options={"num_predict": 1})
    running = client.ps().models
    assert [m.model for m in running] == [f"{MODEL}:latest"] and running[0].context_length > 0
    version = httpx.get(server["base"] + "/api/version", headers={"Authorization": f"Bearer {KEY}"})
    assert version.status_code == 200 and version.json()["version"].count(".") == 2
    for method in ("GET", "HEAD"):
        probe = httpx.request(method, server["base"] + "/", headers={"Authorization": f"Bearer {KEY}"})
        assert probe.status_code == 200 and probe.text == ("Ollama is running" if method == "GET" else "")


@pytest.mark.parametrize("call, status, what", [
    (lambda c: c.chat(model=MODEL, messages=CHAT, options={"temperature": "hot"}), 400, "options.temperature"),
    (lambda c: c.chat(model=MODEL, messages=CHAT, options={"num_predict": 1.5}), 400, "options.num_predict"),
    (lambda c: c.generate(model=MODEL, prompt="hi", options={"stop": 3}), 400, "options.stop"),
    (lambda c: c.chat(model=MODEL, messages=CHAT, options={"top_k": 10 ** 9}), 400, "top_k"),
    (lambda c: c.chat(model="nope", messages=CHAT), 404, "model 'nope' not found"),
    (lambda c: c.show("nope:7b"), 404, "model 'nope:7b' not found"),
    (lambda c: c.chat(model=MODEL, messages=[{"role": "user", "content": "hi", "images": [b"\x89PNG"]}]),
     400, "no vision"),
    (lambda c: c.chat(model=MODEL, messages=CHAT, format="json"), 400, "format"),
    (lambda c: c.chat(model=MODEL, messages=[{"role": "robot", "content": "hi"}]), 400, "messages.0.role"),
    (lambda c: c.generate(model=MODEL, prompt="def f(", suffix="return x"), 400, "suffix"),
    (lambda c: c.generate(model=MODEL, prompt="hi", template="{{ .Prompt }}"), 400, "template"),
    (lambda c: c.generate(model=MODEL, prompt="hi", raw=True, system="be brief"), 400, "raw prompt"),
    (lambda c: c.pull("llama3"), 501, "does not support pulling models"),
    (lambda c: c.embed(model=MODEL, input="hi"), 501, "does not support embeddings"),
    (lambda c: c.delete(MODEL), 501, "does not support deleting models"),
    (lambda c: c.copy(MODEL, "other"), 501, "does not support copying models"),
])
def test_errors_in_ollamas_shape(client, call, status, what):
    with pytest.raises(ollama.ResponseError) as e:
        call(client)
    assert e.value.status_code == status and what in e.value.error


def test_raw_errors_are_ollama_bodies(server):
    r = post(server, "/api/chat", {"model": MODEL, "messages": CHAT}, key=None)
    assert r.status_code == 401 and "API key" in r.json()["error"]
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=server["base"]).list()
    assert e.value.status_code == 401
    r = post(server, "/api/nowhere", {})
    assert r.status_code == 404 and set(r.json()) == {"error"}
    # Ollama's docs send their bodies with curl -d (a form's Content-Type): read as JSON.
    r = httpx.post(server["base"] + "/api/generate", content=json.dumps({"model": MODEL, "prompt": "hi", "stream": False,
                   "options": {"num_predict": 1}}), headers={"Authorization": f"Bearer {KEY}",
                   "Content-Type": "application/x-www-form-urlencoded"}, timeout=120)
    assert r.status_code == 200 and r.json()["eval_count"] == 1


def test_load_and_unload(client):
    """Nothing to generate loads the model; keep_alive 0 unloads it (and the next request
    loads it again)."""
    assert client.chat(model=MODEL, messages=[]).done_reason == "load"
    assert client.generate(model=MODEL, keep_alive=0).done_reason == "unload"
    assert client.ps().models == []
    r = client.chat(model=MODEL, messages=CHAT, options={"num_predict": 1})
    assert r.eval_count == 1 and r.load_duration > 0
    assert [m.model for m in client.ps().models] == [f"{MODEL}:latest"]
