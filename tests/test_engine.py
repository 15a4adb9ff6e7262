"""The engine and the engine pool, in-process, on tiny real models."""

import asyncio
import contextlib
import json

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_logits_processors

from dflash2_mlx.adaptive import COPY_LARGEST
from dflash2_mlx.backend.engine import Engine, EngineError, InvalidOption, PromptTooLong, QueueFull
from dflash2_mlx.backend.pool import EnginePool, NoDefaultModel, PoolBusy, UnknownModel
from dflash2_mlx.backend.settings import ModelSettings, SettingsError, SettingsStore
from dflash2_mlx.backend.stops import StopMatcher
from dflash2_mlx.loop.scoring import prompt_logprobs
from dflash2_mlx.request.sampling import xtc_special_tokens
from tiny_models import make_drafter, make_target, on_worker, worker_reference

NO_EOS = {1: -100.0}  # the tiny tokenizer's <eos>: keeps long generations going
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "find a word",
                                            "parameters": {"type": "object", "properties": {}}}}]
TOOLS_TEMPLATE = (
    "{% if shout %}shout .{% endif %}{% if tools %}{% for t in tools %}{{ t['function']['name'] }} {% endfor %}.{% endif %}"
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}.{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    target = on_worker(make_target, root / "models" / "tiny")
    drafter = on_worker(make_drafter, root / "drafter", target)
    other = on_worker(make_target, root / "models" / "other", seed=5)
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TOOLS_TEMPLATE}))
    return root, target, drafter


@pytest.fixture(scope="module")
def reference(models):
    """dflash2_mlx.generate on the same pair, run on the backend's MLX thread."""
    _, target, drafter = models
    return worker_reference(target, drafter)


@pytest.fixture(scope="module")
def engine(models):
    _, target, drafter = models
    e = Engine(target, ModelSettings(dflash_enabled=True, dflash_draft_model=str(drafter)),
               model_id="tiny", max_queue=1, max_batch=2)
    run(e.start())
    yield e
    run(e.stop())


async def idle(engine, timeout=30.0):
    """Wait until the engine has let go of every request (aborts end on the worker)."""
    for _ in range(int(timeout / 0.01)):
        if not engine.has_active_requests():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("requests still active")


async def joined(chunks):
    out = [c async for c in chunks]
    return "".join(c.text for c in out), out


def test_greedy_output_and_stats(engine, reference):
    before = engine.get_stats()
    want = reference("hello world", max_tokens=24)
    got = run(engine.generate("hello world", max_tokens=24))
    assert got.text == want and got.finish_reason == "length" and got.completion_tokens == 24
    assert got.prompt_tokens == len("hello world") and got.cycles > 0
    text, chunks = run(joined(engine.stream_generate("hello world", max_tokens=24)))
    assert text == want and len(chunks) > 1 and chunks[-1].finish_reason == "length"
    messages = [{"role": "user", "content": "say hi"}]
    assert run(engine.chat(messages, max_tokens=16)).text == reference(messages, max_tokens=16)
    assert run(engine.count_chat_tokens(messages)) == len("u:say hi.a:")
    stats = engine.get_stats()
    assert stats["requests"] == before["requests"] + 3
    assert stats["generation_tokens"] == before["generation_tokens"] + 24 + 24 + 16
    assert stats["cycles"] > before["cycles"] and stats["mean_tau"] >= 1.0
    assert len(stats["acceptance_by_position"]) == COPY_LARGEST - 1  # "auto": copies up to 15 rows
    assert sum(stats["block_sizes"].values()) == stats["cycles"] and "adaptive_fallbacks" in stats
    assert sum(got.block_sizes.values()) == got.cycles
    assert stats["generation_tps"] > 0 and not engine.has_active_requests()


def test_sampling_follows_seed(engine, reference):
    a = run(engine.generate("hello world", max_tokens=16, temperature=1.0, seed=7))
    b = run(engine.generate("hello world", max_tokens=16, temperature=1.0, seed=7))
    assert a.text == b.text == reference("hello world", max_tokens=16, temp=1.0, seed=7)
    greedy = reference("hello world", max_tokens=16)
    others = {run(engine.generate("hello world", max_tokens=16, temperature=1.0, seed=s)).text for s in (1, 2, 3)}
    assert others - {greedy}  # temperature is really applied


