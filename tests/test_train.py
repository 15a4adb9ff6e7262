"""Training on tiny real models: data regeneration and resume, loss going down (also with a
quantized target, whose weights never change), checkpoint round trip and exact resume,
the new-drafter config, the v1 -> v2 warm start as an exact no-op, the CLI."""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx_lm.generate import generate_step
import numpy as np
import pytest
from mlx.utils import tree_flatten
from typer.testing import CliRunner

from dflash2_mlx.cli.main import app
from dflash2_mlx.generate import stream_generate
from dflash2_mlx.loop.target import Target, attach
from dflash2_mlx.model.checkpoint import load_drafter, save_drafter, validate_pair
from dflash2_mlx.train import data, init, objective, trainer
from dflash2_mlx.train.features import FeatureCache, batch_features, target_features
from tiny_models import make_drafter, make_target

PROMPTS = ["the cat sat", "a dog ran far", "sun and moon", "big red box", "one two three",
           "hello world", "slow green sea", "quiet night"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    make_target(root / "target", "qwen3", scale=4.0)
    with open(root / "prompts.jsonl", "w") as f:
        for i, p in enumerate(PROMPTS):
            rec = {"messages": [{"role": "user", "content": p}]} if i % 2 else {"text": p}
            f.write(json.dumps(rec) + "\n")
    model, tok = mlx_lm.load(str(root / "target"))
    n = data.generate_dataset(model, tok, root / "prompts.jsonl", root / "data.jsonl",
                              max_tokens=24, batch_size=4, progress=False)
    assert n == len(PROMPTS)
    return root, model, tok, data.read_dataset(root / "data.jsonl")


def small_config(model, tok, version=2, block_size=6):
    return init.new_drafter_config(model, version=version, num_layers=1, block_size=block_size,
                                   mask_token_id=init.default_mask_token_id(tok, 33),
                                   target_layer_ids=[1, 2], selector_rank=8, selector_top_k=4)


def fixed_blocks(model, drafter, records):
    """A held-out batch: every full-block anchor of the first three sequences."""
    target = attach(model, drafter)
    seqs = list(data.sequences(records[:3]))
    feats = target_features(target, [s for s, _ in seqs])
    seq, anchors = objective.sample_anchors(np.random.default_rng(0), [st for _, st in seqs],
                                            [len(s) for s, _ in seqs], 1000)
    return objective.make_blocks([s for s, _ in seqs], feats, seq, anchors,
                                 drafter.config.block_size, drafter.config.mask_token_id)


def test_dataset_is_resumable(tiny, tmp_path):
    root, model, tok, records = tiny
    out = tmp_path / "d.jsonl"
    assert data.generate_dataset(model, tok, root / "prompts.jsonl", out, max_tokens=24,
                                 batch_size=4, limit=3, progress=False) == 3
    with open(out, "a") as f:  # an interrupted write
        f.write('{"id": 7, "prompt_ids": [1, 2')
    assert data.generate_dataset(model, tok, root / "prompts.jsonl", out, max_tokens=24,
                                 batch_size=4, progress=False) == len(PROMPTS)
    again = data.read_dataset(out)
    assert [r["id"] for r in again] == list(range(len(PROMPTS)))
    assert again[:3] == records[:3]  # kept, not regenerated
    # Prompts went through the chat template; the response is the target's own tokens.
    assert records[1]["prompt_ids"] == list(tok.apply_chat_template(
        [{"role": "user", "content": PROMPTS[1]}], add_generation_prompt=True))
    assert all(len(r["response_ids"]) > 0 for r in records)


def test_equal_length_batches_give_each_prompt_its_own_greedy_response(tiny, tmp_path):
    """--gen-by-length: prompts of one token length decoded together give each the tokens it
    gets alone (plain greedy decoding, up to and with its end token), and it resumes."""
    root, model, tok, _ = tiny
    out = tmp_path / "d.jsonl"
    assert data.generate_by_length(model, tok, root / "prompts.jsonl", out, max_tokens=40,
                                   batch_size=3, limit=5, progress=False) == 5
    assert data.generate_by_length(model, tok, root / "prompts.jsonl", out, max_tokens=40,
                                   batch_size=3, progress=False) == len(PROMPTS)
    records = data.read_dataset(out)
    assert sorted(r["id"] for r in records) == list(range(len(PROMPTS)))
    lengths = [len(r["prompt_ids"]) for r in records]
    assert len(set(lengths)) < len(lengths)  # some batch really held several prompts
    for r in records:
        alone = [int(t) for t, _ in generate_step(mx.array(r["prompt_ids"]), model, max_tokens=40)]
        end = next((k for k, t in enumerate(alone) if t in tok.eos_token_ids), None)
        assert r["response_ids"] == (alone if end is None else alone[: end + 1])


def test_prompt_fields():
    assert data.prompt_of({"question": "q"}) == "q"
    assert data.prompt_of({"turns": ["first", "second"]}) == "first"
    assert data.prompt_of({"problem": "p", "solution": "s"}) == "p"
    msgs = data.prompt_of({"messages": [{"role": "user", "content": "u"},
                                        {"role": "assistant", "content": "a"}]})
    assert msgs == [{"role": "user", "content": "u"}]
    assert data.prompt_of({"answer": 3}) is None


def _train(model, drafter, records, out, steps, **kw):
    cfg = trainer.TrainConfig(steps=steps, lr=kw.pop("lr", 3e-3), batch_size=2, max_anchors=12,
                              warmup=0.1, **kw)
    return trainer.train(model, drafter, records, out, cfg)


@pytest.mark.parametrize("quantized", [False, True])
def test_training_reduces_loss_and_leaves_the_target_alone(tiny, tmp_path, quantized):
    root, _, tok, records = tiny
    model, _ = mlx_lm.load(str(root / "target"))
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
        assert isinstance(model.lm_head, nn.QuantizedLinear)
    before = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    drafter = init.new_drafter(small_config(model, tok), seed=0)
    blocks = fixed_blocks(model, drafter, records)
    start, _ = objective.loss(drafter, blocks)
    _train(model, drafter, records, tmp_path / "run", steps=25)
    end, m = objective.loss(drafter, blocks)
    assert end.item() < 0.7 * start.item()
    assert m["selector_ce"].item() > 0
    after = dict(tree_flatten(model.parameters()))
    assert set(after) == set(before)
    for k, v in after.items():
        assert np.array_equal(np.array(v), before[k]), k


def test_checkpoint_round_trip_and_exact_resume(tiny, tmp_path):
    root, model, tok, records = tiny
    cfg = small_config(model, tok)
    full = _train(model, init.new_drafter(cfg, seed=0), records, tmp_path / "a", steps=4,
                  save_every=2)
    ckpt = tmp_path / "a" / "step-000002"
    # The periodic checkpoint is a published-format drafter.
    loaded = load_drafter(str(ckpt))
    validate_pair(model, loaded)
    saved = json.loads((ckpt / "config.json").read_text())
    assert saved["architectures"] == ["DFlash2DraftModel"]
    assert saved["dflash_config"]["block_size"] == 6
    assert not list((ckpt / "training_state").glob("*.pkl"))
    # Resume from step 2 in a fresh directory: the same steps 3 and 4.
    shutil.copytree(ckpt, tmp_path / "b" / "step-000002")
    resumed = _train(model, None, records, tmp_path / "b", steps=4, save_every=2)
    a, b = dict(tree_flatten(full.parameters())), dict(tree_flatten(resumed.parameters()))
    for k in a:
        assert np.array_equal(np.array(a[k]), np.array(b[k])), k
    ha = json.loads((tmp_path / "a/final/training_state/state.json").read_text())["state"]
    hb = json.loads((tmp_path / "b/final/training_state/state.json").read_text())["state"]
    assert ha["history"][2:] == [dict(h, sec=ha["history"][2 + i]["sec"])
                                 for i, h in enumerate(hb["history"][2:])]
    assert ha["rng"] == hb["rng"] and ha["position"] == hb["position"]
    assert trainer.latest_checkpoint(tmp_path / "a").name == "final"
    # Changed weights were saved: the checkpoint differs from a fresh init.
    fresh = dict(tree_flatten(init.new_drafter(cfg, seed=0).parameters()))
    assert not np.array_equal(np.array(fresh["fc.weight"]), np.array(a["fc.weight"]))


def test_stop_after_ends_a_longer_schedule_early(tiny, tmp_path):
    """stop_after: the first part of a run whose learning rate spans ``steps`` (the weights
    equal that run's own checkpoint at the same step), and the rest resumes from it."""
    root, model, tok, records = tiny
    cfg = small_config(model, tok)
    _train(model, init.new_drafter(cfg, seed=0), records, tmp_path / "a", steps=4, save_every=2)
    part = _train(model, init.new_drafter(cfg, seed=0), records, tmp_path / "b", steps=4,
                  stop_after=2)
    state = json.loads((tmp_path / "b/final/training_state/state.json").read_text())["state"]
    assert state["step"] == 2 and [h["lr"] for h in state["history"]] == [
        h["lr"] for h in json.loads((tmp_path / "a/final/training_state/state.json")
                                    .read_text())["state"]["history"][:2]]
    a = dict(tree_flatten(load_drafter(str(tmp_path / "a" / "step-000002")).parameters()))
    for k, v in tree_flatten(part.parameters()):
        assert np.array_equal(np.array(a[k]), np.array(v)), k


def test_held_out_records_are_evaluated_and_never_trained_on(tiny, tmp_path):
    """val_records: the last records only measure (val_* every val_every steps); the run
    equals one on the other records alone, so validation changes nothing it trains."""
    root, model, tok, records = tiny
    cfg = small_config(model, tok)
    a = _train(model, init.new_drafter(cfg, seed=0), records, tmp_path / "a", steps=4,
               val_records=2, val_every=3)
    b = _train(model, init.new_drafter(cfg, seed=0), records[:-2], tmp_path / "b", steps=4)
    for (k, va), (_, vb) in zip(tree_flatten(a.parameters()), tree_flatten(b.parameters())):
        assert np.array_equal(np.array(va), np.array(vb)), k
    hist = json.loads((tmp_path / "a/final/training_state/state.json").read_text())["state"]["history"]
    assert [h["step"] for h in hist if "val_ce" in h] == [3, 4]
    target = attach(model, a)
    held_out = trainer.DataStream(records[-2:], trainer.TrainConfig(), trainer.TrainState()).seqs
    again = trainer.validate(target, a, held_out, trainer.TrainConfig(batch_size=2, max_anchors=12))
    assert again["val_ce"] == pytest.approx(hist[-1]["val_ce"], rel=1e-5)
    assert 0.0 <= again["val_top1_pos1"] <= 1.0
    with pytest.raises(ValueError, match="nothing to train on"):
        _train(model, init.new_drafter(cfg, seed=0), records, tmp_path / "c", steps=1,
               val_records=len(records))
    # A prompt asked twice is one sequence, and never held out when it is also trained on.
    tc = trainer.TrainConfig()
    assert len(trainer.DataStream(records + records, tc, trainer.TrainState()).seqs) == len(
        trainer.DataStream(records, tc, trainer.TrainState()).seqs)
    with pytest.raises(ValueError, match="nothing held out"):
        _train(model, init.new_drafter(cfg, seed=0), records + records[:1], tmp_path / "d", steps=1,
               val_records=1)


def test_new_drafter_is_sized_from_the_target(tiny, tmp_path):
    root, model, tok, _ = tiny
    cfg = init.new_drafter_config(model, version=2, num_layers=3, block_size=10,
                                  mask_token_id=2, target_layer_ids=[0, 3])
    args = model.args
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta) == (
        args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim,
        args.intermediate_size, args.vocab_size, args.rope_theta)
    assert (cfg.num_hidden_layers, cfg.block_size, cfg.target_layer_ids, cfg.num_target_layers,
            cfg.selector_top_k, cfg.is_causal) == (3, 10, [0, 3], 4, 16, False)
    save_drafter(init.new_drafter(cfg), tmp_path / "new")
    validate_pair(model, load_drafter(str(tmp_path / "new")))
    # Default tapped layers follow the DFlash rule (deduplicated for shallow targets).
    assert init.new_drafter_config(model, mask_token_id=2).target_layer_ids == [1]
    assert init.default_mask_token_id(tok, 33) == tok.mask_token_id == 2


