"""Modelled speed of plain decoding, chains and trees on other machines' cost curves.

    python scripts/experiments/tree_model.py BENCH_JSON [--context 256]

Reads the acceptance (tau) that ``dflash2-mlx bench --tree 8 --tree 16 --tree 32 --sweep 8``
measured per method and temperature, and prices each method's cycle with each cost curve:

    speed over plain = tau / (c(rows) + d)

where c(rows) is what a verify pass over ``rows`` costs in one-row passes (plain: rows 1,
tau 1, no draft; a chain of block b: rows b; a tree of N nodes, as deep as the drafter's
block reaches: rows N + 1), and d the
drafter's pass in one-row passes.  Curves: this machine's calibrated cost model (the one
``--block-size auto`` uses, at ``--context`` tokens) and the named fixtures in
``dflash2_mlx/adaptive/curves/``.  Prints a markdown table; nothing here is measured but tau
(and this machine's curve).
"""

import argparse
import json
import re


def methods(report: dict, temp: str) -> dict:
    """{method: (rows, tau)} of the DFlash 2 chains and trees in a bench report."""
    cfg = report["config"]
    fixed = cfg["block_size"]
    out = {}
    for m, r in report["results"]["overall"][temp].items():
        if r.get("tau") is None:
            continue
        if m == "DFlash 2":
            out[f"chain b{fixed}"] = (fixed, r["tau"])
        elif (hit := re.fullmatch(r"DFlash 2 block (\d+)", m)):
            out[f"chain b{hit[1]}"] = (int(hit[1]), r["tau"])
        elif (hit := re.fullmatch(r"DFlash 2 tree (\d+)", m)):
            out[f"tree {hit[1]}"] = (int(hit[1]) + 1, r["tau"])
    return out


def this_machine(context: int):
    """(c(rows), d) from this machine's calibrated cost model of the built-in pair."""
    import dflash2_mlx as d
    from dflash2_mlx.calibration import costs as cost_model
    from dflash2_mlx.loop.target import attach

    model, _, drafter = d.load()
    costs = cost_model(attach(model, drafter), drafter)
    one = costs.verify(1, context)
    return (lambda rows: costs.verify(rows, context) / one), costs.draft(5, context) / one, max(costs.target)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bench_json")
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()
    from dflash2_mlx.adaptive import curves

    report = json.load(open(args.bench_json))
    priced = {}
    c, dr, most = this_machine(args.context)
    priced[f"this CPU (calibrated, context {args.context})"] = (c, dr, most)
    for name in curves.names():
        rel, curve = curves.relative(name), curves.load(name)
        priced[name] = ((lambda rows, rel=rel: rel[min(rows, max(rel))]), curve["draft"], max(rel))
    print("speed over plain = tau / (c(rows) + d); c: a pass over `rows` in one-row passes, "
          "d: the drafter's pass (same unit)\n")
    for temp in report["results"]["overall"]:
        ms = methods(report, temp)
        names = list(ms)
        print(f"### {temp}\n")
        print("| curve | d | " + " | ".join(f"{m} (tau {ms[m][1]:.2f}, {ms[m][0]} rows)" for m in names) + " |")
        print("|---|---|" + "---|" * len(names))
        for curve, (cost, draft, most) in priced.items():
            cells = []
            for m in names:
                rows, tau = ms[m]
                cells.append(f"{tau / (cost(rows) + draft):.2f}x" + ("*" if rows > most else ""))
            print(f"| {curve} | {draft:.2f} | " + " | ".join(cells) + " |")
        print()
    print("`*`: more rows than the curve was measured at (priced at its widest).")


if __name__ == "__main__":
    main()
