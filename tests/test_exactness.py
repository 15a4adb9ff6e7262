"""The exactness probe and exact=True: a target whose verify pass sums in another order than
its one-row decode step (as a GPU kernel chosen by row count does) is reported not row-exact,
may leave plain decoding's greedy path by default, and gives plain decoding's tokens exactly
with exact=True."""

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest

import dflash2_mlx as d
from dflash2_mlx.responses import stats_line
from dflash2_mlx.calibration import exactness, keys, store
from dflash2_mlx.generate import speculative_generate_step
from dflash2_mlx.loop import verifiers
from dflash2_mlx.loop.cycle import prefill
from dflash2_mlx.loop.target import attach
from helpers import plain_tokens
from tiny_models import abcd_pair, make_drafter, make_target

PROMPTS = ["abcab dcba", "dd", "a b c", "cab", "bbbb a", "dcdc", "ab ba", "c"]
TOKENS = 24


def coarse(y: mx.array) -> mx.array:
    """A partial product as a low-precision accumulator keeps it, to 1/16: bf16 partials
    flipped none of this small model's argmaxes over the eight prompts on some CPUs (an AMD
    EPYC), where the test needs some flipped."""
    return mx.round(y * 16) / 16


class SplitSumLinear(nn.Linear):
    """A Linear whose product over several rows adds two half-width partial products, each
    rounded first (a split-K kernel with low-precision partials); over one row, MLX's own.
    Another, legitimate summation order: the rows agree with one-row steps only roughly."""

    def __call__(self, x):
        if x.ndim < 2 or x.shape[-2] == 1:
            return super().__call__(x)
        h, w = x.shape[-1] // 2, self.weight
        y = coarse(x[..., :h] @ w[:, :h].T) + coarse(x[..., h:] @ w[:, h:].T)
        return y + self.bias if "bias" in self else y


def split_sums(model):
    for _, m in model.named_modules():
        if type(m) is nn.Linear:
            m.__class__ = SplitSumLinear
    return model


_rounding = {}


def rounded_mlps(model):
    """Each layer's MLP, over several rows, rounds its output to bf16 (a fused kernel the
    row-exact pass does not take apart: it runs the MLP over the block's rows)."""
    for layer in model.layers:
        cls = type(layer.mlp)
        if cls not in _rounding:
            def __call__(self, x, cls=cls):
                y = cls.__call__(self, x)
                return y if x.shape[-2] == 1 else y.astype(mx.bfloat16).astype(y.dtype)
            _rounding[cls] = type(f"Rounding{cls.__name__}", (cls,), {"__call__": __call__})
        layer.mlp.__class__ = _rounding[cls]
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("exact")
    return (root, *abcd_pair(root))


def test_probe_says_exact_for_mlx_own_passes_and_not_for_another_summation_order(pair):
    root, model, _, _ = pair
    plain = exactness.probe(model, rows=[2, 5, 8])
    assert plain.rows == [2, 5, 8] and plain.rows_compared == 15
    # This CPU without a BLAS that switches kernels by row count: MLX's passes are row-exact
    # for this small fp32 model, or the probe says by how much they are not.
    assert plain.exact == (plain.max_abs_diff == 0.0)
    other, _ = mlx_lm.load(str(root / "t"))
    v = exactness.probe(split_sums(other), rows=[2, 5, 8])
    assert not v.exact and v.inexact_rows == [2, 5, 8]
    assert 0 < v.max_abs_diff < 1.0 and 0 < v.differing <= 1.0
    assert v.describe().startswith("not row-exact on this machine (max |d| ")


