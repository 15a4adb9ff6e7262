"""The `dflash2-mlx generate` command, run as a real process."""

import json
import subprocess

import pytest

import dflash2_mlx as d
from tiny_models import make_drafter, make_target


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    make_target(root / "t", "qwen3", alphabet="abcd", seed=3)
    make_drafter(root / "d", root / "t", version=2)
    return root


def run(*args):
    return subprocess.run(["dflash2-mlx", *args], capture_output=True, text=True, timeout=300)


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
            "--min-p", "0.01", "--seed", "3", "--draft-bits", "8", "--draft-group-size", "32"]
    a, b = run(*args), run(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout  # same seed, same text


@pytest.mark.parametrize("args,message", [
    (["--block-size", "9"], "block size 9 is impossible"),
    (["--draft-bits", "3"], "bits must be 2, 4 or 8"),
    (["--verify-mode", "tree"], "verify mode 'tree' is not supported"),
])
def test_generate_bad_options(pair, args, message):
    r = run("generate", "--model", str(pair / "t"), "--draft", str(pair / "d"), "--prompt", "ab",
            *args)
    assert r.returncode == 2 and message in r.stderr


def test_help_lists_every_option():
    r = run("generate", "--help")
    for opt in ["--model", "--draft", "--prompt", "--messages-file", "--max-tokens", "--temp",
                "--top-p", "--top-k", "--min-p", "--block-size", "--draft-bits", "--seed",
                "--verbose"]:
        assert opt in r.stdout
    top = run("--help").stdout
    for cmd in ["generate", "doctor", "train", "eval", "serve", "models"]:
        assert cmd in top
