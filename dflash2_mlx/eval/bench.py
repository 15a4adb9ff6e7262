"""Plain decoding, DFlash v1 and DFlash 2 side by side on the same prompts.

For every sampled prompt and temperature the methods run back to back in one process
(so a busy machine slows them alike): plain ``mlx_lm.stream_generate``, then each
drafter through ``dflash2_mlx.stream_generate`` at a fixed block size, then the last
drafter (DFlash 2) again with adaptive speculation (block size "auto"; its histogram of
chosen block sizes is in the report).  Those rows draft every block with the drafter
(they compare drafters); the "+ copies" rows run the same fixed and adaptive blocks as
``generate`` does by default, copying where the sequence repeats itself (``loop/lookup.py``).
Per method and temperature the report has tau (accepted draft tokens + the bonus token,
per cycle), generation tok/s (tokens after the first over the time after the first, as
mlx-lm counts them), the speed-up over plain decoding at the same temperature, and the
per-position acceptance rate.  At T=0
every drafter's tokens must equal plain decoding's token for token; each difference is
recorded as a mismatch (``report["mismatches"]``) and reported loudly.

``write_report`` saves bench.json, bench.md, speed.png and acceptance.png.
"""

import json
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from ..calibration import costs as pair_costs
from ..figures import pyplot, save_figure
from ..loop.target import attach
from ..tree import check_budget as trees_check
from ..machine.identity import describe
from ..train.data import encode
from .profile import cycle_breakdown, format_breakdown
from .report import fmt, plot_acceptance, position_table, table, write_report as write_files
from .evaluate import oracle_run
from .runs import RunTally, run_dflash, run_plain

PLAIN = "plain"
FIXED_BLOCK = 5  # the fixed-block rows' block size unless given


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


def warm_up(model, tokenizer, runs: Dict[str, tuple]):
    """One short run per method, so compilation, allocation and the adaptive row's cost
    calibration (once per pair and machine, then cached) are not timed."""
    ids = tokenizer.encode("Hello")
    run_plain(model, tokenizer, ids, 0.0, 4, 0)
    for d, block_size, lookup, tree in runs.values():
        run_dflash(model, tokenizer, d, ids, 0.0, 4, block_size, 0, lookup, tree)


