"""The ``dflash2-mlx`` command: a thin typer app over the Python API.

Each sub-command lives in its own module with a ``register(app)`` function; ``doctor_report.py``
is what ``doctor`` reports (and the OpenBLAS note below), imported only when a command runs."""

import importlib

import typer

app = typer.Typer(
    help="DFlash 2 speculative decoding for MLX: generate, serve, train, evaluate, benchmark.",
    no_args_is_help=True,
    add_completion=False,
)

# Commands that run models: on the Linux CPU they are several times slower without OpenBLAS.
COMPUTE_COMMANDS = {"generate", "serve", "bench", "eval", "train"}


@app.callback()
def main(ctx: typer.Context):
    """DFlash 2 speculative decoding for MLX."""
    if ctx.invoked_subcommand in COMPUTE_COMMANDS:
        from .doctor_report import blas_hint  # imports MLX: not for --help or the light commands

        hint = blas_hint()
        if hint:
            typer.echo(hint, err=True)


COMMAND_MODULES = ["generate", "doctor", "train", "eval", "serve", "models", "bench"]

for _name in COMMAND_MODULES:
    importlib.import_module(f"dflash2_mlx.cli.{_name}").register(app)


if __name__ == "__main__":
    app()
