"""``dflash2-mlx eval``: recall by position, oracle tau and real-run tau of drafters."""

from pathlib import Path
from typing import List, Optional

import typer

# The command imports MLX and the package's modules when it runs, so that
# `dflash2-mlx --help` stays fast.


def register(app: typer.Typer):
    app.command("eval")(eval_command)


def eval_command(
    draft: List[str] = typer.Option(..., "--draft", "-d", help="Drafter directory or hub id; repeat to compare, NAME=PATH to label it."),
    bench: List[Path] = typer.Option(..., "--bench", "-b", help="Prompt jsonl (text or chat records); repeat. E.g. the five sets shipped in dflash2_mlx/builtin/bench_data/."),
    out: Path = typer.Option(..., "--out", "-o", help="Report directory: report.json, report.md, recall.png, acceptance.png."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target: mlx-lm model directory or hub id. Default: the built-in SmolLM2-135M-Instruct."),
    limit: Optional[int] = typer.Option(8, "--limit", help="Prompts per benchmark."),
    max_tokens: int = typer.Option(128, "--max-tokens", help="Tokens per response (target reference and real runs)."),
    temps: List[float] = typer.Option([0.0, 1.0], "--temp", help="Temperatures of the real runs; repeat."),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="Block size (default: each drafter's trained size)."),
    top_k: int = typer.Option(16, "--top-k", help="k of Recall@k and of the oracle tau."),
    max_anchors: Optional[int] = typer.Option(None, "--max-anchors", help="Offline anchors per response (default: all)."),
    seed: int = typer.Option(0, "--seed"),
):
    """Evaluate drafters on prompt sets: Recall@1/@k by position, oracle tau, tau at T=0/T=1."""
    import mlx_lm

    from ..builtin.smollm2 import default_target_path
    from ..eval.evaluate import evaluate, markdown, write_report
    from ..eval.prompts import load_benches
    from ..model.checkpoint import load_drafter, resolve

    if model is None:
        model = str(default_target_path())
    target, tokenizer = mlx_lm.load(str(resolve(model)))
    drafters = {}
    for spec in draft:
        name, _, path = spec.rpartition("=") if "=" in spec else (Path(spec).name, "", spec)
        try:
            drafters[name] = load_drafter(path, target=target)
        except ValueError as e:
            typer.echo(f"error: {name}: {e}", err=True)
            raise typer.Exit(2)
    report = evaluate(target, tokenizer, drafters, load_benches(bench, limit), max_tokens=max_tokens,
                      temps=temps, block_size=block_size, top_k=top_k, max_anchors=max_anchors,
                      seed=seed, log=lambda s: typer.echo(s, err=True))
    paths = write_report(report, out)
    typer.echo(markdown(report))
    typer.echo("wrote " + ", ".join(str(p) for p in paths), err=True)