def test_xtc_options_reach_the_sampler(engine, reference):
    """min_tokens_to_keep / xtc_* as mlx-lm's server takes them: XTC sparing "\n" and EOS; a
    value mlx-lm refuses is refused when the request is made, naming the option."""
    opts = dict(temperature=1.0, seed=7, min_p=0.05, min_tokens_to_keep=2, xtc_probability=0.9,
                xtc_threshold=0.05, logit_bias=NO_EOS)
    got = run(engine.generate("hello world", max_tokens=16, **opts))
    api = dict(temp=1.0, seed=7, min_p=0.05, min_tokens_to_keep=2, xtc_probability=0.9,
               xtc_threshold=0.05, xtc_special_tokens=xtc_special_tokens(engine.tokenizer),
               logits_processors=make_logits_processors(logit_bias=NO_EOS))
    assert got.text == reference("hello world", max_tokens=16, **api)
    assert got.text != reference("hello world", max_tokens=16, **{**api, "xtc_probability": 0.0})
    for name, bad in (("xtc_threshold", 0.7), ("xtc_probability", -0.1), ("min_tokens_to_keep", 0),
                      ("temperature", -1.0)):
        with pytest.raises(InvalidOption, match=name.replace("temperature", "temp")) as e:
            engine.stream_generate("hello world", **{name: bad})
        assert e.value.param == name


def target_logprobs(model, ids, tokens, bias):
    """The target's log-probability rows after ``ids`` + each prefix of ``tokens``, with
    ``bias`` added to the logits (mlx-lm's logit_bias processor): one teacher-forced pass."""
    logits = model(mx.array([ids + tokens]))[0, len(ids) - 1 : len(ids) + len(tokens) - 1].astype(mx.float32)
    for t, b in bias.items():
        logits[:, t] += b
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def test_logprobs_are_the_targets_own(engine):
    """Each reply token's log-probability and its most likely alternatives, from the
    target's rows, through DFlash cycles (and none for a request that did not ask)."""
    got = run(engine.generate("hello world", max_tokens=20, logprobs=3, logit_bias=NO_EOS))
    assert len(got.logprobs) == got.completion_tokens == 20
    assert "".join(e["token"] for e in got.logprobs) == got.text
    assert got.cycles > 0
    tok = engine.tokenizer
    ids = tok.encode("hello world")
    tokens = [tok.encode(e["token"], add_special_tokens=False)[0] for e in got.logprobs]
    rows = on_worker(lambda: target_logprobs(engine.model, ids, tokens, NO_EOS).tolist())
    for e, t, row in zip(got.logprobs, tokens, rows):
        assert abs(e["logprob"] - row[t]) < 1e-3 and e["bytes"] == list(e["token"].encode())
        best = sorted(range(len(row)), key=lambda i: -row[i])[:3]
        assert [a["token"] for a in e["top_logprobs"]] == [tok.decode([i]) for i in best]
        assert all(abs(a["logprob"] - row[i]) < 1e-3 for a, i in zip(e["top_logprobs"], best))
    assert run(engine.generate("hello world", max_tokens=4)).logprobs == []

    async def side_by_side():  # two at once share a batch (max_batch 2): the batch's path
        return await asyncio.gather(*(engine.generate(p, max_tokens=20, logprobs=3, logit_bias=NO_EOS)
                                      for p in ("hello world", "hey there")))

    before = engine.get_stats()["batch_steps"]
    batched, other = run(side_by_side())
    assert engine.get_stats()["batch_steps"] > before
    assert batched.text == got.text and len(other.logprobs) == other.completion_tokens
    assert [e["top_logprobs"][0]["token"] for e in batched.logprobs] == [e["token"] for e in got.logprobs]
    assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(batched.logprobs, got.logprobs)) < 1e-3
    for bad in (21, -1, True, 2.0):
        with pytest.raises(InvalidOption, match="logprobs is the number of alternatives"):
            engine.stream_generate("hello world", logprobs=bad)


