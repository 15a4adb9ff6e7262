"""Plain decoding, DFlash v1 and DFlash 2 side by side on the same prompts.

For every sampled prompt and temperature the methods run back to back in one process
(so a busy machine slows them alike): plain ``mlx_lm.stream_generate``, then each
drafter through ``dflash2_mlx.stream_generate`` at a fixed block size, then the last
drafter (DFlash 2) again with adaptive speculation (block size "auto"; its histogram of
chosen block sizes is in the report).  Those rows draft every block with the drafter
(they compare drafters); the "+ copies" rows run the same fixed and adaptive blocks as
``generate`` does by default, copying where the sequence repeats itself (``lookup.py``).  Per method and temperature the report
has tau (accepted draft tokens + the bonus token, per cycle), generation tok/s (tokens
after the first over the time after the first, as mlx-lm counts them), the speed-up over
plain decoding at the same temperature, and the per-position acceptance rate.  At T=0
every drafter's tokens must equal plain decoding's token for token; each difference is
recorded as a mismatch (``report["mismatches"]``) and reported loudly.

``write_report`` saves bench.json, bench.md, speed.png and acceptance.png.
"""

import json
import random
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..machine.identity import describe
from .evaluate import plot_acceptance

PLAIN = "plain"
FIXED_BLOCK = 5  # the fixed-block rows' block size unless given


def sample_prompts(paths: Sequence, samples: int, seed: int = 0) -> Dict[str, list]:
    """{file stem: ``samples`` prompts drawn at random (seeded) from each jsonl file}."""
    from ..train.data import read_prompts

    rng = random.Random(seed)
    out = {}
    for p in paths:
        prompts = [q for _, q in read_prompts(p)]
        idx = sorted(rng.sample(range(len(prompts)), min(samples, len(prompts))))
        out[Path(p).stem] = [prompts[i] for i in idx]
    return out


def run_plain(model, tokenizer, ids: List[int], temp: float, max_tokens: int, seed: int) -> dict:
    """One plain ``mlx_lm.stream_generate`` run: tokens and generation timing."""
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    tokens, last = [], None
    for last in mlx_lm.stream_generate(model, tokenizer, mx.array(ids), max_tokens=max_tokens,
                                       sampler=make_sampler(temp)):
        tokens.append(int(last.token))
    return _run(tokens, last)


def run_dflash(model, tokenizer, drafter, ids: List[int], temp: float, max_tokens: int,
               block_size, seed: int, lookup: bool = False) -> dict:
    """One DFlash run through the public ``stream_generate``: tokens, timing, draft stats."""
    from ..generate import stream_generate

    tokens, last = [], None
    for last in stream_generate(model, tokenizer, ids, drafter, max_tokens=max_tokens,
                                temp=temp, block_size=block_size, seed=seed, lookup=lookup):
        tokens.append(int(last.token))
    out = _run(tokens, last)
    out.update(cycles=last.cycles if last else 0,
               acceptance_counts=list(last.acceptance_counts) if last else [],
               block_sizes=dict(last.block_sizes) if last else {},
               shadows=last.shadows if last else 0, copies=last.copies if last else 0)
    return out


def _run(tokens, last) -> dict:
    n = last.generation_tokens if last else 0
    seconds = n / last.generation_tps if last and last.generation_tps else 0.0
    return {"tokens": tokens, "generation_tokens": n, "seconds": seconds}


def first_mismatch(reference: Sequence[int], tokens: Sequence[int]) -> Optional[int]:
    """Index of the first token where two outputs differ (a length difference counts),
    or None when they are identical."""
    for i, (a, b) in enumerate(zip(reference, tokens)):
        if a != b:
            return i
    return None if len(reference) == len(tokens) else min(len(reference), len(tokens))


def mismatch_record(tokenizer, bench: str, index: int, method: str, reference, tokens) -> Optional[dict]:
    """A report entry for a T=0 output that differs from plain decoding (None if equal)."""
    at = first_mismatch(reference, tokens)
    if at is None:
        return None
    pick = lambda seq: seq[at] if at < len(seq) else None
    return {"bench": bench, "prompt": index, "method": method, "position": at,
            "plain_token": pick(reference), "method_token": pick(tokens),
            "plain_length": len(reference), "method_length": len(tokens),
            "plain_text": tokenizer.decode(reference[max(0, at - 8): at + 8]),
            "method_text": tokenizer.decode(tokens[max(0, at - 8): at + 8])}


