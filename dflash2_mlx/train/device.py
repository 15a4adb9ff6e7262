"""Where training runs, and the dtype the target computes in there.

One switch for everything device-specific in training, so a user names at most a device:
- ``gpu`` (MLX's Metal or CUDA backend): the target's forward, which makes every feature
  row and the responses of the data, runs in bf16, the GPU's fast type; the drafter keeps
  fp32 parameters, so its AdamW moments and its losses stay fp32.
- ``cpu``: the target as loaded (the built-in one is fp32): this CPU's bf16 and quantized
  matmuls are far slower than its fp32 ones (DESIGN.md §7).
``auto`` is MLX's default device: the GPU where this MLX has one.
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

DEVICES = ("auto", "cpu", "gpu")


def choose(device: str = "auto") -> str:
    """``device`` resolved to ``cpu`` or ``gpu``, made MLX's default; a clear error where
    this MLX has no GPU."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}: use one of {', '.join(DEVICES)}")
    if device == "auto":
        device = "gpu" if mx.default_device().type == mx.gpu else "cpu"
    if device == "gpu" and not mx.is_available(mx.gpu):
        raise ValueError("--device gpu: this MLX build has no GPU backend (Metal on a Mac, "
                         "the mlx-cuda wheel on Linux); use --device cpu")
    mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)
    return device


def target_dtype(device: str) -> Optional[mx.Dtype]:
    """The dtype the target computes in on ``device`` (None: as loaded)."""
    return mx.bfloat16 if device == "gpu" else None


def prepare_target(model: nn.Module, device: str) -> nn.Module:
    """The target cast to ``device``'s dtype (floating parameters only: quantized weights
    stay packed, their scales follow)."""
    dtype = target_dtype(device)
    if dtype is not None:
        model.set_dtype(dtype)
    return model
