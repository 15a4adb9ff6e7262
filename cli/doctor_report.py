"""What ``dflash2-mlx doctor`` reports: on Linux's CPU build, whether a fast BLAS is
loaded; per kernel, the path in use and the result of its self-check against the twin."""

import platform
import sys
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx

from .. import kernels

# MLX's Linux CPU wheel bundles a reference BLAS; fp32 matmuls are faster with one of these
# loaded into the process (LD_PRELOAD).
FAST_BLAS = ("libopenblas", "libmkl_rt", "libblis")


def openblas_path() -> str:
    """Where Debian / Ubuntu's ``libopenblas0-pthread`` puts the library."""
    return f"/usr/lib/{platform.machine()}-linux-gnu/openblas-pthread/libopenblas.so.0"


def loaded_fast_blas() -> Optional[str]:
    """The path of a fast BLAS mapped into this process (from /proc/self/maps), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if any(name in Path(path).name for name in FAST_BLAS):
            return path
    return None


def blas_hint() -> Optional[str]:
    """One line telling the user how to preload OpenBLAS, when MLX runs on the Linux CPU
    without a fast BLAS; None otherwise."""
    if not sys.platform.startswith("linux") or mx.default_device().type != mx.DeviceType.cpu:
        return None
    if loaded_fast_blas() is not None:
        return None
    path = openblas_path()
    install = "" if Path(path).exists() else " (after: sudo apt-get install libopenblas0-pthread)"
    return ("note: OpenBLAS is not preloaded: MLX's Linux CPU build is then ~7x slower on the "
            f"prompt and 3-5x slower decoding; export LD_PRELOAD={path}{install}")


def kernel_report() -> list:
    """One dict per production kernel variant (``kernels.production_launches``):
    ``kernel``, ``variant``, ``path`` and ``self_check``.

    Where the kernels can run, this runs each variant's self-check (once per process).
    """
    rows = []
    for name in kernels.KERNEL_NAMES:
        for launch in kernels.production_launches(name):
            if kernels.reference_forced():
                check = f"not run (forced by {kernels.FORCE_REFERENCE_ENV})"
            elif not kernels.metal_usable():
                check = "not run (no Metal back-end)" if not mx.metal.is_available() else \
                    "not run (default device is the CPU)"
            else:
                result = kernels.self_check(name, launch)
                check = "passed" if result.passed else f"{result.failure}: {result.detail}"
            rows.append({"kernel": name, "variant": kernels.describe(kernels.variant(name, launch)),
                         "path": kernels.active_path(name, launch), "self_check": check})
    return rows


def verdict(rows: list) -> str:
    """One line: whether this machine runs DFlash as it should, and what to do if not."""
    problems = []
    failed = [r for r in rows if not r["self_check"].startswith(("passed", "not run"))]
    if failed:
        names = sorted({r["kernel"] for r in failed})
        problems.append(f"{len(failed)} kernel variant(s) failed their self-check and run their pure-MLX "
                        f"twin ({', '.join(names)}): `doctor --verbose` shows which")
    if blas_hint() is not None:
        problems.append("OpenBLAS is not preloaded (see below)")
    return "verdict: " + ("ready" if not problems else "attention: " + "; ".join(problems))


def kernels_line(rows: list) -> str:
    on_metal = sum(r["self_check"] == "passed" for r in rows)
    if on_metal == len(rows):
        return f"kernels: {len(rows)} variants on Metal, every self-check passed"
    reason = rows[0]["self_check"].removeprefix("not run (").removesuffix(")") if rows else ""
    if on_metal == 0 and all(r["self_check"].startswith("not run") for r in rows):
        return f"kernels: {len(rows)} variants on their pure-MLX twins ({reason})"
    return f"kernels: {on_metal} of {len(rows)} variants on Metal, the others on their pure-MLX twins"


def run_doctor(echo=print, verbose: bool = False) -> list:
    """Print the verdict, the platform, the BLAS and the kernels in one line each (every
    kernel variant's path and self-check with ``verbose``), through ``echo``; return the
    kernel report."""
    rows = kernel_report()
    echo(verdict(rows))
    echo(f"mlx {mx.__version__}; Metal available: {mx.metal.is_available()}; "
         f"default device: {mx.default_device()}")
    if sys.platform.startswith("linux"):
        blas = loaded_fast_blas()
        hint = blas_hint()
        echo(f"BLAS: {blas} (loaded)" if blas else "BLAS: MLX's bundled reference BLAS"
             + (f"\n  {hint}" if hint else ""))
    echo(kernels_line(rows) + ("" if verbose else "; each variant with --verbose"))
    for r in rows if verbose else ():
        echo(f"  {r['variant']}\n      path: {r['path']}  self-check: {r['self_check']}")
    return rows


def exactness_report(model: Optional[str] = None, measure: bool = False, echo=print, verbose: bool = False) -> list:
    """Whether verify passes are row-exact here (``calibration/exactness.py``): the verdicts kept
    for this machine and BLAS (no model loaded; every kept one with ``verbose``), or with
    ``measure`` a fresh probe of ``model`` (the built-in target by default), kept for later
    runs.  Each line names the target, dtype, device and BLAS it holds for."""
    from ..calibration import exactness

    if measure:
        import mlx_lm

        from ..model.checkpoint import resolve

        if model is None:
            from ..builtin.smollm2 import default_target_path

            model = str(default_target_path())
        target, _ = mlx_lm.load(str(resolve(model)))
        verdicts = [exactness.verdict(target, refresh=True)]
    else:
        verdicts = list(exactness.kept_verdicts())
    here = exactness.machine_digest()
    others = [v for v in verdicts if v.machine != here]
    shown = verdicts if verbose or measure else [v for v in verdicts if v.machine == here]
    if not shown:
        echo(f"verify rows: {exactness.NOT_PROBED} with {exactness.blas_name()} "
             "(dflash2-mlx doctor --exact [--model M])")
    for v in shown:
        echo(f"verify rows ({v.setup()}; rows {v.rows[0]}..{v.rows[-1]}): {v.describe()}"
             + ("" if v.exact else f"; {v.differing:.0%} of logits differ: greedy output is plain "
                f"decoding's with --exact ({_exact_way(v)}), else it may leave it at a near-tie"))
    if others and not verbose and not measure:
        echo(f"  ({len(others)} verdict(s) kept for another BLAS, device or machine: --verbose)")
    echo(exact_kernel_line())
    return verdicts


def exact_kernel_line() -> str:
    """Where the row-exact pass's quantized products run (``kernels/exact_rows.py``)."""
    from ..kernels import exact_rows

    if kernels.reference_forced() or not kernels.metal_usable():
        return ("exact verify kernel: not used here (no Metal default device): a row-exact pass "
                "takes MLX's own one-row product per row")
    if not exact_rows.checked:
        return "exact verify kernel: on Metal, each variant checked against MLX's one-row product on first use"
    return "exact verify kernel: " + ", ".join(
        f"{dtype.split('.')[-1]} group {gs} {bits}-bit {'passed' if ok else 'differs: one-row products'}"
        for (dtype, gs, bits), ok in exact_rows.checked.items())


def _exact_way(v) -> str:
    if v.exact_pass is None:
        return "the row-exact pass is tried on the first --exact run"
    if v.exact_pass:
        return "a row-exact verify pass"
    return "one-row verify" + (f"; the row-exact pass: {v.exact_pass_note}" if v.exact_pass_note else "")


def costs_report(echo=print) -> list:
    """The verify-cost curves kept on this machine (one per calibrated pair) and the named
    fixture curves of other machines, as one table: a pass over N rows in one-row passes."""
    from ..adaptive import CostModel, curves
    from ..calibration import store

    columns = []
    for key, data in store.records("costs"):
        try:
            costs = CostModel.from_json(data)
        except (TypeError, KeyError, ValueError, AttributeError):
            continue
        one = costs.verify(1, 0)
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(costs.created))
        columns.append((f"here {key[:8]}", {r: costs.verify(r, 0) / one for r in costs.target},
                        f"1 row {one * 1e3:.1f} ms; measured {when}, other processes used {costs.busy:.0%} "
                        f"of the cores"))
    for name in curves.names():
        rel, curve = curves.relative(name), curves.load(name)
        shown = set(curve["points"])  # the rows it was measured or published at
        columns.append((name, {r: v for r, v in rel.items() if r in shown}, "fixture"))
    if not any(c[2] != "fixture" for c in columns):
        echo("verify costs here: not measured yet (the first `--block-size auto` or `--tree-budget auto` "
             "request measures them)")
    rows = sorted({r for _, col, _ in columns for r in col})
    echo("verify pass over N rows, in one-row passes (fixtures: dflash2_mlx/adaptive/curves/):")
    echo("| rows | " + " | ".join(name for name, _, _ in columns) + " |")
    echo("|---|" + "---|" * len(columns))
    for r in rows:
        echo(f"| {r} | " + " | ".join(f"{col[r]:.2f}" if r in col else "" for _, col, _ in columns) + " |")
    echo("| | " + " | ".join(note for _, _, note in columns) + " |")
    echo("")
    for line in plot({name: col for name, col, _ in columns}):
        echo(line)
    return columns