class Tally:
    """Tokens, time, cycles and per-position acceptance that add up over runs."""

    def __init__(self):
        self.tokens, self.seconds, self.cycles, self.runs, self.shadows, self.copies = 0, 0.0, 0, 0, 0, 0
        self.positions: List[int] = []
        self.block_sizes: Dict[int, int] = {}

    def add(self, run: dict):
        self.runs += 1
        self.tokens += run["generation_tokens"]
        self.seconds += run["seconds"]
        self.cycles += run.get("cycles", 0)
        self.shadows += run.get("shadows", 0)
        self.copies += run.get("copies", 0)
        counts = run.get("acceptance_counts", [])
        if len(counts) > len(self.positions):
            self.positions += [0] * (len(counts) - len(self.positions))
        for i, c in enumerate(counts):
            self.positions[i] += c
        for b, n in run.get("block_sizes", {}).items():
            self.block_sizes[int(b)] = self.block_sizes.get(int(b), 0) + n

    def merge(self, other: "Tally"):
        self.add({"generation_tokens": other.tokens, "seconds": other.seconds,
                  "cycles": other.cycles, "acceptance_counts": other.positions,
                  "block_sizes": other.block_sizes, "shadows": other.shadows, "copies": other.copies})
        self.runs += other.runs - 1

    def result(self) -> dict:
        out = {"runs": self.runs, "tokens": self.tokens, "seconds": self.seconds,
               "tokens_per_s": self.tokens / self.seconds if self.seconds else None}
        if self.cycles:
            out.update(cycles=self.cycles, tau=(sum(self.positions) + self.cycles) / self.cycles,
                       acceptance_by_position=[c / self.cycles for c in self.positions],
                       block_sizes=dict(sorted(self.block_sizes.items())), shadows=self.shadows,
                       copies=self.copies)
        return out


def warm_up(model, tokenizer, runs: Dict[str, tuple]):
    """One short run per method, so compilation, allocation and the adaptive row's cost
    calibration (once per pair and machine, then cached) are not timed."""
    ids = tokenizer.encode("Hello")
    run_plain(model, tokenizer, ids, 0.0, 4, 0)
    for d, block_size, lookup in runs.values():
        run_dflash(model, tokenizer, d, ids, 0.0, 4, block_size, 0, lookup)


def dflash_runs(drafters: Dict[str, object], block_size: Optional[int], adaptive: bool,
                sweep: Sequence[int] = (), copies: bool = True) -> Dict[str, tuple]:
    """{method: (drafter, block size, lookup)}: each drafter at the fixed block size, the
    last one (DFlash 2) also at each ``sweep`` size as "<label> block b" and with block
    size "auto" as "<label> adaptive", all drafting every block; with ``copies``, its
    fixed and adaptive rows again copying where the sequence repeats ("... + copies")."""
    fixed = block_size or FIXED_BLOCK
    runs = {k: (d, min(fixed, d.config.block_size), False) for k, d in drafters.items()}
    if drafters:
        label = list(drafters)[-1]
        for b in sorted(set(sweep) - {runs[label][1]}):
            if not 1 <= b <= drafters[label].config.block_size:
                raise ValueError(f"sweep block size {b} is impossible for the {label} drafter: "
                                 f"use 1..{drafters[label].config.block_size}")
            runs[f"{label} block {b}"] = (drafters[label], b, False)
        if adaptive:
            runs[f"{label} adaptive"] = (drafters[label], "auto", False)
        if copies:
            runs[f"{label} + copies"] = (drafters[label], runs[label][1], True)
            if adaptive:
                runs[f"{label} adaptive + copies"] = (drafters[label], "auto", True)
    return runs


def best_fixed(overall: dict, label: str, adaptive_run: str) -> Optional[tuple]:
    """(best fixed-block method of ``label``, its tok/s, the adaptive row's tok/s / it)."""
    fixed = {m: r["tokens_per_s"] for m, r in overall.items()
             if (m == label or m.startswith(f"{label} block ")) and r["tokens_per_s"]}
    if not fixed or not overall.get(adaptive_run, {}).get("tokens_per_s"):
        return None
    m = max(fixed, key=fixed.get)
    return m, fixed[m], overall[adaptive_run]["tokens_per_s"] / fixed[m]


