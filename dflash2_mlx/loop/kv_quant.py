"""mlx-lm's KV cache quantization as the cycle applies it: one object, a no-op when off."""

from dataclasses import replace
from typing import Optional

from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, maybe_quantize_kv_cache

from ..adaptive import Choice


def kv_offset(cache) -> int:
    """Tokens in the attention caches (mlx-lm's KV quantization goes by these; 0 without any)."""
    return max((c.offset for c in cache if hasattr(c, "offset")), default=0)


class KVQuantization:
    """mlx-lm's KV cache quantization with ``bits`` (None: off, every method a no-op).

    mlx-lm quantizes the attention caches after the step that brought them to ``start``
    tokens, as ``generate_step`` does; the cycle quantizes before each pass instead, which
    leaves every pass the same cache.  A verify pass never runs across the start token
    (``clamp``): rows before it attend to full-precision keys, rows after to quantized ones,
    in blocks as in one-token steps."""

    def __init__(self, bits: Optional[int] = None, group_size: int = 64,
                 start: int = DEFAULT_QUANTIZED_KV_START):
        self.bits, self.group_size, self.start = bits, group_size, start

    @property
    def on(self) -> bool:
        return self.bits is not None

    def __call__(self, cache):
        """Quantize the caches that hold ``start`` tokens or more."""
        maybe_quantize_kv_cache(cache, quantized_kv_start=self.start, kv_group_size=self.group_size,
                                kv_bits=self.bits)

    def clamp(self, choice: Choice, cache) -> Choice:
        """``choice`` with its block ending at the token that quantizes the cache, at most."""
        if self.on and (held := kv_offset(cache)) < self.start:
            return replace(choice, block=min(choice.block, self.start - held))
        return choice