@pytest.mark.parametrize("quantized", [False, True])
def test_warm_start_from_target_layers(tiny, quantized):
    """Drafter layer i starts as target layer ids[i] (a quantized target's dequantized);
    the target's tiny qwen3 layers have q/k norms too, so every part is copied."""
    root, _, tok, _ = tiny
    model, _ = mlx_lm.load(str(root / "target"))
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    drafter = init.new_drafter(init.new_drafter_config(model, num_layers=2, mask_token_id=2))
    init.warm_start_from_target(drafter, model, [3, 1])
    for i, j in enumerate([3, 1]):
        for part in init.LAYER_PARTS:
            src, dst = model.layers[j], drafter.layers[i]
            for name in part.split("."):
                src, dst = getattr(src, name), getattr(dst, name)
            w = init._weight(src)
            assert np.array_equal(np.array(w), np.array(dst.weight)), (i, part)
    with pytest.raises(ValueError, match="target layer 9 does not exist"):
        init.warm_start_from_target(drafter, model, [0, 9])
    with pytest.raises(ValueError, match="3 target layers given for 2 drafter layers"):
        init.warm_start_from_target(drafter, model, [0, 1, 2])


def test_warm_start_v2_from_v1_is_exactly_v1(tiny, tmp_path):
    root, model, tok, records = tiny
    make_drafter(tmp_path / "v1", root / "target", version=1, block_size=6)
    v1 = load_drafter(str(tmp_path / "v1"))
    # Train v1 a little so its drafts are not trivial.
    v1 = _train(model, v1, records, tmp_path / "run1", steps=10, lr=5e-3)
    save_drafter(warm_start_v2(v1), tmp_path / "v2")
    v1 = load_drafter(str(tmp_path / "run1" / "final"))
    v2 = load_drafter(str(tmp_path / "v2"))
    assert v2.version == 2
    # Same hidden states and logits on the same block.
    target = Target(model, v1.config.target_layer_ids)
    ids = mx.array([records[0]["prompt_ids"] + records[0]["response_ids"][:4]])
    _, feats = target(ids, None)
    block = mx.array([[int(ids[0, -1])] + [v1.config.mask_token_id] * 5])
    outs = []
    for d in (v1, v2):
        d.bind(target.embed, target.lm_head)
        cache = d.make_cache()
        d.append_context(feats[:, :-1], cache)
        outs.append(d.logits(d(block, cache)))
    assert np.array_equal(np.array(outs[0]), np.array(outs[1]))
    # Same generation, token for token, with the same acceptance statistics.
    runs = []
    for d in (v1, v2):
        rs = list(stream_generate(model, tok, PROMPTS[0], d, max_tokens=30, block_size=6))
        runs.append(([r.token for r in rs], rs[-1].acceptance_counts, rs[-1].cycles))
    assert runs[0] == runs[1]
    assert sum(runs[0][1]) > 0  # drafts were accepted, so the comparison is not vacuous


