"""Run an MLX custom Metal kernel on the CPU: the same body text, the same signature.

``metal_source`` rebuilds the exact source ``mx.fast.metal_kernel`` generates (MLX
0.32's ``write_signature``: template line, one parameter per input in ``constant``
when it has fewer than 8 elements else ``device``, ``&`` for 0-d inputs, ``*_shape`` /
``*_strides`` / ``*_ndim`` when the body names them, the outputs, then the Metal
attributes the body mentions, then the body; plus the explicit instantiation).
``emulate`` turns that same text into C++ (dropping only the ``[[...]]`` attributes of
the signature and the instantiation line), includes ``metal_shim.h``, adds a ``main``
that reads the inputs, runs the whole grid through ``emu_launch`` (shuffled thread
order, fibers for barriers) and writes the outputs, compiles it with g++ under
AddressSanitizer (every buffer is its own exact-size allocation, so any read or write
out of bounds aborts the run), and returns the outputs as MLX arrays.
"""

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

HERE = Path(__file__).resolve().parent
CACHE = Path(tempfile.gettempdir()) / "dflash2_metal_emu"
MAX_CONSTANT_ARRAY_SIZE = 8

TYPE_STRINGS = {
    mx.bool_: "bool", mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t",
    mx.uint64: "uint64_t", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t",
    mx.int64: "int64_t", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t",
    mx.float32: "float",
}

# (attribute, type) in the order MLX declares them.
METAL_ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]
EMULATED_ATTRIBUTES = {
    "dispatch_threads_per_threadgroup", "thread_index_in_threadgroup",
    "thread_position_in_grid", "thread_position_in_threadgroup",
    "threadgroup_position_in_grid", "threadgroups_per_grid", "threads_per_grid",
    "threads_per_threadgroup",
}


def _template_value(v):
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    return TYPE_STRINGS[v]


def used_attributes(source: str) -> list:
    return [(a, t) for a, t in METAL_ATTRIBUTES if a in source]


def shape_infos(src) -> list:
    return [tuple(f"{n}_{s}" in src.source for s in ("shape", "strides", "ndim"))
            for n in src.input_names]


def kernel_name(src, template) -> str:
    name = "custom_kernel_" + src.name
    if template:
        # MLX: "<a, b>" with "<", ">" and ", " replaced by "_", last "_" dropped.
        name += "__" + "_".join(_template_value(v) for _, v in template)
    return name


def metal_source(src, launch, metal: bool = True) -> str:
    """The full kernel source MLX generates for this launch (metal=False: as C++)."""
    attr = (lambda s: f" [[{s}]]") if metal else (lambda s: "")
    name = kernel_name(src, launch.template)
    text = src.header
    if launch.template:
        kinds = ["bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "typename"
                 for _, v in launch.template]
        text += "template <" + ", ".join(f"{k} {n}" for k, (n, _) in zip(kinds, launch.template)) + ">\n"
    text += ("[[kernel]] void " if metal else "void ") + name + "(\n"
    params, index = [], 0
    for n, a, info in zip(src.input_names, launch.inputs, shape_infos(src)):
        loc = "constant" if a.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if a.ndim == 0 else "*"
        params.append(f"  const {loc} {TYPE_STRINGS[a.dtype]}{ref} {n}{attr(f'buffer({index})')}")
        index += 1
        if a.ndim > 0:
            for flag, suffix, typ in zip(info, ("shape", "strides", "ndim"),
                                         ("int*", "int64_t*", "int&")):
                if flag:
                    params.append(f"  const constant {typ} {n}_{suffix}{attr(f'buffer({index})')}")
                    index += 1
    for n, d in zip(src.output_names, launch.output_dtypes):
        params.append(f"  device {TYPE_STRINGS[d]}* {n}{attr(f'buffer({index})')}")
        index += 1
    params += [f"  {t} {a}{attr(a)}" for a, t in used_attributes(src.source)]
    text += ",\n".join(params) + ") {\n" + src.source + "\n}\n"
    if metal and launch.template:
        targs = "<" + ", ".join(_template_value(v) for _, v in launch.template) + ">"
        text += (f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({name}{targs}) '
                 f"{name}{targs};\n")
    return text


def _group_dims(launch):
    return tuple(min(t, g) for t, g in zip(launch.threadgroup, launch.grid))


