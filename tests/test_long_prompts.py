"""Long prompts take turns: a prompt is read a time-bounded chunk a step of the worker, so a
request given up while its prompt is read stops within one chunk, and a short request that
comes meanwhile is answered before the long prompt is read (its single stream hands over to
the batch, which reads it a chunk between cycles).  Chunks are made tiny here, so that the
tiny model's prompt takes many of them."""

import asyncio
import time
import types

import pytest

from dflash2_mlx.backend import prefix_cache
from dflash2_mlx.backend.engine import Engine
from dflash2_mlx.backend.prefix_cache import PrefixCache
from dflash2_mlx.backend.settings import ModelSettings
from tiny_models import make_drafter, make_target, on_worker, worker_reference

NO_EOS = {1: -100.0}
LONG = 3000  # prompt tokens: with chunks of 32 tokens at least, up to ~94 chunks


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    target = on_worker(make_target, root / "t")
    drafter = on_worker(make_drafter, root / "d", target)
    return target, drafter


@pytest.fixture
def chunks_read(monkeypatch):
    """Chunks of a prompt read so far (each a worker step), counted."""
    count = [0]
    real = PrefixCache.advance_steps

    def counted(*a, **kw):
        for _ in real(*a, **kw):
            count[0] += 1
            time.sleep(0.01)  # a slow machine's chunk: the test's checks see the prompt being read
            yield

    monkeypatch.setattr(PrefixCache, "advance_steps", staticmethod(counted))
    monkeypatch.setattr(prefix_cache, "PREFILL_CHUNK_SECONDS", 1e-6)
    return count


@pytest.fixture
def batch_chunks(monkeypatch):
    """(prompt length, tokens read) of each chunk read, in order; chunks in the batch of 32
    tokens (its least), each as slow as a slow machine's, so that a request sent meanwhile
    comes while the prompt is read."""
    from dflash2_mlx.backend import batch_job
    chunks = []
    real = PrefixCache.advance_steps

    def counted(start, ids, *a, **kw):
        before = start.tokens
        for _ in real(start, ids, *a, **kw):
            chunks.append((len(ids), start.tokens - before))
            before = start.tokens
            time.sleep(0.01)
            yield

    monkeypatch.setattr(PrefixCache, "advance_steps", staticmethod(counted))
    monkeypatch.setattr(prefix_cache, "PREFILL_CHUNK_SECONDS", 1e-6)
    for name in ("MIN_CHUNK_SECONDS", "PREFILL_CHUNK_SECONDS"):
        monkeypatch.setattr(batch_job, name, 1e-6)
    return chunks


def engine_of(pair, max_batch=4, **settings):
    target, drafter = pair
    return Engine(target, ModelSettings(dflash_enabled=True, dflash_draft_model=str(drafter), **settings),
                  model_id="tiny", max_queue=4, max_batch=max_batch)


def long_ids(n=LONG):
    return [3 + (i * 7) % 11 for i in range(n)]


async def until(cond, timeout=60.0):
    for _ in range(int(timeout / 0.005)):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("timed out")


@pytest.mark.parametrize("cache_gb", [0, 0.064])  # the prefix cache off and on
def test_a_request_given_up_while_its_prompt_is_read_stops_within_a_chunk(pair, chunks_read, cache_gb):
    async def scenario():
        e = engine_of(pair, prefix_cache_gb=cache_gb)
        await e.start()
        try:
            stream = e.stream_ids(long_ids(), request_id="long", max_tokens=8, logit_bias=NO_EOS)
            task = asyncio.ensure_future(asyncio.wait_for(_last(stream), 60))
            await until(lambda: chunks_read[0] >= 3)
            assert e.abort("long") == 1
            at_abort = chunks_read[0]
            last = await task
            await until(lambda: not e.has_active_requests(), 10)
            return at_abort, chunks_read[0], last, e.get_stats()
        finally:
            await e.stop()

    at_abort, after, last, stats = asyncio.run(scenario())
    assert after <= at_abort + 1, f"{after - at_abort} chunks read after the abort"
    assert last.finish_reason == "abort" and last.completion_tokens in (0, None)
    assert stats["aborted_requests"] == 1


