"""model_settings.json: oMLX schema, validation, atomic and concurrent writes, pair check."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash2_mlx.backend import settings as settings_module
from dflash2_mlx.backend.compat import is_compatible
from dflash2_mlx.backend.settings import ModelSettings, SettingsError, SettingsStore
from dflash2_mlx.cli.main import app
from tiny_models import make_drafter, make_target

SETTINGS_FILE = Path(settings_module.__file__)
# Writer processes load settings.py and the modes' table it reads (stdlib only), not the
# packages' __init__ (MLX), so they start in milliseconds.
PRELUDE = f"""
import importlib, os, sys, types
root = {str(SETTINGS_FILE.parents[1])!r}
for name, path in (("dflash2_mlx", root), ("dflash2_mlx.request", root + "/request"),
                   ("dflash2_mlx.backend", root + "/backend")):
    sys.modules[name] = types.ModuleType(name)
    sys.modules[name].__path__ = [path]
settings = importlib.import_module("dflash2_mlx.backend.settings")
SettingsStore = settings.SettingsStore
"""


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = make_target(root / "target")
    return target, make_drafter(root / "drafter", target)


def oMLX_file(path: Path) -> dict:
    """A file as oMLX writes it: manager-only keys, nulls, a second model, extra top-level keys."""
    data = {
        "version": 1,
        "models": {
            "Qwen3-4B": {"is_pinned": True, "temperature": 0.7, "display_name": "Qwen",
                         "chat_template_kwargs": {"enable_thinking": False}, "ttl_seconds": None},
            "other": {"dflash_enabled": False, "turboquant_kv_bits": 4},
        },
        "profiles_version": 1,
    }
    path.write_text(json.dumps(data))
    return data


def test_roundtrip_keeps_unknown_keys_and_drops_none(tmp_path):
    path = tmp_path / "model_settings.json"
    before = oMLX_file(path)
    store = SettingsStore(path)
    s = store.update("Qwen3-4B", {"dflash_enabled": True, "dflash_draft_model": "z-lab/Qwen3-4B-DFlash-b16",
                                  "dflash_draft_quant_enabled": True, "dflash_draft_quant_weight_bits": 4,
                                  "dflash_max_ctx": 4096, "temperature": None})
    assert s.dflash_enabled and s.draft == "z-lab/Qwen3-4B-DFlash-b16" and s.temperature is None
    assert s.is_pinned and s.extra == {"display_name": "Qwen"}
    assert s.chat_template_kwargs == {"enable_thinking": False}
    on_disk = json.loads(path.read_text())
    assert on_disk["version"] == 1 and on_disk["profiles_version"] == 1
    assert on_disk["models"]["other"] == before["models"]["other"]
    entry = on_disk["models"]["Qwen3-4B"]
    assert "temperature" not in entry and "ttl_seconds" not in entry  # None removes / is dropped
    assert entry["display_name"] == "Qwen" and entry["chat_template_kwargs"] == {"enable_thinking": False}
    assert entry["dflash_draft_quant_weight_bits"] == 4 and entry["is_pinned"] is True
    # Read back: typed known fields, unknown keys in extra, nothing lost.
    again = store.get("Qwen3-4B")
    assert again.dflash_max_ctx == 4096 and again.is_pinned and again.extra["display_name"] == "Qwen"
    assert again.load_kwargs() == {"draft_bits": 4, "draft_group_size": 64}
    assert store.get("never-configured") == ModelSettings()


@pytest.mark.parametrize("field,value", [
    ("dflash_enabled", "yes"),
    ("dflash_draft_model", ""),
    ("dflash_draft_quant_weight_bits", 3),
    ("dflash_draft_quant_weight_bits", True),
    ("dflash_draft_quant_activation_bits", 8),
    ("dflash_draft_quant_group_size", 48),
    ("dflash_block_size", 0),
    ("dflash_verify_mode", "forest"),
    ("dflash_max_ctx", -1),
    ("dflash_max_ctx", 1.5),
    ("max_context_window", 0),
    ("temperature", -0.1),
    ("top_p", 0.0),
    ("chat_template_kwargs", ["enable_thinking"]),
    ("forced_ct_kwargs", "enable_thinking"),
    ("forced_ct_kwargs", [1]),
    ("enable_thinking", "no"),
    ("dflash_draft_sink_size", -1),
    ("repetition_penalty", 0),
    ("presence_penalty", 3),
    ("dflash_in_memory_cache_max_entries", 0),
])
def test_invalid_values_are_rejected_naming_the_field(tmp_path, field, value):
    path = tmp_path / "model_settings.json"
    before = json.dumps(oMLX_file(path))
    with pytest.raises(SettingsError, match=field):
        SettingsStore(path).update("Qwen3-4B", {field: value})
    assert path.read_text() == before  # nothing written


def test_template_variables_merge_as_omlx_merges_them():
    """Server defaults, then the model's chat_template_kwargs, its thinking toggles, then the
    request's own variables, except the keys the model forces."""
    s = ModelSettings.from_dict({"chat_template_kwargs": {"enable_thinking": True, "a": 1, "b": 1},
                                 "enable_thinking": False, "forced_ct_kwargs": ["b"]})
    assert s.template_variables() == {"enable_thinking": False, "a": 1, "b": 1}
    assert s.template_variables({"a": 2, "b": 2, "enable_thinking": True}, defaults={"a": 0, "c": 0}) == {
        "a": 2, "b": 1, "c": 0, "enable_thinking": True}
    assert ModelSettings().template_variables({"x": 1}, defaults={"x": 0, "y": 0}) == {"x": 1, "y": 0}
    assert ModelSettings(preserve_thinking=True).to_dict() == {"preserve_thinking": True}