def test_prompt_logprobs_score_the_prompt(engine):
    """prompt_logprobs: each prompt token's log-probability and alternatives from the
    target's own teacher-forced rows (in chunks or not), in the first chunk; max_tokens=0
    scores without generating; a completion keeps its stop token's entry, a chat not."""
    tok = engine.tokenizer
    ids = tok.encode("hello world, how are you today")
    got = run(engine.generate(ids, max_tokens=0, prompt_logprobs=2))
    assert (got.text, got.completion_tokens, got.finish_reason, got.logprobs) == ("", 0, "length", [])
    entries = got.prompt_logprobs
    assert len(entries) == len(ids) and entries[0]["logprob"] is None and entries[0]["top_logprobs"] is None
    assert [e["token"] for e in entries] == [tok.decode([t]) for t in ids]
    rows = on_worker(lambda: target_logprobs(engine.model, ids[:1], ids[1:], {}).tolist())
    for e, t, row in zip(entries[1:], ids[1:], rows):
        assert abs(e["logprob"] - row[t]) < 1e-4
        best = sorted(range(len(row)), key=lambda i: -row[i])[:2]
        assert [a["token"] for a in e["top_logprobs"]] == [tok.decode([i]) for i in best]
        assert all(abs(a["logprob"] - row[i]) < 1e-4 for a, i in zip(e["top_logprobs"], best))
    whole, chunked = on_worker(lambda: (prompt_logprobs(engine.model, ids, 2),
                                        prompt_logprobs(engine.model, ids, 2, chunk=3)))
    assert max(abs(a - b) for a, b in zip(whole[0], chunked[0])) < 1e-4
    assert [[i for i, _ in t] for t in whole[1]] == [[i for i, _ in t] for t in chunked[1]]

    both = run(engine.generate(ids, max_tokens=6, logprobs=1, prompt_logprobs=0, logit_bias=NO_EOS))
    alone = run(engine.generate(ids, max_tokens=6, logprobs=1, logit_bias=NO_EOS))
    assert both.text == alone.text and alone.prompt_logprobs is None
    assert both.engine["verify_mode"] == "off" and alone.cycles > 0  # on from the scoring pass's caches
    longer = run(engine.generate(ids, max_tokens=24, prompt_logprobs=0, logit_bias=NO_EOS))
    assert longer.cycles > 0 and longer.text == run(engine.generate(ids, max_tokens=24, logit_bias=NO_EOS)).text
    assert [e["top_logprobs"] for e in both.prompt_logprobs[1:]] == [[]] * (len(ids) - 1)
    assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(both.logprobs, alone.logprobs)) < 1e-4

    eos = {1: 100.0}  # the tiny tokenizer's <eos> first
    done = run(engine.generate(ids, max_tokens=4, logprobs=0, logit_bias=eos))
    assert done.finish_reason == "stop" and done.text == ""
    assert [e["token"] for e in done.logprobs] == [tok.decode([1])] and done.completion_tokens == 1
    said = run(engine.chat([{"role": "user", "content": "hi"}], max_tokens=4, logprobs=0, logit_bias=eos))
    assert said.finish_reason == "stop" and said.logprobs == []
    for bad in (21, -1, True):
        with pytest.raises(InvalidOption, match="prompt_logprobs is the number of alternatives"):
            engine.stream_generate("hello world", prompt_logprobs=bad)
    with pytest.raises(InvalidOption, match="max_tokens"):
        engine.stream_generate("hello world", max_tokens=-1)
    with pytest.raises(TypeError, match="prompt_logprobs"):
        engine.stream_chat([{"role": "user", "content": "hi"}], prompt_logprobs=1)


