"""``dflash2-mlx models``: list, show and set model settings (model_settings.json)."""

import json
from pathlib import Path
from typing import List, Optional

import typer

from .serve import BUILTIN_ID, builtin_settings

# The commands import MLX and the package's modules when they run, so that
# `dflash2-mlx --help` stays fast.

models_app = typer.Typer(help="List, show and set per-model settings (oMLX's model_settings.json).",
                         no_args_is_help=True)

SETTINGS_OPTION = typer.Option(
    None, "--settings", help="model_settings.json (default: $DFLASH2_MLX_SETTINGS, else model_settings.json in $DFLASH2_MLX_HOME when set, else ~/.dflash2-mlx/model_settings.json).")


def register(app: typer.Typer):
    app.add_typer(models_app, name="models")


def _store(settings: Optional[Path]):
    from dflash2_mlx.backend.settings import SettingsStore

    return SettingsStore(settings)


def _fail(e: Exception):
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(2)


def _effective(model_id: str, raw: dict):
    """A model's settings as `serve` runs it (the built-in model comes with its drafter)."""
    from dflash2_mlx.backend.settings import ModelSettings

    return ModelSettings.from_dict({**raw, **(builtin_settings() if model_id == BUILTIN_ID else {})}, model_id)


def _engine_text(engine: dict) -> str:
    if not engine["dflash"]:
        return "plain\t-\t-"
    block = engine["block_size"]
    return f"dflash\t{engine['drafter']}\t" + ("block auto" if block == "auto" else f"block {block}")


def _naming_text(raw: dict) -> str:
    """How requests reach a model besides its id: the alias the API shows, and whether it
    answers requests that name no model."""
    alias = raw.get("model_alias")
    text = f"\talias {alias}" if isinstance(alias, str) and alias.strip() else ""
    return text + ("\tdefault" if raw.get("is_default") is True else "")


@models_app.command("list")
def list_models(
    model_dir: Optional[Path] = typer.Option(None, "--model-dir", help="Also list the model directories here."),
    settings: Optional[Path] = SETTINGS_OPTION,
):
    """Models with settings, those found in --model-dir and the built-in one, as `serve` runs
    them: id, dflash or plain, drafter, block size (a number, or auto: chosen every cycle), then
    the alias the API shows and "default" where set."""
    from dflash2_mlx.backend.settings import SettingsError

    store = _store(settings)
    try:
        entries = store.read()["models"]
    except SettingsError as e:
        _fail(e)
    ids = list(entries)
    if model_dir is not None and model_dir.is_dir():
        ids += sorted(p.name for p in model_dir.iterdir() if (p / "config.json").is_file() and p.name not in entries)
    ids += [BUILTIN_ID] if BUILTIN_ID not in ids else []
    for model_id in ids:
        raw = entries.get(model_id) or {}
        try:
            engine = _engine_text(_effective(model_id, raw).engine())
        except SettingsError as e:
            engine = f"invalid\t{e}"
        typer.echo(f"{model_id}\t{engine}" + _naming_text(raw))


@models_app.command("show")
def show(model_id: str = typer.Argument(..., help="Model id."), settings: Optional[Path] = SETTINGS_OPTION):
    """Print one model's settings as JSON, and under "engine" how `serve` decodes it."""
    from dflash2_mlx.backend.settings import SettingsError

    try:
        entries = _store(settings).read()["models"]
        if model_id not in entries and model_id != BUILTIN_ID:
            _fail(ValueError(f"no settings for model {model_id!r} (known: {', '.join(entries) or 'none'})"))
        raw = entries.get(model_id) or {}
        engine = _effective(model_id, raw).engine()
    except SettingsError as e:
        _fail(e)
    typer.echo(json.dumps({**raw, "engine": engine}, indent=2))


def _parse_value(text: str):
    if text in ("", "null", "none", "None"):
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


@models_app.command("set")
def set_(
    model_id: str = typer.Argument(..., help="Model id."),
    pairs: List[str] = typer.Argument(..., help="KEY=VALUE pairs (JSON values; KEY= or KEY=null removes the key)."),
    settings: Optional[Path] = SETTINGS_OPTION,
):
    """Set settings of a model, e.g. `models set Qwen3-4B dflash_enabled=true dflash_draft_model=z-lab/Qwen3-4B-DFlash-b16`."""
    from dflash2_mlx.backend.settings import SettingsError

    changes = {}
    for pair in pairs:
        if "=" not in pair:
            _fail(ValueError(f"expected KEY=VALUE, got {pair!r}"))
        key, _, value = pair.partition("=")
        changes[key.strip()] = _parse_value(value)
    store = _store(settings)
    try:
        # Checked against the drafter's config before anything is written.
        _effective(model_id, {**store.raw(model_id), **changes}).check_drafter()
        result = store.update(model_id, changes)
    except SettingsError as e:
        _fail(e)
    typer.echo(json.dumps(result.to_dict(), indent=2))


@models_app.command("unset")
def unset(
    model_id: str = typer.Argument(..., help="Model id."),
    keys: List[str] = typer.Argument(..., help="Keys to remove."),
    settings: Optional[Path] = SETTINGS_OPTION,
):
    """Remove settings of a model."""
    from dflash2_mlx.backend.settings import SettingsError

    try:
        _store(settings).update(model_id, {k: None for k in keys})
    except SettingsError as e:
        _fail(e)


@models_app.command("check")
def check(
    model_id: str = typer.Argument(..., help="Model id."),
    path: Path = typer.Argument(..., help="The target model's directory."),
    settings: Optional[Path] = SETTINGS_OPTION,
):
    """Does the drafter in this model's settings fit the target at PATH? (configs only)."""
    from dflash2_mlx.backend.settings import SettingsError

    try:
        ok, reason = _store(settings).get(model_id).is_compatible(path)
    except SettingsError as e:
        _fail(e)
    typer.echo(("compatible: " if ok else "not compatible: ") + reason)
    raise typer.Exit(0 if ok else 1)
