"""Measuring drafters and the loop: the paper-style evaluation, the side-by-side benchmarks (decoding, serving, kernels) and cycle profiling."""
