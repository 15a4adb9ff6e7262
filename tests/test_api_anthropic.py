"""Anthropic's Messages API of `dflash2-mlx serve` (a real process on loopback) driven by the
official ``anthropic`` client: replies equal to generate()'s, Anthropic's stream of events,
a tool_use round trip, count_tokens, stop sequences, errors in Anthropic's shape, the key.

The model is the built-in SmolLM2-135M-Instruct (with its shipped DFlash 2 drafter) under a
ChatML template that takes tools as Qwen's templates do, so that mlx-lm reads its tool
calls (json_tools) and a few worked examples make it call the tool at T=0."""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import pytest

from dflash2_mlx.backend.anthropic import error_frame
from dflash2_mlx.backend.anthropic_wire import MessagesRequest, error_body, reply_content, stop_reason
from dflash2_mlx.backend.protocol import APIError
from dflash2_mlx.backend.settings import SettingsStore
from dflash2_mlx.backend.wire import Completion
from dflash2_mlx.builtin.defaults import default_pair
from dflash2_mlx.generate import load, stream_generate
from dflash2_mlx.request.prompt import chat_ids
import helpers
from helpers import start_server, stop_server
from tiny_models import on_worker

KEY = "anthropic-test-key"
MODEL = "smol"
TEMPLATE = r"""{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You can call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
To call one, reply with <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% if not loop.first %}<|im_start|>system
{{ message.content }}<|im_end|>
{% endif %}
{%- elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {% if tool_call.arguments is string %}{{ tool_call.arguments }}{% else %}{{ tool_call.arguments | tojson }}{% endif %}}
</tool_call>
{%- endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

SYSTEM = "You are a friendly assistant."
HELLO = [{"role": "user", "content": "Say hi"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
OPENAI_WEATHER = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                   "parameters": WEATHER["input_schema"]}}


def asked(i: int, city: str) -> list:
    """A worked example: the user asks, the assistant calls the tool."""
    return [{"role": "user", "content": f"Weather in {city}?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": f"call_{i}", "name": "get_weather",
                                               "input": {"city": city}}]}]


# Three worked examples, then the question the model answers with a tool call at T=0.
FEW_SHOT = asked(0, "Paris") + asked(1, "Rome") + asked(2, "Madrid") + [{"role": "user", "content": "Weather in Berlin?"}]


def openai_asked(i: int, city: str) -> list:
    """``asked`` as the OpenAI route's template messages."""
    call = {"id": f"call_{i}", "type": "function", "function": {"name": "get_weather",
                                                                "arguments": json.dumps({"city": city})}}
    return [{"role": "user", "content": f"Weather in {city}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("anthropic")
    target, drafter = default_pair()
    smol = root / "models" / MODEL
    smol.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        os.symlink(os.path.join(target, name), smol / name)
    with open(os.path.join(target, "tokenizer_config.json")) as f:
        config = json.load(f)
    (smol / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    settings = root / "model_settings.json"
    SettingsStore(settings).set(MODEL, dflash_enabled=True, dflash_draft_model=drafter)
    proc, base = start_server(root, ["--model-dir", root / "models", "--settings", settings,
                                     "--max-batch", 2, "--log-level", "warning"],
                              env={**os.environ, "DFLASH2_MLX_API_KEY": KEY})
    yield {"base": base, "target": smol, "proc": proc}
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server["base"], api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def pair(server):
    """The served target as generate() loads it (on the MLX worker thread)."""
    model, tokenizer, _ = on_worker(load, str(server["target"]))
    return model, tokenizer


def greedy(pair, messages, n: int, tools=None, prefill=None):
    """generate()'s first ``n`` greedy tokens for template messages (and ``prefill``, the
    start of the reply), and its text."""
    model, tokenizer = pair
    ids = chat_ids(tokenizer, messages, prefill, tools=tools)
    out = on_worker(lambda: list(stream_generate(model, tokenizer, ids, max_tokens=n)))
    return [r.token for r in out], "".join(r.text for r in out)


def test_reply_equals_generate(client, pair):
    """T=0: the reply's tokens are generate()'s for the same messages; usage as Anthropic's."""
    r = client.messages.create(model=MODEL, max_tokens=12, system=SYSTEM, messages=HELLO)
    ids, text = greedy(pair, [{"role": "system", "content": SYSTEM}, *HELLO], 12)
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == text
    assert r.usage.output_tokens == len(ids) == 12 and r.stop_reason == "max_tokens" and r.stop_sequence is None
    prompt = len(chat_ids(pair[1], [{"role": "system", "content": SYSTEM}, *HELLO]))
    # Anthropic's input_tokens leaves out the tokens read from the (prefix) cache.
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == prompt
    assert r.usage.cache_creation_input_tokens == 0
    assert r.model_extra["dflash"]["dflash"] is True and r.model_extra["dflash"]["cycles"] > 0


def test_stream_events_in_order(server, client):
    """stream=True: Anthropic's events in their order, framed `event: T` / `data: {...}`;
    the text equals the reply's unstreamed; messages.stream() assembles the same message."""
    kw = dict(model=MODEL, max_tokens=10, system=[{"type": "text", "text": SYSTEM}], messages=HELLO)
    whole = client.messages.create(**kw)
    events = list(client.messages.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.content == [] and events[0].message.stop_reason is None
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 10
    assert events[-2].model_extra["dflash"]["cycles"] > 0  # the draft statistics, in an extra field
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text and final.stop_reason == "max_tokens"
    with httpx.stream("POST", server["base"] + "/v1/messages", json={**kw, "stream": True},
                      headers={"x-api-key": KEY}, timeout=120) as r:
        frames = r.read().decode().split("\n\n")
    assert r.headers["content-type"].startswith("text/event-stream") and frames[-1] == ""
    for f in frames[:-1]:
        event, data = f.split("\n")
        assert event == f"event: {json.loads(data.removeprefix('data: '))['type']}"
    assert frames[1].startswith("event: ping")


def test_tool_use_round_trip(client, pair):
    """The model's tool call comes back as a tool_use block (streamed: an input_json_delta);
    sent back with its tool_result it reaches the template as OpenAI's tool_calls and a
    "tool" message, and the reply is generate()'s for those."""
    r = client.messages.create(model=MODEL, max_tokens=40, tools=[WEATHER], messages=FEW_SHOT)
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    use = r.content[0]
    assert use.name == "get_weather" and use.input == {"city": "Berlin"} and use.id
    with client.messages.stream(model=MODEL, max_tokens=40, tools=[WEATHER], messages=FEW_SHOT) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert [d.type for d in deltas] == ["input_json_delta"] and json.loads(deltas[0].partial_json) == use.input
    assert final.stop_reason == "tool_use" and final.content[0].input == use.input

    turn = FEW_SHOT + [{"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                     "content": [{"type": "text", "text": "snowy"}]}]}]
    after = client.messages.create(model=MODEL, max_tokens=8, tools=[WEATHER], messages=turn)
    template = (openai_asked(0, "Paris") + openai_asked(1, "Rome") + openai_asked(2, "Madrid")
                + openai_asked(3, "Berlin")[:1] + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": use.id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Berlin"}'}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "snowy"}])
    count = client.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=turn).input_tokens
    assert count == len(chat_ids(pair[1], template, tools=[OPENAI_WEATHER]))
    ids, text = greedy(pair, template, 8, tools=[OPENAI_WEATHER])
    assert after.content[0].text == text and after.usage.output_tokens == len(ids)


def test_count_tokens_equals_the_prompt_generate_uses(client, pair):
    """count_tokens: the ids of the same template messages and tools as /v1/messages renders."""
    n = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=HELLO).input_tokens
    assert n == len(chat_ids(pair[1], [{"role": "system", "content": SYSTEM}, *HELLO]))
    n = client.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=FEW_SHOT).input_tokens
    template = openai_asked(0, "Paris") + openai_asked(1, "Rome") + openai_asked(2, "Madrid") + FEW_SHOT[-1:]
    assert n == len(chat_ids(pair[1], template, tools=[OPENAI_WEATHER]))
    # tool_choice "none": the tools stay out of the prompt
    none = client.messages.count_tokens(model=MODEL, tools=[WEATHER], tool_choice={"type": "none"}, messages=FEW_SHOT)
    assert none.input_tokens == len(chat_ids(pair[1], template))


def test_prefill_is_continued(client, pair):
    """A final assistant message is the start of the reply: the reply continues it (and
    leaves it out), as generate() continues the same prefill."""
    messages = HELLO + [{"role": "assistant", "content": [{"type": "text", "text": "Hello! My name"}]}]
    r = client.messages.create(model=MODEL, max_tokens=8, messages=messages)
    ids, _ = greedy(pair, HELLO, 8, prefill="Hello! My name")
    # the whole continuation: its first token's leading space too ("Hello! My name" + " is")
    text = pair[1].decode(ids)
    assert text.startswith(" ") and r.content[0].text == text and r.usage.output_tokens == len(ids)
    with client.messages.stream(model=MODEL, max_tokens=8, messages=messages) as stream:
        assert stream.get_final_message().content[0].text == text
    with ThreadPoolExecutor(2) as pool:  # in the batch too
        both = list(pool.map(lambda _: client.messages.create(model=MODEL, max_tokens=8, messages=messages), range(2)))
    assert [m.content[0].text for m in both] == [text] * 2
    count = client.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    assert count == len(chat_ids(pair[1], HELLO, "Hello! My name"))


def test_stop_sequence_ends_the_reply(server, client, pair):
    _, text = greedy(pair, HELLO, 12)
    word = text.split()[2]
    kw = dict(model=MODEL, max_tokens=12, messages=HELLO, stop_sequences=["zzzz", word])
    r = client.messages.create(**kw)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == word
    assert r.content[0].text == text[:text.index(word)]
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == word
    assert final.content[0].text == r.content[0].text
    # two at once: they share the batch, which reports the stop string as the single stream does
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda _: client.messages.create(**kw), range(2)))
    assert [(m.stop_sequence, m.content[0].text) for m in both] == [(word, r.content[0].text)] * 2
    assert metrics(server)["models"][MODEL]["peak_batch_size"] == 2


BAD = [
    ({"messages": HELLO}, "max_tokens"),
    ({"max_tokens": "5", "messages": HELLO}, "max_tokens"),
    ({"max_tokens": 5, "temperature": 1.5, "messages": HELLO}, "temperature"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "tool_use_id"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f",
                                                                  "input": {}}]}]}, "assistant message"),
    ({"max_tokens": 5, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f",
                                                                       "input": {}}]}]}, "final assistant message"),
    ({"max_tokens": 5, "tools": [{"name": "f"}], "messages": HELLO}, "tools.0.input_schema"),
    ({"max_tokens": 5, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "g"}, "messages": HELLO}, "tool_choice"),
    ({"max_tokens": 5, "stop_sequences": "x", "messages": HELLO}, "stop_sequences"),
    ({"max_tokens": 100_000, "messages": HELLO}, "max_tokens"),
]