def run_bench(model, tokenizer, drafters: Dict[str, object], benches: Dict[str, list], *,
              temps: Sequence[float] = (0.0, 1.0), max_tokens: int = 64,
              block_size: Optional[int] = None, adaptive: bool = True, seed: int = 0,
              sweep: Sequence[int] = (), log: Optional[Callable[[str], None]] = None,
              copies: bool = True) -> dict:
    """Run plain decoding and every drafter on every prompt at every temperature.

    ``drafters``: {label: Drafter}, run at ``block_size`` (default 5), the last also
    adaptively unless ``adaptive`` is False.  Returns the report dict (see ``write_report``)."""
    from ..train.data import encode

    say = log or (lambda s: None)
    runs = dflash_runs(drafters, block_size, adaptive, sweep, copies)
    methods = [PLAIN, *runs]
    temp_keys = [f"T={t:g}" for t in temps]
    report = {
        "config": {"temps": list(temps), "max_tokens": max_tokens,
                   "block_size": block_size or FIXED_BLOCK, "adaptive": adaptive, "copies": copies, "seed": seed, "benches": {b: len(p) for b, p in benches.items()},
                   "drafters": {k: {"version": d.version, "trained_block_size": d.config.block_size,
                                    "layers": d.config.num_hidden_layers}
                                for k, d in drafters.items()}},
        "machine": describe(), "methods": methods, "results": {}, "mismatches": [],
        "t0_checked": 0,
    }
    warm_up(model, tokenizer, runs)
    report["config"]["adaptive_costs"] = _costs(model, runs)
    if drafters:
        from .profile import cycle_breakdown

        first = next(iter(benches.values()))[0]
        label = list(drafters)[-1]
        bs = min(block_size or FIXED_BLOCK, drafters[label].config.block_size)
        report["cycle"] = {"method": label, "block_size": bs,
                           **cycle_breakdown(model, drafters[label], encode(tokenizer, first), bs)}
    tallies = {b: {t: {m: Tally() for m in methods} for t in temp_keys} for b in benches}
    tic = time.perf_counter()
    for bench, prompts in benches.items():
        for i, prompt in enumerate(prompts):
            ids = encode(tokenizer, prompt)
            for temp, tk in zip(temps, temp_keys):
                run_seed = seed + 1000 * i + 17
                plain = run_plain(model, tokenizer, ids, temp, max_tokens, run_seed)
                tallies[bench][tk][PLAIN].add(plain)
                line = [f"plain {_rate(plain)}"]
                for name, (drafter, bs, lookup) in runs.items():
                    run = run_dflash(model, tokenizer, drafter, ids, temp, max_tokens, bs, run_seed, lookup)
                    tallies[bench][tk][name].add(run)
                    tau = (sum(run["acceptance_counts"]) + run["cycles"]) / max(run["cycles"], 1)
                    line.append(f"{name} {_rate(run)} tau {tau:.2f}")
                    if temp == 0:
                        report["t0_checked"] += 1
                        bad = mismatch_record(tokenizer, bench, i, name, plain["tokens"], run["tokens"])
                        if bad:
                            report["mismatches"].append(bad)
                            say(f"!!! T=0 MISMATCH: {name} differs from plain decoding on {bench} "
                                f"prompt {i} at token {bad['position']}: plain {bad['plain_text']!r} "
                                f"vs {name} {bad['method_text']!r}")
                say(f"[{bench} {i + 1}/{len(prompts)} {tk}] " + " | ".join(line))
    report["wall_seconds"] = time.perf_counter() - tic
    for bench in benches:
        report["results"][bench] = {tk: {m: tallies[bench][tk][m].result() for m in methods}
                                    for tk in temp_keys}
    overall = {tk: {m: Tally() for m in methods} for tk in temp_keys}
    for bench in benches:
        for tk in temp_keys:
            for m in methods:
                overall[tk][m].merge(tallies[bench][tk][m])
    report["results"]["overall"] = {tk: {m: overall[tk][m].result() for m in methods}
                                    for tk in temp_keys}
    for per_temp in report["results"].values():
        for res in per_temp.values():
            base = res[PLAIN]["tokens_per_s"]
            for m in methods:
                tps = res[m]["tokens_per_s"]
                res[m]["speedup"] = tps / base if tps and base else None
    return report


def _costs(model, runs) -> Optional[dict]:
    """The adaptive row's cost model (measured in the warm-up, or cached before)."""
    from .. import adaptive
    from ..loop.target import attach

    auto = [d for d, bs, _ in runs.values() if bs == "auto"]
    return adaptive.cost_model(attach(model, auto[0]), auto[0]).to_json() if auto else None


