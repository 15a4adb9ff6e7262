"""The `dflash2-mlx generate` command, run as a real process."""

import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tuner.utils import linear_to_lora_layers

import dflash2_mlx as d
from dflash2_mlx.cli.doctor_report import openblas_path
from dflash2_mlx.request.sampling import xtc_special_tokens
from tiny_models import make_drafter, make_target


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    make_target(root / "t", "qwen3", alphabet="abcd", seed=3)
    make_drafter(root / "d", root / "t", version=2)
    return root


def run(*args):
    return subprocess.run(["dflash2-mlx", *args], capture_output=True, text=True, timeout=240)


def test_generate_streams_text_then_stats(pair):
    r = run("generate", "--model", str(pair / "t"), "--draft", str(pair / "d"), "--prompt", "abcab dcba",
            "--max-tokens", "20", "--block-size", "4")
    assert r.returncode == 0, r.stderr
    model, tok, drafter = d.load(str(pair / "t"), str(pair / "d"))
    chat = [{"role": "user", "content": "abcab dcba"}]  # a text prompt goes through the chat template
    want = d.generate(model, tok, chat, drafter, max_tokens=20, block_size=4)
    assert r.stdout == want + "\n"
    assert "tau " in r.stderr and "tok/s" in r.stderr and "peak memory" in r.stderr
    raw = run("generate", "--model", str(pair / "t"), "--draft", str(pair / "d"), "--prompt", "abcab dcba",
              "--max-tokens", "20", "--block-size", "4", "--ignore-chat-template")
    assert raw.stdout == d.generate(model, tok, "abcab dcba", drafter, max_tokens=20, block_size=4) + "\n"


