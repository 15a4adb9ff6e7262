"""The out-of-the-box pair: the shipped drafters load, fit the converted SmolLM2 target,
stay small, and DFlash's greedy output equals plain mlx-lm decoding token for token.

Uses the real 135M target (converted once into the user cache by ``default_pair``)."""

import json

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.sample_utils import make_sampler

from dflash2_mlx.builtin import defaults
from dflash2_mlx import generate, load, stream_generate
from dflash2_mlx.eval import evaluate as E
from dflash2_mlx.model.checkpoint import load_drafter, validate_pair
from dflash2_mlx.train.data import encode

MAX_BYTES = 25 * 1024 * 1024
MAX_TOKENS = 12  # keeps the default suite fast without OpenBLAS (slow: 64)
SHIPPED = [defaults.DEFAULT_DRAFTER, defaults.V1_DRAFTER]


@pytest.fixture(scope="module")
def pair():
    target_path, drafter_path = defaults.default_pair()
    model, tokenizer = mlx_lm.load(target_path)
    return model, tokenizer, drafter_path


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_drafter_is_small_and_complete(name):
    path = defaults.drafter_path(name)
    files = {p.name: p.stat().st_size for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "README.md"} <= set(files)
    assert sum(files.values()) < MAX_BYTES


def test_default_pair_is_the_dflash2_drafter():
    _, drafter_path = defaults.default_pair()
    assert drafter_path == str(defaults.drafter_path(defaults.DEFAULT_DRAFTER))
    assert load_drafter(drafter_path).version == 2
    assert load_drafter(defaults.default_v1_drafter()).version == 1
    with pytest.raises(FileNotFoundError, match="shipped"):
        defaults.drafter_path("no-such-drafter")


@pytest.mark.parametrize("name,max_tokens", [
    (defaults.DEFAULT_DRAFTER, MAX_TOKENS),
    pytest.param(defaults.DEFAULT_DRAFTER, 64, marks=pytest.mark.slow),
    pytest.param(defaults.V1_DRAFTER, 64, marks=pytest.mark.slow),
])
def test_shipped_drafter_greedy_equals_plain_decoding(pair, name, max_tokens):
    model, tokenizer, _ = pair
    drafter = load_drafter(str(defaults.drafter_path(name)))
    validate_pair(model, drafter)
    # Shipped quantized (the config's `quantization` entry); on Metal they stay quantized,
    # on a CPU they run dequantized (fp32 matmuls are faster there).
    assert "quantization" in json.loads((defaults.drafter_path(name) / "config.json").read_text())
    quantized = "scales" in dict(drafter.layers[0].mlp.gate_proj.parameters())
    assert quantized == mx.metal.is_available()
    ids = encode(tokenizer, "Write a Python function that adds two numbers.")
    plain = [r.token for r in mlx_lm.stream_generate(model, tokenizer, mx.array(ids), max_tokens=max_tokens,
                                                     sampler=make_sampler(0.0))]
    # The 64-token runs (slow suite) fix the block: the default run already covers "auto", and
    # each drafter's first "auto" calibrates the pair (minutes on a loaded two-core host).
    block = 5 if max_tokens > MAX_TOKENS else "auto"
    last, drafted = None, []
    for last in stream_generate(model, tokenizer, ids, drafter, max_tokens=max_tokens, temp=0.0, block_size=block):
        drafted.append(last.token)
    assert drafted == plain
    assert last.cycles >= 1 and last.tau >= 1.0


def test_load_without_arguments_is_the_built_in_pair_and_the_readme_example_speaks():
    model, tokenizer, drafter = load()
    assert drafter.version == 2 and drafter.config.hidden_size == 576
    # The README's example: chat messages go through the chat template.
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    assert generate(model, tokenizer, messages, drafter, max_tokens=8).strip()
    # The rule the README states: a text prompt is fed as is, as in mlx_lm.generate.
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert generate(model, tokenizer, ids, drafter, max_tokens=8) == \
        generate(model, tokenizer, messages, drafter, max_tokens=8)
    _, _, v1 = load(draft=defaults.default_v1_drafter())
    assert v1.version == 1


@pytest.mark.slow
def test_loop_tau_offline_matches_the_real_runs(pair):
    """eval's loop τ (teacher-forced, at the anchors a T=0 run visits) is the real T=0
    runs' τ: the loop drafts from the same context as the offline forward. They differ only
    where a run's last blocks are cut by max_tokens, so a few per cent at most."""
    model, tokenizer, drafter_path = pair
    drafter = load_drafter(drafter_path)
    benches = {"mixed": ["Write a Python function that returns the largest of three numbers.",
                         "Natalia sold 48 clips in April and half as many in May. How many in all?",
                         "Explain in two sentences why the sky is blue."]}
    o = E.evaluate(model, tokenizer, {"v2": drafter}, benches, max_tokens=64, temps=(0.0,),
                   block_size=5)["drafters"]["v2"]["overall"]
    real = o["runs"]["T=0"]["tau"]
    assert real > 1.2  # the shipped drafter accepts: the comparison has something to compare
    assert o["tau_loop"] == pytest.approx(real, rel=0.05)
    assert o["tau_selector"] > o["tau_loop"]  # every anchor overstates a run
