"""DFlash 2's grouped dynamic two-tap convolution over the draft block.

    conv(x, dyn, base)[t, c] = sum_o (base[o, c] + dyn[t, o, c // g]) * x[t - o, c],  x[-1] = 0

One module sits around each sublayer: ``prepare`` convolves the sublayer input
(side 0) and keeps the dynamic taps, ``finish`` convolves the sublayer output
(side 1) with the taps computed from the same input.  The base kernel starts as
the identity (tap 0 = 1, tap 1 = 0) and the projection at zero, so a fresh conv
is an exact no-op and a v1 drafter can be warm-started.
"""

import mlx.core as mx
import mlx.nn as nn


def dynamic_conv_reference(x: mx.array, dyn: mx.array, base: mx.array) -> mx.array:
    """The meaning of the conv kernel, in plain MLX ops.

    x: [..., T, H]; dyn: [..., T, 2, H // g] (tap o per channel group); base: [2, H].
    """
    H = x.shape[-1]
    g = H // dyn.shape[-1]
    taps = base + mx.repeat(dyn, g, axis=-1)  # [..., T, 2, H]
    prev = mx.concatenate([mx.zeros_like(x[..., :1, :]), x[..., :-1, :]], axis=-2)
    out = taps[..., 0, :] * x + taps[..., 1, :] * prev
    return out.astype(x.dtype)


class DynamicConv(nn.Module):
    def __init__(self, hidden_size: int, group_size: int = 16, kernel_size: int = 2):
        super().__init__()
        if kernel_size != 2:
            raise ValueError("DFlash 2's dynamic conv has exactly two taps")
        self.hidden_size = hidden_size
        self.group_size = group_size
        base = mx.zeros((2, kernel_size, hidden_size))
        self.base_kernel = base.at[:, 0, :].add(1.0)  # [side, tap, channel]
        self.kernel_projection = nn.Linear(
            hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False
        )
        self.kernel_projection.weight = mx.zeros_like(self.kernel_projection.weight)

    def _conv(self, x, dyn, side):
        # Local import: kernels.py dispatches to Metal or back to the twin above.
        from .kernels import dynamic_conv

        return dynamic_conv(x, dyn[..., side, :, :], self.base_kernel[side])

    def prepare(self, u: mx.array):
        dyn = self.kernel_projection(u)
        dyn = dyn.reshape(*u.shape[:-1], 2, 2, self.hidden_size // self.group_size)
        return self._conv(u, dyn, 0), dyn

    def finish(self, y: mx.array, dyn: mx.array) -> mx.array:
        return self._conv(y, dyn, 1)