def test_model_penalties_are_defaults_a_request_overrides(models, reference):
    """model_settings.json's repetition_penalty / presence_penalty (oMLX's fields) apply to
    requests that send none; a request's own wins (1.0 / 0.0: none at all)."""
    _, target, drafter = models
    e = Engine(target, ModelSettings(dflash_enabled=True, dflash_draft_model=str(drafter),
                                     repetition_penalty=1.5, presence_penalty=0.5), model_id="tiny")
    run(e.start())
    try:
        penalized = reference("hello world", max_tokens=24, logits_processors=make_logits_processors(
            repetition_penalty=1.5, presence_penalty=0.5))
        assert penalized != reference("hello world", max_tokens=24)  # the penalties change this text
        assert run(e.generate("hello world", max_tokens=24)).text == penalized
        own = run(e.generate("hello world", max_tokens=24, repetition_penalty=1.0, presence_penalty=0.0))
        assert own.text == reference("hello world", max_tokens=24)
    finally:
        run(e.stop())


def test_stop_strings_cut_the_text(engine, reference):
    full = reference("hello world", max_tokens=40, logits_processors=None)
    stop = full[12:15]
    want = full[: full.find(stop)]
    got = run(engine.generate("hello world", max_tokens=40, stop=[stop, "never seen"]))
    assert got.text == want and got.finish_reason == "stop"
    text, chunks = run(joined(engine.stream_generate("hello world", max_tokens=40, stop=stop)))
    assert text == want and chunks[-1].finish_reason == "stop"


def test_stop_matcher_holds_back_partial_matches():
    m = StopMatcher(["</s>", "xyz"])
    assert m.add("ab") == ("ab", False)
    assert m.add("c<") == ("c", False)  # "<" may begin "</s>"
    assert m.add("/") == ("", False)
    assert m.add("t") == ("</t", False)  # not a stop after all: released
    assert m.add("x</s> more") == ("x", True)
    assert m.text == "abc</tx" and m.text_after_stop == " more"
    n = StopMatcher(["zz"])
    assert n.add("az") == ("a", False) and n.flush() == "z"


def test_queue_limit_and_abort(engine):
    """max_batch (2) requests run, max_queue (1) waits, one more is refused; an abort frees
    a place for the waiting one."""
    async def scenario():
        long = engine.stream_generate("hello", request_id="long", max_tokens=400, logit_bias=NO_EOS)
        first = await long.__anext__()
        other = engine.stream_generate("hey", request_id="other", max_tokens=400, logit_bias=NO_EOS)
        await other.__anext__()
        waiting = asyncio.create_task(engine.generate("hello", request_id="waiting", max_tokens=5))
        for _ in range(200):
            if engine.get_stats()["queued_requests"] == 1:
                break
            await asyncio.sleep(0.01)
        assert engine.get_stats()["queued_requests"] == 1 and engine.has_active_requests()
        with pytest.raises(QueueFull):
            engine.stream_generate("hello", max_tokens=2)  # max_queue=1: refused at once
        assert engine.abort("long") == 1
        rest = [c async for c in long]
        assert rest[-1].finish_reason == "abort" and rest[-1].completion_tokens < 400
        done = await waiting
        await other.aclose()
        assert done.completion_tokens == 5 and done.finish_reason == "length"
        await idle(engine)
        return first

    aborted = engine.get_stats()["aborted_requests"]
    run(scenario())
    stats = engine.get_stats()
    assert stats["aborted_requests"] == aborted + 2 and stats["rejected_requests"] >= 1


def test_a_request_cut_off_while_it_waits_is_counted(engine):
    """A client that leaves before its request's turn came (it never reached the worker)
    counts as an aborted request, and frees its place in the queue."""
    async def scenario():
        running = [engine.stream_generate(p, max_tokens=400, logit_bias=NO_EOS) for p in ("hello", "hey")]
        for r in running:
            await r.__anext__()
        waiting = asyncio.create_task(engine.generate("hello", max_tokens=5))
        for _ in range(200):
            if engine.get_stats()["queued_requests"] == 1:
                break
            await asyncio.sleep(0.01)
        assert engine.get_stats()["queued_requests"] == 1
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        middle = engine.get_stats()
        for r in running:
            await r.aclose()
        await idle(engine)
        return middle

    before = engine.get_stats()
    middle = run(scenario())
    assert middle["aborted_requests"] == before["aborted_requests"] + 1 and middle["queued_requests"] == 0
    assert engine.get_stats()["aborted_requests"] == before["aborted_requests"] + 3