def _case_code(src, launch, i: int) -> str:
    """One launch as C++: the kernel text in its own namespace, and a runner."""
    unsupported = [a for a, _ in used_attributes(src.source) if a not in EMULATED_ATTRIBUTES]
    if unsupported:
        raise NotImplementedError(f"the emulator does not model {unsupported}")
    name = kernel_name(src, launch.template)
    targs = ("<" + ", ".join(_template_value(v) for _, v in launch.template) + ">") if launch.template else ""
    lines, args, nbuf = [], [], 0
    for n, a, info in zip(src.input_names, launch.inputs, shape_infos(src)):
        t = TYPE_STRINGS[a.dtype]
        args.append(f"*(const {t}*)bufs[{nbuf}]" if a.ndim == 0 else f"(const {t}*)bufs[{nbuf}]")
        nbuf += 1
        if a.ndim > 0:
            if info[0]:
                lines.append(f"static const int {n}_shape_v[] = {{{', '.join(map(str, a.shape))}}};")
                args.append(f"{n}_shape_v")
            if info[1]:
                strides = np.cumprod([1, *a.shape[::-1]])[:-1][::-1]
                lines.append(f"static const int64_t {n}_strides_v[] = {{{', '.join(map(str, strides))}}};")
                args.append(f"{n}_strides_v")
            if info[2]:
                lines.append(f"static const int {n}_ndim_v = {a.ndim};")
                args.append(f"{n}_ndim_v")
    for d in launch.output_dtypes:
        args.append(f"({TYPE_STRINGS[d]}*)bufs[{nbuf}]")
        nbuf += 1
    args += [f"emu_t.{a}" for a, _ in used_attributes(src.source)]
    gx, gy, gz = launch.grid
    tx, ty, tz = _group_dims(launch)
    barriers = "threadgroup_barrier" in src.source
    return "\n".join([
        f"namespace case_{i} {{",
        metal_source(src, launch, metal=False),
        *lines,
        "int run(void** bufs, unsigned seed) {",
        f"  return emu_launch({{{gx}u, {gy}u, {gz}u}}, {{{tx}u, {ty}u, {tz}u}}, "
        f"{'true' if barriers else 'false'}, seed, [&](const EmuThread& emu_t) {{",
        f"    {name}{targs}(",
        "      " + ",\n      ".join(args) + ");",
        "  });",
        "}",
        f"}}  // namespace case_{i}",
    ])


def _sizes(launch) -> list:
    return [a.nbytes for a in launch.inputs] + [
        int(np.prod(s, dtype=np.int64)) * d.size for s, d in zip(launch.output_shapes, launch.output_dtypes)
    ]


def cpp_program(src, launches) -> str:
    """One executable for several launches of one kernel: `prog CASE SEED files...`."""
    cases = [_case_code(src, launch, i) for i, launch in enumerate(launches)]
    table = []
    for i, launch in enumerate(launches):
        sizes = _sizes(launch)
        table.append(f"  {{case_{i}::run, {len(launch.inputs)}, {len(sizes)}, "
                     f"{{{', '.join(map(str, sizes))}}}}},")
    most = max(len(_sizes(launch)) for launch in launches)
    return "\n".join([
        '#include "metal_shim.h"',
        *cases,
        "struct EmuCase { int (*run)(void**, unsigned); int n_in, n_buf; size_t sizes[%d]; };" % most,
        "static const EmuCase emu_cases[] = {",
        *table,
        "};",
        "int main(int argc, char** argv) {",
        "  // argv: case, seed, input files..., output files...",
        "  const EmuCase& c = emu_cases[std::atoi(argv[1])];",
        "  unsigned seed = (unsigned)std::strtoul(argv[2], nullptr, 10);",
        "  std::vector<void*> bufs(c.n_buf);",
        "  for (int i = 0; i < c.n_buf; ++i) {",
        "    bufs[i] = std::malloc(c.sizes[i] ? c.sizes[i] : 1);  // exact size: ASan sees overruns",
        "    if (i < c.n_in) {",
        '      FILE* f = std::fopen(argv[3 + i], "rb");',
        "      if (!f || std::fread(bufs[i], 1, c.sizes[i], f) != c.sizes[i]) return 3;",
        "      std::fclose(f);",
        "    } else {",
        "      std::memset(bufs[i], 0xFF, c.sizes[i]);  // unwritten outputs read as NaN / -1",
        "    }",
        "  }",
        "  int rc = c.run(bufs.data(), seed);",
        "  if (rc) return rc;",
        "  for (int i = c.n_in; i < c.n_buf; ++i) {",
        '    FILE* f = std::fopen(argv[3 + i], "wb");',
        "    if (!f || std::fwrite(bufs[i], 1, c.sizes[i], f) != c.sizes[i]) return 4;",
        "    std::fclose(f);",
        "  }",
        "  for (void* b : bufs) std::free(b);",
        "  return 0;",
        "}",
        "",
    ])


