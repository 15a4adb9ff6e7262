"""The prefix cache, in-process on tiny real models: multi-turn chats reuse earlier caches and
give exactly the text of a run without them (greedy), for attention and hybrid targets,
DFlash on (fixed and adaptive blocks) and off; memory stays within the budget."""

import asyncio
import gc

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.sample_utils import make_logits_processors

from dflash2_mlx.backend.engine import Engine
from dflash2_mlx.backend.prefix_cache import PrefixCache
from dflash2_mlx.backend.settings import ModelSettings
from tiny_models import make_target, on_worker

NO_EOS = {1: -100.0}
# The tiny qwen3_5 tokenizer (transformers' Qwen3_5Tokenizer over the char vocabulary) decodes
# the space token but drops spaces when it encodes, so a reply with a space never comes back
# verbatim in the next prompt; chats leave it out so turn 1's reply can be reused whole.
CHAT_BIAS = {**NO_EOS, 29: -100.0}
LARGEST_BLOCK = 8  # the tiny drafter's block size


ENGINES = {  # settings -> the reference generate() options
    "dflash auto": (dict(dflash_enabled=True), {}),
    "dflash block 4": (dict(dflash_enabled=True, dflash_block_size=4), dict(block_size=4)),
    "plain": (dict(dflash_enabled=False), dict(verify_mode="off")),
}


def chat_turns(engine, turns, **options):
    """Run a chat turn by turn (each reply goes into the history); the completions."""
    async def go():
        messages, out = [], []
        for text in turns:
            messages.append({"role": "user", "content": text})
            c = await engine.chat(list(messages), **options)
            messages.append({"role": "assistant", "content": c.text})
            out.append((list(messages[:-1]), c))
        return out

    return asyncio.run(go())


@pytest.mark.parametrize("kind", list(ENGINES))
def test_chat_turns_reuse_the_cache_and_match_generate(cache_pair, kind):
    target, drafter, reference = cache_pair
    settings, ref_options = ENGINES[kind]
    engine = Engine(target, ModelSettings(dflash_draft_model=str(drafter), **settings), model_id="t")
    asyncio.run(engine.start())
    try:
        turns = ["tell me a long story about cats", "and then what", "why so"]
        done = chat_turns(engine, turns, max_tokens=20, logit_bias=CHAT_BIAS)
        for i, (messages, c) in enumerate(done):
            want = reference(messages, max_tokens=20, **ref_options, **_bias(CHAT_BIAS))
            assert c.text == want, f"turn {i + 1}"
            assert c.engine["dflash"] == (kind != "plain")
        cached = [c.cached_tokens for _, c in done]
        assert cached[0] == 0 and all(n > 0 for n in cached[1:])
        # Turn 2 reuses turn 1's prompt and reply, hybrid targets too (their end-of-turn
        # state); with DFlash the last cycle may have run past the reply's end, so up to a
        # block's worth of the reply may be left out.
        first = done[0][1]
        whole = first.prompt_tokens + first.completion_tokens
        assert whole - (0 if kind == "plain" else LARGEST_BLOCK) <= cached[1] <= whole
        stats = engine.get_stats()
        assert stats["prefix_cache_hits"] == 2 and stats["prefix_cache_misses"] == 1
        assert 0 < stats["prefix_cache_bytes"] <= stats["prefix_cache_budget_bytes"]
    finally:
        asyncio.run(engine.stop())


def _bias(bias):
    return {"logits_processors": make_logits_processors(logit_bias=bias)}


