"""Run an MLX custom Metal kernel on the CPU: the same body text, the same signature.

``metal_source`` rebuilds the exact source ``mx.fast.metal_kernel`` generates (MLX
0.32's ``write_signature``: template line, one parameter per input in ``constant``
when it has fewer than 8 elements else ``device``, ``&`` for 0-d inputs, ``*_shape`` /
``*_strides`` / ``*_ndim`` when the body names them, the outputs, then the Metal
attributes the body mentions, then the body; plus the explicit instantiation).
``emulate`` turns that same text into C++ (dropping only the ``[[...]]`` attributes of
the signature and the instantiation line, and rewriting each ``threadgroup T name[N];``
into the shim's checked per-threadgroup array), includes ``metal_shim.h``, adds a ``main``
that reads the inputs, runs the whole grid through ``emu_launch`` (shuffled thread
order, fibers for barriers) and writes the outputs, compiles it with g++ under
AddressSanitizer (every buffer is its own exact-size allocation, so any read or write
out of bounds aborts the run), and returns the outputs as MLX arrays.
"""

import hashlib
import os
import re
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
    "threads_per_threadgroup", "thread_index_in_simdgroup", "simdgroup_index_in_threadgroup",
    "threads_per_simdgroup", "simdgroups_per_threadgroup",
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


# A threadgroup array declared in a kernel body: `threadgroup TYPE NAME[SIZE];`. Other
# uses of `threadgroup` stay as they are, and the shim's macro makes them fail to compile.
THREADGROUP_ARRAY = re.compile(r"\bthreadgroup\s+([A-Za-z_][\w:]*)\s+([A-Za-z_]\w*)\s*\[([^\[\]]+)\]\s*;")