def test_generate_from_messages_file_with_sampling(pair, tmp_path):
    msgs = tmp_path / "chat.json"
    msgs.write_text(json.dumps([{"role": "user", "content": "abcd"}]))
    args = ["generate", "--model", str(pair / "t"), "--draft", str(pair / "d"), "--messages-file",
            str(msgs), "--max-tokens", "12", "--temp", "0.8", "--top-p", "0.9", "--top-k", "5",
            "--min-p", "0.01", "--seed", "3", "--draft-bits", "8", "--draft-group-size", "32",
            "--block-size", "4"]  # a seed repeats its text under a fixed block size (auto follows the clock)
    a, b = run(*args), run(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout  # same seed, same text


@pytest.mark.parametrize("args,message", [
    (["--block-size", "9"], "block size 9 is impossible"),
    (["--draft-bits", "3"], "bits must be 2, 4 or 8"),
    (["--verify-mode", "forest"], "verify mode 'forest' is not supported"),
    (["--verify-mode", "tree", "--tree-budget", "0"], "tree budget 0 is impossible"),
    (["--tree-budget", "8"], "tree_budget='8' needs verify_mode='tree'"),
])
def test_generate_bad_options(pair, args, message):
    r = run("generate", "--model", str(pair / "t"), "--draft", str(pair / "d"), "--prompt", "ab",
            *args)
    assert r.returncode == 2 and message in r.stderr


def test_help_lists_every_option():
    r = subprocess.run(["dflash2-mlx", "generate", "--help"], capture_output=True, text=True, timeout=240,
                       env={**os.environ, "COLUMNS": "200"})  # option names unabridged
    for opt in ["--model", "--draft", "--prompt", "--messages-file", "--max-tokens", "--temp",
                "--top-p", "--top-k", "--min-p", "--block-size", "--draft-bits", "--seed",
                "--verbose", "--copies", "--no-copies", "--system-prompt", "--prefill-response",
                "--chat-template-config", "--extra-eos-token", "--prefill-step-size", "--draft-model",
                "--min-tokens-to-keep", "--xtc-probability", "--xtc-threshold", "--prompt-cache-file", "--max-kv-size"]:
        assert opt in r.stdout
    top = run("--help").stdout
    for cmd in ["generate", "doctor", "train", "eval", "serve", "models"]:
        assert cmd in top


def mlx_lm_text(*args):
    """The reply text of `python -m mlx_lm generate` (between its ========== lines)."""
    r = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", *args], capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    return r.stdout.split("==========\n")[1].removesuffix("\n")


def test_chat_options_as_mlx_lm_generate_has_them(pair, tmp_path):
    # A template that reads an extra argument, as Qwen3's reads enable_thinking.
    shutil.copytree(pair / "t", tmp_path / "t")
    config = tmp_path / "t" / "tokenizer_config.json"
    cfg = json.loads(config.read_text())
    cfg["chat_template"] = "{% if shout %}dddd{% endif %}" + cfg["chat_template"]
    config.write_text(json.dumps(cfg))
    for prompt, opts in (("abcab dcba", ["--system-prompt", "dcb", "--prefill-response", "ab"]),
                         ("abcab dcba", ["--chat-template-config", '{"shout": true}', "--extra-eos-token", "c"]),
                         ("ab\\nba", [])):  # a typed \n is a newline, as mlx_lm reads it
        args = ["--model", str(tmp_path / "t"), "--prompt", prompt, "--max-tokens", "24", *opts]
        ours = run("generate", "--draft-model", str(pair / "d"), *args)
        assert ours.returncode == 0, ours.stderr
        assert ours.stdout == mlx_lm_text(*args) + "\n", opts
    stops = run("generate", "--model", str(tmp_path / "t"), "--draft", str(pair / "d"), "--prompt",
                "abcab dcba", "--max-tokens", "24", "--extra-eos-token", "c")
    assert "c" not in stops.stdout and "generation 24 tokens" not in stops.stderr


def test_xtc_and_min_tokens_to_keep_as_mlx_lm_generate_has_them(pair):
    """Plain decoding samples them with mlx-lm's own sampler and special tokens ("\\n" and
    EOS), so a seed gives mlx-lm's text (seeded where generation starts: mlx_lm.generate
    seeds before loading the model, whose initialisation draws from the same stream); DFlash
    takes them as the Python API does."""
    opts = ["--prompt", "abcab dcba", "--max-tokens", "24", "--temp", "1.0", "--min-p", "0.05",
            "--min-tokens-to-keep", "2", "--xtc-probability", "0.9", "--xtc-threshold", "0.05", "--seed", "4"]
    model, tok, drafter = d.load(str(pair / "t"), str(pair / "d"))
    chat = [{"role": "user", "content": "abcab dcba"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True)
    special = xtc_special_tokens(tok)

    def mlx_lm_plain(xtc):
        mx.random.seed(4)
        sampler = make_sampler(1.0, min_p=0.05, min_tokens_to_keep=2, xtc_probability=xtc,
                               xtc_threshold=0.05, xtc_special_tokens=special)
        return "".join(r.text for r in mlx_lm.stream_generate(model, tok, ids, max_tokens=24, sampler=sampler))

    plain = run("generate", "--model", str(pair / "t"), "--draft", str(pair / "d"), "--verify-mode", "off", *opts)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == mlx_lm_plain(0.9) + "\n" and mlx_lm_plain(0.9) != mlx_lm_plain(0.0)
    # A seed gives the same text under a fixed block size (auto's sizes follow the clock).
    ours = run("generate", "--model", str(pair / "t"), "--draft", str(pair / "d"), "--block-size", "4", *opts)
    kw = dict(max_tokens=24, temp=1.0, min_p=0.05, min_tokens_to_keep=2, xtc_threshold=0.05,
              xtc_special_tokens=special, seed=4, block_size=4)
    want = d.generate(model, tok, chat, drafter, xtc_probability=0.9, **kw)
    assert want != d.generate(model, tok, chat, drafter, xtc_probability=0.0, **kw)
    assert ours.stdout == want + "\n"
    bad = run("generate", "--model", str(pair / "t"), "--draft", str(pair / "d"), *opts, "--xtc-threshold", "0.7")
    assert bad.returncode == 2 and "xtc_threshold is in [0, 0.5]; got 0.7" in bad.stderr


def test_prompt_cache_file_as_mlx_lm_generate_reads_it(pair, tmp_path):
    """A prefix cached by mlx_lm.cache_prompt, then a question after it: mlx_lm.generate's
    text, with DFlash (its drafter starts without the prefix) and without; the model comes
    from the file unless given; a file of another model, or not a cache, is one line."""
    cache = tmp_path / "ctx.safetensors"
    made = subprocess.run([sys.executable, "-m", "mlx_lm", "cache_prompt", "--model", str(pair / "t"),
                           "--prompt", "abcab dcba abcd dcba ab cd", "--prompt-cache-file", str(cache)],
                          capture_output=True, text=True, timeout=240)
    assert made.returncode == 0, made.stderr
    for opts in ([], ["--prefill-response", "ab"]):
        args = ["--prompt-cache-file", str(cache), "--prompt", "bca dd", "--max-tokens", "24", *opts]
        want = mlx_lm_text(*args) if opts != ["--prefill-response", "ab"] else None
        for mode in ("dflash", "off"):
            ours = run("generate", "--draft", str(pair / "d"), "--verify-mode", mode, *args)
            assert ours.returncode == 0, ours.stderr
            if want is not None:  # mlx_lm.generate puts its <query> in the prefill turn instead
                assert ours.stdout == want + "\n", (opts, mode)
            else:
                assert ours.stdout == run("generate", "--draft", str(pair / "d"), "--verify-mode", "off",
                                          *args).stdout
    same = run("generate", "--model", str(pair / "t"), "--draft", str(pair / "d"), "--prompt-cache-file",
               str(cache), "--prompt", "bca dd", "--max-tokens", "24")
    assert same.stdout == mlx_lm_text("--prompt-cache-file", str(cache), "--prompt", "bca dd", "--max-tokens", "24") + "\n"
    other = tmp_path / "other"
    shutil.copytree(pair / "t", other)
    bad = run("generate", "--model", str(other), "--prompt-cache-file", str(cache), "--prompt", "a")
    assert bad.returncode == 2 and "than that used to create the prompt cache" in bad.stderr
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a cache")
    bad = run("generate", "--prompt-cache-file", str(junk), "--prompt", "a")
    assert bad.returncode == 2 and "is not a prompt cache saved by mlx_lm.cache_prompt" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    bad = run("generate", "--prompt-cache-file", str(tmp_path / "none.safetensors"), "--prompt", "a")
    assert bad.returncode == 2 and "none.safetensors: no such file" in bad.stderr


def test_max_kv_size_as_mlx_lm_generate_has_it_when_decoding_plain(pair):
    args = ["--model", str(pair / "t"), "--prompt", "abcab dcba", "--max-tokens", "40", "--max-kv-size", "24"]
    plain = run("generate", "--draft", str(pair / "d"), "--verify-mode", "off", *args)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == mlx_lm_text(*args) + "\n"
    assert plain.stdout != mlx_lm_text(*args[:-2]) + "\n"  # the window changes this text
    bad = run("generate", "--draft", str(pair / "d"), *args)
    assert bad.returncode == 2 and "--max-kv-size goes with --verify-mode off" in bad.stderr


def make_adapter(target, path, seed=7):
    """LoRA adapters for ``target`` as mlx_lm.lora writes them, with random (non-zero) B
    matrices so that they change the model's text."""
    model, _ = mlx_lm.load(str(target))
    config = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": {"rank": 4, "scale": 20.0, "dropout": 0.0}}
    model.freeze()  # as mlx_lm.lora does: only the LoRA matrices train, and are saved
    linear_to_lora_layers(model, config["num_layers"], config["lora_parameters"])
    mx.random.seed(seed)
    weights = {k: (mx.random.normal(v.shape) * 0.05 if k.endswith("lora_b") else v)
               for k, v in tree_flatten(model.trainable_parameters())}
    path.mkdir(parents=True)
    mx.save_safetensors(str(path / "adapters.safetensors"), weights)
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def test_num_draft_tokens_is_the_block_size_less_one(pair):
    args = ["generate", "--model", str(pair / "t"), "--draft", str(pair / "d"), "--prompt", "abcab dcba",
            "--max-tokens", "20"]
    three = run(*args, "--num-draft-tokens", "3")
    assert three.returncode == 0 and "blocks 4x" in three.stderr, three.stderr
    assert three.stdout == run(*args, "--block-size", "4").stdout
    both = run(*args, "--num-draft-tokens", "3", "--block-size", "4")
    assert both.returncode == 2 and errors(both.stderr) == ["error: give --block-size or --num-draft-tokens, not both"]


def test_kv_bits_as_mlx_lm_generate_has_them(tmp_path):
    make_target(tmp_path / "t", "qwen3", alphabet="abcd", seed=11, head_dim=32)  # groups of 32
    make_drafter(tmp_path / "d", tmp_path / "t", version=2)
    args = ["--model", str(tmp_path / "t"), "--prompt", "abcab dcba", "--max-tokens", "24",
            "--kv-bits", "2", "--kv-group-size", "32", "--quantized-kv-start", "0"]
    ours = run("generate", "--draft", str(tmp_path / "d"), "--block-size", "4", *args)
    assert ours.returncode == 0, ours.stderr
    want = mlx_lm_text(*args)
    assert ours.stdout == want + "\n" and want != mlx_lm_text(*args[:6])  # quantized: another text
    bad = run("generate", "--draft", str(tmp_path / "d"), *args[:6], "--kv-bits", "7", "--kv-group-size", "32",
              "--quantized-kv-start", "0")
    assert bad.returncode == 2 and len(errors(bad.stderr)) == 1 and "bits" in bad.stderr, bad.stderr


def test_adapter_path_as_mlx_lm_generate_has_it(pair, tmp_path):
    adapter = make_adapter(pair / "t", tmp_path / "adapter")
    args = ["--model", str(pair / "t"), "--prompt", "abcab dcba", "--max-tokens", "24"]
    ours = run("generate", "--draft", str(pair / "d"), "--block-size", "4", "--adapter-path", str(adapter), *args)
    assert ours.returncode == 0, ours.stderr
    want = mlx_lm_text(*args, "--adapter-path", str(adapter))
    assert ours.stdout == want + "\n" and want != mlx_lm_text(*args)  # the adapter changed the text
    missing = run("generate", "--draft", str(pair / "d"), "--adapter-path", str(tmp_path), *args)
    assert missing.returncode == 2 and errors(missing.stderr) == [
        f"error: no adapter_config.json in {tmp_path} (adapters: a directory written by mlx_lm.lora)"]


@pytest.mark.parametrize("args,message", [
    (["--chat-template-config", "[1]"], "--chat-template-config: must be a JSON object"),
    (["--chat-template-config", "{'a': 1}"], "--chat-template-config: invalid JSON (Expecting property"),
    (["--system-prompt", "x", "--ignore-chat-template"],
     "--system-prompt, --prefill-response and --chat-template-config need the chat template (--ignore-chat-template)"),
    (["--extra-eos-token", "zz"], "'zz' is not a token for this tokenizer"),
])
def test_chat_option_problems_are_one_line(pair, args, message):
    r = run("generate", "--model", str(pair / "t"), "--draft", str(pair / "d"), "--prompt", "ab", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert errors(r.stderr) == [f"error: {message}"] or message in errors(r.stderr)[0], r.stderr


def errors(stderr):
    """stderr without the notes: OpenBLAS (printed when a CI machine lacks it) and the
    first-use steps (a conversion, the cost calibration)."""
    return [line for line in stderr.splitlines()
            if line and not line.startswith(("note: OpenBLAS", "dflash2-mlx: first use: "))]


@pytest.mark.parametrize("content,problem", [
    (None, "no such file"),
    ("dir", "is a directory"),
    ("[{\"role\": \"user\",", "invalid JSON (Expecting"),
    ("{\"role\": \"user\", \"content\": \"hi\"}", "must hold a JSON list of {role, content} objects"),
])
def test_messages_file_problems_are_one_line(pair, tmp_path, content, problem):
    path = tmp_path / "chat.json"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    r = run("generate", "--model", str(pair / "t"), "--draft", str(pair / "d"), "--messages-file", str(path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (line,) = errors(r.stderr)
    assert line.startswith(f"error: --messages-file {path}: ") and problem in line


def test_drafter_for_another_model_names_the_cause(pair, tmp_path):
    make_target(tmp_path / "other", "qwen3", hidden=128, alphabet="abcdefgh")
    make_drafter(tmp_path / "od", tmp_path / "other", version=2)
    (tmp_path / "od" / "model.safetensors").write_bytes(b"not read: the config is checked first")
    r = run("generate", "--model", str(pair / "t"), "--draft", str(tmp_path / "od"), "--prompt", "ab")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    vocab = lambda p: json.loads((p / "config.json").read_text())["vocab_size"]
    assert errors(r.stderr) == [
        f"error: drafter does not match the target: vocab size: drafter {vocab(tmp_path / 'other')}, "
        f"target {vocab(pair / 't')}; hidden size: drafter 128, target 64"]


def test_max_tokens_minus_one_is_no_limit_and_zero_is_refused():
    # As in mlx_lm.generate: -1 generates until the end of sequence. The built-in pair ends
    # this reply with its end-of-sequence token well before 200 tokens.
    prompt = ["generate", "--prompt", "Say hi."]
    unlimited, bounded = run(*prompt, "--max-tokens", "-1"), run(*prompt, "--max-tokens", "200")
    assert unlimited.returncode == 0, unlimited.stderr
    assert unlimited.stdout.strip() and unlimited.stdout == bounded.stdout
    for bad in ("0", "-2"):
        r = run(*prompt, "--max-tokens", bad)
        assert r.returncode == 2 and errors(r.stderr) == [
            f"error: max_tokens is a whole number of tokens, 1 or more (-1: no limit); got {bad}"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the OpenBLAS note is for Linux")
def test_openblas_note_without_preload_and_doctor_reports_it(pair):
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    r = subprocess.run(["dflash2-mlx", "generate", "--model", str(pair / "t"), "--prompt", "ab",
                        "--max-tokens", "2"], capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr
    (note,) = [line for line in r.stderr.splitlines() if "OpenBLAS" in line]
    assert note.startswith("note: OpenBLAS is not preloaded") and f"export LD_PRELOAD={openblas_path()}" in note
    doctor = subprocess.run(["dflash2-mlx", "doctor"], capture_output=True, text=True, timeout=240, env=env)
    assert "BLAS: MLX's bundled reference BLAS" in doctor.stdout and "export LD_PRELOAD=" in doctor.stdout
    if os.path.exists(openblas_path()):
        env["LD_PRELOAD"] = openblas_path()
        r = subprocess.run(["dflash2-mlx", "generate", "--model", str(pair / "t"), "--prompt", "ab",
                            "--max-tokens", "2"], capture_output=True, text=True, timeout=240, env=env)
        assert r.returncode == 0 and "OpenBLAS" not in r.stderr
        doctor = subprocess.run(["dflash2-mlx", "doctor"], capture_output=True, text=True, timeout=240, env=env)
        assert "libopenblas" in doctor.stdout and "(loaded)" in doctor.stdout