def test_a_prompt_given_up_while_read_beside_the_batch_keeps_what_was_read(pair, chunks_read, monkeypatch):
    """A client that gives up while its long prompt is read beside decoding requests (its
    SDK timed out) and asks again goes on from what was read: the read part is in the prefix
    cache, and the reply is a fresh run's."""
    from dflash2_mlx.backend import batch_job
    for name in ("MIN_CHUNK_SECONDS", "PREFILL_CHUNK_SECONDS"):  # chunks of a token or so in
        monkeypatch.setattr(batch_job, name, 1e-6)  # the batch, however fast the machine
    target, drafter = pair
    reference = worker_reference(target, drafter)
    ids = long_ids(1200)

    async def scenario():
        e = engine_of(pair, prefix_cache_gb=0.064)
        await e.start()
        try:
            busy = asyncio.ensure_future(asyncio.wait_for(_last(e.stream_ids(
                [3, 4, 5], request_id="busy", max_tokens=2000, logit_bias=NO_EOS)), 120))
            await until(lambda: e.get_stats()["active_requests"] == 1)
            long = asyncio.ensure_future(asyncio.wait_for(
                _last(e.stream_ids(ids, request_id="long", max_tokens=8)), 120))
            await until(lambda: chunks_read[0] >= 4)
            assert e.abort("long") == 1
            first = await long
            read = chunks_read[0]
            again = [c async for c in e.stream_ids(ids, max_tokens=8)]
            assert not busy.done(), "the prompts were not read beside a decoding request"
            e.abort("busy")
            await busy
            return first, read, again
        finally:
            await e.stop()

    first, read, again = asyncio.run(scenario())
    assert first.finish_reason == "abort"
    assert again[-1].cached_tokens >= read, "the second request read the prompt from the start"
    assert "".join(c.text for c in again) == reference(ids, max_tokens=8)


def test_a_short_request_is_answered_while_a_long_prompt_is_read(pair, chunks_read):
    async def scenario():
        e = engine_of(pair)
        await e.start()
        try:
            long = asyncio.ensure_future(asyncio.wait_for(
                _last(e.stream_ids(long_ids(), max_tokens=4, logit_bias=NO_EOS)), 120))
            await until(lambda: chunks_read[0] >= 2)
            short = await asyncio.wait_for(_last(e.stream_ids([3, 4, 5], max_tokens=3, logit_bias=NO_EOS)), 60)
            read_when_short_ended = chunks_read[0]
            done_long = await long
            return short, read_when_short_ended, chunks_read[0], done_long
        finally:
            await e.stop()

    short, read_then, read_in_all, long = asyncio.run(scenario())
    assert short.finish_reason == "length" and short.completion_tokens == 3
    assert read_then < read_in_all, "the short request waited for the whole long prompt"
    assert long.finish_reason == "length" and long.completion_tokens == 4


def test_long_prompts_are_read_one_at_a_time_and_short_requests_pass_them(pair, batch_chunks):
    """Two long prompts hold both of the batch's places: the second waits while the first is
    read (read together, each would take as long as both) and passes its place on, so a short
    request that comes meanwhile is answered before either long one; both replies are their
    single streams'."""
    order = batch_chunks  # (prompt length, tokens read) of each chunk, in order
    target, drafter = pair
    reference = worker_reference(target, drafter)
    first_ids, second_ids = long_ids(2000), long_ids(1800)[::-1]

    async def scenario():
        e = engine_of(pair, max_batch=2)
        await e.start()
        try:
            first = asyncio.ensure_future(asyncio.wait_for(_all(e.stream_ids(first_ids, max_tokens=4)), 120))
            await until(lambda: len(order) >= 2)
            second = asyncio.ensure_future(asyncio.wait_for(_all(e.stream_ids(second_ids, max_tokens=4)), 120))
            then = len(order)
            await until(lambda: len(order) >= then + 5)  # the first has handed over: both are in the batch
            short = await asyncio.wait_for(_last(e.stream_ids([3, 4, 5], max_tokens=3, logit_bias=NO_EOS)), 60)
            long_done_when_short_ended = first.done() or second.done()
            return short, long_done_when_short_ended, await first, await second
        finally:
            await e.stop()

    short, long_done, first, second = asyncio.run(scenario())
    assert short.finish_reason == "length" and short.completion_tokens == 3
    assert not long_done, "the short request waited for a long prompt to be read"
    # The first prompt is read to its end (by its single stream, then in the batch) before
    # any chunk of the second.
    lengths = [n for n, _ in order]
    switches = sum(1 for a, b in zip(lengths, lengths[1:]) if a != b)
    assert switches == 1, f"the long prompts were read in turns: {lengths}"
    assert first == reference(first_ids, max_tokens=4)
    assert second == reference(second_ids, max_tokens=4)