def emulate_threadgroup_arrays(text: str) -> tuple:
    """(C++ text with each threadgroup array rewritten as the shim's EmuThreadgroupArray,
    whether there was any)."""
    sites = iter(range(1 << 30))
    out, n = THREADGROUP_ARRAY.subn(
        lambda m: f'EmuThreadgroupArray<{m[1]}, ({m[3]})> {m[2]}("{m[2]}", {next(sites)});', text)
    return out, n > 0


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
    barriers = any(f in src.header + src.source for f in ("threadgroup_barrier", "simd_sum"))
    kernel_text, tg_memory = emulate_threadgroup_arrays(metal_source(src, launch, metal=False))
    n_in, sizes = len(launch.inputs), _sizes(launch)
    threads = gx * gy * gz
    races = sum(sizes[n_in:]) * threads <= RACE_TRACKING_BUDGET
    return "\n".join([
        f"namespace case_{i} {{",
        kernel_text,
        *lines,
        f"static const size_t sizes[] = {{{', '.join(map(str, sizes))}}};",
        "int run(void** bufs, unsigned seed) {",
        f"  return emu_launch({{{gx}u, {gy}u, {gz}u}}, {{{tx}u, {ty}u, {tz}u}}, "
        f"{'true' if barriers else 'false'}, {'true' if tg_memory else 'false'}, seed, emu_outputs(bufs, {n_in}, {len(sizes)}, sizes), "
        f"{'true' if races else 'false'}, [&](const EmuThread& emu_t) {{",
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
    table = [f"  {{case_{i}::run, {len(launch.inputs)}, {len(_sizes(launch))}, case_{i}::sizes}},"
             for i, launch in enumerate(launches)]
    return "\n".join([
        '#include "metal_shim.h"',
        f"#pragma GCC poison {' '.join(METAL_FORBIDDEN)}",
        *cases,
        "static const EmuCase emu_cases[] = {",
        *table,
        "};",
        "int main(int argc, char** argv) { return emu_main(argc, argv, emu_cases); }",
        "",
    ])


# C++ that Metal rejects (MSL specification, "C++ features not supported"): poisoned for
# the kernel text; variable-length arrays are errors (-Werror=vla).
METAL_FORBIDDEN = ("double", "std", "new", "delete", "throw", "try", "catch", "goto",
                   "virtual", "typeid", "dynamic_cast", "thread_local", "register")
# Race tracking compares every output byte after each thread's run: skip it where that
# would compare more than this many bytes (the published-size conv).
RACE_TRACKING_BUDGET = 10**9
MAX_THREADS_PER_THREADGROUP = 1024  # Metal's limit on every Apple GPU
CXXFLAGS = ["-std=c++17", "-O0", "-g0", "-ffp-contract=off", "-fno-fast-math",
            "-Werror=vla", "-fsanitize=address", "-Wall",
            "-Wno-unused-variable", "-Wno-sign-compare", "-Wno-unused-but-set-variable"]


def _gxx(args, work, program):
    res = subprocess.run([os.environ.get("CXX", "g++"), *args, f"-I{HERE}", "kernel.cpp"],
                         cwd=work, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"g++ failed on the emulated kernel:\n{res.stderr}\n--- source ---\n{program}")


def compile_program(program: str, extra_flags=()) -> Path:
    """Compile (cached by source hash) and return the executable's path.

    Two builds: the one that runs, with `constant` as `volatile`, and a syntax-only one
    with `device` as `volatile`; between them any pointer bound across address spaces
    drops a qualifier and fails, as it fails on Metal."""
    shim = (HERE / "metal_shim.h").read_text()
    flags = [*CXXFLAGS, *extra_flags]
    key = hashlib.sha256((program + shim + " ".join(flags)).encode()).hexdigest()[:20]
    CACHE.mkdir(parents=True, exist_ok=True)
    exe = CACHE / f"k_{key}"
    if exe.exists():
        return exe
    work = Path(tempfile.mkdtemp(dir=CACHE))
    try:
        (work / "kernel.cpp").write_text(program)
        _gxx(["-std=c++17", "-Werror=vla", "-fsyntax-only", "-DEMU_DEVICE_IS_VOLATILE"], work, program)
        _gxx([*flags, "-DEMU_CONSTANT_IS_VOLATILE", "-o", "kernel"], work, program)
        os.replace(work / "kernel", exe)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return exe


# ---- what Metal would reject before the kernel runs ------------------------------------

PRELUDE_HEADERS = ("utils.h", "bf16.h", "bf16_math.h", "complex.h", "defines.h", "logging.h")


def _prelude_dir() -> Path:
    return Path(mx.__file__).resolve().parent.parent / "mlx" / "include" / "mlx" / "backend" / "metal" / "kernels"


def _top_level_names(text: str) -> set:
    """Names declared at namespace scope (declarations starting in column 0, as
    clang-format lays them out; good enough for MLX's headers and ours)."""
    text = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)
    names = set(re.findall(r"^(?:template\s*<[^>]*>\s*)?(?:struct|class|union|enum(?:\s+class)?)\s+(\w+)",
                           text, flags=re.M))
    names |= set(re.findall(r"^typedef\b[^;]*?\b(\w+)\s*;", text, flags=re.M))
    names |= set(re.findall(r"^using\s+(\w+)\s*=", text, flags=re.M))
    names |= set(re.findall(r"^(?:template\s*<[^>]*>\s*)?(?:[\w:<>,]+[\s*&]+)+(\w+)\s*[(=]", text, flags=re.M))
    return names - {"operator", "if", "for", "while", "return"}


def mlx_prelude() -> tuple:
    """(macros, namespace-scope names) of the prelude MLX puts before every custom
    kernel (``metal::utils()``: kernels/utils.h and what it includes), read from the
    installed MLX's headers."""
    d = _prelude_dir()
    missing = [h for h in PRELUDE_HEADERS if not (d / h).exists()]
    if missing:
        raise FileNotFoundError(f"MLX's Metal prelude headers {missing} are not in {d}")
    text = "\n".join((d / h).read_text() for h in PRELUDE_HEADERS)
    return set(re.findall(r"^\s*#\s*define\s+(\w+)", text, flags=re.M)), _top_level_names(text)


def check_metal_rules(src, launches) -> None:
    """Reject what the Metal compiler or MLX would reject and g++ would accept: a
    threadgroup above Metal's 1024 threads; a name that clashes with MLX's prelude
    (a macro used anywhere, or a namespace-scope name the kernel's header declares again)."""
    for launch in launches:
        threads = int(np.prod(launch.threadgroup))
        if threads > MAX_THREADS_PER_THREADGROUP:
            raise ValueError(f"{src.name}: a threadgroup of {threads} threads exceeds Metal's "
                             f"{MAX_THREADS_PER_THREADGROUP}")
    macros, names = mlx_prelude()
    words = set(re.findall(r"\b[A-Za-z_]\w*\b", src.header + src.source))
    words |= {n for launch in launches for n, _ in launch.template}
    clash = sorted((words & macros) | (_top_level_names(src.header) & names))
    if clash:
        raise ValueError(f"{src.name}: {clash} clash with MLX's Metal prelude (utils.h)")


def _to_bytes(a: mx.array) -> bytes:
    a = mx.contiguous(a)
    if a.dtype in (mx.float16, mx.bfloat16):
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a)).tobytes()


def _from_bytes(raw: bytes, shape, dtype) -> mx.array:
    buf = mx.array(np.frombuffer(raw, dtype=np.uint8).copy())
    return buf.view(dtype).reshape(shape)


def emulate_many(src, launches, seeds=(0,), extra_flags=()) -> list:
    """Run each launch of kernel ``src`` on the CPU, once per seed (thread orders).

    Returns, per launch, the outputs like the kernel's; raises if two seeds disagree
    bit for bit (the kernel would depend on thread order) or if a run fails.
    """
    check_metal_rules(src, launches)
    exe = compile_program(cpp_program(src, launches), extra_flags)
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


def emulate(src, launch, seed: int = 0, extra_flags=()) -> list:
    """Run one launch of kernel ``src`` on the CPU; returns the outputs like the kernel."""
    return emulate_many(src, [launch], seeds=(seed,), extra_flags=extra_flags)[0]