def test_consumer_leaving_stops_generation(engine):
    async def scenario():
        chunks = engine.stream_generate("hello", max_tokens=400, logit_bias=NO_EOS)
        async for _ in chunks:
            break
        await chunks.aclose()
        for _ in range(300):
            if not engine.has_active_requests():
                break
            await asyncio.sleep(0.01)
        return engine.has_active_requests()

    before = engine.get_stats()
    assert run(scenario()) is False
    after = engine.get_stats()
    assert after["aborted_requests"] == before["aborted_requests"] + 1
    assert after["generation_tokens"] - before["generation_tokens"] < 400


def test_max_ctx_falls_back_to_plain_decoding(models, reference):
    _, target, drafter = models
    e = Engine(target, ModelSettings(dflash_enabled=True, dflash_draft_model=str(drafter), dflash_max_ctx=5))
    run(e.start())
    try:
        long_prompt = run(e.generate("hello world", max_tokens=12))  # 11 tokens > 5: plain
        short_prompt = run(e.generate("hey", max_tokens=12))  # 3 tokens: DFlash
        stats = e.get_stats()
    finally:
        run(e.stop())
    assert long_prompt.text == reference("hello world", max_tokens=12) and long_prompt.cycles == 0
    assert short_prompt.cycles > 0 and stats["plain_fallbacks"] == 1


def test_oversize_prompt_and_bad_token_ids(models):
    _, target, _ = models
    e = Engine(target, ModelSettings(max_context_window=8))
    run(e.start())
    try:
        with pytest.raises(PromptTooLong, match="at most 8"):
            e.stream_generate("a prompt far over eight tokens")
        with pytest.raises(ValueError, match="outside the vocabulary"):
            e.stream_generate([3, 4, 10_000])
        assert run(e.generate([5, 6, 7], max_tokens=3)).completion_tokens == 3
    finally:
        run(e.stop())


def test_tools_reach_the_chat_template(models):
    root, _, _ = models
    e = Engine(root / "models" / "other")
    run(e.start())
    try:
        messages = [{"role": "user", "content": "hi"}]
        plain = run(e.count_chat_tokens(messages))
        with_tools = run(e.count_chat_tokens(messages, TOOLS))
        assert with_tools == plain + len("lookup .")
        reply = run(e.chat(messages, TOOLS, max_tokens=4))
        assert reply.prompt_tokens == with_tools and reply.completion_tokens <= 4
    finally:
        run(e.stop())
    # A template without a tools section would drop them: a clear error naming the field.
    e = Engine(root / "models" / "tiny")
    run(e.start())
    try:
        with pytest.raises(InvalidOption, match="does not render tools") as caught:
            run(e.count_chat_tokens([{"role": "user", "content": "hi"}], TOOLS))
        assert caught.value.param == "tools"
    finally:
        run(e.stop())


def test_chat_template_variables_reach_the_template(models):
    root, _, _ = models
    e = Engine(root / "models" / "other", chat_template_args={"shout": True})  # serve --chat-template-args
    run(e.start())
    try:
        messages = [{"role": "user", "content": "hi"}]
        quiet = run(e.count_chat_tokens(messages, chat_template_kwargs={"shout": False}))
        assert run(e.count_chat_tokens(messages)) == quiet + len("shout .")
        reply = run(e.chat(messages, max_tokens=4, chat_template_kwargs={"shout": False}))
        assert reply.prompt_tokens == quiet  # a request's variables override the engine's
        with pytest.raises(InvalidOption, match="may not set add_generation_prompt, tokenize") as bad:
            e.stream_chat(messages, chat_template_kwargs={"tokenize": False, "add_generation_prompt": True})
        assert bad.value.param == "chat_template_kwargs"
    finally:
        run(e.stop())