def warm_start_v2(v1):
    return init.warm_start_v2(v1, selector_rank=8, selector_top_k=4, seed=3)


def test_train_cli(tiny, tmp_path):
    root, *_ = tiny
    args = ["train", "--model", str(root / "target"), "--prompts", str(root / "prompts.jsonl"),
            "--data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "run"),
            "--prompt-limit", "4", "--gen-max-tokens", "16", "--layers", "1", "--block-size", "4",
            "--target-layer", "1", "--target-layer", "3", "--selector-rank", "8",
            "--steps", "3", "--batch-size", "2", "--max-anchors", "8", "--log-every", "1"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "step 3" in res.output
    d = load_drafter(str(tmp_path / "run" / "final"))
    assert d.config.target_layer_ids == [1, 3] and d.config.block_size == 4
    assert len(data.read_dataset(tmp_path / "d.jsonl")) == 4
    assert (tmp_path / "run" / "loss.png").stat().st_size > 0
    assert len((tmp_path / "run" / "log.jsonl").read_text().splitlines()) == 3


def test_feature_cache_is_bounded_resumable_and_exact(tiny, tmp_path):
    root, model, tok, records = tiny
    target = Target(model, [1, 2])
    seqs = [s for s, _ in data.sequences(records[:4])]
    per_row = 2 * 64 * 4  # two taps of H = 64, float32
    meta = {"target": "tiny", "layers": [1, 2], "max_len": 1024}
    budget = per_row * (len(seqs[0]) + len(seqs[1])) + 2048  # + safetensors headers
    cache = FeatureCache(tmp_path / "f", budget, meta)
    got = batch_features(target, seqs, [0, 1, 2, 3], cache)
    assert sorted(p.name for p in (tmp_path / "f").glob("*.safetensors")) == ["0.safetensors", "1.safetensors"]
    assert cache.used <= budget
    for i, s in enumerate(seqs):
        alone = target_features(target, [s])[0]
        np.testing.assert_allclose(np.array(got[i, : len(s)]), np.array(alone), atol=1e-5)
    again = FeatureCache(tmp_path / "f", budget, meta)  # a restart reuses what is there
    assert again.used == cache.used and again.get(1) is not None
    assert np.array_equal(np.array(again.get(0)), np.array(got[0, : len(seqs[0])]))
    FeatureCache(tmp_path / "f", budget, dict(meta, layers=[0, 3]))  # another target: cleared
    assert not list((tmp_path / "f").glob("*.safetensors"))


def test_training_with_feature_cache(tiny, tmp_path):
    root, model, tok, records = tiny
    drafter = init.new_drafter(small_config(model, tok), seed=0)
    blocks = fixed_blocks(model, drafter, records)
    start, _ = objective.loss(drafter, blocks)
    _train(model, drafter, records, tmp_path / "run", steps=12, feature_cache_gb=0.01)
    end, _ = objective.loss(drafter, blocks)
    assert end.item() < start.item()
    assert len(list((tmp_path / "run" / "features").glob("*.safetensors"))) == len(records)