def dflash_runs(drafters: Dict[str, object], block_size: Optional[int], adaptive: bool,
                sweep: Sequence[int] = (), copies: bool = True, trees: Sequence[int] = ()) -> Dict[str, tuple]:
    """{method: (drafter, block size, lookup, tree budget)}: each drafter at the fixed block
    size, the last one (DFlash 2) also at each ``sweep`` size as "<label> block b", verifying
    trees of each of ``trees`` nodes as "<label> tree n" and with block size "auto" as
    "<label> adaptive", all drafting every block; with ``copies``, its fixed and adaptive
    rows again copying where the sequence repeats ("... + copies")."""
    fixed = block_size or FIXED_BLOCK
    runs = {k: (d, min(fixed, d.config.block_size), False, None) for k, d in drafters.items()}
    if drafters:
        label = list(drafters)[-1]
        for b in sorted(set(sweep) - {runs[label][1]}):
            if not 1 <= b <= drafters[label].config.block_size:
                raise ValueError(f"sweep block size {b} is impossible for the {label} drafter: "
                                 f"use 1..{drafters[label].config.block_size}")
            runs[f"{label} block {b}"] = (drafters[label], b, False, None)
        for n in trees:  # as deep as the drafter's block reaches
            runs[f"{label} tree {n}"] = (drafters[label], drafters[label].config.block_size, False, trees_check(n))
        if adaptive:
            runs[f"{label} adaptive"] = (drafters[label], "auto", False, None)
        if copies:
            runs[f"{label} + copies"] = (drafters[label], runs[label][1], True, None)
            if adaptive:
                runs[f"{label} adaptive + copies"] = (drafters[label], "auto", True, None)
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
              copies: bool = True, trees: Sequence[int] = ()) -> dict:
    """Run plain decoding and every drafter on every prompt at every temperature.

    ``drafters``: {label: Drafter}, run at ``block_size`` (default 5), the last also
    adaptively unless ``adaptive`` is False.  Returns the report dict (see ``write_report``)."""
    say = log or (lambda s: None)
    runs = dflash_runs(drafters, block_size, adaptive, sweep, copies, trees)
    methods = [PLAIN, *runs]
    temp_keys = [f"T={t:g}" for t in temps]
    report = {
        "config": {"temps": list(temps), "max_tokens": max_tokens,
                   "block_size": block_size or FIXED_BLOCK, "adaptive": adaptive, "trees": list(trees), "copies": copies, "seed": seed, "benches": {b: len(p) for b, p in benches.items()},
                   "drafters": {k: {"version": d.version, "trained_block_size": d.config.block_size,
                                    "layers": d.config.num_hidden_layers}
                                for k, d in drafters.items()}},
        "machine": describe(), "methods": methods, "results": {}, "mismatches": [],
        "t0_checked": 0,
    }
    warm_up(model, tokenizer, runs)
    report["config"]["adaptive_costs"] = _costs(model, runs)
    if drafters:
        first = next(iter(benches.values()))[0]
        label = list(drafters)[-1]
        bs = min(block_size or FIXED_BLOCK, drafters[label].config.block_size)
        report["cycle"] = {"method": label, "block_size": bs,
                           **cycle_breakdown(model, drafters[label], encode(tokenizer, first), bs)}
    tallies = {b: {t: {m: RunTally() for m in methods} for t in temp_keys} for b in benches}
    oracles = _oracle_blocks(drafters, runs) if trees and 0.0 in temps else {}
    tally = {b: [0, 0] for b in oracles}  # tokens, cycles
    tic = time.perf_counter()
    for bench, prompts in benches.items():
        for i, prompt in enumerate(prompts):
            ids = encode(tokenizer, prompt)
            for temp, tk in zip(temps, temp_keys):
                run_seed = seed + 1000 * i + 17
                plain = run_plain(model, tokenizer, ids, temp, max_tokens, run_seed)
                tallies[bench][tk][PLAIN].add(plain)
                line = [f"plain {_rate(plain)}"]
                for b, drafter in oracles.items() if temp == 0 else ():
                    tokens, cycles = oracle_run(attach(model, drafter), drafter, list(ids) + list(plain["tokens"]),
                                                len(ids), b)
                    tally[b][0] += tokens
                    tally[b][1] += cycles
                for name, (drafter, bs, lookup, tree) in runs.items():
                    run = run_dflash(model, tokenizer, drafter, ids, temp, max_tokens, bs, run_seed, lookup, tree)
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
    report["results"] = results(tallies, methods)
    report["oracle"] = {str(b): t / c for b, (t, c) in tally.items() if c}
    return report


def _oracle_blocks(drafters: Dict[str, object], runs: Dict[str, tuple]) -> Dict[int, object]:
    """{block size: drafter} of the oracle rows beside trees: the last drafter's chain block
    and its full block."""
    label = list(drafters)[-1]
    return {runs[label][1]: drafters[label], drafters[label].config.block_size: drafters[label]}


def results(tallies: Dict[str, Dict[str, Dict[str, RunTally]]], methods: List[str]) -> dict:
    """{benchmark or "overall": {temperature: {method: figures, with the speed-up over plain}}}
    from {benchmark: {temperature: {method: tally}}}."""
    out, overall = {}, {}
    for bench, per_temp in tallies.items():
        out[bench] = {tk: {m: t.result() for m, t in per_method.items()} for tk, per_method in per_temp.items()}
        for tk, per_method in per_temp.items():
            for m in methods:
                overall.setdefault(tk, {}).setdefault(m, RunTally()).merge(per_method[m])
    out["overall"] = {tk: {m: t.result() for m, t in per_method.items()} for tk, per_method in overall.items()}
    for per_temp in out.values():
        for res in per_temp.values():
            base = res[PLAIN]["tokens_per_s"]
            for m in methods:
                tps = res[m]["tokens_per_s"]
                res[m]["speedup"] = tps / base if tps and base else None
    return out