def test_a_prompt_in_line_that_begins_as_the_one_read_reads_only_the_rest(pair, batch_chunks):
    """Two clients send the same long prompt together: the second waits while the first is
    read, and when its turn comes it starts from what the first read (kept at once, not at
    the end of the first's turn), so the prompt is read once, not twice; both replies are
    their single streams', and the second's two lookups count as one."""
    from dflash2_mlx.backend import batch_job
    chunks = batch_chunks  # (prompt length, tokens read) of each chunk, in order
    target, drafter = pair
    reference = worker_reference(target, drafter)
    ids = long_ids(2000)

    async def scenario():
        e = engine_of(pair, max_batch=2, prefix_cache_gb=0.064)
        await e.start()
        try:
            first = asyncio.ensure_future(asyncio.wait_for(_all(e.stream_ids(ids, max_tokens=4)), 120))
            await until(lambda: len(chunks) >= 2)
            second = asyncio.ensure_future(asyncio.wait_for(_all(e.stream_ids(ids, max_tokens=4)), 120))
            replies = await first, await second
            return replies, e.get_stats()
        finally:
            await e.stop()

    (first, second), stats = asyncio.run(scenario())
    read = sum(k for _, k in chunks)
    assert read < 1.2 * len(ids), f"the prompt was read {read / len(ids):.1f} times"
    assert first == second == reference(ids, max_tokens=4)
    # One miss (the first's single stream), a hit for its handover to the batch (its caches
    # pass through the prefix cache) and one for the second: its two lookups count once.
    assert (stats["prefix_cache_misses"], stats["prefix_cache_hits"]) == (1, 2)
    assert stats["prefix_cache_cached_tokens"] >= len(ids) - 1 - batch_job.READ_AT_ONCE


async def _all(chunks) -> str:
    return "".join([c.text async for c in chunks])


def test_a_prompt_read_in_chunks_gives_the_same_tokens(pair, chunks_read):
    """Greedy output is generate()'s, whether the prompt was read at once or in chunks."""
    target, drafter = pair
    reference = worker_reference(target, drafter)
    ids = long_ids(600)

    async def scenario():
        e = engine_of(pair)
        await e.start()
        try:
            out = [c async for c in e.stream_ids(ids, max_tokens=12)]
            return out
        finally:
            await e.stop()

    out = asyncio.run(scenario())
    assert chunks_read[0] > 5
    text = "".join(c.text for c in out)
    assert text == reference(ids, max_tokens=12)


async def _last(chunks):
    last = None
    async for c in chunks:
        last = c
    return last


def test_a_prompt_read_beside_decoding_requests_is_read_in_chunks_of_their_cycles(pair):
    """While requests decode, a prompt being read takes chunks of about one of their cycles
    (so their gaps stay about two cycles) but not under 16 tokens, asked before each chunk;
    alone, half a second."""
    from dflash2_mlx.backend.batch_job import MIN_CHUNK_SECONDS, Batching
    from dflash2_mlx.backend.prefix_cache import PREFILL_CHUNK_SECONDS, Start
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    b = Batching(engine=None)
    assert b.chunk_seconds() == PREFILL_CHUNK_SECONDS
    for cycle, want in ((0.1, 0.075), (5.0, PREFILL_CHUNK_SECONDS), (1e-4, MIN_CHUNK_SECONDS)):
        b.cycle_seconds = cycle
        assert b.chunk_seconds() == pytest.approx(want)
    model, _ = on_worker(load, str(pair[0]))

    def chunks(seconds) -> list:
        start = Start(make_prompt_cache(model), None)
        sizes, before = [], 0
        for _ in PrefixCache.advance_steps(start, long_ids(200), model, seconds=seconds):
            sizes.append(start.tokens - before)
            before = start.tokens
        return sizes

    asked = []
    tiny = on_worker(chunks, lambda: asked.append(1) or 1e-9)
    # However short the cycles, a chunk holds LEAST_BESIDE tokens (16): below, each is
    # mostly the weights' pass, and the prompt is read many times slower than alone.
    assert tiny == [128, 16, 16, 16, 16, 8] and len(asked) == len(tiny)
    assert on_worker(chunks, 1e9) == [128, 72]


def test_the_prompts_in_line_get_more_of_the_time_as_the_line_grows(monkeypatch):
    """Beside decoding requests, a chunk that takes longer than their cycle is followed by
    cycles only until the chunks had their share: the batch's cycles one part, each prompt in
    line one part.  One prompt: the cycles are owed as long as its chunk took; three: a third
    of what their chunks took (not as long again: a line drains in n + 1 times one's time)."""
    from dflash2_mlx.backend import batch_job
    from dflash2_mlx.backend.admission import Request
    from dflash2_mlx.backend.options import RequestOptions

    clock = [0.0]
    monkeypatch.setattr(batch_job, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def chunks():  # each chunk of a prompt takes 10 ms of the clock
        while True:
            clock[0] += 0.01
            yield

    for line, owed in ((1, 0.01), (3, 0.01)):
        b = batch_job.Batching(engine=None)
        b.cycle_seconds = 0.001
        reading = [batch_job.Reading(Request(f"r{i}", [3, 4, 5], RequestOptions()), None, None, [3, 4, 5], None,
                                     chunks()) for i in range(line)]
        b._read(None, {0: "decoding"}, reading)
        assert b.owed == pytest.approx(owed), line