def _rate(run: dict) -> str:
    tps = run["generation_tokens"] / run["seconds"] if run["seconds"] else 0.0
    return f"{tps:.1f} tok/s"


def _fmt(x, spec=".2f", none="-"):
    return none if x is None else format(x, spec)


def markdown(report: dict) -> str:
    cfg = report["config"]
    methods = report["methods"]
    temps = [f"T={t:g}" for t in cfg["temps"]]
    n = sum(cfg["benches"].values())
    lines = ["# dflash2-mlx bench", ""]
    if report["mismatches"]:
        lines += [f"**T=0 MISMATCH: {len(report['mismatches'])} of {report['t0_checked']} "
                  "DFlash outputs differ from plain decoding** (details below).", ""]
    elif report["t0_checked"]:
        lines += [f"T=0 parity: all {report['t0_checked']} DFlash outputs are identical to plain "
                  "decoding, token for token.", ""]
    bs = f"fixed block size {cfg['block_size']}" + (
        "; the adaptive rows choose every cycle (block size auto)" if cfg.get("adaptive") else "") + (
        "; \"+ copies\" rows copy where the sequence repeats itself (as generate does), the "
        "others draft every block" if cfg.get("copies") else "")
    lines += [f"{n} prompts ({', '.join(f'{b} {k}' for b, k in cfg['benches'].items())}), "
              f"max {cfg['max_tokens']} tokens, {bs}, seed {cfg['seed']}.", "",
              "## Overall", "",
              "| method | " + " | ".join(f"τ {t} | tok/s {t} | speed-up {t}" for t in temps) + " |",
              "|---|" + "---|" * (3 * len(temps))]
    overall = report["results"]["overall"]
    for m in methods:
        cells = []
        for t in temps:
            r = overall[t][m]
            cells += [_fmt(r.get("tau")), _fmt(r["tokens_per_s"], ".1f"), _fmt(r["speedup"]) + "×"]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "## Per benchmark", "",
              "| benchmark | method | " + " | ".join(f"τ {t} | speed-up {t}" for t in temps) + " |",
              "|---|---|" + "---|" * (2 * len(temps))]
    for bench, res in report["results"].items():
        if bench == "overall":
            continue
        for m in methods:
            cells = []
            for t in temps:
                cells += [_fmt(res[t][m].get("tau")), _fmt(res[t][m]["speedup"]) + "×"]
            lines.append(f"| {bench} | {m} | " + " | ".join(cells) + " |")
    drafted = [m for m in methods if m != PLAIN]
    for t in temps:
        cols = {m: overall[t][m].get("acceptance_by_position", []) for m in drafted}
        T = max((len(v) for v in cols.values()), default=0)
        if not T:
            continue
        lines += ["", f"## Acceptance rate by block position ({t}, overall)", "",
                  "| position | " + " | ".join(drafted) + " |", "|---|" + "---|" * len(drafted)]
        for p in range(T):
            lines.append(f"| {p + 1} | " + " | ".join(
                _fmt(cols[m][p], ".3f") if p < len(cols[m]) else "" for m in drafted) + " |")
    chosen = [(m, t, overall[t][m]["block_sizes"]) for m in drafted for t in temps
              if " adaptive" in m and overall[t][m].get("block_sizes")]
    if chosen:
        lines += ["", "## Block sizes chosen by the adaptive rows (cycles; 1 = plain decode step)", "",
                  "| method | temperature | block sizes | plain steps with a shadow probe | copies |",
                  "|---|---|---|---|---|"]
        for m, t, hist in chosen:
            lines.append(f"| {m} | {t} | " + ", ".join(f"{b}: {c}" for b, c in hist.items())
                         + f" | {overall[t][m].get('shadows', 0)} | {overall[t][m].get('copies', 0)} |")
        for m, t, _ in chosen:
            if not m.endswith(" adaptive"):
                continue
            best = best_fixed(overall[t], m[: -len(" adaptive")], m)
            if best and len([x for x in methods if x.startswith(m[: -len(" adaptive")])]) > 2:
                lines.append(f"\n{t}: {m} runs at {best[2]:.2f}x the best fixed block size "
                             f"({best[0]}, {best[1]:.1f} tok/s).")
        costs = cfg.get("adaptive_costs")
        if costs:
            lines += ["", f"Cost model: target pass (ms at context 0, +ms per 1k tokens) "
                      + ", ".join(f"{b} rows {1e3 * v[0]:.1f} +{1e6 * v[1]:.1f}" for b, v in costs["target"].items())
                      + "; drafter step " + ", ".join(f"block {b} {1e3 * v[0]:.1f} +{1e6 * v[1]:.1f}"
                                                     for b, v in costs["drafter"].items())
                      + f"; calibrated in {costs['calibration_s']:.2f} s (cached per pair and machine)."]
    cyc = report.get("cycle")
    if cyc:
        from .profile import format_breakdown

        lines += ["", f"## Where a cycle's time goes ({cyc['method']}, block {cyc['block_size']}, T=0, "
                  "first prompt)", "", format_breakdown(cyc, cyc["block_size"]) + "."]
    if report["mismatches"]:
        lines += ["", "## T=0 mismatches", "",
                  "| benchmark | prompt | method | first differing token | plain | method |",
                  "|---|---|---|---|---|---|"]
        for x in report["mismatches"]:
            lines.append(f"| {x['bench']} | {x['prompt']} | {x['method']} | {x['position']} | "
                         f"{json.dumps(x['plain_text'])} | {json.dumps(x['method_text'])} |")
    mach = report["machine"]
    lines += ["", f"Machine: {mach['platform']}, {mach['cpus']} CPUs, mlx {mach['mlx']}, "
              f"Metal {'yes' if mach['metal'] else 'no'}"
              + (f", LD_PRELOAD={mach['ld_preload']}" if mach["ld_preload"] else "")
              + f". Wall time {report.get('wall_seconds', 0):.0f} s."]
    return "\n".join(lines) + "\n"