def test_model_settings_set_template_variables(models, tmp_path):
    """model_settings.json's chat_template_kwargs and forced_ct_kwargs (oMLX's fields): the
    model's variables over serve's, a request's over the model's except forced keys; an edit
    applies from the next request; a variable that would set apply_chat_template's own
    arguments makes the settings unusable, naming the field (a model that had good ones
    keeps them)."""
    root, _, _ = models
    store = SettingsStore(tmp_path / "model_settings.json")
    store.set("other", chat_template_kwargs={"shout": True})
    pool = EnginePool(store, model_dir=root / "models", chat_template_args={"shout": False})
    messages = [{"role": "user", "content": "hi"}]

    async def scenario():
        e = await pool.get("other")
        quiet = await e.count_chat_tokens(messages, chat_template_kwargs={"shout": False})
        assert await e.count_chat_tokens(messages) == quiet + len("shout .")
        store.set("other", forced_ct_kwargs=["shout"])
        assert await pool.get("other") is e  # no reload: applies from the next request
        assert await e.count_chat_tokens(messages, chat_template_kwargs={"shout": False}) == quiet + len("shout .")
        reply = await e.chat(messages, max_tokens=4, chat_template_kwargs={"shout": False})
        assert reply.prompt_tokens == quiet + len("shout .")
        store.set("other", chat_template_kwargs={"shout": True, "tokenize": False})
        assert await pool.get("other") is e  # the last good settings kept (issue 41)
        assert "other: chat_template_kwargs" in pool.settings_problem()
        assert "may not set tokenize" in pool.settings_problem()
        await pool.stop()
        fresh = EnginePool(store, model_dir=root / "models")  # never good: refused, naming the field
        with pytest.raises(SettingsError, match="other: chat_template_kwargs: .* may not set tokenize") as bad:
            await fresh.get("other")
        assert bad.value.param == "chat_template_kwargs"

    run(scenario())


def test_stop_frees_memory_and_refuses_work(models):
    _, target, drafter = models
    active = lambda: on_worker(mx.get_active_memory)  # noqa: E731
    before = active()
    e = Engine(target, draft=str(drafter))
    run(e.start())
    loaded = active()
    run(e.stop())
    assert loaded > before and active() <= before
    with pytest.raises(EngineError):
        e.stream_generate("hello")


class _CountingStore(SettingsStore):
    reads = 0

    def read(self):
        self.reads += 1
        return super().read()


def test_pool_names_defaults_and_ttl(models, tmp_path):
    """oMLX's model_alias (the API's name; the id still works), is_default (the model of a
    request naming none) and ttl_seconds (idle models unloaded; pinned or busy ones kept;
    the settings file read once a check, however many models are loaded)."""
    root, _, _ = models
    store = _CountingStore(tmp_path / "model_settings.json")
    pool = EnginePool(store, model_dir=root / "models", max_models=2)
    with pytest.raises(NoDefaultModel):
        pool.resolve(None)
    store.set("tiny", model_alias="tiny-chat", ttl_seconds=5)
    store.set("other", is_default=True, ttl_seconds=5, is_pinned=True)
    assert [pool.resolve(n) for n in ("tiny-chat", "tiny", None)] == ["tiny", "tiny", "other"]
    assert pool.public_name("tiny") == "tiny-chat" and pool.public_name("other") == "other"
    with pytest.raises(UnknownModel):
        pool.resolve("tiny-chatty")

    async def scenario():
        tiny, other = await pool.get("tiny"), await pool.get("other")
        now, store.reads = tiny.last_used, 0
        assert await pool.expire(now + 4) == []  # not idle long enough
        assert store.reads == 1
        busy = tiny.stream_generate("hello", max_tokens=400, logit_bias=NO_EOS)
        await busy.__anext__()
        assert await pool.expire(tiny.last_used + 60) == []  # busy
        await busy.aclose()
        await idle(tiny)
        assert await pool.expire(max(tiny.last_used, other.last_used) + 6) == ["tiny"]  # other is pinned
        assert not tiny.running and other.running and list(pool.engines) == ["other"]
        await pool.stop()

    run(scenario())


