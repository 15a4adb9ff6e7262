"""What ``dflash2-mlx doctor`` reports about the kernels: per kernel, the path in use
and the result of its self-check against the twin."""

import mlx.core as mx

from . import kernels


def kernel_report() -> list:
    """One dict per kernel: ``kernel``, ``path`` and ``self_check``.

    Where the kernels can run, this runs each self-check (once per process).
    """
    rows = []
    for name in kernels.KERNEL_NAMES:
        if kernels.reference_forced():
            check = f"not run (forced by {kernels.FORCE_REFERENCE_ENV})"
        elif not kernels.metal_usable():
            check = "not run (no Metal back-end)" if not mx.metal.is_available() else \
                "not run (default device is the CPU)"
        else:
            result = kernels.self_check(name)
            check = "passed" if result.passed else f"failed: {result.detail}"
        rows.append({"kernel": name, "path": kernels.active_path(name), "self_check": check})
    return rows


def run_doctor(echo=print) -> list:
    """Print the kernel report (through ``echo``) and return it."""
    rows = kernel_report()
    echo(f"mlx {mx.__version__}; Metal available: {mx.metal.is_available()}; "
         f"default device: {mx.default_device()}")
    width = max(len(r["kernel"]) for r in rows)
    for r in rows:
        echo(f"  {r['kernel']:<{width}}  path: {r['path']}  self-check: {r['self_check']}")
    return rows
