"""Named verify-cost curves (what a pass over N rows costs against one row) of machines
other than this one, with where each came from: fixtures for the tree's sizing and the
modelled tables (``scripts/experiments/tree_model.py``)."""

import json
from pathlib import Path
from typing import Dict

HERE = Path(__file__).parent


def names():
    return sorted(p.stem for p in HERE.glob("*.json"))


def load(name: str) -> dict:
    path = HERE / f"{name}.json"
    if not path.exists():
        raise ValueError(f"no cost curve named {name!r}; there are {', '.join(names())}")
    return json.loads(path.read_text())


def relative(name: str) -> Dict[int, float]:
    """{rows: cost of a pass over that many rows, in one-row passes}."""
    return {int(k): v for k, v in load(name)["relative"].items()}


def cost_model(name: str):
    """The curve as a ``CostModel`` in one-row passes (context-free), for pricing choices."""
    from ..costs import CostModel

    curve = load(name)
    return CostModel({r: (v, 0.0) for r, v in relative(name).items()},
                     {2: (curve["draft"], 0.0), 16: (curve["draft"], 0.0)})