def test_pool_loads_on_demand_and_evicts_lru(models, tmp_path):
    root, target, drafter = models
    store = SettingsStore(tmp_path / "model_settings.json")
    store.set("tiny", dflash_enabled=True, dflash_draft_model=str(drafter))
    pool = EnginePool(store, model_dir=root / "models", max_models=1)
    assert pool.model_ids() == ["other", "tiny"]

    async def scenario():
        tiny = await pool.get("tiny")
        assert tiny.settings.draft == str(drafter) and await pool.get("tiny") is tiny
        other = await pool.get("other")  # room for one: tiny (idle, least recent) goes
        assert list(pool.engines) == ["other"] and not tiny.running and other.running
        busy = other.stream_generate("hello", max_tokens=400, logit_bias=NO_EOS)
        await busy.__anext__()
        with pytest.raises(PoolBusy):
            await pool.get("tiny")  # the only loaded model is busy
        await busy.aclose()
        while other.has_active_requests():
            await asyncio.sleep(0.01)
        tiny = await pool.get("tiny")
        # A manager edits the settings: a sampling default applies without a reload...
        store.set("tiny", temperature=0.5)
        assert await pool.get("tiny") is tiny and tiny.settings.temperature == 0.5
        assert tiny.prefix_cache.enabled  # ...and so does the prefix cache's size
        store.set("tiny", dflash_in_memory_cache=False)
        assert await pool.get("tiny") is tiny and not tiny.prefix_cache.enabled
        # ...and turning DFlash off reloads the model without its drafter.
        store.set("tiny", dflash_enabled=False)
        plain = await pool.get("tiny")
        assert plain is not tiny and plain.settings.draft is None and not tiny.running
        with pytest.raises(UnknownModel):
            await pool.get("nope")
        with pytest.raises(UnknownModel):
            await pool.get("../models/tiny")
        await pool.stop()
        assert pool.engines == {} and not plain.running

    run(scenario())


def test_pool_memory_budget(models, tmp_path):
    root, _, _ = models
    pool = EnginePool(SettingsStore(tmp_path / "s.json"), model_dir=root / "models", max_models=4,
                      memory_budget_gb=1.5 * (root / "models" / "tiny" / "model.safetensors").stat().st_size / 1e9)

    async def scenario():
        await pool.get("tiny")
        await pool.get("other")  # both do not fit the budget: tiny is unloaded
        assert list(pool.engines) == ["other"]
        await pool.stop()

    run(scenario())


@pytest.mark.parametrize("block", [None, 4])
def test_concurrent_requests_share_the_batch_and_each_keeps_its_text(models, reference, block):
    """Requests that run together are verified in one batch; each greedy one still gets
    exactly its generate() text (mixed prompts and lengths, a stop string, an abort), and
    the seeded sampled one its single-stream text: under adaptive block sizes it runs next to
    the batch, under a fixed one in it (the batch copies as its single stream does)."""
    _, target, drafter = models
    e = Engine(target, ModelSettings(dflash_enabled=True, dflash_draft_model=str(drafter),
                                     dflash_block_size=block),
               model_id="tiny", max_batch=6)
    run(e.start())
    full = reference("hello world", max_tokens=40)
    stop = full[12:15]
    asks = [("hello world", dict(max_tokens=40, stop=[stop])),
            ("a much longer prompt about the sea and the sky", dict(max_tokens=30)),
            ("hey", dict(max_tokens=7)),
            ("zebra", dict(max_tokens=25, logit_bias=NO_EOS)),
            ("hello world", dict(max_tokens=16, temperature=1.0, seed=7, logit_bias=NO_EOS)),
            ("zebra", dict(max_tokens=40, temperature=0.3, seed=3, logit_bias=NO_EOS))]  # copies 3 blocks

    async def scenario():
        doomed = e.stream_generate("abort me", request_id="doomed", max_tokens=400, logit_bias=NO_EOS)
        await doomed.__anext__()
        tasks = [asyncio.create_task(e.generate(p, **kw)) for p, kw in asks]
        await asyncio.sleep(0.05)
        assert e.abort("doomed") == 1
        rest = [c async for c in doomed]
        return await asyncio.gather(*tasks), rest[-1]

    try:
        done, aborted = run(scenario())
        stats = e.get_stats()
        assert stats["batching"] and stats["peak_batch_size"] >= 3 and stats["mean_batch_size"] > 1
    finally:
        run(e.stop())
    assert aborted.finish_reason == "abort" and aborted.completion_tokens < 400
    assert done[0].text == full[: full.find(stop)] and done[0].finish_reason == "stop"
    for (prompt, kw), got in zip(asks[1:], done[1:]):
        want = reference(prompt, max_tokens=kw["max_tokens"], temp=kw.get("temperature", 0.0),
                         seed=kw.get("seed"), logits_processors=_bias(kw.get("logit_bias")),
                         block_size=block or "auto")
        # A seeded sampled reply is its single stream's under a fixed block size; under auto
        # the sizes (and with them the draws) follow each run's clock.
        if block is not None or not kw.get("temperature"):
            assert got.text == want, (prompt, kw)
        assert got.completion_tokens <= kw["max_tokens"] and got.cycles > 0
        assert sum(got.block_sizes.values()) == got.cycles


