"""Dispatch between the Metal kernels and their pure-MLX twins.

(Placeholder dispatch: the twins only, until the Metal kernels land.)
"""

from .conv import dynamic_conv_reference
from .selector import pair_scores_reference, walk_reference


def dynamic_conv(x, dyn, base):
    return dynamic_conv_reference(x, dyn, base)


def pair_scores(unary, cand, gate, anchor, predecessor_codebook, successor_codebook):
    return pair_scores_reference(unary, cand, gate, anchor, predecessor_codebook, successor_codebook)


def walk(scores, temperature=0.0, uniforms=None):
    return walk_reference(scores, temperature, uniforms)
