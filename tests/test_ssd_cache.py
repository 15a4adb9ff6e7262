"""The prefix cache's disk tier (oMLX's dflash_ssd_cache), in-process on tiny real models:
entries memory lets go are restored from disk with exactly the text of a run without them
(greedy), after the engine restarts too; a pair only reads its own entries; unreadable files
are dropped, never trusted (damaged arrays fail their checksum, arrays of other shapes the
model's layout, a dead writer's temporary file goes at start); the disk stays within its budget."""

import asyncio
import logging
import os
import threading
from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_logits_processors

from dflash2_mlx.backend.engine import Engine
from dflash2_mlx.backend.pool import EnginePool
from dflash2_mlx.backend.settings import ModelSettings, SettingsError, SettingsStore
from dflash2_mlx.backend.prefix_cache import Entry
from dflash2_mlx.backend.ssd_cache import DiskTier, checksum
from tiny_models import make_drafter, on_worker

NO_EOS = {1: -100.0}


def _engine(target, drafter, disk, **settings):
    base = dict(dflash_enabled=True, dflash_draft_model=str(drafter), dflash_block_size=4, dflash_ssd_cache=True)
    engine = Engine(target, ModelSettings(**{**base, **settings}), model_id="t", ssd_cache_dir=disk)
    asyncio.run(engine.start())
    return engine


def _run(engine, prompt, max_tokens=12):
    """One request, and its entry on disk (the writer thread done) before the test looks."""
    reply = asyncio.run(engine.generate(prompt, max_tokens=max_tokens, logit_bias=NO_EOS))
    if engine.prefix_cache.disk is not None:
        engine.prefix_cache.disk.flush()
    return reply


def _reference(reference, prompt, max_tokens=12):
    return reference(prompt, max_tokens=max_tokens, block_size=4,
                     logits_processors=make_logits_processors(logit_bias=NO_EOS))


def test_memory_off_entries_go_to_disk_and_come_back(cache_pair, tmp_path):
    """With the memory tier off every entry is written to disk; a prompt extending an earlier
    turn starts from it and gives the text of a fresh run."""
    target, drafter, reference = cache_pair
    engine = _engine(target, drafter, tmp_path, dflash_in_memory_cache=False)
    try:
        a = _run(engine, "tell me a story")
        stats = engine.get_stats()
        assert stats["prefix_cache_entries"] == 0 and stats["prefix_cache_ssd_entries"] >= 1
        assert 0 < stats["prefix_cache_ssd_bytes"] <= stats["prefix_cache_ssd_budget_bytes"]
        prompt = "tell me a story" + a.text + " and more"
        b = _run(engine, prompt)
        assert b.cached_tokens > 0 and engine.get_stats()["prefix_cache_ssd_hits"] == 1
        assert a.text == _reference(reference, "tell me a story")
        assert b.text == _reference(reference, prompt)
        assert engine.get_stats()["prefix_cache_entries"] == 0  # read back, not kept in memory
    finally:
        asyncio.run(engine.stop())


def test_entries_outlive_the_engine_and_only_their_pair_reads_them(cache_pair, tmp_path):
    """An engine that stops writes its memory entries to disk; a new engine over the same
    pair starts from them, one with another drafter does not see them."""
    target, drafter, reference = cache_pair
    first = _engine(target, drafter, tmp_path)
    try:
        a = _run(first, "hello world")
        assert first.get_stats()["prefix_cache_entries"] >= 1
        assert first.get_stats()["prefix_cache_ssd_entries"] == 0  # memory holds it until the end
    finally:
        asyncio.run(first.stop())
    other_drafter = on_worker(make_drafter, tmp_path / "other-drafter", target, seed=5)
    other = _engine(target, other_drafter, tmp_path)
    try:
        assert other.get_stats()["prefix_cache_ssd_entries"] == 0
        assert _run(other, "hello world").cached_tokens == 0
    finally:
        asyncio.run(other.stop())
    again = _engine(target, drafter, tmp_path)
    try:
        assert again.get_stats()["prefix_cache_ssd_entries"] >= 1
        b = _run(again, "hello world")
        assert b.cached_tokens > 0 and again.get_stats()["prefix_cache_ssd_hits"] == 1
        assert a.text == b.text == _reference(reference, "hello world")
        assert again.get_stats()["prefix_cache_entries"] >= 1  # back in memory, where it fits
    finally:
        asyncio.run(again.stop())


