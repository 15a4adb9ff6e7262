"""DFlash 2's grouped dynamic two-tap convolution over the draft block.

    conv(x, dyn, base)[t, c] = sum_o (base[o, c] + dyn[t, o, c // g]) * x[t - o, c],  x[-1] = 0

This module is the conv's meaning and imports nothing of the kernels beside it: ``dispatch``
runs the Metal kernel or this twin, and the module around each sublayer
(``model.drafter.DynamicConv``) calls the dispatch.
"""

import mlx.core as mx


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