PLOT_MARKS = "*o+x#@%&"


def plot(series: dict, largest: int = 40, height: int = 12) -> list:
    """The curves as text: one column per row count 1..``largest``, cost (in one-row
    passes) upwards, a mark per curve (straight lines between its measured rows)."""
    from ..adaptive.costs import interp

    curves = {name: {r: (v, 0.0) for r, v in col.items()} for name, col in series.items() if col}
    if not curves:
        return []
    values = {name: [interp(c, r)[0] for r in range(1, largest + 1)] for name, c in curves.items()}
    top = max(max(v) for v in values.values())
    grid = [[" "] * largest for _ in range(height)]
    for mark, v in zip(PLOT_MARKS, values.values()):
        for x, y in enumerate(v):
            grid[height - 1 - min(height - 1, int(round((y - 1.0) / max(top - 1.0, 1e-9) * (height - 1))))][x] = mark
    out = [f"{1.0 + (top - 1.0) * (height - 1 - i) / (height - 1):6.2f} |" + "".join(row)
           for i, row in enumerate(grid)]
    out.append("       +" + "-" * largest)
    out.append("        " + "".join(str(r // 10) if r % 10 == 0 else " " for r in range(1, largest + 1))
               + "  rows (x10)")
    out.append("        " + "  ".join(f"{m} {name}" for m, name in zip(PLOT_MARKS, values)))
    return out
