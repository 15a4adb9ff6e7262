"""Measuring drafters the way the DFlash 2 paper does.

Offline (teacher-forced on the target's own greedy response to each prompt, every
anchor of the response with a full block after it):
- Recall@1 and Recall@k per block position, each conditioned on every earlier position
  being right (Recall@1: the drafter's argmax equals the target's token; Recall@k: the
  target's token is among the top k; the paper's Table 1 - our position 1 is its 0);
- oracle tau: 1 + the leading positions whose true token is in the top k (perfect
  selection over the candidates), beside the top-1 tau (argmax drafting) and, for
  DFlash 2, the greedy selector walk's tau;
- loop tau: the drafter's own tau (selector walk, or argmax for v1) at only the anchors a
  T=0 run visits (each one past the previous block's accepted tokens and bonus).  Every
  anchor is not a fair sample: a run's next anchor follows a miss, where the text is
  harder to guess, so the all-anchor figures run above the real runs' tau and this one
  matches it.
Online (real draft-verify runs through ``stream_generate`` at T=0 and T=1, every block
drafted: no copies, so the figures are the drafter's):
- tau = (accepted draft tokens + cycles) / cycles, per benchmark and overall;
- per-position acceptance: the fraction of cycles that accepted block position i
  (the paper's Figure 5).
``write_report`` saves report.json, report.md and recall.png / acceptance.png with one
line per drafter, so several drafters compare side by side.
"""

import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.generate import batch_generate

from ..figures import pyplot, save_figure
from ..kernels.selector import pair_scores_reference, walk_reference
from ..loop.target import Target, attach
from ..train import objective
from ..train.data import encode
from ..train.features import target_features
from .report import fmt, plot_acceptance, position_table, table, write_report as write_files
from .runs import RunTally, run_dflash


def leading(hits: np.ndarray) -> np.ndarray:
    """Per row, how many positions from the first on are all hits."""
    return np.cumprod(hits.astype(np.int64), axis=1).sum(axis=1)


def conditional_counts(hits: np.ndarray):
    """(num, den) per position: den = rows whose earlier positions all hit, num = those
    that also hit here.  Recall = num / den."""
    prefix = np.cumprod(hits.astype(np.int64), axis=1)
    den = np.concatenate([[hits.shape[0]], prefix[:, :-1].sum(axis=0)])
    return prefix.sum(axis=0), den


def loop_anchors(lead: np.ndarray) -> np.ndarray:
    """Indices of the anchors a T=0 run visits, given each anchor's accepted count: the
    first, then each one past the accepted tokens and the bonus token."""
    out, i = [], 0
    while i < len(lead):
        out.append(i)
        i += int(lead[i]) + 1
    return np.array(out, np.int64)


def oracle_run(target: Target, drafter, seq: List[int], start: int, block_size: int, top_k: int = 16) -> tuple:
    """(tokens, cycles) of the T=0 run an oracle selector would make on ``seq`` (prompt and
    the target's greedy response from ``start``): every block's path the true tokens while
    they are among the drafter's top ``top_k``, every anchor the one such a run visits."""
    _, hitk, _ = offline_hits(target, drafter, seq, start, block_size, top_k)
    lead = leading(hitk)
    visited = loop_anchors(lead)
    return int(lead[visited].sum()) + len(visited), len(visited)