def test_same_prompt_twice_and_budget(cache_pair):
    target, drafter, reference = cache_pair
    # A fixed block size: an entry keeps the rows its request's last cycle left, and adaptive
    # block sizes follow the machine's timing, which would make the budget arithmetic below
    # depend on it.
    engine = Engine(target, ModelSettings(dflash_enabled=True, dflash_draft_model=str(drafter),
                                          dflash_block_size=4),
                    model_id="t", prefix_cache_gb=0.0)
    asyncio.run(engine.start())
    try:
        a = asyncio.run(engine.generate("hello world", max_tokens=12))
        b = asyncio.run(engine.generate("hello world", max_tokens=12))
        assert a.text == b.text == reference("hello world", max_tokens=12)
        assert b.cached_tokens == 0 and engine.get_stats()["prefix_cache_entries"] == 0  # off
        engine.prefix_cache.budget = 1
        asyncio.run(engine.generate("hello world", max_tokens=12))
        assert engine.get_stats()["prefix_cache_bytes"] == 0  # an entry over the budget is not kept
        engine.prefix_cache.budget = 10**9
        asyncio.run(engine.generate("hello world", max_tokens=12))
        c = asyncio.run(engine.generate("hello world", max_tokens=12))
        assert c.text == a.text and c.cached_tokens > 0
        size, entries = engine.get_stats()["prefix_cache_bytes"], engine.get_stats()["prefix_cache_entries"]
        # Room for one request's entries (hybrid targets: before and after the turn): the
        # older request's go.
        engine.prefix_cache.budget = size + size // 2
        asyncio.run(engine.generate("zebra quiz", max_tokens=12))
        assert engine.get_stats()["prefix_cache_entries"] == entries
        assert asyncio.run(engine.generate("hello world", max_tokens=12)).cached_tokens == 0
    finally:
        asyncio.run(engine.stop())


def test_hybrid_turn_end_is_the_last_step_with_only_known_tokens(tmp_path):
    """A speculative cycle can leave a hybrid target's caches past the reply's end (drafts
    accepted, not emitted). The end-of-turn entry is then the recurrent state of the latest
    step that held only known tokens: a prompt continuing the reply, started from it, gets
    the logits of a full prefill."""
    target = on_worker(make_target, tmp_path / "t", "qwen3_5", scale=4.0)

    def run():
        model, tokenizer = load(str(target))
        ids, reply = tokenizer.encode("tell me"), tokenizer.encode("about cats")
        cache = PrefixCache(10**9)
        start = cache.start(ids, model)
        for i, token in enumerate(ids[-1:] + reply):  # generation: one token a step
            model(mx.array([[token]]), cache=start.cache)
            cache.note(start, len(ids) + i)
        model(mx.array([reply[:3]]), cache=start.cache)  # a verify pass beyond the reply
        cache.note(start, len(ids) + len(reply))
        cache.store(ids + reply, start)
        assert max(len(e.tokens) for e in cache.entries.values()) == len(ids) + len(reply)
        prompt = ids + reply + tokenizer.encode("and dogs")
        again = cache.start(prompt, model)
        assert again.reused == len(ids) + len(reply)
        cached = model(mx.array([prompt[-1:]]), cache=again.cache)[0, -1]
        full = model(mx.array([prompt]))[0, -1]
        assert mx.allclose(cached, full, atol=1e-4).item(), mx.abs(cached - full).max().item()

    on_worker(run)


