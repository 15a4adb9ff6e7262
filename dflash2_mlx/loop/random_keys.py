"""Random streams of their own: a sequence's (or a job's) PRNG key swapped in around its draws.

``propose`` and the accept rules draw from MLX's global key, so a seeded sequence in a batch,
or a request taking turns on the worker, draws what it would draw alone when its own key is
the global one for exactly its draws (``swap_key``, or ``RandomStream`` around them)."""

from typing import Optional

import mlx.core as mx


def swap_key(key: int) -> int:
    """Make ``key`` (64 bits) the global PRNG key; return the key it replaces.

    ``mx.random.seed(s)`` sets the key to [s >> 32, s & 0xffffffff], so any key can be
    put back; ``propose`` and the accept rules draw from the global key."""
    hi, lo = mx.random.state[0].tolist()
    mx.random.seed(key)
    return (hi << 32) | lo


def restore_key(key: int):
    """Make ``key`` the global PRNG key without reading the one it replaces: after a
    draw that raised (mlx-lm's samplers are compiled with the global key as their input
    and output, and one that raises while tracing leaves a key that cannot be read)."""
    mx.random.seed(key)


def fresh_key() -> int:
    """A key for a sequence without a seed, drawn from the global generator (62 bits)."""
    hi, lo = mx.random.randint(0, (1 << 31) - 1, shape=(2,)).tolist()
    return (hi << 32) | lo


class RandomStream:
    """A random stream of its own: ``with stream:`` makes its key the global one for the
    draws inside, puts the global one back after them (whatever they raise), and keeps
    its key where its draws left it.  ``key`` None (a greedy sequence, which draws nothing): the global key stays."""

    def __init__(self, key: Optional[int]):
        self.key, self.outer = key, None

    def __enter__(self):
        if self.key is not None:
            self.outer = swap_key(self.key)
        return self

    def __exit__(self, kind, value, tb):
        if self.key is None:
            return
        if kind is None:
            self.key = swap_key(self.outer)
        else:  # the draws raised: the global key may be unreadable; put the outer one back
            restore_key(self.outer)