def test_unreadable_files_are_dropped_not_trusted(cache_pair, tmp_path, caplog):
    target, drafter, reference = cache_pair
    engine = _engine(target, drafter, tmp_path, dflash_in_memory_cache=False)
    try:
        _run(engine, "zebra quiz")
        disk = engine.prefix_cache.disk
        files = sorted(disk.root.glob("*.safetensors"))
        assert files
    finally:
        asyncio.run(engine.stop())
    (disk.root / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with caplog.at_level(logging.WARNING, logger="dflash2_mlx.serve"):
        engine = _engine(target, drafter, tmp_path, dflash_in_memory_cache=False)
    try:
        assert "junk.safetensors" in caplog.text and not (disk.root / "junk.safetensors").exists()
        assert engine.get_stats()["prefix_cache_ssd_entries"] == len(files)
        for f in files:  # cut short after start-up: noticed only when restored
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        c = _run(engine, "zebra quiz")
        assert c.cached_tokens == 0 and c.text == _reference(reference, "zebra quiz")
        assert engine.get_stats()["prefix_cache_ssd_hits"] == 0 and "dropping unreadable" in caplog.text
        assert _run(engine, "zebra quiz").cached_tokens > 0  # the request wrote a good entry again
    finally:
        asyncio.run(engine.stop())


def test_the_disk_stays_within_its_budget(cache_pair, tmp_path):
    target, drafter, _ = cache_pair
    engine = _engine(target, drafter, tmp_path, dflash_in_memory_cache=False)
    try:
        _run(engine, "hello world")
        one = engine.get_stats()["prefix_cache_ssd_bytes"]
        engine.update_settings(replace(engine.settings, dflash_ssd_cache_max_bytes=one * 2))
        for prompt in ("zebra quiz", "the sea and the sky", "cats and dogs"):
            _run(engine, prompt)
            stats = engine.get_stats()
            assert 0 < stats["prefix_cache_ssd_bytes"] <= one * 2 == stats["prefix_cache_ssd_budget_bytes"]
        assert len(list(engine.prefix_cache.disk.root.glob("*.safetensors"))) == stats["prefix_cache_ssd_entries"]
        assert _run(engine, "cats and dogs").cached_tokens > 0  # the newest stays
        assert _run(engine, "hello world").cached_tokens == 0  # the oldest went
        engine.update_settings(replace(engine.settings, dflash_ssd_cache=False))
        assert engine.prefix_cache.disk is None and not engine.prefix_cache.enabled
    finally:
        asyncio.run(engine.stop())


def test_ssd_settings_are_validated():
    with pytest.raises(SettingsError, match="dflash_ssd_cache must be true or false"):
        ModelSettings.from_dict({"dflash_ssd_cache": "yes"})
    with pytest.raises(SettingsError, match="dflash_ssd_cache_max_bytes"):
        ModelSettings.from_dict({"dflash_ssd_cache": True, "dflash_ssd_cache_max_bytes": -1})
    assert ModelSettings.from_dict({"dflash_ssd_cache_max_bytes": 5}).ssd_cache_bytes() == 0
    assert ModelSettings.from_dict({"dflash_ssd_cache": True, "dflash_ssd_cache_max_bytes": 5}).ssd_cache_bytes() == 5


def test_the_pool_puts_each_pair_under_the_servers_directory(cache_pair, tmp_path):
    """`serve --ssd-cache-dir` reaches the engines the pool loads; the settings file turns
    the tier on per model."""
    target, drafter, _ = cache_pair
    store = SettingsStore(tmp_path / "model_settings.json")
    store.set("t", dflash_enabled=True, dflash_draft_model=str(drafter), dflash_ssd_cache=True,
              dflash_ssd_cache_max_bytes=10**8)
    store.set("plain", dflash_ssd_cache=False)
    pool = EnginePool(store, models={"t": str(target), "plain": str(target)}, max_models=2,
                      ssd_cache_dir=tmp_path / "ssd")

    async def scenario():
        t, plain = await pool.get("t"), await pool.get("plain")
        try:
            return t.prefix_cache.disk, plain.prefix_cache.disk
        finally:
            await pool.stop()

    disk, none = asyncio.run(scenario())
    assert none is None and disk.root.parent == tmp_path / "ssd" and disk.budget == 10**8


def test_a_disk_tier_that_cannot_be_made_leaves_the_model_serving(cache_pair, tmp_path, caplog):
    target, drafter, reference = cache_pair
    (tmp_path / "file").write_text("not a directory")
    with caplog.at_level(logging.ERROR, logger="dflash2_mlx.engine"):
        engine = _engine(target, drafter, tmp_path / "file")
    try:
        assert engine.prefix_cache.disk is None and "no disk tier" in caplog.text
        assert _run(engine, "hello world").text == _reference(reference, "hello world")
    finally:
        asyncio.run(engine.stop())


def _written(cache_pair, tmp_path, prompt):
    """The files of the entries ``prompt`` leaves on disk (memory tier off), the engine stopped."""
    target, drafter, _ = cache_pair
    engine = _engine(target, drafter, tmp_path, dflash_in_memory_cache=False)
    try:
        _run(engine, prompt)
        files = sorted(engine.prefix_cache.disk.root.glob("*.safetensors"))
        assert files
    finally:
        asyncio.run(engine.stop())
    return files


def _served_fresh(cache_pair, tmp_path, prompt, caplog):
    """A new engine serves ``prompt`` as a fresh run (the bad files dropped) and writes a good entry."""
    target, drafter, reference = cache_pair
    engine = _engine(target, drafter, tmp_path, dflash_in_memory_cache=False)
    try:
        with caplog.at_level(logging.WARNING, logger="dflash2_mlx.serve"):
            c = _run(engine, prompt)
        assert c.cached_tokens == 0 and c.text == _reference(reference, prompt)
        assert engine.get_stats()["prefix_cache_ssd_hits"] == 0 and "dropping unreadable" in caplog.text
        assert _run(engine, prompt).cached_tokens > 0  # the request wrote a good entry again
    finally:
        asyncio.run(engine.stop())


def test_damaged_tensor_bytes_are_caught_by_the_checksum(cache_pair, tmp_path, caplog):
    files = _written(cache_pair, tmp_path, "zebra quiz")
    for f in files:  # the header intact, bytes of the first array flipped
        data = bytearray(f.read_bytes())
        start = 8 + int.from_bytes(data[:8], "little")  # safetensors: header length, header, arrays
        data[start: start + 16] = bytes(b ^ 0xFF for b in data[start: start + 16])
        f.write_bytes(bytes(data))
    _served_fresh(cache_pair, tmp_path, "zebra quiz", caplog)


def test_arrays_of_other_shapes_are_not_served(cache_pair, tmp_path, caplog):
    """A well-formed file (its checksum right) whose arrays are not this model's shapes."""
    files = _written(cache_pair, tmp_path, "zebra quiz")
    for f in files:
        arrays, meta = mx.load(str(f), return_metadata=True)
        keys = next(k for k in sorted(arrays) if k.startswith("t") and k.endswith(".k"))  # an attention layer's
        arrays[keys] = mx.concatenate([arrays[keys]] * 2, axis=-1)
        meta["sha256"] = checksum(arrays)
        mx.save_safetensors(str(f), arrays, metadata=meta)
    _served_fresh(cache_pair, tmp_path, "zebra quiz", caplog)


def test_a_dead_writers_temporary_file_is_removed_at_start(cache_pair, tmp_path):
    files = _written(cache_pair, tmp_path, "zebra quiz")
    root = files[0].parent
    dead = root / ".abc.999999999.1.tmp.safetensors"  # no process has that id
    live = root / f".abc.{os.getpid()}.1.tmp.safetensors"  # a writer still writing
    for f in (dead, live):
        f.write_bytes(b"half an entry")
    target, drafter, _ = cache_pair
    engine = _engine(target, drafter, tmp_path, dflash_in_memory_cache=False)
    try:
        assert not dead.exists() and live.exists()
        assert engine.get_stats()["prefix_cache_ssd_entries"] == len(files)
    finally:
        asyncio.run(engine.stop())


def _entry(tokens):
    """An entry of every dtype a cache holds: bf16 keys and values, fp32 recurrent state,
    int32 lengths."""
    kv = lambda seed: mx.random.normal((1, 2, len(tokens), 8), key=mx.random.key(seed)).astype(mx.bfloat16)  # noqa: E731
    target = [(kv(0), kv(1)), ([mx.random.normal((1, 3, 4), key=mx.random.key(2)), None], mx.array([len(tokens)]))]
    draft = [(kv(3)[..., :4], kv(4)[..., :4])]  # a slice: not contiguous in memory
    arrays = [a for pair in target + draft for part in pair for a in (part if isinstance(part, list) else [part])
              if a is not None]
    mx.eval(arrays)
    return Entry(tuple(tokens), target, draft, False, sum(a.nbytes for a in arrays))


def _same(a: Entry, b: Entry):
    assert a.tokens == b.tokens and a.trimmable == b.trimmable and len(a.draft) == len(b.draft)
    for x, y in zip(a.target + a.draft, b.target + b.draft):
        for p, q in zip(x, y):
            for u, v in zip(p if isinstance(p, list) else [p], q if isinstance(q, list) else [q]):
                assert (u is None) == (v is None)
                if u is not None:
                    assert u.dtype == v.dtype and u.shape == v.shape and mx.array_equal(u, v).item()


def test_the_writer_thread_serves_an_entry_until_its_file_is_in_place(tmp_path, monkeypatch):
    """An entry handed to the disk tier is found and served from memory while the writer has
    it; its file then reads back the same arrays (the writer's own safetensors, checksum
    included), in this tier and in the next one opened on the directory."""
    from dflash2_mlx.backend import ssd_cache

    go, started = threading.Event(), threading.Event()
    write = ssd_cache._write_safetensors

    def held(*args):  # the writer waits for the test: the entry is pending meanwhile
        started.set()
        assert go.wait(30)
        write(*args)

    monkeypatch.setattr(ssd_cache, "_write_safetensors", held)
    disk = DiskTier(tmp_path, 10**8)
    entry = _entry([5, 6, 7, 8])
    disk.put(entry)
    assert started.wait(30)
    name, n = disk.best([5, 6, 7, 8, 9], draft=True)
    assert n == 4 and disk.load(name) is entry and not list(tmp_path.glob("*.safetensors"))
    go.set()
    disk.flush()
    assert not disk.pending and disk.stats()["prefix_cache_ssd_entries"] == 1
    _same(disk.load(name), entry)
    again = DiskTier(tmp_path, 10**8)
    assert again.best([5, 6, 7, 8, 9], draft=True) == (name, 4)
    _same(again.load(name), entry)


def test_the_files_and_the_one_being_written_stay_within_the_budget(tmp_path, monkeypatch):
    """Room is made before a file is written (a kill -9 mid-write leaves its temporary file:
    the folder stays within budget with it), and the oldest entries are the ones that go."""
    from dflash2_mlx.backend import ssd_cache

    write, seen = ssd_cache._write_safetensors, []

    def measured(path, head, raw):  # the folder's bytes as the write ends, the new file in
        write(path, head, raw)
        seen.append(sum(f.stat().st_size for f in tmp_path.iterdir() if f.is_file()))

    monkeypatch.setattr(ssd_cache, "_write_safetensors", measured)
    probe = DiskTier(tmp_path / "probe", 10**8)
    probe.put(_entry([1] * 16))
    probe.flush()
    one = probe.stats()["prefix_cache_ssd_bytes"]
    seen.clear()
    disk = DiskTier(tmp_path, int(one * 2.5))  # two entries, not three
    for first in range(2, 7):
        disk.put(_entry([first] * 16))
        disk.flush()
    assert len(seen) == 5 and max(seen) <= disk.budget, (seen, disk.budget)
    assert disk.stats()["prefix_cache_ssd_entries"] == 2
    assert disk.best([6] * 17, draft=True)[1] == 16 and disk.best([2] * 17, draft=True)[1] == 0