@pytest.mark.parametrize("body,what", BAD)
def test_bad_requests_are_anthropic_400s(client, body, what):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", cast_to=httpx.Response, body={"model": MODEL, **body})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert what in e.value.body["error"]["message"]


def test_key_unknown_model_and_error_shapes(server, client):
    wrong = anthropic.Anthropic(base_url=server["base"], api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=MODEL, max_tokens=3, messages=HELLO)
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(server["base"] + "/v1/messages/count_tokens", json={"messages": HELLO})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=3, messages=HELLO)
    assert e.value.body == {"type": "error", "error": {"type": "not_found_error",
                                                       "message": "The model 'nope' does not exist"}}
    assert error_body(APIError(503, "busy"))["error"]["type"] == "overloaded_error"
    assert error_body(APIError(500, "x"))["error"]["type"] == "api_error"
    assert error_body(APIError(429, "x"))["error"]["type"] == "rate_limit_error"
    # an error once a stream has begun: an event of its own, with the same body
    assert error_frame(APIError(503, "busy")) == (
        'event: error\ndata: {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}\n\n')


def metrics(server) -> dict:
    return helpers.metrics(server, {"x-api-key": KEY}, timeout=10)


def idle(server, timeout=30.0) -> dict:
    return helpers.wait_idle(server, timeout, {"x-api-key": KEY})


