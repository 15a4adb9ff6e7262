"""OpenAI's Responses API on `dflash2-mlx serve`, driven by the official openai client: text
and streamed replies equal to generate()'s, a function-calling round trip, previous_response_id,
stored responses, errors, cached tokens, and a disconnect stopping the generation.

The server runs the built-in pair (SmolLM2-135M-Instruct and its shipped drafter). SmolLM2's
own chat template has no tools, so the model is served from a directory that links its files
and gives it a template that also renders tools, tool calls and tool results (plain chats
render as with SmolLM2's own template), with mlx-lm's json_tools parser for the calls."""

import json
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from dflash2_mlx.backend.responses import OutputBuilder
from dflash2_mlx.backend.tool_calls import template_messages
from dflash2_mlx.backend.wire import Chunk
from dflash2_mlx.builtin.defaults import default_pair
from dflash2_mlx.generate import load
from dflash2_mlx.request.prompt import chat_ids
from helpers import counters, greedy_ids, metrics, start_server, stop_server, tool_variant, wait_idle
from tiny_models import on_worker, worker_reference

MODEL = "smol"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# SmolLM2's template, plus: the tools in the system message, an assistant's tool calls as
# <tool_call>{...}</tool_call> (the arguments reach templates as objects), a tool's result
# as a "tool" message.
TOOL_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first %}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if message['role'] == 'system' %}{{ message['content'] }}{%- else %}{{ '" + SYSTEM + "' }}{%- endif %}"
    "{%- if tools %}{{ '\\nYou can call these functions:\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{ tool['function'] | tojson }}{{ '\\n' }}{%- endfor %}"
    "{{ '</tools>\\nTo call one, answer <tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call>' }}"
    "{%- endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- if loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>tool\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{ '<tool_call>{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{- call['function']['arguments'] | tojson }}{{ '}</tool_call>' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
QUESTION = "Why is the sky blue?"
HELLO = "Say hello in one short sentence."
NO_EOS = {"2": -100}
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)  # SmolLM2's <|im_end|>: keeps a generation going


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("responses")
    target, drafter = default_pair()
    served = tool_variant(Path(target), root / MODEL, TOOL_TEMPLATE)
    proc, base = start_server(root, ["--model", f"{MODEL}={served}", "--draft", drafter,
                                     "--settings", root / "model_settings.json", "--log-level", "warning"])
    yield {"base": base, "target": target, "drafter": drafter, "served": served, "root": root}
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server["base"] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(server):
    """generate() of the served pair (its template renders tools) on chat messages."""
    generate = worker_reference(server["served"], server["drafter"])
    _, tokenizer, _ = on_worker(load, str(server["served"]))

    def ref(messages, tools=None, **kw):
        return generate(on_worker(chat_ids, tokenizer, template_messages(messages), None, tools), **kw)

    return ref


def test_text_reply_is_generate_s_tokens(server, client):
    """instructions, a developer message and text parts reach the template as generate()
    takes them; the reply is the built-in target's own greedy tokens."""
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}]
    ids, tokenizer = on_worker(greedy_ids, server["target"], messages, 16)
    r = client.responses.create(model=MODEL, instructions="Answer briefly.", max_output_tokens=16, temperature=0,
                                input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
                                metadata={"run": "parity"})
    assert r.output_text == tokenizer.decode(ids) and r.usage.output_tokens == len(ids) == 16
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.metadata == {"run": "parity"} and r.instructions == "Answer briefly."
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    usage = r.usage
    assert usage.input_tokens == len(on_worker(chat_ids, tokenizer, messages))
    assert usage.total_tokens == usage.input_tokens + 16 and usage.output_tokens_details.reasoning_tokens == 0
    dflash = r.model_extra["dflash"]
    assert dflash["cycles"] > 0 and sum(dflash["block_sizes"].values()) == dflash["cycles"]
    as_developer = client.responses.create(model=MODEL, max_output_tokens=16, temperature=0, input=[
        {"role": "developer", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}])
    assert as_developer.output_text == r.output_text


def test_logprobs_and_stop_strings(client):
    """include's message.output_text.logprobs with top_logprobs gives each token's entry;
    a stop string (this server's option, as its chat route takes it) ends the text before it."""
    kw = dict(model=MODEL, input=QUESTION, max_output_tokens=10, temperature=0)
    r = client.responses.create(**kw, include=["message.output_text.logprobs"], top_logprobs=2)
    entries = r.output[0].content[0].logprobs
    assert len(entries) == 10 and "".join(e.token for e in entries) == r.output_text
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in entries)  # greedy
    stop = r.output_text[6:9]
    stopped = client.responses.create(**kw, extra_body={"stop": [stop]})
    assert stopped.output_text == r.output_text[:r.output_text.index(stop)] and stopped.status == "completed"


def call_of(name, city) -> dict:
    return {"id": f"call_{city}", "type": "function",
            "function": {"name": name, "arguments": json.dumps({"city": city})}}


