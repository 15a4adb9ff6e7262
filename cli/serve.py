"""``dflash2-mlx serve``: the OpenAI-compatible server."""

import os
from pathlib import Path
from typing import List, Optional

import typer

# The commands import MLX and the package's modules when they run, so that
# `dflash2-mlx --help` stays fast.

BUILTIN_ID = "SmolLM2-135M-Instruct"
API_KEY_ENV = "DFLASH2_MLX_API_KEY"


def builtin_settings() -> dict:
    """The settings `serve` with no model gives the built-in model: its shipped drafter."""
    from ..builtin.defaults import drafter_path

    return {"dflash_enabled": True, "dflash_draft_model": str(drafter_path())}


def register(app: typer.Typer):
    app.command("serve")(serve)


def serve(
    model: List[str] = typer.Option(
        [], "--model", "-m", help="A model to serve: PATH or ID=PATH (repeatable). Its id defaults to the directory name. Default (no --model, no --model-dir): the built-in SmolLM2-135M-Instruct with its shipped DFlash 2 drafter."),
    draft: Optional[str] = typer.Option(
        None, "--draft", "-d", help="Drafter for the --model given (one --model only); overrides its settings."),
    model_dir: Optional[Path] = typer.Option(
        None, "--model-dir", help="Directory of model directories (oMLX layout): each one with a config.json is served under its name."),
    settings: Optional[Path] = typer.Option(
        None, "--settings", help="model_settings.json (default: $DFLASH2_MLX_SETTINGS, else model_settings.json in $DFLASH2_MLX_HOME when set, else ~/.dflash2-mlx/model_settings.json)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (loopback by default)."),
    port: int = typer.Option(8000, "--port", help="Port to listen on."),
    max_models: int = typer.Option(1, "--max-models", help="Most models loaded at once; the least recently used idle one is unloaded."),
    memory_budget: Optional[float] = typer.Option(None, "--memory-budget", help="Most GB of weights loaded at once."),
    queue_size: int = typer.Option(8, "--queue-size", help="Requests that may wait per model; one more gets 503."),
    max_batch: int = typer.Option(8, "--max-batch", help="Per model: requests that run at once; DFlash requests share one batched draft and verify pass, each lossless (1: one at a time). A model's max_batch setting overrides it."),
    max_tokens: int = typer.Option(512, "--max-tokens", help="Default max_tokens when a request and the settings give none."),
    preload: bool = typer.Option(False, "--preload/--lazy", help="Load the --model models at start instead of on the first request."),
    prefix_cache_gb: float = typer.Option(1.0, "--prefix-cache-gb", help="Per model: most GB of prompt caches kept for reuse by later requests that share a prefix (0: off). A model's prefix_cache_gb setting overrides it."),
    ssd_cache_dir: Optional[Path] = typer.Option(None, "--ssd-cache-dir", help="Where the prefix cache's disk tier keeps the entries memory lets go, for models whose settings turn on dflash_ssd_cache (default: ssd-cache in $DFLASH2_MLX_HOME, else ~/.cache/dflash2_mlx/ssd-cache; one directory per pair)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar=API_KEY_ENV, show_envvar=True, help="Require Authorization: Bearer KEY on every route but /health (also from $DFLASH2_MLX_API_KEY)."),
    chat_template_args: Optional[str] = typer.Option(
        None, "--chat-template-args", help="Chat-template variables for every chat request as a JSON object, e.g. '{\"enable_thinking\": false}' (a model's settings and a request's chat_template_kwargs override them)."),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level."),
    distributed: Optional[str] = typer.Option(
        None, "--distributed", help="Split the target over mx.distributed ranks (run under mlx.launch): tensor or pipeline. Rank 0 serves HTTP, the others follow it; ONE request at a time in this mode (max_batch 1, one model loaded)."),
):
    """Serve models over HTTP for OpenAI clients (/v1/chat/completions, /v1/completions,
    /v1/responses, /v1/models), Anthropic clients (/v1/messages, /v1/messages/count_tokens) and
    Ollama clients (/api/chat, /api/generate, /api/tags, /api/show, ...); /health, /metrics,
    /tokenize and /detokenize besides."""
    from dflash2_mlx.backend.pool import EnginePool
    from dflash2_mlx.backend.server import serve as run
    from dflash2_mlx.backend.settings import SettingsError, SettingsStore

    from .generate import template_config

    models = {}
    for spec in model:
        model_id, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        models[model_id or Path(path).expanduser().name] = path
    if not models and model_dir is None:
        # Like `generate`: with no model given, serve the built-in pair.
        from ..builtin.defaults import default_pair

        target, default_draft = default_pair()
        models = {BUILTIN_ID: target}
        draft = draft or default_draft
    if draft is not None and len(models) != 1:
        raise typer.BadParameter("--draft needs exactly one --model")
    if prefix_cache_gb < 0:
        raise typer.BadParameter("--prefix-cache-gb must be >= 0")
    if max_batch < 1:
        raise typer.BadParameter("--max-batch must be >= 1")
    if api_key is None:  # click reads an empty variable as unset: the key would be off unnoticed
        api_key = os.environ.get(API_KEY_ENV)
    if api_key is not None and not api_key.strip():
        raise typer.BadParameter(f"the API key is empty: give one, or unset {API_KEY_ENV}", param_hint="--api-key")
    try:
        template_args = template_config(chat_template_args, "--chat-template-args")
    except ValueError as e:
        raise typer.BadParameter(str(e).removeprefix("--chat-template-args: "), param_hint="--chat-template-args")
    lockstep = None
    if distributed is not None:
        from dflash2_mlx.backend.follow import distributed_setup

        lockstep, max_batch, max_models = distributed_setup(distributed)
        from dflash2_mlx.backend.ssd_cache import default_ssd_cache_dir

        ssd_cache_dir = (ssd_cache_dir or default_ssd_cache_dir()) / f"rank{lockstep.rank}"
    overrides = {m: {"dflash_enabled": True, "dflash_draft_model": draft} for m in models} if draft else {}
    pool = EnginePool(SettingsStore(settings), model_dir=model_dir, models=models, overrides=overrides,
                      max_models=max(max_models, 1), memory_budget_gb=memory_budget,
                      max_queue=queue_size, default_max_tokens=max_tokens,
                      prefix_cache_gb=prefix_cache_gb, max_batch=max_batch,
                      chat_template_args=template_args, ssd_cache_dir=ssd_cache_dir)
    try:  # a settings problem is one line now, not a traceback from the first load
        pool.store.read()
        for model_id in models if preload else ():
            pool.settings_of(model_id).check_drafter(pool.path_of(model_id))
    except (SettingsError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    if lockstep is not None and lockstep.rank != 0:
        from dflash2_mlx.backend.engine import Engine
        from dflash2_mlx.backend.follow import follow

        def make_engine(model_id, path, model_settings):
            return Engine(path, model_settings, model_id=model_id, max_queue=queue_size,
                          default_max_tokens=max_tokens, prefix_cache_gb=prefix_cache_gb, max_batch=1,
                          chat_template_args=template_args, ssd_cache_dir=pool.ssd_cache_dir)

        raise typer.Exit(follow(lockstep, make_engine))
    typer.echo(f"dflash2-mlx: serving {', '.join(pool.model_ids()) or '(no models yet)'} "
               f"at http://{host}:{port}/v1 (settings: {pool.store.path})", err=True)
    run(pool, host=host, port=port, preload=list(models) if preload else (), log_level=log_level,
        api_key=api_key or None)