def test_disconnect_stops_generation(server):
    body = {"model": MODEL, "max_tokens": 2000, "stream": True,
            "messages": [{"role": "user", "content": "Write a long story about a dragon and a knight."}]}
    before = helpers.counters(metrics(server), MODEL)
    with httpx.stream("POST", server["base"] + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(12)]
        assert any("text_delta" in line for line in got)
    now = idle(server)["models"][MODEL]  # closed: the generation must stop
    assert now["aborted_requests"] == before["aborted_requests"] + 1
    assert now["generation_tokens"] - before["generation_tokens"] < 2000


def test_conversion_to_template_messages():
    """Anthropic's blocks as the OpenAI route's template messages, and a reply's blocks."""
    body = MessagesRequest.model_validate({"max_tokens": 5, "system": [{"type": "text", "text": "a"},
                                                                       {"type": "text", "text": "b"}], "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "text", "text": "let me look"},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}},
                                          {"type": "tool_use", "id": "t2", "name": "g", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "one"},
                                     {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                                      "content": [{"type": "text", "text": "no"}]},
                                     {"type": "text", "text": "go on"}]}]})
    assert body.template_messages() == [
        {"role": "system", "content": "ab"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": "let me look", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "t2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "one"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: no"},
        {"role": "user", "content": "go on"}]
    assert body.options() == {"max_tokens": 5}
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
             {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "[1]"}}]
    assert reply_content("", calls) == [{"type": "tool_use", "id": "c1", "name": "f", "input": {"x": 1}},
                                        {"type": "tool_use", "id": "c2", "name": "g", "input": {"arguments": [1]}}]
    assert reply_content("hi", calls, one_tool_use=True)[1:] == reply_content("", calls)[:1]
    assert reply_content("", []) == [{"type": "text", "text": ""}]
    assert stop_reason(Completion(finish_reason="stop", stop_sequence="x")) == "stop_sequence"
    assert stop_reason(Completion(finish_reason="stop")) == "end_turn"