def _bias(bias):
    return make_logits_processors(logit_bias=bias) if bias else None


def test_plain_requests_run_side_by_side_each_with_its_own_random_stream(models, reference):
    """Without a drafter requests take turns on the worker a token at a time; each draws
    from its own key, so a seeded sampled reply is still generate()'s with that seed."""
    _, target, _ = models
    e = Engine(target, model_id="plain", max_batch=3)
    run(e.start())
    asks = [dict(temperature=1.0, seed=5), dict(temperature=0.9, seed=6), dict(temperature=1.0)]

    async def scenario():
        return await asyncio.gather(*(e.generate("hello world", max_tokens=30, logit_bias=NO_EOS, **kw)
                                      for kw in asks))

    try:
        done = run(scenario())
    finally:
        run(e.stop())
    for kw, got in zip(asks[:2], done):
        want = reference("hello world", max_tokens=30, verify_mode="off", temp=kw["temperature"],
                         seed=kw["seed"], logits_processors=_bias(NO_EOS))
        assert got.text == want and got.cycles == 0
    assert done[0].text != done[1].text


def test_a_sliding_window_target_is_batched_exactly(tmp_path):
    """A sliding-window target serves concurrent DFlash requests in the batch (its windows
    masked there): generate()'s text, batch steps in /metrics."""
    on_worker(make_target, tmp_path / "t", "llama", alphabet="abcd", seed=3)
    config = json.loads((tmp_path / "t" / "config.json").read_text())
    config.update(layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8)
    (tmp_path / "t" / "config.json").write_text(json.dumps(config))
    on_worker(make_drafter, tmp_path / "d", tmp_path / "t")
    reference = worker_reference(tmp_path / "t", tmp_path / "d")
    e = Engine(tmp_path / "t", ModelSettings(dflash_enabled=True, dflash_draft_model=str(tmp_path / "d")),
               max_batch=4)
    run(e.start())
    prompts = ["abcab dcba", "dd cb", "cab"]

    async def scenario():
        return await asyncio.gather(*(e.generate(p, max_tokens=20) for p in prompts))

    try:
        done = run(scenario())
        stats = e.get_stats()
    finally:
        run(e.stop())
    assert stats["batching"] and stats["batch_steps"] > 0
    for p, got in zip(prompts, done):
        assert got.text == reference(p, max_tokens=20) and got.engine["dflash"]


def test_tree_mode_decodes_exactly_and_reports_its_trees(models, reference):
    _, target, drafter = models
    e = Engine(target, ModelSettings(dflash_enabled=True, dflash_draft_model=str(drafter), dflash_block_size=5,
                                     dflash_verify_mode="ddtree", dflash_tree_budget=8), max_batch=1)
    run(e.start())
    try:
        got = run(e.generate("hello world", max_tokens=20))
    finally:
        run(e.stop())
    assert got.text == reference("hello world", max_tokens=20)
    assert got.engine["verify_mode"] == "ddtree" and got.engine["tree_budget"] == 8
    assert got.trees["trees"] > 0 and got.trees["nodes_verified"] == 8 * got.trees["trees"]
    assert got.trees["chain_why"] is None