def _costs(model, runs) -> Optional[dict]:
    """The adaptive row's cost model (measured in the warm-up, or cached before)."""
    auto = [d for d, bs, *_ in runs.values() if bs == "auto"]
    return pair_costs(attach(model, auto[0]), auto[0]).to_json() if auto else None


def _rate(run: dict) -> str:
    tps = run["generation_tokens"] / run["seconds"] if run["seconds"] else 0.0
    return f"{tps:.1f} tok/s"


def markdown(report: dict) -> str:
    """bench.md: parity, the overall and per-benchmark tables, acceptance by position, the
    adaptive rows' block sizes, where a cycle's time goes, any T=0 mismatch, the machine."""
    cfg, methods = report["config"], report["methods"]
    temps = [f"T={t:g}" for t in cfg["temps"]]
    overall = report["results"]["overall"]
    drafted = [m for m in methods if m != PLAIN]
    lines = ["# dflash2-mlx bench", "", *_parity(report), *_setting(cfg), "", "## Overall", ""]
    lines += table(["method"] + [f"{col} {t}" for t in temps for col in ("τ", "tok/s", "speed-up")],
                   [[m] + [c for t in temps for c in (fmt(overall[t][m].get("tau")),
                                                      fmt(overall[t][m]["tokens_per_s"], ".1f"),
                                                      fmt(overall[t][m]["speedup"]) + "×")]
                    for m in methods])
    lines += ["", "## Per benchmark", ""]
    lines += table(["benchmark", "method"] + [f"{col} {t}" for t in temps for col in ("τ", "speed-up")],
                   [[bench, m] + [c for t in temps for c in (fmt(res[t][m].get("tau")),
                                                             fmt(res[t][m]["speedup"]) + "×")]
                    for bench, res in report["results"].items() if bench != "overall" for m in methods])
    if report.get("oracle"):
        lines += ["", "Oracle (T=0): the τ of a run whose every block takes the true tokens while they are "
                  "among the drafter's top 16 (a bound no selector or tree of that depth can pass): "
                  + ", ".join(f"block {b} {tau:.2f}" for b, tau in report["oracle"].items()) + "."]
    for t in temps:
        cols = {m: overall[t][m].get("acceptance_by_position", []) for m in drafted}
        if any(cols.values()):
            lines += ["", f"## Acceptance rate by block position ({t}, overall)", "", position_table(cols)]
    lines += _adaptive_rows(report, temps, drafted)
    cyc = report.get("cycle")
    if cyc:
        lines += ["", f"## Where a cycle's time goes ({cyc['method']}, block {cyc['block_size']}, T=0, "
                  "first prompt)", "", format_breakdown(cyc, cyc["block_size"]) + "."]
    if report["mismatches"]:
        lines += ["", "## T=0 mismatches", ""]
        lines += table(["benchmark", "prompt", "method", "first differing token", "plain", "method"],
                       [[x["bench"], x["prompt"], x["method"], x["position"], json.dumps(x["plain_text"]),
                         json.dumps(x["method_text"])] for x in report["mismatches"]])
    mach = report["machine"]
    lines += ["", f"Machine: {mach['platform']}, {mach['cpus']} CPUs, mlx {mach['mlx']}, "
              f"Metal {'yes' if mach['metal'] else 'no'}"
              + (f", LD_PRELOAD={mach['ld_preload']}" if mach["ld_preload"] else "")
              + f". Wall time {report.get('wall_seconds', 0):.0f} s."]
    return "\n".join(lines) + "\n"


