"""Checkpoint loading and pair validation: every bad input fails with a specific message."""

import json
import shutil

import mlx.core as mx
import pytest
from mlx_lm.utils import _get_classes

import dflash2_mlx as d
from dflash2_mlx.loop.target import Target, UnsupportedTargetError
from dflash2_mlx.model.checkpoint import CheckpointError, PairError, load_drafter, save_drafter
from dflash2_mlx.model.config import DrafterConfig
from dflash2_mlx.model.drafter import Drafter
from tiny_models import drafter_config, make_drafter, make_target


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("loading")
    make_target(root / "t", "qwen3")
    make_drafter(root / "v2", root / "t", version=2)
    make_drafter(root / "v1", root / "t", version=1)
    return root


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if k in cfg.get("dflash_config", {}):
            cfg["dflash_config"][k] = v
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def copy(root, tmp_path, name="v2"):
    dst = tmp_path / name
    shutil.copytree(root / name, dst)
    return dst


def test_round_trip_v1_and_v2(root):
    v2 = load_drafter(str(root / "v2"))
    v1 = load_drafter(str(root / "v1"))
    assert v2.version == 2 and v1.version == 1
    assert "candidate_selector" in v2 and "candidate_selector" not in v1
    files = mx.load(str(root / "v2" / "model.safetensors"))
    # Published names: raw codebook names (no .weight), conv tensors per layer.
    assert "candidate_selector.predecessor_codebook" in files
    assert "candidate_selector.successor_codebook" in files
    assert files["layers.0.attention_conv.base_kernel"].shape == (2, 2, 64)
    assert files["layers.1.mlp_conv.kernel_projection.weight"].shape == (4 * 64 // 16, 64)


def test_config_keys_read_from_dflash_config_first_then_top_level(root):
    cfg = json.loads((root / "v2" / "config.json").read_text())
    cfg["block_size"] = 3  # top level loses to dflash_config
    assert DrafterConfig.from_dict(cfg).block_size == 8
    del cfg["dflash_config"]["block_size"]
    assert DrafterConfig.from_dict(cfg).block_size == 3  # v1 style: top level


def test_model_prefix_and_codebook_weight_suffix_are_renamed(root, tmp_path):
    path = copy(root, tmp_path)
    w = mx.load(str(path / "model.safetensors"))
    renamed = {("model." + k if "layers" in k else k): v for k, v in w.items()}
    renamed["candidate_selector.successor_codebook.weight"] = renamed.pop("candidate_selector.successor_codebook")
    mx.save_safetensors(str(path / "model.safetensors"), renamed)
    load_drafter(str(path))


def test_sharded_checkpoint(root, tmp_path):
    path = copy(root, tmp_path)
    w = mx.load(str(path / "model.safetensors"))
    keys = sorted(w)
    half = len(keys) // 2
    (path / "model.safetensors").unlink()
    mx.save_safetensors(str(path / "model-00001-of-00002.safetensors"), {k: w[k] for k in keys[:half]})
    mx.save_safetensors(str(path / "model-00002-of-00002.safetensors"), {k: w[k] for k in keys[half:]})
    index = {"weight_map": {k: f"model-0000{1 + (i >= half)}-of-00002.safetensors" for i, k in enumerate(keys)}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    load_drafter(str(path))
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard.*missing.*model-00002-of-00002"):
        load_drafter(str(path))


@pytest.mark.parametrize("change,message", [
    (dict(vocab_size=99), "vocab size: drafter 99, target"),
    (dict(hidden_size=48, head_dim=12), "hidden size: drafter 48, target 64"),
    (dict(num_target_layers=6), "num_target_layers: drafter trained on 6, target has 4"),
    (dict(target_layer_ids=[1, 7]), r"target_layer_ids \[7\] out of range for a 4-layer target"),
    (dict(mask_token_id=500), "mask_token_id 500 not in the target vocabulary"),
])
def test_pair_mismatch(root, tmp_path, change, message):
    cfg = drafter_config(root / "t", 2, **change)
    save_drafter(Drafter(DrafterConfig.from_dict(cfg)), tmp_path / "bad")
    with pytest.raises(PairError, match=message):
        d.load(str(root / "t"), str(tmp_path / "bad"))


def test_missing_unexpected_and_misshapen_tensors(root, tmp_path):
    path = copy(root, tmp_path)
    good = mx.load(str(path / "model.safetensors"))
    w = dict(good)
    del w["layers.1.mlp_conv.base_kernel"]
    mx.save_safetensors(str(path / "model.safetensors"), w)
    with pytest.raises(CheckpointError, match="missing tensors: layers.1.mlp_conv.base_kernel"):
        load_drafter(str(path))
    w = dict(good, **{"layers.9.extra.weight": mx.zeros((2,))})
    mx.save_safetensors(str(path / "model.safetensors"), w)
    with pytest.raises(CheckpointError, match="unexpected tensors: layers.9.extra.weight"):
        load_drafter(str(path))
    w = dict(good, **{"fc.weight": mx.zeros((64, 64))})
    mx.save_safetensors(str(path / "model.safetensors"), w)
    with pytest.raises(CheckpointError, match=r"wrong tensor shapes: fc.weight \(64, 64\) \(expected \(64, 128\)\)"):
        load_drafter(str(path))


def test_corrupt_and_incomplete_checkpoints(root, tmp_path):
    path = copy(root, tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cannot read model.safetensors"):
        load_drafter(str(path))
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="has no \\*.safetensors weights"):
        load_drafter(str(path))
    (path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match="only pickle checkpoints.*pickles are never loaded"):
        load_drafter(str(path))
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        load_drafter(str(path))
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_drafter(str(path))
    with pytest.raises(CheckpointError, match="no such directory"):
        load_drafter(str(tmp_path / "nowhere"))


@pytest.mark.parametrize("change,message", [
    (dict(architectures=["LlamaForCausalLM"]), "name no DFlash drafter"),
    (dict(block_size=1), "block_size must be at least 2"),
    (dict(conv_group_size=24), "not divisible by conv_group_size 24"),
    (dict(mask_token_id=None), "missing mask_token_id"),
])
def test_bad_drafter_config(root, tmp_path, change, message):
    path = copy(root, tmp_path)
    edit_config(path, **change)
    with pytest.raises(CheckpointError, match=message):
        load_drafter(str(path))


def test_impossible_block_size_empty_prompt_and_bad_mode(root):
    model, tok, drafter = d.load(str(root / "t"), str(root / "v2"))
    for bad in (0, 9, -1):
        with pytest.raises(ValueError, match=f"block size {bad} is impossible.*use 1..8"):
            list(d.stream_generate(model, tok, "ab", drafter, block_size=bad, max_tokens=4))
    for empty in ("", []):
        with pytest.raises(ValueError, match="prompt is empty"):
            list(d.stream_generate(model, tok, empty, drafter, max_tokens=4))
    with pytest.raises(ValueError, match="verify mode 'forest' is not supported"):
        list(d.stream_generate(model, tok, "ab", drafter, verify_mode="forest", max_tokens=4))
    with pytest.raises(ValueError, match=r"temp is a finite number, 0 or more \(0: greedy\); got -1"):
        list(d.stream_generate(model, tok, "ab", drafter, temp=-1, max_tokens=4))


def test_unsupported_target_names_what_is_missing(tmp_path):
    config = dict(model_type="gpt2", n_ctx=64, n_embd=32, n_head=2, n_layer=2, n_positions=64,
                  layer_norm_epsilon=1e-5, vocab_size=40)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    with pytest.raises(UnsupportedTargetError, match="no model.embed_tokens"):
        Target(model, [0])


@pytest.mark.parametrize("bits,group,act", [(4, 32, 32), (8, 64, 16), (2, 32, 32)])
def test_drafter_quantization_keeps_output_lossless(root, bits, group, act):
    model, tok, plain = d.load(str(root / "t"), str(root / "v2"))
    ref = [r.token for r in d.stream_generate(model, tok, "abc", plain, max_tokens=12)]
    _, _, q = d.load(str(root / "t"), str(root / "v2"), draft_bits=bits, draft_group_size=group,
                     draft_activation_bits=act)
    assert type(q.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
    assert q.layers[0].self_attn.q_proj.bits == bits
    assert q.activation_dtype == (mx.float32 if act == 32 else mx.bfloat16)
    out = [r.token for r in d.stream_generate(model, tok, "abc", q, max_tokens=12)]
    assert out == ref


def test_bad_quantization_settings(root):
    with pytest.raises(ValueError, match="bits must be 2, 4 or 8, got 3"):
        d.load(str(root / "t"), str(root / "v2"), draft_bits=3)
    with pytest.raises(ValueError, match="group size must be 32, 64 or 128, got 48"):
        d.load(str(root / "t"), str(root / "v2"), draft_bits=4, draft_group_size=48)
    with pytest.raises(ValueError, match="activation bits must be 16 or 32, got 8"):
        d.load(str(root / "t"), str(root / "v2"), draft_activation_bits=8)


def test_drafter_for_another_model_fails_on_its_config_before_its_tensors(root, tmp_path):
    make_target(tmp_path / "other", "qwen3", hidden=128, alphabet="abcdefgh")
    make_drafter(tmp_path / "od", tmp_path / "other", version=2)
    # Unreadable tensors: the cause must come from the config, before any tensor is read.
    (tmp_path / "od" / "model.safetensors").write_bytes(b"never read")
    with pytest.raises(PairError, match=r"^drafter does not match the target: vocab size: drafter \d+, "
                                        r"target \d+; hidden size: drafter 128, target 64$"):
        d.load(str(root / "t"), str(tmp_path / "od"))
