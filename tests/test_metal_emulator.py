"""The Metal emulator itself can fail: it catches thread-order dependence, out-of-bounds
reads, data races, missing or wrong barriers and fences, misuse of threadgroup memory,
address-space mismatches and what Metal does not have, as real Metal would."""

import mlx.core as mx
import pytest

from dflash2_mlx import kernels
from metal_emu.cases import needs_gxx
from metal_emu.emulate import emulate, emulate_many


TOY = kernels.KernelSource(
    name="toy_sum",
    input_names=("x",),
    output_names=("y", "total"),
    source="""
const uint i = thread_position_in_grid.x;
y[i] = x[i] * 2.0f;
BARRIER
if (i == 0) {
  float s = 0.0f;
  for (uint j = 0; j < N; ++j) {
    if (y[j] == y[j]) s += y[j];  // unwritten outputs hold NaN: add what is there
  }
  total[0] = s;
}
""",
)


def toy(barrier: bool, read_past_end: bool = False):
    src = TOY.source.replace("BARRIER", "metal::threadgroup_barrier(metal::mem_flags::mem_device);" if barrier else "")
    if read_past_end:
        src = src.replace("x[i] * 2.0f", "x[i + 1] * 2.0f")
    n = 64
    launch = kernels.Launch(inputs=[mx.arange(n, dtype=mx.float32)], template=[("N", n)], grid=(n, 1, 1),
                            threadgroup=(n, 1, 1), output_shapes=[(n,), (1,)],
                            output_dtypes=[mx.float32, mx.float32])
    return kernels.KernelSource(TOY.name, TOY.input_names, TOY.output_names, src), launch


@needs_gxx
def test_harness_catches_thread_order_dependence_and_honours_barriers():
    src, launch = toy(barrier=False)
    with pytest.raises(AssertionError, match="depends on thread order"):
        emulate_many(src, [launch], seeds=(0, 1, 2, 3))
    src, launch = toy(barrier=True)
    (y, total), = emulate_many(src, [launch], seeds=(0, 1, 2, 3))
    assert total.item() == 2 * sum(range(64))


@needs_gxx
def test_harness_catches_out_of_bounds_reads():
    src, launch = toy(barrier=True, read_past_end=True)
    with pytest.raises(RuntimeError, match="heap-buffer-overflow"):
        emulate(src, launch)


def toy_launch(n=64, groups=1, inputs=None):
    return kernels.Launch(inputs=inputs or [mx.arange(n * groups, dtype=mx.float32)], template=[("N", n)],
                          grid=(n * groups, 1, 1), threadgroup=(n, 1, 1), output_shapes=[(n * groups,), (1,)],
                          output_dtypes=[mx.float32, mx.float32])


def toy_kernel(source, header=""):
    return kernels.KernelSource("toy", ("x",), ("y", "total"), source, header)


SUM_AFTER_BARRIER = """
const uint i = thread_position_in_grid.x;
y[i] = x[i] * 2.0f;
metal::threadgroup_barrier(FLAGS);
if (i == 0) {
  float s = 0.0f;
  for (uint j = 0; j < N; ++j) s += y[j];
  total[0] = s;
}
"""

BROKEN_KERNELS = {
    "memory fence missing": (SUM_AFTER_BARRIER.replace("FLAGS", "metal::mem_flags::mem_none"), "",
                             "without mem_flags::mem_device"),
    "threadgroup-only fence": (SUM_AFTER_BARRIER.replace("FLAGS", "metal::mem_flags::mem_threadgroup"), "",
                               "without mem_flags::mem_device"),
    "lost update": ("const uint i = thread_position_in_grid.x;\ny[i] = x[i];\ntotal[0] = total[0] == total[0] ? "
                    "total[0] + x[i] + 1.0f : x[i] + 1.0f;\n", "", "data race"),
    "two threadgroups write one element": ("const uint i = thread_position_in_grid.x;\ny[i] = x[i];\n"
                                           "if (thread_position_in_threadgroup.x == 0) total[0] = x[i] + 1.0f;\n",
                                           "", "data race"),
    "barriers at different call sites": (
        "const uint i = thread_position_in_grid.x;\ny[i] = x[i];\n"
        "if (i % 2) {\n  metal::threadgroup_barrier(metal::mem_flags::mem_device);\n} else {\n"
        "  metal::threadgroup_barrier(metal::mem_flags::mem_device);\n}\n"
        "if (i == 0) total[0] = y[1];\n", "", "wait at different barriers"),
    "constant data bound to a device pointer": (
        "const uint i = thread_position_in_grid.x;\ny[i] = first(x);\nif (i == 0) total[0] = 0.0f;\n",
        "inline float first(const device float* p) { return p[0]; }\n", "invalid conversion"),
    "device data bound to a constant pointer": (
        "const uint i = thread_position_in_grid.x;\ny[i] = first(x);\nif (i == 0) total[0] = 0.0f;\n",
        "inline float first(const constant float* p) { return p[0]; }\n", "invalid conversion"),
    "clash with MLX's prelude": ("const uint i = thread_position_in_grid.x;\ny[i] = ceildiv(i, 2u);\n"
                                 "if (i == 0) total[0] = 0.0f;\n",
                                 "inline uint ceildiv(uint a, uint b) { return (a + b - 1) / b; }\n",
                                 "clash with MLX's Metal prelude"),
    "double": ("const uint i = thread_position_in_grid.x;\ndouble d = x[i];\ny[i] = d;\nif (i == 0) total[0] = 0.0f;\n",
               "", "poisoned"),
    "std::": ("const uint i = thread_position_in_grid.x;\ny[i] = std::sqrt(x[i]);\nif (i == 0) total[0] = 0.0f;\n",
              "", "poisoned"),
    "variable-length array": ("const uint i = thread_position_in_grid.x;\nfloat tmp[i + 1];\ntmp[0] = x[i];\n"
                              "y[i] = tmp[0];\nif (i == 0) total[0] = 0.0f;\n", "", "variable length array"),
}


