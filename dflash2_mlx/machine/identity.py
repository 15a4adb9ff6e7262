"""The one description of this machine: what the adaptive policy's cost model is keyed by
(``identity``: what changes the seconds of a pass), and what a benchmark report records
(``describe``: that, plus what a reader needs to reproduce the run)."""

import os
import platform

import mlx
import mlx.core as mx


def identity() -> dict:
    info = {"machine": platform.machine(), "processor": platform.processor(),
            "system": platform.system(), "cpus": os.cpu_count(),
            "mlx": getattr(mlx, "__version__", None) or mx.__version__,
            "device": str(mx.default_device()),
            "blas": os.path.basename(os.environ.get("LD_PRELOAD", "")),
            "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")}
    if mx.metal.is_available():
        # mx.device_info() since mlx 0.32 (mx.metal.device_info() warns there).
        info_of = getattr(mx, "device_info", None) or mx.metal.device_info
        info["gpu"] = info_of().get("device_name", "")
    return info


def describe() -> dict:
    return {"platform": platform.platform(), **identity(), "metal": mx.metal.is_available(),
            "ld_preload": os.environ.get("LD_PRELOAD", "")}