class RecallTally:
    """Offline counts (recall by position, the tau figures) that add up across prompts and
    benchmarks."""

    def __init__(self, T: int):
        self.c = {k: np.zeros(T, np.int64) for k in ("r1_num", "r1_den", "rk_num", "rk_den")}
        self.s = {"blocks": 0, "oracle": 0, "top1": 0, "selector": 0, "loop": 0, "loop_blocks": 0}

    def add(self, hit1, hitk, hitsel=None, every_anchor: bool = True):
        """Hits [N, T] of one sequence; ``every_anchor``: row i is anchor i of its response
        (no anchor left out), so the anchors a run visits can be followed."""
        for name, h in (("r1", hit1), ("rk", hitk)):
            num, den = conditional_counts(h)
            self.c[f"{name}_num"] += num
            self.c[f"{name}_den"] += den
        n = hit1.shape[0]
        self.s["blocks"] += n
        self.s["oracle"] += int(leading(hitk).sum()) + n
        lead = leading(hit1)  # then the drafted path's: the walk's for DFlash 2
        self.s["top1"] += int(lead.sum()) + n
        if hitsel is not None:
            lead = leading(hitsel)
            self.s["selector"] += int(lead.sum()) + n
        if every_anchor:
            visited = loop_anchors(lead)
            self.s["loop"] += int(lead[visited].sum()) + len(visited)
            self.s["loop_blocks"] += len(visited)

    def merge(self, other: "RecallTally"):
        for k in self.c:
            self.c[k] += other.c[k]
        for k in self.s:
            self.s[k] += other.s[k]

    def result(self, version: int) -> dict:
        n = max(self.s["blocks"], 1)
        ratio = lambda a, b: [float(x) / y if y else None for x, y in zip(a, b)]
        out = {
            "blocks": self.s["blocks"],
            "recall_at_1": ratio(self.c["r1_num"], self.c["r1_den"]),
            "recall_at_k": ratio(self.c["rk_num"], self.c["rk_den"]),
            "tau_oracle": self.s["oracle"] / n,
            "tau_top1": self.s["top1"] / n,
        }
        if version == 2:
            out["tau_selector"] = self.s["selector"] / n
        out["tau_loop"] = self.s["loop"] / self.s["loop_blocks"] if self.s["loop_blocks"] else None
        return out


def drafted_blocks(target: Target, drafter, ids: List[int], start: int, block_size: int,
                   top_k: int, max_anchors: Optional[int] = None, chunk: int = 32, seed: int = 0,
                   feats: Optional[mx.array] = None):
    """Yield, per chunk of the full-block anchors of one sequence, (labels, cand, scores):
    the true tokens [N, B-1], the drafter's top-k candidate ids [N, B-1, k] by descending
    logit and, for DFlash 2, the selector's pair scores over its top candidates (else None)."""
    feats = target_features(target, [ids]) if feats is None else feats
    rng = np.random.default_rng(seed)
    seq, anchors = objective.sample_anchors(rng, [start], [len(ids)], max_anchors or len(ids),
                                            full_blocks=block_size)
    for i in range(0, len(anchors), chunk):
        blocks = objective.make_blocks([ids], feats, seq[i : i + chunk], anchors[i : i + chunk],
                                       block_size, drafter.config.mask_token_id)
        hidden = objective.block_forward(drafter, blocks)[:, 1:]
        logits = drafter.logits(hidden)
        order = mx.argsort(-logits, axis=-1)[..., :top_k]
        cand = drafter.token_ids(order)
        scores = None
        if drafter.version == 2:
            sel = drafter.candidate_selector
            scores = pair_scores_reference(
                mx.take_along_axis(logits, order[..., : sel.top_k], axis=-1), cand[..., : sel.top_k],
                sel.hidden_projection(hidden), blocks.block_ids[:, 0], sel.predecessor_codebook,
                sel.successor_codebook)
        yield blocks.labels, cand, scores


def offline_hits(target: Target, drafter, ids: List[int], start: int, block_size: int,
                 top_k: int, max_anchors: Optional[int] = None, chunk: int = 32, seed: int = 0,
                 feats: Optional[mx.array] = None):
    """(hit1, hitk, hitsel) [N, B-1] booleans over the full-block anchors of one sequence
    (``feats``: its target features, when the caller already has them)."""
    T = block_size - 1
    out1, outk, outs = [], [], []
    for labels, cand, scores in drafted_blocks(target, drafter, ids, start, block_size, top_k,
                                               max_anchors, chunk, seed, feats):
        out1.append(np.array(cand[..., 0] == labels))
        outk.append(np.array((cand == labels[..., None]).any(axis=-1)))
        if scores is not None:
            path, _ = walk_reference(scores)
            c = cand[..., : scores.shape[-1]]
            drafted = mx.take_along_axis(c, path[..., None], axis=-1)[..., 0]
            outs.append(np.array(drafted == labels))
    if not out1:
        empty = np.zeros((0, T), bool)
        return empty, empty, (empty if drafter.version == 2 else None)
    return (np.concatenate(out1), np.concatenate(outk),
            np.concatenate(outs) if outs else None)