@needs_gxx
@pytest.mark.parametrize("name", list(BROKEN_KERNELS))
def test_emulator_rejects_broken_kernel(name):
    source, header, message = BROKEN_KERNELS[name]
    groups = 2 if "threadgroups" in name else 1
    n = 8 if "constant data" in name else 64
    inputs = [mx.arange(4, dtype=mx.float32)] if "constant data" in name else None
    launch = toy_launch(n, groups, inputs)
    if inputs:  # 4 inputs, 8 threads: the kernel reads x[0] only
        launch.output_shapes = [(n,), (1,)]
    with pytest.raises((RuntimeError, ValueError, AssertionError), match=message):
        emulate_many(toy_kernel(source, header), [launch], seeds=(0, 1))


@needs_gxx
def test_emulator_passes_the_fixed_kernels_and_rejects_oversized_threadgroups():
    (y, total), = emulate_many(toy_kernel(SUM_AFTER_BARRIER.replace("FLAGS", "metal::mem_flags::mem_device")),
                               [toy_launch()], seeds=(0, 1))
    assert total.item() == 2 * sum(range(64))
    ok = "const uint i = thread_position_in_grid.x;\ny[i] = x[i];\nif (i == 0) total[0] = 1.0f;\n"
    big = toy_launch(2048)
    with pytest.raises(ValueError, match="exceeds Metal's 1024"):
        emulate_many(toy_kernel(ok), [big])


# Each threadgroup reverses its slice of x through threadgroup memory (so every thread
# reads what another wrote), twice, refilling the array between the rounds.
REVERSE_IN_THREADGROUP = """
threadgroup float tile[N];
const uint i = thread_position_in_threadgroup.x;
const uint base = threadgroup_position_in_grid.x * N;
float acc = 0.0f;
for (uint k = 0; k < 2; ++k) {
  tile[i] = x[base + i] + static_cast<float>(k);
  AFTER_FILL
  acc += tile[N - 1 - i];
  BEFORE_REFILL
}
y[base + i] = acc;
if (thread_position_in_grid.x == 0) total[0] = 1.0f;
"""
TG_BARRIER = "metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);"


def reverse_kernel(after_fill=TG_BARRIER, before_refill=TG_BARRIER, **replace):
    source = REVERSE_IN_THREADGROUP.replace("AFTER_FILL", after_fill).replace("BEFORE_REFILL", before_refill)
    for old, new in replace.items():
        source = source.replace(old, new)
    return toy_kernel(source)


TG_BROKEN = {
    "no barrier after filling": (reverse_kernel(after_fill=""), "threadgroup memory"),
    # Read-then-refill or refill-then-read, depending on which thread runs first: both races.
    "no barrier before refilling": (reverse_kernel(before_refill=""), "data race on threadgroup memory"),
    "no barrier at all": (reverse_kernel(after_fill="", before_refill=""), "threadgroup memory"),
    "fenced as device memory": (reverse_kernel(TG_BARRIER.replace("threadgroup)", "device)")),
                                "without mem_flags::mem_threadgroup"),
    "fenced as nothing": (reverse_kernel(TG_BARRIER.replace("threadgroup)", "none)")), "fences no memory"),
    "two threads fill one element": (reverse_kernel(**{"tile[i] = ": "tile[i / 2] = "}), "both write"),
    "index past the end": (reverse_kernel(**{"tile[i] = ": "tile[i + 1] = "}), "past the end"),
    "shared across threadgroups": (reverse_kernel(**{"tile[i] = ": "if (base == 0) tile[i] = "}),
                                   "which no thread of its threadgroup wrote"),
    "above 32 KiB": (reverse_kernel(**{"tile[N];": "tile[N];\nthreadgroup float spill[8192];"}),
                     "exceeds Metal's 32768"),
}


@needs_gxx
@pytest.mark.parametrize("name", list(TG_BROKEN))
def test_emulator_rejects_broken_threadgroup_memory_use(name):
    src, message = TG_BROKEN[name]
    # Two threadgroups of 64: interleaved in one pool, each with its own threadgroup memory.
    with pytest.raises(RuntimeError, match=message):
        emulate_many(src, [toy_launch(64, 2)], seeds=(0, 1))


@needs_gxx
def test_emulator_runs_threadgroup_memory_per_threadgroup():
    # 2 threadgroups run interleaved; 40 (2560 threads, above the shim's EMU_INTERLEAVE)
    # one after another.
    for groups in (2, 40):
        x = mx.arange(64 * groups, dtype=mx.float32)
        (y, _), = emulate_many(reverse_kernel(), [toy_launch(64, groups, [x])], seeds=(0, 1, 2))
        want = 2 * x.reshape(groups, 64)[:, ::-1].reshape(-1) + 1
        assert mx.array_equal(y, want).item()
    # Pointers into threadgroup memory are not modelled: refused, not emulated loosely.
    pointer = reverse_kernel(**{"acc += tile[N - 1 - i];": "threadgroup float* p = tile;\nacc += p[N - 1 - i];"})
    with pytest.raises(RuntimeError, match="only_threadgroup_arrays_are_emulated"):
        emulate_many(pointer, [toy_launch(64, 2)])
