"""One validation of generation arguments for every surface: each bad value below is refused
by Python's ``generate`` (an ``ArgumentError`` naming it) and by the CLI (exit 2, one line,
no traceback, before any model is loaded) with the same message, and by the server (a 400
naming the parameter; a value its API's schema refuses first gets that schema's message)."""

import json

import httpx
import pytest
from typer.testing import CliRunner

import dflash2_mlx as d
from dflash2_mlx.cli.main import app
from dflash2_mlx.request.arguments import MAX_SEED, ArgumentError
from dflash2_mlx.backend.settings import SettingsStore
from helpers import start_server, stop_server
from tiny_models import make_drafter, make_target

NAN, INF = float("nan"), float("inf")

# (Python argument, bad value, CLI arguments or None, server field and value or None, message)
CASES = [
    ("temp", NAN, ["--temp", "nan"], ("temperature", NAN), "temp is a finite number, 0 or more"),
    ("temp", INF, ["--temp", "inf"], ("temperature", INF), "temp is a finite number, 0 or more"),
    ("temp", -0.5, ["--temp", "-0.5"], ("temperature", -0.5), "temp is a finite number, 0 or more"),
    ("seed", -1, ["--seed", "-1"], ("seed", -1), f"seed is a whole number in 0..{MAX_SEED}"),
    ("seed", MAX_SEED + 1, ["--seed", str(MAX_SEED + 1)], ("seed", MAX_SEED + 1), f"seed is a whole number in 0..{MAX_SEED}"),
    ("top_p", 2.0, ["--top-p", "2"], ("top_p", 2.0), "top_p is in [0, 1] (0 and 1: off"),
    ("top_p", NAN, ["--top-p", "nan"], ("top_p", NAN), "top_p is in [0, 1] (0 and 1: off"),
    ("min_p", 1.5, ["--min-p", "1.5"], ("min_p", 1.5), "min_p is in [0, 1]"),
    ("top_k", -1, ["--top-k", "-1"], ("top_k", -1), "top_k is a whole number, 0 or more"),
    ("top_k", 2.5, None, ("top_k", 2.5), "top_k is a whole number, 0 or more"),
    ("xtc_probability", 1.5, ["--xtc-probability", "1.5"], ("xtc_probability", 1.5), "xtc_probability is in [0, 1]"),
    ("max_tokens", "10", None, ("max_tokens", "10"), "max_tokens is a whole number of tokens"),
    ("exact", "yes", None, None, "exact is true or false"),
    ("lookup", 1, None, None, "lookup is true or false"),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("arguments")
    make_target(root / "models" / "tiny", "qwen3", alphabet="abcd", seed=3)
    make_drafter(root / "d", root / "models" / "tiny", version=2)
    return root


@pytest.fixture(scope="module")
def loaded(pair):
    return d.load(str(pair / "models" / "tiny"), str(pair / "d"))


@pytest.fixture(scope="module")
def server(pair):
    settings = pair / "model_settings.json"
    SettingsStore(settings).set("tiny", dflash_enabled=True, dflash_draft_model=str(pair / "d"))
    proc, base = start_server(pair, ["--model-dir", pair / "models", "--settings", settings,
                                     "--log-level", "warning"])
    yield base
    stop_server(proc)


def case_id(case):
    return f"{case[0]}={case[1]!r}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_python_refuses_it(loaded, case):
    name, value, _, _, message = case
    model, tok, drafter = loaded
    for verify_mode in ("dflash", "off"):
        with pytest.raises(ArgumentError) as e:
            d.generate(model, tok, "abc", drafter, verify_mode=verify_mode, **{"max_tokens": 4, name: value})
        assert e.value.name == name and str(e.value).startswith(message), str(e.value)


@pytest.mark.parametrize("case", [c for c in CASES if c[2] is not None], ids=case_id)
def test_the_cli_refuses_it_in_one_line_before_loading(case, tmp_path):
    _, _, args, _, message = case
    missing = tmp_path / "no-such-model"  # the rule speaks first: nothing is loaded
    r = CliRunner().invoke(app, ["generate", "--model", str(missing), "--prompt", "abc", *args])
    assert r.exit_code == 2, (r.output, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
    assert "Traceback" not in r.output


@pytest.mark.parametrize("case", [c for c in CASES if c[3] is not None], ids=case_id)
def test_the_server_refuses_it_naming_the_parameter(server, case):
    _, _, _, (field, value), _ = case
    # NaN and Infinity as Python's json writes them: JSON has no such numbers, a client may send them.
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "abc"}], "max_tokens": 4,
                       field: value})
    r = httpx.post(server + "/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field or field in error["message"], error


def test_messages_without_content_are_refused_everywhere(loaded, server, tmp_path):
    model, tok, drafter = loaded
    with pytest.raises(ArgumentError, match=r"messages\[0\] \(user\) has no content"):
        d.generate(model, tok, [{"role": "user"}], drafter, max_tokens=4)
    with pytest.raises(ArgumentError, match=r"messages\[1\] has no role"):
        d.generate(model, tok, [{"role": "user", "content": "a"}, {"content": "b"}], drafter, max_tokens=4)
    file = tmp_path / "chat.json"
    file.write_text(json.dumps([{"role": "user"}]))
    r = CliRunner().invoke(app, ["generate", "--model", str(tmp_path / "none"), "--messages-file", str(file)])
    assert r.exit_code == 2 and "has no content" in r.stderr, r.output
    no_content = [{"role": "user"}]
    for path, body in (("/v1/chat/completions", {}), ("/v1/messages", {"max_tokens": 4}), ("/api/chat", {}),
                       ("/v1/responses", {})):  # every API's chat route
        key = "input" if path == "/v1/responses" else "messages"
        r = httpx.post(server + path, json={"model": "tiny", key: no_content, **body}, timeout=60)
        assert r.status_code == 400 and "content" in r.text, (path, r.status_code, r.text)


def test_zero_top_p_is_mlx_lms_off(loaded):
    """0 and 1 both leave top-p off, as in mlx-lm; the message says so."""
    model, tok, drafter = loaded
    kw = dict(max_tokens=8, temp=1.0, seed=3, block_size=4)
    assert d.generate(model, tok, "abc", drafter, top_p=0.0, **kw) == d.generate(model, tok, "abc", drafter, **kw)
