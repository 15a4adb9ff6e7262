"""The server against a hostile client (issue 41): options out of the model's range, a
sampler that raises, fields of the wrong kind, settings edited wrong while serving, a
disk tier with bad files, dropped clients and big bodies; in-process engines and a real
`dflash2-mlx serve` on loopback."""

import asyncio

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import apply_top_k, make_logits_processors

from dflash2_mlx.backend.engine import Engine, InvalidOption
from dflash2_mlx.backend.options import MAX_SEED
from dflash2_mlx.backend.settings import ModelSettings
from dflash2_mlx.backend.solo import own_random
from dflash2_mlx.loop.random_keys import RandomStream, swap_key
from tiny_models import make_drafter, make_target, on_worker, worker_reference

PROMPT = "hello world"


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening")
    target = on_worker(make_target, root / "models" / "tiny")
    drafter = on_worker(make_drafter, root / "drafter", target)
    return root, target, drafter


@pytest.fixture(scope="module")
def reference(models):
    _, target, drafter = models
    return worker_reference(target, drafter)


@pytest.fixture(scope="module")
def engine(models):
    _, target, drafter = models
    e = Engine(target, ModelSettings(dflash_enabled=True, dflash_draft_model=str(drafter)),
               model_id="tiny", max_queue=4, max_batch=2)
    run(e.start())
    yield e
    run(e.stop())


def refused(engine, param, **options):
    """The option is refused when the stream is made, naming ``param``."""
    with pytest.raises(InvalidOption) as e:
        engine.stream_generate(PROMPT, max_tokens=2, **options)
    assert e.value.param == param, str(e.value)
    return str(e.value)


# 1. logit_bias --------------------------------------------------------------------------
def test_logit_bias_ids_outside_the_vocabulary_are_refused(engine, reference):
    v = engine.vocab_size
    for key in (str(v), "99999999", v, -1, "-1", "-99999999", "x", "1.5"):
        message = refused(engine, "logit_bias", logit_bias={key: 1.0})
        assert f"0..{v - 1}" in message
    for value in (float("nan"), float("inf"), "1"):
        refused(engine, "logit_bias", logit_bias={"5": value})
    # The last id of the vocabulary is one, and the engine still serves.
    bias = {str(v - 1): 5.0}
    got = run(engine.generate(PROMPT, max_tokens=4, logit_bias=bias)).text
    assert got == reference(PROMPT, max_tokens=4, logits_processors=make_logits_processors(logit_bias={v - 1: 5.0}))


# 2. sampling options bounded up front, random state restored -----------------------------
def test_sampling_options_past_the_vocabulary_are_refused(engine, reference):
    v = engine.vocab_size
    assert "1.." in refused(engine, "top_k", temperature=1.0, top_k=v)
    refused(engine, "top_k", temperature=1.0, top_k=10 ** 9)
    refused(engine, "min_tokens_to_keep", temperature=1.0, min_p=0.1, min_tokens_to_keep=v + 1)
    refused(engine, "min_tokens_to_keep", temperature=1.0, min_p=0.1, min_tokens_to_keep=2 ** 62)
    refused(engine, "temperature", temperature=float("nan"))
    refused(engine, "top_p", temperature=1.0, top_p=float("nan"))
    refused(engine, "repetition_penalty", repetition_penalty=float("inf"))
    refused(engine, "presence_penalty", presence_penalty="high")
    refused(engine, "top_k", top_k=True)
    assert "0..18446744073709551615" in refused(engine, "seed", seed=MAX_SEED + 1)
    refused(engine, "seed", seed=-1)
    # What is in range still runs: the largest top_k, the whole vocabulary kept, the largest seed.
    kw = dict(max_tokens=4, top_k=v - 1, min_p=0.1, min_tokens_to_keep=v, seed=MAX_SEED)
    assert run(engine.generate(PROMPT, temperature=1.0, **kw)).text == reference(PROMPT, temp=1.0, **kw)


def test_a_draw_that_raises_leaves_the_global_key_as_it_was():
    """mlx-lm's samplers are compiled with the global key as input and output: one that
    raises while tracing leaves a key that cannot be read. The stream puts the outer back."""
    mx.random.seed(7)
    outer = mx.random.state[0].tolist()
    logits = mx.zeros((1, 10))
    with pytest.raises(Exception):
        with RandomStream(123):
            apply_top_k(logits, 10)
    assert mx.random.state[0].tolist() == outer
    mx.random.uniform(shape=(2,)).tolist()  # draws again

    def steps():
        yield
        apply_top_k(logits, 10)

    job = own_random(steps)()
    next(job)  # its key drawn from the global one, which is back between its steps
    outer = mx.random.state[0].tolist()
    with pytest.raises(Exception):
        next(job)
    assert mx.random.state[0].tolist() == outer
    assert swap_key(5) == (outer[0] << 32) | outer[1]