def test_omlx_window_and_cache_names():
    """oMLX's dflash_draft_window_size / _sink_size and dflash_in_memory_cache(_max_bytes)
    mean what ours do; ours win where both are set."""
    s = ModelSettings.from_dict({"dflash_draft_window_size": 1024, "dflash_draft_sink_size": 64})
    assert (s.draft_window, s.draft_sink) == (1024, 64)
    assert ModelSettings(dflash_draft_window=256, dflash_draft_window_size=1024).draft_window == 256
    assert ModelSettings(dflash_draft_window_size=0).draft_window is None and ModelSettings().draft_sink == 0
    assert ModelSettings().prefix_cache_bytes(1.0) == 10**9
    assert ModelSettings(dflash_in_memory_cache=False).prefix_cache_bytes(1.0) == 0
    assert ModelSettings(dflash_in_memory_cache_max_bytes=5000).prefix_cache_bytes(1.0) == 5000
    assert ModelSettings(prefix_cache_gb=2.0, dflash_in_memory_cache=False).prefix_cache_bytes(1.0) == 2 * 10**9


def test_tree_verify_modes_and_their_budget(tmp_path):
    store = SettingsStore(tmp_path / "s.json")
    store.set("m", dflash_verify_mode="ddtree", dflash_tree_budget=16)  # oMLX's name is accepted
    store.set("n", dflash_verify_mode="tree", dflash_tree_budget="auto")
    for bad in (0, 65, "many", True):
        with pytest.raises(SettingsError, match="dflash_tree_budget must be 'auto' or an integer in 1..64"):
            store.set("m", dflash_tree_budget=bad)
    with pytest.raises(SettingsError, match="dflash_verify_mode must be"):
        store.set("m", dflash_verify_mode="forest")


def test_invalid_value_in_the_file_is_reported_on_read(tmp_path):
    path = tmp_path / "model_settings.json"
    path.write_text(json.dumps({"version": 1, "models": {"m": {"dflash_draft_quant_group_size": 7}}}))
    with pytest.raises(SettingsError, match="m: dflash_draft_quant_group_size"):
        SettingsStore(path).get("m")
    path.write_text("{not json")
    with pytest.raises(SettingsError, match="not valid JSON"):
        SettingsStore(path).read()


def test_max_ctx_falls_back_to_plain_decoding():
    s = ModelSettings(dflash_enabled=True, dflash_draft_model="d", dflash_max_ctx=100)
    assert s.verify_mode(100) == "dflash" and s.verify_mode(101) == "off"
    assert ModelSettings(dflash_enabled=True, dflash_draft_model="d", dflash_max_ctx=0).verify_mode(10**6) == "dflash"
    assert ModelSettings(dflash_enabled=False, dflash_draft_model="d").verify_mode(1) == "off"
    assert ModelSettings(dflash_enabled=True, dflash_draft_model="d", dflash_verify_mode="off").verify_mode(1) == "off"


WRITER = PRELUDE + """
store, who, n = SettingsStore(sys.argv[1]), sys.argv[2], int(sys.argv[3])
for i in range(n):
    store.update("shared", {f"{who}_{i}": i})
    store.update(f"model_{who}", {"count": i})
"""