def greedy_responses(model, tokenizer, prompts, max_tokens: int, batch_size: int = 8):
    """(prompt ids + the target's greedy response, response start) per prompt."""
    enc = [encode(tokenizer, p) for p in prompts]
    out = []
    for b in range(0, len(enc), batch_size):
        chunk = enc[b : b + batch_size]
        res = batch_generate(model, tokenizer, chunk, max_tokens=max_tokens, return_token_ids=True)
        out += [(ids + list(map(int, r)), len(ids)) for ids, r in zip(chunk, res.token_ids)]
    return out


def real_runs(model, tokenizer, drafter, prompts, temp: float, block_size: int,
              max_tokens: int, seed: int = 0) -> RunTally:
    """Draft-verify runs through the public ``stream_generate``, every block drafted (no
    copies: the drafter's own tau)."""
    tally = RunTally()
    for i, prompt in enumerate(prompts):
        tic = time.perf_counter()
        run = run_dflash(model, tokenizer, drafter, encode(tokenizer, prompt), temp, max_tokens,
                         block_size, seed + i, lookup=False)
        run["seconds"] = time.perf_counter() - tic  # this report's tok/s counts the prefill too
        tally.add(run)
    return tally


def run_result(tally: RunTally, positions: int) -> dict:
    """The real runs' figures at a fixed block size (``positions``: the block's drafts)."""
    counts = (tally.positions + [0] * positions)[:positions]
    c = max(tally.cycles, 1)
    return {"tau": (sum(counts) + tally.cycles) / c if tally.cycles else None,
            "cycles": tally.cycles, "tokens": tally.tokens,
            "tokens_per_s": tally.tokens / tally.seconds if tally.seconds else None,
            "acceptance_by_position": [float(x) / c for x in counts]}


def evaluate(model, tokenizer, drafters: Dict[str, object], benches: Dict[str, list], *,
             max_tokens: int = 128, temps: Sequence[float] = (0.0, 1.0),
             block_size: Optional[int] = None, top_k: int = 16,
             max_anchors: Optional[int] = None, seed: int = 0,
             log=None) -> dict:
    """Offline recall / oracle tau and real-run tau for each drafter on each benchmark."""
    say = log or (lambda s: None)
    report = {"config": {"max_tokens": max_tokens, "temps": list(temps), "top_k": top_k,
                         "block_size": block_size, "max_anchors": max_anchors,
                         "benches": {b: len(p) for b, p in benches.items()}},
              "drafters": {}}
    sequences = {}
    for bench, prompts in benches.items():
        say(f"[{bench}] target responses for {len(prompts)} prompts")
        sequences[bench] = greedy_responses(model, tokenizer, prompts, max_tokens)
    for name, drafter in drafters.items():
        B = min(block_size or drafter.config.block_size, drafter.config.block_size)
        target = attach(model, drafter)
        entry = {"version": drafter.version, "block_size": B, "benches": {}}
        total = RecallTally(B - 1)
        runs_total = {t: RunTally() for t in temps}
        for bench, prompts in benches.items():
            tally = RecallTally(B - 1)
            for i, (ids, start) in enumerate(sequences[bench]):
                hits = offline_hits(target, drafter, ids, start, B, top_k, max_anchors, seed=seed + i)
                tally.add(*hits, every_anchor=max_anchors is None)
            total.merge(tally)
            res = tally.result(drafter.version)
            res["runs"] = {}
            for t in temps:
                say(f"[{name}] {bench}: real runs at T={t:g}")
                rt = real_runs(model, tokenizer, drafter, prompts, t, B, max_tokens, seed)
                runs_total[t].merge(rt)
                res["runs"][f"T={t:g}"] = run_result(rt, B - 1)
            entry["benches"][bench] = res
            say(f"[{name}] {bench}: " + summary_line(res))
        overall = total.result(drafter.version)
        overall["runs"] = {f"T={t:g}": run_result(runs_total[t], B - 1) for t in temps}
        entry["overall"] = overall
        report["drafters"][name] = entry
    return report