def test_verdict_is_measured_once_and_kept(pair, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH2_MLX_HOME", str(tmp_path))
    root, model, _, _ = pair
    assert exactness.known(model) is None
    calls = []
    real = exactness.probe
    monkeypatch.setattr(exactness, "probe", lambda m, **kw: calls.append(1) or real(m, rows=[2, 3], **kw))
    first = exactness.verdict(model)
    again = exactness.verdict(model)
    assert calls == [1] and again == first == exactness.known(model)
    assert list((tmp_path / "calibration").glob("exactness-*.json"))


@pytest.mark.parametrize("mode", ["pass", "steps"])
def test_exact_restores_plain_decoding_where_the_default_leaves_it(pair, tmp_path, monkeypatch, mode):
    """The products sum in another order over several rows: the row-exact pass takes them
    apart ("pass"); where an MLP also rounds several rows otherwise, the probe finds the pass
    not row-exact either and exact=True verifies with one-row steps ("steps")."""
    monkeypatch.setenv("DFLASH2_MLX_HOME", str(tmp_path))
    root, _, tok, drafter_src = pair
    model, _ = mlx_lm.load(str(root / "t"))
    split_sums(model)
    if mode == "steps":
        rounded_mlps(model)
    drafter = d.load(str(root / "t"), str(root / "d"))[2]
    used = []
    for how, verifier in (("exact_pass", verifiers.RowExactPass), ("one_row_steps", verifiers.OneRowSteps)):
        real = verifier.__call__
        monkeypatch.setattr(verifier, "__call__",
                            lambda self, ids, cache, how=how, real=real: used.append(how) or real(self, ids, cache))
    diverged = 0
    for text in PROMPTS:
        ids = tok.encode(text)
        ref = plain_tokens(model, ids, TOKENS)
        runs = {}
        for exact in (True, False):  # the first measures the verdict the second reports
            out = list(d.stream_generate(model, tok, ids, drafter, max_tokens=TOKENS, block_size=5,
                                         exact=exact, lookup=False))
            runs[exact] = out
        # stream_generate stops at an end token, as mlx_lm.generate does; generate_step does not.
        same = lambda out: [r.token for r in out] == ref[: len(out)] and (
            len(out) == TOKENS or out[-1].token in tok.eos_token_ids)
        assert same(runs[True]), f"exact=True left plain decoding on {text!r}"
        diverged += not same(runs[False])
        said = {"pass": "exact, by the exact mode's row-exact verify pass (ordinary passes here are not row-exact",
                "steps": "exact, by the exact mode's one-row verify (ordinary passes here are not row-exact"}[mode]
        assert runs[True][-1].exactness.startswith(said)
        assert runs[False][-1].exactness.startswith("not row-exact on this machine")
        assert ("verify rows: " + said[:20] in stats_line(runs[True][-1])) == (runs[True][-1].cycles > 0)
    # The other summation order is not a harmless one: somewhere the default's greedy text is
    # not plain decoding's (the issue users meet on GPUs). (With the MLPs' rounding too, the
    # eight prompts happen not to flip an argmax.)
    assert diverged > 0 or mode == "steps"
    verdict = exactness.known(model)
    assert verdict.exact_pass == (mode == "pass") and not verdict.exact
    # The probe tried the pass; the runs then verified only the mode's way.
    decoding = [u for u in used if u != "exact_pass"] if mode == "steps" else used[len(verdict.rows):]
    assert decoding and set(decoding) == {"exact_pass" if mode == "pass" else "one_row_steps"}


def test_exact_costs_nothing_where_passes_are_row_exact(pair, tmp_path, monkeypatch):
    """A kept verdict of "exact": exact=True keeps the one-pass verify (and says "exact")."""
    monkeypatch.setenv("DFLASH2_MLX_HOME", str(tmp_path))
    root, model, tok, drafter = pair
    store.write("exactness", keys.exactness(model), exactness.Verdict(exact=True, rows=[2]).to_json())
    passes = []
    steps_call = verifiers.OneRowSteps.__call__
    monkeypatch.setattr(verifiers.OneRowSteps, "__call__",
                        lambda self, ids, cache: passes.append(1) or steps_call(self, ids, cache))
    ids = tok.encode(PROMPTS[0])
    out = list(d.stream_generate(model, tok, ids, drafter, max_tokens=TOKENS, block_size=5, exact=True))
    assert [r.token for r in out] == plain_tokens(model, ids, TOKENS)[: len(out)]
    assert passes == [] and out[-1].exactness == "exact"


def test_exact_prefill_is_chunked_as_mlx_lm_chunks_it(pair):
    """The prompt but its last token in prefill-step chunks, then that token alone: the cache
    and the first logits come from the same passes as mlx-lm's generate_step."""
    _, model, tok, drafter = pair
    target = attach(model, drafter, exact="steps")
    seen = []
    real = type(target).__call__
    type(target).__call__ = lambda self, ids, cache: seen.append(ids.shape[1]) or real(self, ids, cache)
    try:
        prefill(target, mx.array(tok.encode("abcab dcba abcd")), target.make_cache(), step=4)
    finally:
        type(target).__call__ = real
    n = len(tok.encode("abcab dcba abcd"))
    assert seen == [4] * ((n - 1) // 4) + ([(n - 1) % 4] if (n - 1) % 4 else []) + [1]


def test_doctor_reports_kept_verdicts_probes_with_exact_and_recalibrates(pair, tmp_path):
    """`doctor`: the kept verdicts (no model loaded), `--exact --model M` probes and keeps
    one, `--recalibrate` forgets the measured pass costs and timings."""
    import os
    import subprocess
    import sys

    root = pair[0]
    env = {**os.environ, "DFLASH2_MLX_HOME": str(tmp_path)}
    cmd = [sys.executable, "-m", "dflash2_mlx.cli.main", "doctor"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env).stdout
    assert "verify rows: not probed on this machine" in out
    out = subprocess.run(cmd + ["--exact", "--model", str(root / "t")], capture_output=True, text=True,
                         timeout=240, env=env).stdout
    # The line names the target, its weights, the device and the BLAS it holds for.
    line = f"verify rows (qwen3 64x4, float32 weights, {mx.default_device()}, {exactness.blas_name()}; rows 2..16)"
    assert line in out, out
    assert len(list((tmp_path / "calibration").glob("exactness-*.json"))) == 1
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env).stdout
    assert line in out and "not probed" not in out
    # Another setup of this machine (here: another BLAS thread count) has no verdict yet: plain
    # doctor says so in one line and counts the other; --verbose shows it.
    other = {**env, "OPENBLAS_NUM_THREADS": str(int(env.get("OPENBLAS_NUM_THREADS") or 0) + 7)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=other).stdout
    assert "verify rows: not probed on this machine" in out and line not in out
    assert "1 verdict(s) kept for another BLAS, device or machine: --verbose" in out
    out = subprocess.run(cmd + ["--verbose"], capture_output=True, text=True, timeout=240, env=other).stdout
    assert line in out
    for name in ("costs-a.json", "timing-a.json", "acceptance-a.json"):
        (tmp_path / "calibration" / name).write_text("{}")
    out = subprocess.run(cmd + ["--recalibrate"], capture_output=True, text=True, timeout=240, env=env).stdout
    assert "recalibrate: 2 kept cost and timing record(s) removed" in out
    assert sorted(p.name for p in (tmp_path / "calibration").glob("*-a.json")) == ["acceptance-a.json"]


def test_one_row_verify_prices_a_pass_as_its_rows():
    """exact=True where passes are not row-exact: b rows cost b one-row passes, drafts alike."""
    from dflash2_mlx.adaptive.costs import CostModel

    costs = CostModel({1: (0.04, 1e-6), 5: (0.06, 2e-6), 8: (0.07, 3e-6)}, {2: (0.01, 0.0), 8: (0.02, 0.0)})
    one = costs.one_row_verify()
    for b in (1, 2, 5, 8, 16):
        assert one.verify(b, 100) == pytest.approx(b * costs.verify(1, 100))
        assert one.draft(b, 100) == costs.draft(b, 100)


def test_every_reply_tells_its_verify_rows(tmp_path, monkeypatch):
    """The engine's replies (every API's dflash block) say whether verify rows are exact here:
    the verdict a first use's calibration keeps (a fixed block size calibrates nothing: "not
    probed" until the probe has run)."""
    import asyncio

    from dflash2_mlx.backend.engine import Engine
    from dflash2_mlx.backend.settings import ModelSettings
    from tiny_models import make_drafter, make_target, on_worker

    monkeypatch.setenv("DFLASH2_MLX_HOME", str(tmp_path))
    target = on_worker(make_target, tmp_path / "t")
    drafter = on_worker(make_drafter, tmp_path / "d", target)

    async def scenario():
        e = Engine(target, ModelSettings(dflash_enabled=True, dflash_draft_model=str(drafter), dflash_block_size=4),
                   model_id="tiny")
        await e.start()
        try:
            first = [c async for c in e.stream_generate("abc", max_tokens=4)][-1]
            verdict = await asyncio.wrap_future(e.worker.submit(exactness.verdict, e.model))
            second = [c async for c in e.stream_generate("abc", max_tokens=4)][-1]
            return first, verdict, second
        finally:
            await e.stop()

    first, verdict, second = asyncio.run(scenario())
    assert first.engine["verify_rows"].startswith("not probed on this machine")
    assert second.engine["verify_rows"].startswith(verdict.describe())


def test_a_first_use_probes_at_the_end_of_its_reply_not_before_its_first_token(pair, tmp_path, monkeypatch):
    """A pair's first use measures its costs (coarse) before the first token and leaves the
    probe to the end of that reply, whose last response tells the verdict; the next reply
    neither measures nor probes."""
    monkeypatch.setenv("DFLASH2_MLX_HOME", str(tmp_path))
    store.live.clear()
    _, model, tok, drafter = pair
    verdicts = lambda: list((tmp_path / "calibration").glob("exactness-*.json"))
    stream = d.stream_generate(model, tok, "abcab", drafter, max_tokens=6, block_size="auto")
    first = next(stream)
    assert list((tmp_path / "calibration").glob("costs-*.json")) and not verdicts()
    assert first.exactness.startswith(exactness.NOT_PROBED)
    last = list(stream)[-1]
    assert len(verdicts()) == 1 and last.exactness == exactness.exactness_of(model, False)[0]
    assert not last.exactness.startswith(exactness.NOT_PROBED)
    before = verdicts()[0].stat().st_mtime_ns
    again = list(d.stream_generate(model, tok, "abcab", drafter, max_tokens=6, block_size="auto"))[-1]
    assert again.exactness == last.exactness and verdicts()[0].stat().st_mtime_ns == before


def test_a_model_listing_names_the_verdict_kept_before_it_loads(tmp_path, monkeypatch):
    """``/v1/models`` of a model the server has not loaded yet: the verdict this machine keeps
    for the files it loads from (probed here through the Python API), not "not probed"; and
    "not probed" for another model's files, and for a target whose config changed since."""
    from dflash2_mlx import load
    from dflash2_mlx.backend.pool import EnginePool
    from dflash2_mlx.backend.server import _model_card
    from dflash2_mlx.backend.settings import SettingsStore
    from tiny_models import make_target, on_worker

    monkeypatch.setenv("DFLASH2_MLX_HOME", str(tmp_path))
    probed = on_worker(make_target, tmp_path / "models" / "probed")
    on_worker(make_target, tmp_path / "models" / "other", seed=5)
    pool = EnginePool(SettingsStore(tmp_path / "settings.json"), model_dir=tmp_path / "models")
    card = lambda name: _model_card(pool, name)["dflash"]["verify_rows"]
    assert card("probed") == exactness.NOT_PROBED

    model = on_worker(lambda: load(str(probed))[0])
    verdict = on_worker(exactness.verdict, model, try_pass=False)
    assert card("probed") == verdict.describe()
    assert card("other") == exactness.NOT_PROBED
    config = probed / "config.json"
    config.write_text(config.read_text().replace("{", '{"note": "edited", ', 1))
    assert card("probed") == exactness.NOT_PROBED


PASS_FAMILIES = ["llama", "qwen3_moe", "qwen3_5", "qwen3_next"]


@pytest.mark.parametrize("family", PASS_FAMILIES)
@pytest.mark.parametrize("weights", ["split sums", "4-bit"])
def test_the_row_exact_pass_on_each_family(tmp_path, monkeypatch, family, weights):
    """Dense products that sum otherwise over several rows, and 4-bit ones (the exact
    kernel's twin here): the row-exact pass gives one-row steps' bits on attention, MoE and
    recurrent (qwen3_5, qwen3_next) targets, and exact=True then decodes as plain decoding."""
    monkeypatch.setenv("DFLASH2_MLX_HOME", str(tmp_path))
    make_target(tmp_path / "t", family, alphabet="abcd", seed=3)
    make_drafter(tmp_path / "d", tmp_path / "t", version=2, seed=11)
    model, tok, drafter = d.load(str(tmp_path / "t"), str(tmp_path / "d"))
    if weights == "4-bit":
        nn.quantize(model, group_size=32, bits=4,
                    class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % 32 == 0)
    else:
        split_sums(model)
    v = exactness.probe(model, rows=[2, 5, 8])
    assert v.exact_pass, v.exact_pass_note
    target = attach(model, drafter, exact="pass")
    for text in PROMPTS[:3]:
        ids = tok.encode(text)
        cache = target.make_cache()
        out = [t for t, *_ in speculative_generate_step(mx.array(ids), target, drafter, max_tokens=TOKENS,
                                                        block_size=5, prompt_cache=cache)]
        assert out == plain_tokens(model, ids, TOKENS)[: len(out)] and len(out) == TOKENS


def test_a_family_the_pass_cannot_take_apart_falls_back_to_one_row_steps(tmp_path, monkeypatch):
    """gemma4's attention returns more than its rows (the KV it shares with later layers):
    the probe says why the pass is not used, and exact=True verifies with one-row steps."""
    make_target(tmp_path / "t", "gemma4_text", alphabet="abcd", seed=3)
    model, _ = mlx_lm.load(str(tmp_path / "t"))
    v = exactness.probe(model, rows=[2, 3])
    assert not v.exact_pass and v.exact_pass_note
    monkeypatch.setattr(exactness, "verdict", lambda m: v)
    v.exact = False
    assert exactness.exactness_of(model, True)[1] == "steps"


def test_a_first_calibration_probes_and_the_first_exact_run_tries_the_pass(tmp_path, monkeypatch):
    """The verdict is kept beside the cost calibration at a pair's first use (replies then say
    it without being asked); the row-exact pass is tried when exact=True first needs it."""
    monkeypatch.setenv("DFLASH2_MLX_HOME", str(tmp_path))
    make_target(tmp_path / "t", "qwen3", alphabet="abcd", seed=3)
    make_drafter(tmp_path / "d", tmp_path / "t", version=2, seed=11)
    model, tok, drafter = d.load(str(tmp_path / "t"), str(tmp_path / "d"))
    split_sums(model)
    assert exactness.known(model) is None
    monkeypatch.setattr(store, "live", {})  # a first use in this process too
    out = list(d.stream_generate(model, tok, tok.encode("abcab"), drafter, max_tokens=8, block_size="auto"))
    first = exactness.known(model)
    assert first is not None and not first.exact and first.exact_pass is None
    assert out[-1].exactness.startswith("not row-exact on this machine")
    out = list(d.stream_generate(model, tok, tok.encode("abcab"), drafter, max_tokens=8, exact=True))
    assert exactness.known(model).exact_pass is True
    assert out[-1].exactness.startswith("exact, by the exact mode's row-exact verify pass")


def test_the_exact_setting_serves_plain_decodings_text_and_says_so(tmp_path, monkeypatch):
    """``dflash_exact``: replies decoded with exact=True (alone, beside the batch), their
    dflash block saying "exact": true and how, with plain decoding's greedy text."""
    import asyncio

    from dflash2_mlx.backend.engine import Engine
    from dflash2_mlx.backend.settings import ModelSettings, SettingsError, check_value
    from tiny_models import on_worker

    monkeypatch.setenv("DFLASH2_MLX_HOME", str(tmp_path))
    target = on_worker(make_target, tmp_path / "t", "qwen3", alphabet="abcd", seed=3)
    drafter = on_worker(make_drafter, tmp_path / "d", target, version=2, seed=11)

    async def scenario():
        e = Engine(target, ModelSettings(dflash_enabled=True, dflash_draft_model=str(drafter), dflash_exact=True,
                                         dflash_block_size=4), model_id="tiny")
        await e.start()
        try:
            replies = await asyncio.gather(*[_collect(e, p) for p in ("abcab", "dcba")])
            return replies, e.model, e.tokenizer
        finally:
            await e.stop()

    async def _collect(e, prompt):
        return [c async for c in e.stream_generate(prompt, max_tokens=12, temperature=0.0)]

    replies, model, tok = asyncio.run(scenario())
    for prompt, chunks in zip(("abcab", "dcba"), replies):
        last = chunks[-1]
        assert last.engine["exact"] is True
        v = exactness.known(model)
        assert last.engine["verify_rows"] == \
            f"exact, by the exact mode's row-exact verify pass (ordinary passes here are {v.describe()})"
        plain = plain_tokens(model, tok.encode(prompt), 12)
        ends = [i for i, t in enumerate(plain) if t in tok.eos_token_ids]
        assert "".join(c.text for c in chunks) == tok.decode(plain[: ends[0] if ends else 12])
    with pytest.raises(SettingsError, match="dflash_exact"):
        check_value("dflash_exact", "yes please")
