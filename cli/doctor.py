"""``dflash2-mlx doctor``: the BLAS MLX uses on Linux, and which path each kernel runs and
how its self-check went."""

import typer


def register(app: typer.Typer):
    app.command("doctor")(doctor)


def doctor():
    """Report the BLAS in use (Linux CPU) and, per kernel, the active path and self-check result."""
    # Imported when the command runs, not when the CLI starts, so that `--help` stays fast.
    from ..machine.doctor import run_doctor

    run_doctor(echo=typer.echo)
