"""``dflash2-mlx doctor``: the BLAS MLX uses on Linux, and which path each kernel runs and
how its self-check went."""

from typing import Optional

import typer


def register(app: typer.Typer):
    app.command("doctor")(doctor)


def doctor(
    exact: bool = typer.Option(False, "--exact", help="Also run the exactness probe on the target (verify passes against one-row decode steps), measure it anew and keep its verdict."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target for --exact. Default: the built-in SmolLM2-135M-Instruct."),
):
    """Report the BLAS in use (Linux CPU), per kernel the active path and self-check result,
    and whether a verify pass is row-exact on this machine (the kept verdict, or --exact)."""
    # Imported when the command runs, not when the CLI starts, so that `--help` stays fast.
    from ..machine.doctor import run_doctor, exactness_report

    run_doctor(echo=typer.echo)
    exactness_report(model, measure=exact, echo=typer.echo)