def plot(report: dict, out_dir) -> List[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    methods = report["methods"]
    temps = [f"T={t:g}" for t in report["config"]["temps"]]
    overall = report["results"]["overall"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    x = np.arange(len(temps))
    w = 0.8 / len(methods)
    for i, m in enumerate(methods):
        tps = [overall[t][m]["tokens_per_s"] or 0.0 for t in temps]
        taus = [overall[t][m].get("tau") or 1.0 for t in temps]
        axes[0].bar(x + i * w, tps, w, label=m, color=f"C{i}")
        axes[1].bar(x + i * w, taus, w, label=m, color=f"C{i}")
        for j, t in enumerate(temps):
            s = overall[t][m]["speedup"]
            if s:
                axes[0].text(x[j] + i * w, tps[j], f"{s:.2f}×", ha="center", va="bottom", fontsize=8)
    for ax, title in ((axes[0], "generation tok/s (speed-up over plain)"),
                      (axes[1], "τ (tokens per target pass)")):
        ax.set_xticks(x + w * (len(methods) - 1) / 2, temps)
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths = [out_dir / "speed.png"]
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)
    curves = {t: [(f"{m} (τ {_fmt(overall[t][m].get('tau'))})", overall[t][m].get("acceptance_by_position"))
                  for m in methods] for t in temps}
    paths.append(plot_acceptance(curves, out_dir / "acceptance.png"))
    return paths


def write_report(report: dict, out_dir) -> List[Path]:
    """bench.json, bench.md, speed.png, acceptance.png under ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(report, indent=1))
    (out_dir / "bench.md").write_text(markdown(report))
    return [out_dir / "bench.json", out_dir / "bench.md", *plot(report, out_dir)]


BENCH_FILES = ("gsm8k_test", "math500", "humaneval", "mbpp_test", "mt_bench")
BENCH_DIR_ENV = "DFLASH2_MLX_BENCH_DIR"
# The five prompt sets ship with the package (sources and licenses: builtin/bench_data/SOURCES.md).
SHIPPED_BENCH_DIR = Path(__file__).resolve().parent.parent / "builtin" / "bench_data"


def default_bench_dir() -> Path:
    """``$DFLASH2_MLX_BENCH_DIR`` when set, else the prompt sets shipped in the package."""
    import os

    env = os.environ.get(BENCH_DIR_ENV)
    return Path(env) if env else SHIPPED_BENCH_DIR


def default_bench_files() -> List[Path]:
    """The five prompt sets (GSM8K, MATH-500, HumanEval, MBPP, MT-Bench) of ``default_bench_dir``;
    a ValueError names the directory and what it lacks."""
    where = default_bench_dir()
    files = [where / f"{name}.jsonl" for name in BENCH_FILES]
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise ValueError(f"{where} lacks the prompt set(s) {', '.join(absent)}: "
                         f"give --bench FILE (repeat) or point ${BENCH_DIR_ENV} elsewhere")
    return files
