"""``dflash2-mlx doctor``: which path each kernel runs and how its self-check went."""

import typer


def register(app: typer.Typer):
    app.command("doctor")(doctor)


def doctor():
    """Report, per kernel, the active path (Metal or reference twin) and the self-check result."""
    from dflash2_mlx.doctor import run_doctor

    run_doctor(echo=typer.echo)