def _parity(report: dict) -> List[str]:
    if report["mismatches"]:
        return [f"**T=0 MISMATCH: {len(report['mismatches'])} of {report['t0_checked']} "
                "DFlash outputs differ from plain decoding** (details below).", ""]
    if report["t0_checked"]:
        return [f"T=0 parity: all {report['t0_checked']} DFlash outputs are identical to plain "
                "decoding, token for token.", ""]
    return []


def _setting(cfg: dict) -> List[str]:
    bs = f"fixed block size {cfg['block_size']}" + (
        "; the adaptive rows choose every cycle (block size auto)" if cfg.get("adaptive") else "") + (
        "; \"+ copies\" rows copy where the sequence repeats itself (as generate does), the "
        "others draft every block" if cfg.get("copies") else "")
    return [f"{sum(cfg['benches'].values())} prompts ({', '.join(f'{b} {k}' for b, k in cfg['benches'].items())}), "
            f"max {cfg['max_tokens']} tokens, {bs}, seed {cfg['seed']}."]


def _adaptive_rows(report: dict, temps: List[str], drafted: List[str]) -> List[str]:
    """The block sizes the adaptive rows chose, against the best fixed one, and the cost model."""
    overall = report["results"]["overall"]
    chosen = [(m, t, overall[t][m]["block_sizes"]) for m in drafted for t in temps
              if " adaptive" in m and overall[t][m].get("block_sizes")]
    if not chosen:
        return []
    lines = ["", "## Block sizes chosen by the adaptive rows (cycles; 1 = plain decode step)", ""]
    lines += table(["method", "temperature", "block sizes", "plain steps with a shadow probe", "copies"],
                   [[m, t, ", ".join(f"{b}: {c}" for b, c in hist.items()),
                     overall[t][m].get("shadows", 0), overall[t][m].get("copies", 0)] for m, t, hist in chosen])
    for m, t, _ in chosen:
        if not m.endswith(" adaptive"):
            continue
        label = m[: -len(" adaptive")]
        best = best_fixed(overall[t], label, m)
        if best and len([x for x in report["methods"] if x.startswith(label)]) > 2:
            lines.append(f"\n{t}: {m} runs at {best[2]:.2f}x the best fixed block size "
                         f"({best[0]}, {best[1]:.1f} tok/s).")
    costs = report["config"].get("adaptive_costs")
    if costs:
        lines += ["", "Cost model: target pass (ms at context 0, +ms per 1k tokens) "
                  + ", ".join(f"{b} rows {1e3 * v[0]:.1f} +{1e6 * v[1]:.1f}" for b, v in costs["target"].items())
                  + "; drafter step " + ", ".join(f"block {b} {1e3 * v[0]:.1f} +{1e6 * v[1]:.1f}"
                                                 for b, v in costs["drafter"].items())
                  + f"; calibrated in {costs['calibration_s']:.2f} s (cached per pair and machine)."]
    return lines

def plot(report: dict, out_dir) -> List[Path]:
    """speed.png (tok/s and τ per method and temperature) and acceptance.png."""
    out_dir = Path(out_dir)
    methods = report["methods"]
    temps = [f"T={t:g}" for t in report["config"]["temps"]]
    overall = report["results"]["overall"]
    fig, axes = pyplot().subplots(1, 2, figsize=(10, 3.8))
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
    paths = [save_figure(fig, out_dir / "speed.png")]
    curves = {t: [(f"{m} (τ {fmt(overall[t][m].get('tau'))})", overall[t][m].get("acceptance_by_position"))
                  for m in methods] for t in temps}
    paths.append(plot_acceptance(curves, out_dir / "acceptance.png"))
    return paths


def write_report(report: dict, out_dir) -> List[Path]:
    """bench.json, bench.md, speed.png, acceptance.png under ``out_dir``."""
    return write_files(out_dir, "bench", report, markdown(report), plot)