def test_output_builder_holds_whitespace_and_keeps_one_call_unless_parallel():
    """Whitespace before a call makes no message; with parallel_tool_calls false only the
    first call is kept; text after a call is a message of its own; an empty reply is an
    empty message."""
    out = OutputBuilder(parallel_tool_calls=False)
    assert out.add(Chunk(text="\n")) == []
    events = out.add(Chunk(tool_calls=[call_of("get_weather", "Paris"), call_of("get_weather", "Rome")]))
    assert [k for k, _ in events] == ["response.output_item.added", "response.function_call_arguments.delta",
                                      "response.function_call_arguments.done", "response.output_item.done"]
    assert events[0][1]["item"]["arguments"] == "" and events[-1][1]["item"]["status"] == "completed"
    more = out.add(Chunk(text=" done")) + out.finish("completed")
    assert {f["output_index"] for _, f in more} == {1}
    assert [i["type"] for i in out.items] == ["function_call", "message"]
    assert out.items[0]["call_id"] == "call_Paris" and out.items[1]["content"][0]["text"] == " done"
    both = OutputBuilder()
    both.add(Chunk(tool_calls=[call_of("f", "a"), call_of("f", "b")]))
    both.finish("completed")
    assert [i["call_id"] for i in both.items] == ["call_a", "call_b"]
    empty = OutputBuilder()
    assert [k for k, _ in empty.finish("incomplete")][-1] == "response.output_item.done"
    assert empty.items[0]["status"] == "incomplete" and empty.items[0]["content"][0]["text"] == ""


def streamed(client, **kw):
    with client.responses.stream(**kw) as stream:
        return list(stream), stream


def test_stream_events_build_the_reply(client):
    """client.responses.stream parses every event; the deltas are the whole reply's text."""
    kw = dict(model=MODEL, input=HELLO, max_output_tokens=40, temperature=0)
    whole = client.responses.create(**kw)
    events, stream = streamed(client, **kw)
    final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text == final.output_text
    assert whole.status == final.status == "completed" and final.usage.output_tokens == whole.usage.output_tokens < 40
    assert final.id == events[0].response.id != whole.id and final.model_extra["dflash"]["cycles"] > 0
    assert client.responses.retrieve(final.id).output_text == whole.output_text  # a streamed one is kept


def test_stream_cut_by_max_output_tokens_ends_incomplete(client):
    """As OpenAI's: the last event is response.incomplete (the SDK's get_final_response wants
    a response.completed, so the response is read from that event)."""
    kw = dict(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0)
    events, _ = streamed(client, **kw)
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == last.response.output_text == client.responses.create(**kw).output_text
    assert last.response.output[0].status == "incomplete" and last.response.usage.output_tokens == 12


def sse_frames(lines) -> list:
    """(event line's type, data) of each frame of a stream."""
    frames, kind = [], None
    for line in lines:
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: "):
            frames.append((kind, json.loads(line.removeprefix("data: "))))
    return frames