@pytest.mark.parametrize("prefix_cache_gb,disk", [(1.0, False), (0.0, False), (0.0, True)])
def test_a_lone_request_runs_as_a_single_stream_and_hands_over_when_others_come(cache_pair, prefix_cache_gb,
                                                                                 disk, tmp_path):
    """Alone, a request runs as a single stream (no batch step); when a second one asks
    to join, the first goes on in the batch after its tokens (its caches through the prefix
    cache, or its own where that is off, even with a disk tier): each text is still
    generate()'s, token counts and draft statistics run on across the handover."""
    target, drafter, reference = cache_pair
    e = Engine(target, ModelSettings(dflash_enabled=True, dflash_draft_model=str(drafter), dflash_ssd_cache=disk),
               model_id="tiny", max_batch=4, prefix_cache_gb=prefix_cache_gb, ssd_cache_dir=tmp_path)
    asyncio.run(e.start())

    async def scenario():
        alone = await e.generate("hello world", max_tokens=12, logit_bias=NO_EOS)
        solo_steps = e.get_stats()["batch_steps"]
        first = e.stream_generate("the sea and the sky", max_tokens=120, logit_bias=NO_EOS)
        head = [await first.__anext__()]
        second = asyncio.create_task(e.generate("zebra", max_tokens=20, logit_bias=NO_EOS))
        rest = [c async for c in first]
        return alone, solo_steps, head + rest, await second

    try:
        alone, solo_steps, chunks, second = asyncio.run(scenario())
        stats = e.get_stats()
    finally:
        asyncio.run(e.stop())
    bias = make_logits_processors(logit_bias=NO_EOS)
    assert solo_steps == 0 and alone.text == reference("hello world", max_tokens=12, logits_processors=bias)
    assert stats["peak_batch_size"] == 2  # the first request went on in the batch
    assert "".join(c.text for c in chunks) == reference("the sea and the sky", max_tokens=120,
                                                         logits_processors=bias)
    last = chunks[-1]
    assert last.completion_tokens == 120 and last.finish_reason == "length"
    if not prefix_cache_gb:  # the handover's own caches are not the client's prompt cache
        assert last.cached_tokens == 0 and stats["prefix_cache_ssd_hits"] == 0
    assert [c.completion_tokens for c in chunks] == sorted(c.completion_tokens for c in chunks)
    assert sum(last.block_sizes.values()) == last.cycles and last.tau >= 1.0
    assert second.text == reference("zebra", max_tokens=20, logits_processors=bias)
    assert stats["requests"] == 3 and stats["generation_tokens"] == 12 + 120 + 20


def test_omlx_cache_and_window_settings(cache_pair):
    """oMLX's names: dflash_in_memory_cache false turns the prefix cache off, its
    max_entries keeps that many entries; a draft window with sinks keeps the text exact."""
    target, drafter, reference = cache_pair
    base = dict(dflash_enabled=True, dflash_draft_model=str(drafter), dflash_block_size=4)
    off = Engine(target, ModelSettings(**base, dflash_in_memory_cache=False), model_id="t")
    assert not off.prefix_cache.enabled
    engine = Engine(target, ModelSettings(**base, dflash_in_memory_cache_max_entries=1,
                                          dflash_draft_window_size=3, dflash_draft_sink_size=2), model_id="t")
    assert engine.prefix_cache.enabled and engine.settings.draft_window == 3 and engine.settings.draft_sink == 2
    asyncio.run(engine.start())
    try:
        for prompt in ("hello world", "zebra quiz"):
            c = asyncio.run(engine.generate(prompt, max_tokens=12))
            assert c.text == reference(prompt, max_tokens=12, block_size=4)
            assert engine.get_stats()["prefix_cache_entries"] == 1
    finally:
        asyncio.run(engine.stop())


def test_entries_hold_no_more_memory_than_they_count(cache_pair):
    """An entry keeps copies of the rows it covers, not views into the caches' buffers
    (mlx-lm's grow in steps of 256 rows, and a view keeps the whole buffer alive): the
    memory the entries hold is what the cache counts, so its budget bounds real memory."""
    target, drafter, _ = cache_pair
    engine = Engine(target, ModelSettings(dflash_enabled=True, dflash_draft_model=str(drafter),
                                          dflash_block_size=4), model_id="t", prefix_cache_gb=1.0)
    asyncio.run(engine.start())
    try:
        asyncio.run(engine.generate("warm up", max_tokens=4))
        engine.prefix_cache.close()
        before = on_worker(_settled_memory)
        for prompt in ("abc", "hello world", "zebra quiz", "what next"):
            asyncio.run(engine.generate(prompt, max_tokens=6, logit_bias=NO_EOS))
        held = on_worker(_settled_memory) - before
        counted = engine.get_stats()["prefix_cache_bytes"]
        assert engine.get_stats()["prefix_cache_entries"] >= 4 and counted > 0
        assert held <= 1.5 * counted, (held, counted)
    finally:
        asyncio.run(engine.stop())


def _settled_memory() -> int:
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()
