"""Figures as the reports and training draw them: matplotlib on its file-only backend, and a
figure saved.  Beneath both ``eval/`` (the reports' figures) and ``train/`` (the loss curve)."""

from pathlib import Path


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend.  Imported here, not at the top of
    the module: matplotlib is slow to import and only the figures need it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    return Path(path)
