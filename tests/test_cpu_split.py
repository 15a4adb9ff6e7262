"""Multi-row target passes with their products split over two CPU streams (cpu_split): the
same logits up to float rounding, exactly the old computation outside such a pass, and the
BLAS thread count restored after every pass.  (Greedy parity and the sampling tests run
through it too wherever OpenBLAS is preloaded, as in CI.)"""

import os
from pathlib import Path

import mlx.core as mx
import pytest

import dflash2_mlx as d
from dflash2_mlx.machine import cpu_split
from dflash2_mlx.loop.target import attach
from tiny_models import make_drafter, make_target


def test_openblas_is_found_exactly_when_loaded():
    maps = Path("/proc/self/maps")
    loaded = maps.exists() and "/libopenblas" in maps.read_text()
    assert (cpu_split._blas is not None) == loaded
    if "openblas" in os.environ.get("LD_PRELOAD", ""):
        assert loaded and cpu_split.enabled()


@pytest.fixture
def blas(monkeypatch):
    """The BLAS thread control, recording every count set: OpenBLAS's own where it is
    loaded, else a stand-in (the split itself does not need OpenBLAS to be computed)."""
    if cpu_split._blas is None:
        count = [2]
        get, set_ = (lambda: count[0]), (lambda n: count.__setitem__(0, n))
    else:
        get, set_ = cpu_split._blas
    before = get()
    if before < 2:
        set_(2)
    calls = []
    monkeypatch.setattr(cpu_split, "_blas", (get, lambda n: (calls.append(n), set_(n))))
    monkeypatch.delenv("DFLASH2_MLX_CPU_SPLIT", raising=False)
    yield get, calls
    set_(before)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "qwen3_5"])  # qwen2 ties its LM head
def test_split_pass_matches_the_unsplit_one(tmp_path, blas, monkeypatch, family):
    get, calls = blas
    make_target(tmp_path / "t", family, seed=2)
    make_drafter(tmp_path / "d", tmp_path / "t")
    model, tok, drafter = d.load(str(tmp_path / "t"), str(tmp_path / "d"))
    target = attach(model, drafter)
    assert any(isinstance(m, cpu_split.SplitLinear) for _, m in model.named_modules())
    if family == "qwen2":
        assert isinstance(model.model.embed_tokens, cpu_split.SplitEmbedding)
    threads = get()
    products = []  # the products computed split
    split_product = cpu_split._product
    monkeypatch.setattr(cpu_split, "_product", lambda x, w: (products.append(w.shape),
                                                             split_product(x, w))[1])

    def run(ids, split: bool):
        """Logits and features of a pass over ``ids`` after a prompt; the thread counts set
        and the products computed split during that pass."""
        monkeypatch.setenv("DFLASH2_MLX_CPU_SPLIT", "0")  # the same cache before either pass
        cache = target.make_cache()
        target(mx.array([tok.encode("abc dab ")]), cache)
        monkeypatch.setenv("DFLASH2_MLX_CPU_SPLIT", "1" if split else "0")
        calls.clear(), products.clear()
        logits, features = target(mx.array([ids]), cache)
        return mx.concatenate([logits, features], axis=-1), list(calls)

    block = tok.encode("cab a")  # 5 rows: split
    split, set_during = run(block, True)
    assert set_during == [1, threads] and get() == threads  # one thread while it ran, then restored
    heads = [s for s in products if s[0] == target.vocab_size]
    assert len(products) >= 4 * len(model.layers) and len(heads) == 1  # every layer, and the head
    plain, _ = run(block, False)
    assert mx.allclose(split, plain, atol=1e-4).item() and not cpu_split._here.active
    vocab = target.vocab_size
    assert mx.array_equal(split[..., :vocab].argmax(-1), plain[..., :vocab].argmax(-1)).item()
    one, set_during = run(block[:1], True)  # a plain step: computed as before, bit for bit
    assert set_during == products == [] and mx.array_equal(one, run(block[:1], False)[0]).item()
    long = tok.encode("abcd " * 4)[: cpu_split.MAX_ROWS + 1]  # past MAX_ROWS: as before
    out, set_during = run(long, True)
    assert set_during == products == [] and mx.array_equal(out, run(long, False)[0]).item()


def test_threads_are_restored_when_a_pass_fails(blas):
    get, calls = blas
    threads = get()
    with pytest.raises(RuntimeError):
        with cpu_split.rows(5) as split:
            assert split and cpu_split._here.active
            raise RuntimeError("a pass that fails")
    assert get() == threads and not cpu_split._here.active and calls == [1, threads]