def test_concurrent_writers_lose_no_update(tmp_path):
    path = tmp_path / "model_settings.json"
    writers, n = 4, 25
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), f"w{w}", str(n)])
             for w in range(writers)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    data = json.loads(path.read_text())
    shared = data["models"]["shared"]
    assert len(shared) == writers * n
    assert all(shared[f"w{w}_{i}"] == i for w in range(writers) for i in range(n))
    assert all(data["models"][f"model_w{w}"]["count"] == n - 1 for w in range(writers))


CRASH_BETWEEN_WRITE_AND_REPLACE = PRELUDE + """
real_fsync = os.fsync
def crash(fd):  # the new content is fully written to the temp file: die before the rename
    real_fsync(fd)
    os._exit(9)
settings.os.fsync = crash
SettingsStore(sys.argv[1]).set("m", dflash_enabled=False, note="new")
"""


def test_crash_between_write_and_replace_leaves_the_old_file(tmp_path):
    path = tmp_path / "model_settings.json"
    store = SettingsStore(path)
    store.set("m", dflash_enabled=True, note="old")
    before = path.read_text()
    proc = subprocess.run([sys.executable, "-c", CRASH_BETWEEN_WRITE_AND_REPLACE, str(path)])
    assert proc.returncode == 9  # it really died mid-write
    assert path.read_text() == before
    assert store.get("m").dflash_enabled is True
    store.set("m", note="after")  # the lock of the dead writer does not block anyone
    assert store.raw("m") == {"dflash_enabled": True, "note": "after"}


