"""One plan per server request: the model's settings and the request's options become one
``Plan`` (``backend/options.decoding_plan``), as ``stream_generate`` makes one of its keyword
arguments; the batch reads its block policy from the settings' plan."""

import pytest

import dflash2_mlx as d
from dflash2_mlx.adaptive import Adaptive
from dflash2_mlx.backend.batch_job import block_policy
from dflash2_mlx.backend.options import Generation, decoding_plan
from dflash2_mlx.backend.settings import ModelSettings
from dflash2_mlx.request.plan import Plan
from dflash2_mlx.request.sampling import SamplingParams
from tiny_models import make_drafter, make_target


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    make_target(root / "t", "qwen3", alphabet="abcd", seed=3)
    make_drafter(root / "d", root / "t", version=2, seed=11)
    model, tok, drafter = d.load(str(root / "t"), str(root / "d"))
    return model, drafter, root / "d"


def settings(path, **kw) -> ModelSettings:
    return ModelSettings(dflash_enabled=True, dflash_draft_model=str(path), **kw)


def test_the_settings_and_the_options_make_the_plan_stream_generate_would(pair):
    model, drafter, path = pair
    g = Generation(SamplingParams(temp=0.7, top_p=0.9), {"repetition_penalty": 1.1}, max_tokens=12, seed=5)
    s = settings(path, dflash_verify_mode="adaptive", dflash_block_size=3, dflash_draft_window=64,
                 dflash_draft_sink_size=4, dflash_copies=False)
    plan = decoding_plan(s, drafter, 10, g, continues=True)
    asked = Plan.of(drafter, verify_mode="adaptive", block_size=3, max_tokens=12, seed=5, temp=0.7, top_p=0.9,
                    lookup=False, continues=True, draft_window=64, draft_sink=4,
                    logits_processors=plan.logits_processors)
    assert plan == asked
    assert (plan.verify, plan.block_size, plan.largest) == ("chain", "auto", 3)
    assert len(plan.logits_processors) == 1  # the repetition penalty
    # A fixed block, the tree mode, a prompt past dflash_max_ctx, DFlash off.
    assert decoding_plan(settings(path, dflash_block_size=4), drafter, 10, g).block_size == 4
    tree = decoding_plan(settings(path, dflash_verify_mode="ddtree"), drafter, 10, g)
    assert (tree.verify, tree.tree_budget) == ("tree", "auto")
    assert decoding_plan(settings(path, dflash_max_ctx=8), drafter, 10, g).verify == "off"
    assert decoding_plan(ModelSettings(), None, 10, g).verify == "off"
    with pytest.raises(ValueError, match="impossible for this drafter"):
        decoding_plan(settings(path, dflash_block_size=drafter.config.block_size + 1), drafter, 10, g)


def test_the_batch_reads_its_block_policy_from_the_settings_plan(pair):
    model, drafter, path = pair
    assert block_policy(decoding_plan(settings(path, dflash_block_size=4), drafter), model, drafter) == 4
    assert block_policy(decoding_plan(settings(path), drafter), model, drafter) == "auto"
    tree = decoding_plan(settings(path, dflash_verify_mode="tree", dflash_block_size=4), drafter)
    assert block_policy(tree, model, drafter) == "auto"  # a tree's requests run chains in a batch
    capped = block_policy(decoding_plan(settings(path, dflash_verify_mode="adaptive", dflash_block_size=3),
                                        drafter), model, drafter)
    assert isinstance(capped, Adaptive) and capped.largest == 3
