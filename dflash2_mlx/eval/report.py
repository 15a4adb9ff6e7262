"""Report files of the eval commands: a report as NAME.json and NAME.md with its figures
beside them, and the table and figure helpers the bench, the evaluation and the serving bench
share (drawn with ``dflash2_mlx/figures.py``, which training's loss curve uses too)."""

import json
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from ..figures import pyplot, save_figure


def write_report(out_dir, name: str, report: dict, markdown: str,
                 figures: Optional[Callable[[dict, Path], List[Path]]] = None) -> List[Path]:
    """NAME.json, NAME.md and the paths ``figures(report, out_dir)`` draws, under ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    paths[0].write_text(json.dumps(report, indent=1))
    paths[1].write_text(markdown)
    return paths + (figures(report, out_dir) if figures else [])


def fmt(x, spec: str = ".2f", none: str = "-") -> str:
    """A figure of a table cell; ``none`` where there is none."""
    return none if x is None else format(x, spec)


def table(header: Sequence[str], rows: Sequence[Sequence]) -> List[str]:
    """A markdown table's lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def position_table(columns: Dict[str, Sequence]) -> str:
    """Rates by block position, a column per drafter or method (shorter columns end blank)."""
    depth = max((len(v) for v in columns.values()), default=0)
    rows = [[p + 1] + [fmt(v[p], ".3f") if p < len(v) else "" for v in columns.values()]
            for p in range(depth)]
    return "\n".join(table(["position", *columns], rows))


def plot_acceptance(curves: dict, path) -> Path:
    """One panel per temperature: acceptance rate by block position, a line per drafter.

    curves: {"T=0": [(label, rates), ...], ...}; a label with no rates is left out."""
    fig, axes = pyplot().subplots(1, len(curves), figsize=(5 * len(curves), 3.8), squeeze=False)
    for ax, (t, lines) in zip(axes[0], curves.items()):
        for i, (label, ys) in enumerate(lines):
            if ys:
                ax.plot(range(1, len(ys) + 1), ys, marker="o", ms=3, color=f"C{i}", label=label)
        ax.set_title(f"acceptance by block position, {t}")
        ax.set_xlabel("block position")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path)
