"""``dflash2-mlx doctor``: the BLAS MLX uses on Linux, and which path each kernel runs and
how its self-check went."""

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer):
    app.command("doctor")(doctor)


def doctor(
    exact: bool = typer.Option(False, "--exact", help="Also run the exactness probe on the target (verify passes against one-row decode steps), measure it anew and keep its verdict."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target for --exact. Default: the built-in SmolLM2-135M-Instruct."),
    export_costs: Optional[Path] = typer.Option(None, "--export-costs", help="Write this machine's pass costs of the pair (--model and --draft, default the built-in pair; measured now if not yet) to this file, for `generate --cost-file` here or on another machine."),
    draft: Optional[str] = typer.Option(None, "--draft", help="The drafter of --model for --export-costs."),
    costs: bool = typer.Option(False, "--costs", help="Print the verify-cost curves: this machine's measured ones (a pass over N rows against one row) beside the named curves of other machines (an H200, an M4-Pro-shaped one)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print every kernel variant's path and self-check."),
    recalibrate: bool = typer.Option(False, "--recalibrate", help="Forget this machine's measured pass costs and live timings (every pair): the next DFlash request measures them again, e.g. after a calibration taken while the machine was busy."),
):
    """A verdict first, then the BLAS in use (Linux CPU), the kernels (each variant's path and
    self-check with --verbose), and whether a verify pass is row-exact on this machine (the
    kept verdict, or --exact)."""
    # Imported when the command runs, not when the CLI starts, so that `--help` stays fast.
    from .doctor_report import run_doctor, exactness_report

    run_doctor(echo=typer.echo, verbose=verbose)
    if recalibrate:
        from ..calibration import recalibrate as forget
        from ..calibration.store import home

        typer.echo(f"recalibrate: {forget()} kept cost and timing record(s) removed from {home()}; "
                   "the next DFlash request measures again")
    exactness_report(model, measure=exact, echo=typer.echo, verbose=verbose)
    if export_costs is not None:
        import dflash2_mlx as d
        from ..calibration import export_costs as export
        from ..loop.target import attach

        if (model is None) != (draft is None):
            raise typer.BadParameter("--export-costs takes --model and --draft together (or neither: the built-in pair)")
        target, _, drafter = d.load(model, draft)
        export(attach(target, drafter), drafter, export_costs)
        typer.echo(f"costs of this pair on this machine written to {export_costs}")
    if costs:
        from .doctor_report import costs_report

        costs_report(echo=typer.echo)