def test_bodies_and_events_validate_as_the_sdk_s_types(server):
    """Checked strictly (the SDK itself builds its objects without validating): every field
    the SDK's Response and ResponseStreamEvent types need is there, of its type."""
    body = {"model": MODEL, "input": HELLO, "max_output_tokens": 8, "tools": [WEATHER], "metadata": {"a": "b"}}
    r = httpx.post(server["base"] + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())
    with httpx.stream("POST", server["base"] + "/v1/responses", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        frames = sse_frames(r.iter_lines())
    events = [STREAM_EVENT.validate_python(data) for _, data in frames]
    assert all(kind == data["type"] for kind, data in frames) and events[-1].type == "response.incomplete"
    Response.model_validate(frames[-1][1]["response"])


def weather_example(city, n, weather) -> list:
    """One worked exchange: the question, the call, its output, the answer."""
    call = {"type": "function_call", "call_id": f"call_{n}", "name": "get_weather",
            "arguments": json.dumps({"city": city})}
    return [{"role": "user", "content": f"What is the weather in {city}?"}, call,
            {"type": "function_call_output", "call_id": f"call_{n}", "output": weather},
            {"role": "assistant", "content": f"It is {weather} in {city}."}]


def as_messages(items) -> list:
    """What the Responses items are as chat messages (OpenAI's chat shape)."""
    out = []
    for item in items:
        if item.get("type") == "function_call":
            out.append({"role": "assistant", "content": "", "tool_calls": [{
                "id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}]})
        elif item.get("type") == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            out.append(item)
    return out


CHAT_TOOLS = [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]


def paris_items() -> list:
    """Two worked examples, then the question: the model calls get_weather for Paris."""
    return weather_example("London", 1, "sunny") + weather_example("Rome", 2, "rainy") + [
        {"role": "user", "content": "What is the weather in Paris?"}]


def round_trip(client):
    """The model's function call, then its answer to our function_call_output (sent with
    previous_response_id); and the items of the second turn."""
    items = paris_items()
    first = client.responses.create(model=MODEL, input=items, tools=[WEATHER], temperature=0, max_output_tokens=40)
    call = first.output[-1]
    answer = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER], temperature=0,
                                     max_output_tokens=20, input=[{"type": "function_call_output",
                                                                   "call_id": call.call_id, "output": "cloudy"}])
    sent_back = items + [{"type": "function_call", "call_id": call.call_id, "name": call.name,
                          "arguments": call.arguments},
                         {"type": "function_call_output", "call_id": call.call_id, "output": "cloudy"}]
    return first, answer, sent_back


def test_function_call_round_trip(client):
    first, answer, _ = round_trip(client)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.id.startswith("fc_") and call.call_id
    assert first.status == "completed" and first.output_text == ""
    assert first.tools[0].name == "get_weather" and first.tool_choice == "auto"
    Response.model_validate(first.to_dict())  # strictly, as the server sent it
    assert [o.type for o in answer.output] == ["message"] and answer.previous_response_id == first.id
    assert "cloudy" in answer.output_text and "Paris" in answer.output_text


@pytest.mark.slow
def test_function_call_turns_equal_generate(client, reference):
    """Both turns of the round trip are generate()'s text for the same chat messages."""
    first, answer, sent_back = round_trip(client)
    assert reference(as_messages(paris_items()), CHAT_TOOLS, max_tokens=40) == \
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert answer.output_text == reference(as_messages(sent_back), CHAT_TOOLS, max_tokens=20)


def test_function_call_streamed(client):
    items = weather_example("London", 1, "sunny") + [{"role": "user", "content": "What is the weather in Paris?"}]
    with client.responses.stream(model=MODEL, input=items, tools=[WEATHER], temperature=0,
                                 max_output_tokens=40) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    [call] = final.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    assert events[-2].item.arguments == call.arguments
    for event in events:
        STREAM_EVENT.validate_python(event.to_dict())


@pytest.mark.slow
def test_tool_choice_none_offers_no_tools(client, reference):
    """With tool_choice "none" the template gets no tools and nothing is parsed as a call."""
    items = weather_example("London", 1, "sunny") + [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.responses.create(model=MODEL, input=items, tools=[WEATHER], tool_choice="none", temperature=0,
                                max_output_tokens=12)
    assert [o.type for o in r.output] == ["message"] and r.tool_choice == "none"
    assert r.output_text == reference(as_messages(items), max_tokens=12)


def test_previous_response_id_continues_and_stored_responses(server, client, reference):
    first = client.responses.create(model=MODEL, input="My name is Sam. Say hello.", max_output_tokens=10,
                                    temperature=0)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="What is my name?",
                                     max_output_tokens=10, temperature=0)
    messages = [{"role": "user", "content": "My name is Sam. Say hello."},
                {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "What is my name?"}]
    assert second.output_text == reference(messages, max_tokens=10)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens  # the first turn's caches
    assert client.responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, previous_response_id="resp_unknown", input="hi", max_output_tokens=4)
    assert e.value.body["param"] == "previous_response_id" and "resp_unknown" in e.value.body["message"]
    unkept = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, previous_response_id=unkept.id, input="hi", max_output_tokens=2)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)


def test_repeated_prompt_reports_cached_tokens(client):
    kw = dict(model=MODEL, input="Name three colours of the rainbow.", max_output_tokens=4, temperature=0)
    first, again = client.responses.create(**kw), client.responses.create(**kw)
    assert again.output_text == first.output_text
    assert 0 < again.usage.input_tokens_details.cached_tokens < again.usage.input_tokens == first.usage.input_tokens


@pytest.mark.parametrize("fields, param, what", [
    ({"temperature": "hot"}, "temperature", "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "needs its name"),
    ({"tool_choice": "required"}, "tool_choice", "cannot force"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "input_image"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "reasoning"),
    ({"input": []}, "input", "empty"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text", "json_schema"),
    ({"background": True}, "background", "not supported"),
    ({"metadata": {"k": 1}}, "metadata", "metadata"),
    ({"model": "nope"}, "model", "nope"),
])
def test_bad_fields_are_bad_requests_naming_them(client, fields, param, what):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, **fields}
    model, given = body.pop("model"), body.pop("input")
    error = openai.NotFoundError if param == "model" else openai.BadRequestError
    with pytest.raises(error) as e:
        client.responses.create(model=model, input=given, extra_body=body)
    assert e.value.body["param"] == param and what in e.value.body["message"], e.value.body


def test_disconnect_stops_generation(server):
    before = counters(metrics(server), MODEL)
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 4000, "stream": True, "logit_bias": NO_EOS}
    with httpx.stream("POST", server["base"] + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(20)]
        assert any("response.output_text.delta" in line for line in got)
        assert metrics(server)["active_requests"]
    after = wait_idle(server)["models"][MODEL]  # closed: the generation must stop
    assert after["aborted_requests"] == before["aborted_requests"] + 1
    assert after["generation_tokens"] - before["generation_tokens"] < 4000
