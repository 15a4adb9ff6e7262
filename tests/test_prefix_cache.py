"""The prefix cache, in-process on tiny real models: multi-turn chats reuse earlier caches and
give exactly the text of a run without them (greedy), for attention and hybrid targets,
DFlash on (fixed and adaptive blocks) and off; memory stays within the budget."""

import asyncio

import pytest

from dflash2_mlx.backend.engine import Engine
from dflash2_mlx.backend.settings import ModelSettings
from tiny_models import make_drafter, make_target, on_worker, worker_reference

NO_EOS = {1: -100.0}


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    target = on_worker(make_target, root / "target", request.param, scale=4.0)
    drafter = on_worker(make_drafter, root / "drafter", target)
    return target, drafter, worker_reference(target, drafter)


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
def test_chat_turns_reuse_the_cache_and_match_generate(pair, kind):
    target, drafter, reference = pair
    settings, ref_options = ENGINES[kind]
    engine = Engine(target, ModelSettings(dflash_draft_model=str(drafter), **settings), model_id="t")
    asyncio.run(engine.start())
    try:
        turns = ["tell me a long story about cats", "and then what", "why so"]
        done = chat_turns(engine, turns, max_tokens=20, logit_bias=NO_EOS)
        for i, (messages, c) in enumerate(done):
            want = reference(messages, max_tokens=20, **ref_options, **_bias())
            assert c.text == want, f"turn {i + 1}"
            assert c.engine["dflash"] == (kind != "plain")
        cached = [c.cached_tokens for _, c in done]
        assert cached[0] == 0 and all(n > 0 for n in cached[1:])
        if engine.prefix_cache.entries and next(iter(engine.prefix_cache.entries.values())).trimmable:
            # Attention caches keep the reply too: turn 2 reuses all of turn 1 but the end.
            assert cached[1] >= done[0][1].prompt_tokens
        stats = engine.get_stats()
        assert stats["prefix_cache_hits"] == 2 and stats["prefix_cache_misses"] == 1
        assert 0 < stats["prefix_cache_bytes"] <= stats["prefix_cache_budget_bytes"]
    finally:
        asyncio.run(engine.stop())


def _bias():
    from mlx_lm.sample_utils import make_logits_processors

    return {"logits_processors": make_logits_processors(logit_bias=NO_EOS)}


def test_same_prompt_twice_and_budget(pair):
    target, drafter, reference = pair
    engine = Engine(target, ModelSettings(dflash_enabled=True, dflash_draft_model=str(drafter)),
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
        size = engine.get_stats()["prefix_cache_bytes"]
        engine.prefix_cache.budget = size + size // 2  # room for one entry: the older goes
        asyncio.run(engine.generate("zebra quiz", max_tokens=12))
        assert engine.get_stats()["prefix_cache_entries"] == 1
        assert asyncio.run(engine.generate("hello world", max_tokens=12)).cached_tokens == 0
    finally:
        asyncio.run(engine.stop())
