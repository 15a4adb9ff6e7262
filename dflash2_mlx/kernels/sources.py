"""What the GPU is handed: the kernel text and the arguments of each launch.

The kernel bodies live in ``metal/*.metal`` (package ``dflash2_mlx.metal``), split on
their ``//@ name`` lines and handed verbatim to ``mx.fast.metal_kernel`` (``SOURCES``,
one ``KernelSource`` per kernel); ``run_metal`` builds each kernel object once and calls
it with a ``Launch`` (inputs, template arguments, grid, output shapes), which the
builders in ``kernels.launches`` make from arrays.  The CPU emulation harness in
``tests/metal_emu`` compiles and runs the same ``KernelSource`` + ``Launch`` pair, so it
exercises exactly the text and arguments the GPU gets.
"""

from dataclasses import dataclass
from importlib import resources

import mlx.core as mx

# The drafter's kernels (self-checked against their twins, reported by doctor); the exact
# verify kernel ("exact_qmv") is checked against MLX's own one-row product instead
# (kernels/exact_rows.py).
KERNEL_NAMES = ("dynamic_conv", "path_selector", "path_scores", "path_walk")


def read_sections(filename: str) -> dict:
    """Split ``metal/<filename>`` into its ``//@ name`` sections (text before the
    first marker is the file's comment and is dropped)."""
    text = resources.files("dflash2_mlx.metal").joinpath(filename).read_text()
    sections, name, lines = {}, None, []
    for line in text.splitlines():
        if line.startswith("//@ "):
            if name is not None:
                sections[name] = "\n".join(lines).strip("\n") + "\n"
            name, lines = line[4:].strip(), []
        elif name is not None:
            lines.append(line)
    if name is not None:
        sections[name] = "\n".join(lines).strip("\n") + "\n"
    return sections


@dataclass(frozen=True)
class KernelSource:
    """The arguments of ``mx.fast.metal_kernel`` for one kernel."""

    name: str
    input_names: tuple
    output_names: tuple
    source: str
    header: str = ""


@dataclass
class Launch:
    """The arguments of one call of a ``mx.fast.metal_kernel`` object."""

    inputs: list
    template: list
    grid: tuple
    threadgroup: tuple
    output_shapes: list
    output_dtypes: list


def _sources() -> dict:
    conv = read_sections("dynamic_conv.metal")
    sel = read_sections("path_selector.metal")
    return {
        "dynamic_conv": KernelSource(
            name="dflash2_dynamic_conv",
            input_names=("x", "dyn", "base"),
            output_names=("out",),
            source=conv["conv"],
        ),
        "path_selector": KernelSource(
            name="dflash2_path_selector",
            input_names=(
                "unary", "cand", "gate", "anchor", "predecessor_codebook",
                "successor_codebook", "temperature", "uniforms",
            ),
            output_names=("scores", "path", "q"),
            source=sel["select"],
            header=sel["header"],
        ),
        "path_scores": KernelSource(
            name="dflash2_path_scores",
            input_names=(
                "unary", "cand", "gate", "anchor", "predecessor_codebook",
                "successor_codebook",
            ),
            output_names=("scores",),
            source=sel["scores"],
        ),
        "exact_qmv": KernelSource(
            name="dflash2_exact_qmv",
            input_names=("w", "scales", "biases", "x"),
            output_names=("y",),
            source=read_sections("exact_rows.metal")["qmv_rows"],
        ),
        "path_walk": KernelSource(
            name="dflash2_path_walk",
            input_names=("scores", "temperature", "uniforms"),
            output_names=("path", "q"),
            source=sel["walk"],
            header=sel["header"],
        ),
    }


SOURCES = _sources()


_metal_kernels = {}


def run_metal(key: str, launch: Launch) -> list:
    """Call the real kernel (raises "No Metal back-end" where there is none)."""
    if key not in _metal_kernels:
        src = SOURCES[key]
        _metal_kernels[key] = mx.fast.metal_kernel(
            name=src.name,
            input_names=list(src.input_names),
            output_names=list(src.output_names),
            source=src.source,
            header=src.header,
        )
    return _metal_kernels[key](
        inputs=launch.inputs,
        template=launch.template,
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=launch.output_shapes,
        output_dtypes=launch.output_dtypes,
    )
