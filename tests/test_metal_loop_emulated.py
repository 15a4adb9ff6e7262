"""The whole DFlash loop with the Metal branch forced on and the emulator standing in for
Metal: what a first run on a Mac does, with the real launch builders, real drafter shapes,
every self-check, block sizes 3, 8 and auto, greedy and sampled, bf16 drafter activations;
every variant is compiled and checked at load (``warm_kernels``), none mid-reply.
Greedy output must be plain decoding's and a seeded sampled reply the twins' own (the
kernels match their twins bit for bit); every kernel must have run and passed its check."""

import collections

import pytest

import dflash2_mlx as d
from dflash2_mlx import kernels
from dflash2_mlx.generate import warm_kernels
from dflash2_mlx.kernels import dispatch, selfcheck
from dflash2_mlx.model.checkpoint import set_activation_bits
from helpers import plain_tokens
from metal_emu.cases import needs_gxx
from metal_emu.emulate import emulate
from tiny_models import make_drafter, make_target

PROMPT = "abcab dcba"
TOKENS = 16


@needs_gxx
@pytest.mark.slow
def test_the_loop_on_the_metal_branch_emulated(tmp_path, monkeypatch):
    make_target(tmp_path / "t", "qwen3", alphabet="abcd", seed=3)
    make_drafter(tmp_path / "d", tmp_path / "t", version=2, seed=11)
    model, tok, drafter = d.load(str(tmp_path / "t"), str(tmp_path / "d"))
    set_activation_bits(drafter, 16)
    ids = tok.encode(PROMPT)
    ref = plain_tokens(model, ids, TOKENS)

    def run(**kw):
        out = list(d.stream_generate(model, tok, ids, drafter, max_tokens=TOKENS, **kw))
        return [r.token for r in out], out[-1]

    # The twins' sampled replies first (the kernels are off here: no Metal on this machine).
    assert not dispatch.metal_usable()
    twin_sampled = {b: run(block_size=b, temp=1.0, seed=7)[0] for b in (3, 8)}

    calls = collections.Counter()

    def emulated(key, launch):
        calls[key] += 1
        return emulate(kernels.SOURCES[key], launch)

    monkeypatch.setattr(dispatch, "metal_usable", lambda: True)
    monkeypatch.setattr(dispatch, "run_metal", emulated)
    monkeypatch.setattr(selfcheck, "run_metal", emulated)
    monkeypatch.setattr(selfcheck, "results", {})
    # What load() does on a Mac: every variant a single stream launches, checked up front.
    warm_kernels(model, drafter)
    warmed = set(selfcheck.results)
    assert warmed
    for block in (3, 8, "auto"):
        tokens, last = run(block_size=block)
        assert tokens == ref[: len(tokens)], f"block {block}: greedy output left plain decoding"
        assert last.cycles > 0
    for block in (3, 8):
        assert run(block_size=block, temp=1.0, seed=7)[0] == twin_sampled[block], f"block {block} sampled"
    assert calls["dynamic_conv"] > 0
    assert calls["path_selector"] + calls["path_walk"] > 0
    assert set(selfcheck.results) == warmed, "a variant was first compiled mid-reply"
    checked = selfcheck.checked_variants()
    assert checked and all(c.passed for c in checked), [c for c in checked if not c.passed]
    assert any("bfloat16" in c.variant for c in checked)