def summary_line(res: dict) -> str:
    runs = " ".join(f"tau({k}) {v['tau']:.2f}" for k, v in res["runs"].items() if v["tau"])
    return (f"{runs} oracle tau {res['tau_oracle']:.2f} top-1 tau {res['tau_top1']:.2f} "
            f"R@1[1] {fmt(res['recall_at_1'][0], '.3f')} R@k[1] {fmt(res['recall_at_k'][0], '.3f')}")


def markdown(report: dict) -> str:
    """report.md: the acceptance-length table, recall and real-run acceptance by position."""
    k = report["config"]["top_k"]
    temps = [f"T={t:g}" for t in report["config"]["temps"]]
    lines = ["# Drafter evaluation", "",
             f"Prompts per benchmark: {report['config']['benches']}; "
             f"max tokens {report['config']['max_tokens']}; recall at k = {k}.", "",
             "## Acceptance length", ""]
    lines += table(["drafter", "benchmark", *(f"τ {t}" for t in temps), f"oracle τ@{k}", "top-1 τ",
                    "selector τ", "loop τ", "R@1 pos 1", f"R@{k} pos 1", "blocks"],
                   [[name, bench, *(fmt(r["runs"][t]["tau"]) for t in temps), f"{r['tau_oracle']:.2f}",
                     f"{r['tau_top1']:.2f}", fmt(r.get("tau_selector")), fmt(r.get("tau_loop")),
                     fmt(r["recall_at_1"][0], ".3f"), fmt(r["recall_at_k"][0], ".3f"), r["blocks"]]
                    for name, d in report["drafters"].items()
                    for bench, r in [*d["benches"].items(), ("**overall**", d["overall"])]])
    overall = {name: d["overall"] for name, d in report["drafters"].items()}
    for title, key in (("Recall@1 by position (overall, conditioned on earlier positions)", "recall_at_1"),
                       (f"Recall@{k} by position (overall, conditioned on earlier positions)", "recall_at_k")):
        lines += ["", f"## {title}", "", position_table({n: o[key] for n, o in overall.items()})]
    for t in temps:
        lines += ["", f"## Acceptance rate by position ({t}, overall)", "",
                  position_table({n: o["runs"][t]["acceptance_by_position"] for n, o in overall.items()})]
    return "\n".join(lines) + "\n"


def plot(report: dict, out_dir) -> List[Path]:
    """recall.png (Recall@1 and Recall@k by position) and acceptance.png."""
    out_dir = Path(out_dir)
    k = report["config"]["top_k"]
    temps = [f"T={t:g}" for t in report["config"]["temps"]]
    fig, ax = pyplot().subplots(figsize=(6.5, 4))
    for i, (name, d) in enumerate(report["drafters"].items()):
        color = f"C{i}"
        for key, style, label in (("recall_at_1", "-", "R@1"), ("recall_at_k", "--", f"R@{k}")):
            ys = d["overall"][key]
            ax.plot(range(1, len(ys) + 1), [np.nan if y is None else y for y in ys], style,
                    color=color, marker="o", ms=3, label=f"{name} {label}")
    ax.set_xlabel("block position")
    ax.set_ylabel("recall (earlier positions right)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths = [save_figure(fig, out_dir / "recall.png")]
    curves = {t: [(f"{name} (τ {fmt(d['overall']['runs'][t]['tau'])})",
                   d["overall"]["runs"][t]["acceptance_by_position"])
                  for name, d in report["drafters"].items()] for t in temps}
    paths.append(plot_acceptance(curves, out_dir / "acceptance.png"))
    return paths


def write_report(report: dict, out_dir) -> List[Path]:
    """report.json, report.md, recall.png, acceptance.png under ``out_dir``."""
    return write_files(out_dir, "report", report, markdown(report), plot)