CXXFLAGS = ["-std=c++17", "-O0", "-g0", "-ffp-contract=off", "-fno-fast-math",
            "-fsanitize=address", "-Wall",
            "-Wno-unused-variable", "-Wno-sign-compare", "-Wno-unused-but-set-variable"]


def compile_program(program: str) -> Path:
    """Compile (cached by source hash) and return the executable's path."""
    shim = (HERE / "metal_shim.h").read_text()
    key = hashlib.sha256((program + shim + " ".join(CXXFLAGS)).encode()).hexdigest()[:20]
    CACHE.mkdir(parents=True, exist_ok=True)
    exe = CACHE / f"k_{key}"
    if exe.exists():
        return exe
    work = Path(tempfile.mkdtemp(dir=CACHE))
    try:
        (work / "kernel.cpp").write_text(program)
        res = subprocess.run(
            [os.environ.get("CXX", "g++"), *CXXFLAGS, f"-I{HERE}", "kernel.cpp", "-o", "kernel"],
            cwd=work, capture_output=True, text=True,
        )
        if res.returncode:
            raise RuntimeError(f"g++ failed on the emulated kernel:\n{res.stderr}\n--- source ---\n{program}")
        os.replace(work / "kernel", exe)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return exe


def _to_bytes(a: mx.array) -> bytes:
    a = mx.contiguous(a)
    if a.dtype in (mx.float16, mx.bfloat16):
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a)).tobytes()


def _from_bytes(raw: bytes, shape, dtype) -> mx.array:
    buf = mx.array(np.frombuffer(raw, dtype=np.uint8).copy())
    return buf.view(dtype).reshape(shape)


def emulate_many(src, launches, seeds=(0,)) -> list:
    """Run each launch of kernel ``src`` on the CPU, once per seed (thread orders).

    Returns, per launch, the outputs like the kernel's; raises if two seeds disagree
    bit for bit (the kernel would depend on thread order) or if a run fails.
    """
    exe = compile_program(cpp_program(src, launches))
    results = []
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        # ASan must be the first runtime loaded: drop any preloaded library (OpenBLAS).
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        env["ASAN_OPTIONS"] = "detect_leaks=0:detect_stack_use_after_return=0"
        for i, launch in enumerate(launches):
            ins = [d / f"c{i}_in{j}" for j in range(len(launch.inputs))]
            for p, a in zip(ins, launch.inputs):
                p.write_bytes(_to_bytes(a))
            first = None
            for seed in seeds:
                outs = [d / f"c{i}_s{seed}_out{j}" for j in range(len(launch.output_shapes))]
                res = subprocess.run([str(exe), str(i), str(seed), *map(str, ins), *map(str, outs)],
                                     capture_output=True, text=True, env=env)
                if res.returncode:
                    raise RuntimeError(f"emulated kernel {src.name}, case {i}, seed {seed} failed "
                                       f"(rc {res.returncode}):\n{res.stderr[-4000:]}")
                raw = [p.read_bytes() for p in outs]
                if first is None:
                    first = raw
                elif raw != first:
                    raise AssertionError(f"emulated kernel {src.name}, case {i}: the result "
                                         f"depends on thread order (seed {seed} vs {seeds[0]})")
            results.append([_from_bytes(r, s, dt)
                            for r, s, dt in zip(first, launch.output_shapes, launch.output_dtypes)])
    return results


def emulate(src, launch, seed: int = 0) -> list:
    """Run one launch of kernel ``src`` on the CPU; returns the outputs like the kernel."""
    return emulate_many(src, [launch], seeds=(seed,))[0]