def test_failed_write_keeps_the_file_and_cleans_up(tmp_path, monkeypatch):
    path = tmp_path / "model_settings.json"
    store = SettingsStore(path)
    store.set("m", dflash_block_size=4)
    before = path.read_text()

    def disk_full(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(settings_module.os, "replace", disk_full)
    with pytest.raises(OSError):
        store.set("m", dflash_block_size=6)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


HAMMER = PRELUDE + """
store = SettingsStore(sys.argv[1])
print("ready", flush=True)
i = 0
while True:
    i += 1
    store.update(f"model_{i % 50}", {"blob": "x" * 20000, "i": i})
"""


def test_killed_writer_never_leaves_a_torn_file(tmp_path):
    path = tmp_path / "model_settings.json"
    SettingsStore(path).set("keep", dflash_enabled=True)
    for delay in (0.05, 0.13, 0.21, 0.37):
        proc = subprocess.Popen([sys.executable, "-c", HAMMER, str(path)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        data = json.loads(path.read_text())  # always whole JSON
        assert data["version"] == 1 and data["models"]["keep"] == {"dflash_enabled": True}
    assert len(data["models"]) > 1  # the writers did write


def test_is_compatible_from_configs(pair, tmp_path):
    target, drafter = pair
    ok, reason = is_compatible(target, drafter)
    assert ok, reason
    # A drafter made for a wider target does not fit.
    wide = make_target(tmp_path / "wide", hidden=32)
    ok, reason = is_compatible(wide, drafter)
    assert not ok and "hidden size" in reason
    # Multimodal configs nest the sizes under text_config.
    mm = tmp_path / "mm"
    mm.mkdir()
    cfg = json.loads((target / "config.json").read_text())
    nested = {k: cfg.pop(k) for k in ("vocab_size", "hidden_size", "num_hidden_layers")}
    (mm / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3_vl", "text_config": nested}))
    assert is_compatible(mm, drafter)[0]
    # The target is not a drafter, and a missing directory is reported.
    ok, reason = is_compatible(target, target)
    assert not ok and "not a DFlash drafter" in reason
    ok, reason = is_compatible(tmp_path / "missing", drafter)
    assert not ok and "target config" in reason
    # Through the settings of a model.
    s = ModelSettings(dflash_enabled=True, dflash_draft_model=str(drafter))
    assert s.is_compatible(target)[0]
    assert not ModelSettings(dflash_draft_model=str(drafter)).is_compatible(target)[0]


def test_models_cli_sets_shows_lists_and_checks(tmp_path, pair):
    target, drafter = pair
    path = tmp_path / "model_settings.json"
    oMLX_file(path)
    run = CliRunner().invoke
    r = run(app, ["models", "set", "Qwen3-4B", "dflash_enabled=true", f"dflash_draft_model={drafter}",
                  "dflash_block_size=4", "temperature=", "--settings", str(path)])
    assert r.exit_code == 0, r.output
    entry = json.loads(path.read_text())["models"]["Qwen3-4B"]
    assert entry["dflash_enabled"] is True and entry["dflash_block_size"] == 4 and "temperature" not in entry
    assert entry["display_name"] == "Qwen"
    r = run(app, ["models", "set", "Qwen3-4B", "dflash_draft_quant_weight_bits=5", "--settings", str(path)])
    assert r.exit_code == 2 and "dflash_draft_quant_weight_bits" in r.output
    r = run(app, ["models", "show", "Qwen3-4B", "--settings", str(path)])
    assert json.loads(r.output)["dflash_draft_model"] == str(drafter)
    r = run(app, ["models", "list", "--settings", str(path)])
    assert r.exit_code == 0 and f"Qwen3-4B\tdflash\t{drafter.name}\t" in r.output and "other\tplain" in r.output
    r = run(app, ["models", "check", "Qwen3-4B", str(target), "--settings", str(path)])
    assert r.exit_code == 0 and r.output.startswith("compatible")
    r = run(app, ["models", "unset", "Qwen3-4B", "dflash_enabled", "--settings", str(path)])
    assert r.exit_code == 0 and "dflash_enabled" not in json.loads(path.read_text())["models"]["Qwen3-4B"]


def test_models_cli_refuses_values_the_drafter_cannot_take(tmp_path, pair):
    target, drafter = pair  # the tiny drafter is trained on blocks of 8
    path = tmp_path / "model_settings.json"
    run = CliRunner().invoke
    base = ["models", "set", "m", "dflash_enabled=true", f"dflash_draft_model={drafter}"]
    r = run(app, base + ["dflash_block_size=99", "--settings", str(path)])
    assert r.exit_code == 2 and "dflash_block_size" in r.output and "1..8" in r.output
    assert not path.exists()  # nothing written
    r = run(app, base + ["dflash_block_size=4", "--settings", str(path)])
    assert r.exit_code == 0, r.output
    r = run(app, ["models", "set", "m", f"dflash_draft_model={tmp_path / 'nowhere'}", "--settings", str(path)])
    assert r.exit_code == 2 and "dflash_draft_model" in r.output
    r = run(app, ["models", "set", "m", "model_alias=tiny", "is_default=true", "--settings", str(path)])
    assert r.exit_code == 0, r.output
    r = run(app, ["models", "list", "--settings", str(path)])
    assert f"m\tdflash\t{drafter.name}\tblock 4\talias tiny\tdefault\n" in r.output
    # The built-in model is listed as `serve` runs it: with its shipped drafter, block size auto.
    assert "SmolLM2-135M-Instruct\tdflash\t" in r.output and "smollm2-135m-dflash2\tblock auto" in r.output
    r = run(app, ["models", "show", "m", "--settings", str(path)])
    assert json.loads(r.output)["engine"] == {"dflash": True, "drafter": drafter.name,
                                              "verify_mode": "dflash", "block_size": 4}
    r = run(app, ["models", "show", "Nope", "--settings", str(path)])
    assert r.exit_code != 0 and "Nope" in r.output and "{}" not in r.output


def test_engine_description():
    assert ModelSettings().engine() == {"dflash": False, "drafter": None, "verify_mode": "off", "block_size": None}
    on = ModelSettings(dflash_enabled=True, dflash_draft_model="d", dflash_block_size=4)
    assert on.engine()["block_size"] == 4
    assert ModelSettings(dflash_enabled=True, dflash_draft_model="d", dflash_block_size=4,
                         dflash_verify_mode="adaptive").engine()["block_size"] == "auto"
    assert ModelSettings(dflash_enabled=True, dflash_draft_model="d", dflash_max_ctx=10).engine(11)["dflash"] is False


def test_the_settings_file_follows_the_home(tmp_path, monkeypatch):
    """$DFLASH2_MLX_SETTINGS, else the file in $DFLASH2_MLX_HOME when that is set (a home of
    its own holds everything), else ~/.dflash2-mlx/model_settings.json."""
    monkeypatch.setenv("DFLASH2_MLX_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DFLASH2_MLX_SETTINGS", raising=False)
    assert settings_module.default_path() == tmp_path / "home" / "model_settings.json"
    monkeypatch.setenv("DFLASH2_MLX_SETTINGS", str(tmp_path / "mine.json"))
    assert settings_module.default_path() == tmp_path / "mine.json"
    monkeypatch.delenv("DFLASH2_MLX_SETTINGS")
    monkeypatch.delenv("DFLASH2_MLX_HOME")
    assert settings_module.default_path() == Path("~/.dflash2-mlx/model_settings.json").expanduser()
