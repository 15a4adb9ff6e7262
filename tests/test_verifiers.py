"""The verifiers and how they compose (``loop/verifiers.py``): every combination the product
allows (exact verify x the CPU split x chain, path or tree x a pipeline stage) decodes as
plain mlx-lm decoding, token for token, through the verifiers the composition names; every
combination it refuses says why."""

import mlx.core as mx
import pytest

import dflash2_mlx as d
from dflash2_mlx import tree as trees
from dflash2_mlx.calibration import store
from dflash2_mlx.distributed import pipeline
from dflash2_mlx.generate import speculative_generate_step
from dflash2_mlx.loop import verifiers
from dflash2_mlx.loop.target import attach
from dflash2_mlx.machine import cpu_split
from helpers import plain_tokens
from tiny_models import make_drafter, make_target

PROMPT = "abcab dcba"
TOKENS = 20
VERIFIERS = (verifiers.Chain, verifiers.RowExactPass, verifiers.OneRowSteps, verifiers.PathPass, trees.TreePass)


def pair(tmp_path, family: str, split: bool, monkeypatch):
    monkeypatch.setenv("DFLASH2_MLX_CPU_SPLIT", "1" if split else "0")
    make_target(tmp_path / "t", family, alphabet="abcd", seed=3, scale=4.0)
    make_drafter(tmp_path / "d", tmp_path / "t", version=2, seed=11)
    return d.load(str(tmp_path / "t"), str(tmp_path / "d"))


@pytest.fixture
def used(monkeypatch):
    """The verifiers each verify pass (or replay) ran through: their calls counted, not changed."""
    seen = []
    for cls in VERIFIERS:
        real = cls.__call__
        monkeypatch.setattr(cls, "__call__", lambda self, *a, real=real: seen.append(self.name) or real(self, *a))
    return seen


def decode(model, target, drafter, tok, tree_budget=None):
    """Plain decoding's tokens, checked; after it, nothing a pass changes for itself is left."""
    ids = tok.encode(PROMPT)
    out, stats, cache = [], None, target.make_cache()
    for t, _, _, stats in speculative_generate_step(mx.array(ids), target, drafter, max_tokens=TOKENS, block_size=5,
                                                    tree_budget=tree_budget, lookup=False, prompt_cache=cache):
        out.append(t)
    assert out == plain_tokens(model, ids, TOKENS), "not plain decoding's tokens"
    assert not [c for c in cache if type(c).__name__.startswith("TreeMasked")]
    tree = target.verifiers.tree
    assert tree is None or (tree.depths in (None, [None]) and (tree.recurrent is None or tree.recurrent[0] == [None]))
    return stats


@pytest.mark.parametrize("split", [True, False], ids=["cpu-split", "unsplit"])
@pytest.mark.parametrize("exact", [None, "pass", "steps"])
@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_each_exact_mode_and_split_verifies_as_composed(tmp_path, monkeypatch, used, split, exact, kind):
    """An attention target: chains and trees without exact verify; with it, chains only
    (a tree asked for is verified as chains, saying why), through the mode's verifier."""
    model, tok, drafter = pair(tmp_path, "llama", split, monkeypatch)
    target = attach(model, drafter, exact=exact)
    installed = any(isinstance(m, cpu_split.SplitLinear) for _, m in model.named_modules())
    assert installed == (split and cpu_split._blas is not None)
    want = {None: "chain", "pass": "pass", "steps": "steps"}[exact]
    assert target.verifiers.names == ((want, "tree", "path") if exact is None else (want,))
    stats = decode(model, target, drafter, tok, tree_budget=8 if kind == "tree" else None)
    if exact is None and kind == "tree":
        assert "tree" in used and stats.trees > 0
    else:
        assert set(used) == {want} and stats.trees == 0
    if exact is not None and kind == "tree":
        assert stats.chain_why == "exact verify reads one row at a time (a chain)"


@pytest.mark.parametrize("exact", [None, "pass", "steps"])
def test_a_hybrid_verifies_its_chains_as_paths_unless_exact(tmp_path, monkeypatch, used, exact):
    """qwen3_5's recurrent layers cannot be trimmed: its chains go through a tree of one
    path (every row's state kept); exact verify reads rows alone, so chains replay instead."""
    model, tok, drafter = pair(tmp_path, "qwen3_5", True, monkeypatch)
    target = attach(model, drafter, exact=exact)
    decode(model, target, drafter, tok)
    assert ("path" in used) == (exact is None)
    assert exact is None or set(used) == {exact}


def test_a_pipeline_stage_verifies_chains_and_refuses_exact(tmp_path, monkeypatch, used):
    """A target split into a pipeline (a group of one: every path of a stage but the
    exchanges; two ranks in ``test_distributed_pipeline.py``) verifies chains, saying why a
    tree asked for is not one; exact verify is refused with a clear error, before any probe."""
    monkeypatch.setenv("DFLASH2_MLX_HOME", str(tmp_path / "home"))
    model, tok, drafter = pair(tmp_path, "qwen3", True, monkeypatch)
    pipeline.split(model, mx.distributed.init())
    target = attach(model, drafter)
    assert target.verifiers.names == ("chain",)
    stats = decode(model, target, drafter, tok, tree_budget=8)
    assert set(used) == {"chain"} and stats.chain_why == "a pipeline target verifies chains"
    with pytest.raises(ValueError, match="exact verify on a target split into a pipeline"):
        attach(model, drafter, exact="pass")
    with pytest.raises(ValueError, match="exact verify on a target split into a pipeline"):
        list(d.stream_generate(model, tok, PROMPT, drafter, max_tokens=4, exact=True))
    assert list(store.records("exactness")) == []


def test_an_unknown_exact_mode_is_refused(tmp_path, monkeypatch):
    model, tok, drafter = pair(tmp_path, "llama", True, monkeypatch)
    with pytest.raises(ValueError, match="exact verify is one of"):
        attach(model, drafter, exact="rows")
