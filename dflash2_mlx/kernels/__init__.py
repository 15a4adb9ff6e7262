"""Metal kernels for DFlash 2's dynamic conv and path selector, with dispatch to their
pure-MLX twins (``conv``, ``selector``), which define what they compute.

- ``conv``, ``selector``: the twins, in plain MLX ops (training runs them, for their gradients);
- ``sources``: the kernel text read from ``metal/*.metal``, and running a launch on Metal;
- ``launches``: each kernel's launch (template arguments, grid, output shapes) for arrays;
- ``selfcheck``: each kernel variant checked against the twins on its first use;
- ``dispatch``: kernel or twin, and the entry points the drafter calls.

Every public name of ``sources``, ``launches``, ``selfcheck`` and ``dispatch`` is importable
from here (``kernels.select``, ...).
"""

from .dispatch import (
    FORCE_REFERENCE_ENV,
    SPLIT_BELOW_ROWS,
    active_path,
    dynamic_conv,
    force_reference,
    kernel_launch,
    metal_usable,
    pair_scores,
    profile,
    reference_forced,
    select,
    walk,
    with_twin_vjp,
)
from .launches import (
    MAX_THREADGROUP_MEMORY,
    RANK_TILE,
    SCORE_THREADS,
    batch_rows,
    conv_launch,
    score_tiles,
    scores_launch,
    selector_launch,
    walk_launch,
)
from .selfcheck import (
    BOUNDARY_TOL,
    CHECK_CASES,
    COMPILE_FAILURES,
    MAX_CONSTANT_ARRAY_SIZE,
    CheckCase,
    SelfCheck,
    check_variant,
    checked,
    checked_variants,
    conv_problem,
    describe,
    path_problem,
    production_launches,
    self_check,
    variant,
)
from .sources import KERNEL_NAMES, SOURCES, KernelSource, Launch, read_sections, run_metal

__all__ = [
    "FORCE_REFERENCE_ENV", "SPLIT_BELOW_ROWS", "active_path", "dynamic_conv", "force_reference",
    "kernel_launch", "metal_usable", "pair_scores", "profile", "reference_forced", "select", "walk",
    "with_twin_vjp", "MAX_THREADGROUP_MEMORY", "RANK_TILE", "SCORE_THREADS", "batch_rows",
    "conv_launch", "score_tiles", "scores_launch", "selector_launch", "walk_launch", "BOUNDARY_TOL",
    "CHECK_CASES", "COMPILE_FAILURES", "MAX_CONSTANT_ARRAY_SIZE", "CheckCase", "SelfCheck",
    "check_variant", "checked", "checked_variants", "conv_problem", "describe", "path_problem",
    "production_launches", "self_check", "variant", "KERNEL_NAMES", "SOURCES", "KernelSource",
    "Launch", "read_sections", "run_metal",
]
