"""``dflash2-mlx bench distributed``: plain and DFlash decoding on a target split over N
ranks (tensor or pipeline), side by side in one run, and what crosses the wire.

The ranks run on this machine over the ring backend (``distributed.local``); every rank
generates the same prompts, plain and then with DFlash, at T=0.  Every collective the
target, the drafter and the loop issue goes through ``mx.distributed``'s functions, which
are counted while the graph is built: calls, and the bytes each rank puts on the wire (the
ring's all_sum sends 2 (N-1)/N of the array, all_gather (N-1)/N of its output, send all of
it).  Per run: tokens/s, calls and bytes per generated token, and the time a rank spends in
communication, estimated from a loopback micro-benchmark of the same collectives at the
same sizes measured in the same run.  The ranks share this machine's cores, so their speed
is not a split target's: the ratios and the traffic are what carry over, and ``model``
turns them into the speed-up on a real link (a latency and a bandwidth; see ``LINKS``).

Run as a rank: ``python -m dflash2_mlx.eval.bench_distributed --rank-run JSON``.
"""

import argparse
import json
import sys
import time
from collections import defaultdict
from typing import Callable, Dict, List, Optional

import mlx.core as mx

from .report import fmt, table, write_report as write_files

# Assumed links, for the model (not measured here): one-way latency per collective (s) and
# bandwidth (bytes/s).  Thunderbolt 5 with RDMA (JACCL); 10 Gb Ethernet with TCP (ring).
LINKS = {"Thunderbolt 5 (RDMA)": (10e-6, 10e9), "10 GbE (TCP)": (60e-6, 1.1e9)}
COUNTED = ("all_sum", "all_gather", "all_max", "all_min", "send", "recv", "recv_like")


class Traffic:
    """Counts of the collectives issued while installed, and the bytes this rank sends."""

    def __init__(self, size: int):
        self.size, self.calls, self.bytes = size, defaultdict(int), defaultdict(float)
        self.shapes = defaultdict(int)  # (op, nbytes) -> calls: what the micro-benchmark times
        self._originals = {}

    def _sent(self, op: str, x) -> float:
        n = self.size
        if op == "all_sum" or op in ("all_max", "all_min"):
            return 2 * (n - 1) / n * x.nbytes
        if op == "all_gather":
            return (n - 1) * x.nbytes  # each rank's piece reaches the n - 1 others
        if op == "send":
            return x.nbytes
        return 0.0

    def install(self):
        for op in COUNTED:
            fn = getattr(mx.distributed, op, None)
            if fn is None:
                continue
            self._originals[op] = fn

            def counted(*args, _op=op, _fn=fn, **kwargs):
                x = args[0] if args and isinstance(args[0], mx.array) else None
                self.calls[_op] += 1
                if x is not None:
                    self.bytes[_op] += self._sent(_op, x)
                    self.shapes[(_op, x.nbytes)] += 1
                return _fn(*args, **kwargs)

            setattr(mx.distributed, op, counted)

    def uninstall(self):
        for op, fn in self._originals.items():
            setattr(mx.distributed, op, fn)
        self._originals = {}

    def reset(self):
        self.calls.clear(), self.bytes.clear(), self.shapes.clear()

    def snapshot(self) -> dict:
        return {"calls": dict(self.calls), "bytes": dict(self.bytes),
                "shapes": [[op, nb, c] for (op, nb), c in self.shapes.items()]}


def loopback_costs(group, shapes: List[tuple], repeats: int = 20) -> Dict[str, float]:
    """Seconds per call of each (op, nbytes) in ``shapes`` on this group: all_sum and all_gather timed
    directly (every rank issues them); point-to-point ones timed as an all_sum of their size."""
    out = {}
    for op, nbytes in shapes:
        n = max(1, int(nbytes) // 4)
        x = mx.zeros((n,), dtype=mx.float32)
        fn = mx.distributed.all_gather if op == "all_gather" else mx.distributed.all_sum
        mx.eval(fn(x, group=group))
        tic = time.perf_counter()
        for _ in range(repeats):
            mx.eval(fn(x, group=group))
        out[f"{op}:{nbytes}"] = (time.perf_counter() - tic) / repeats
    return out


def rank_run(cfg: dict) -> Optional[dict]:
    """One rank's part: load the split pair, generate plain and DFlash, count the traffic."""
    from ..generate import load, stream_generate
    from .prompts import sample_prompts
    from ..builtin.bench_sets import default_bench_files

    group = mx.distributed.init(strict=True)
    model, tokenizer, drafter = load(cfg.get("model"), cfg.get("draft"), distributed=cfg["mode"], group=group)
    prompts = [p for ps in sample_prompts(default_bench_files(), cfg["samples"], cfg["seed"]).values() for p in ps]
    if cfg.get("prompts"):
        prompts = prompts[: cfg["prompts"]]
    traffic = Traffic(group.size())
    runs = {}
    for name, use_drafter in (("warm-up", True), ("plain", False), ("dflash", True)):
        traffic.reset()
        traffic.install()
        tokens, texts, tic, taus = 0, [], time.perf_counter(), []
        try:
            for p in (prompts[:1] if name == "warm-up" else prompts):
                last, pieces = None, []
                for last in stream_generate(model, tokenizer, [{"role": "user", "content": p}],
                                            drafter if use_drafter else None, max_tokens=cfg["max_tokens"],
                                            block_size=cfg.get("block_size") or "auto"):
                    pieces.append(last.text)
                tokens += last.generation_tokens
                texts.append("".join(pieces))
                taus.append(last.tau)
        finally:
            traffic.uninstall()
        runs[name] = {"tokens": tokens, "seconds": time.perf_counter() - tic, **traffic.snapshot(),
                      "tau": sum(taus) / len(taus) if taus else 0.0, "texts": texts}
    del runs["warm-up"]
    shapes = [s for r in runs.values() for s in r["shapes"]]
    costs = loopback_costs(group, sorted({(op, nb) for op, nb, _ in shapes}))
    for r in runs.values():
        r["comm_s"] = sum(costs[f"{op}:{nb}"] * c for op, nb, c in r["shapes"])
    return {"rank": group.rank(), "size": group.size(), "runs": runs} if group.rank() == 0 else None


def summarize(rank0: dict, mode: str) -> dict:
    """Per run: tok/s, calls and bytes per token, communication time; and the ratios."""
    rows = {}
    for name, r in rank0["runs"].items():
        t = max(1, r["tokens"])
        calls, sent = sum(r["calls"].values()), sum(r["bytes"].values())
        rows[name] = {"tokens": r["tokens"], "tok_s": r["tokens"] / r["seconds"] if r["seconds"] else 0.0,
                      "calls_per_token": calls / t, "bytes_per_token": sent / t,
                      "comm_s_per_token": r["comm_s"] / t, "compute_s_per_token": max(0.0, r["seconds"] - r["comm_s"]) / t,
                      "tau": r["tau"], "calls": r["calls"]}
    runs = rank0["runs"]
    same = sum(a == b for a, b in zip(runs["plain"]["texts"], runs["dflash"]["texts"]))
    return {"mode": mode, "ranks": rank0["size"], "runs": rows, "model": link_model(rows),
            "same_text": same, "prompts": len(runs["plain"]["texts"])}


def link_model(rows: dict) -> dict:
    """The DFlash speed-up over plain on each link in ``LINKS``: per token, the compute
    measured here plus each collective's latency and its bytes over the bandwidth."""
    out = {}
    for link, (latency, bandwidth) in LINKS.items():
        t = {name: r["compute_s_per_token"] + r["calls_per_token"] * latency + r["bytes_per_token"] / bandwidth
             for name, r in rows.items()}
        out[link] = {"plain_s_per_token": t.get("plain"), "dflash_s_per_token": t.get("dflash"),
                     "speedup": t["plain"] / t["dflash"] if t.get("dflash") else None}
    return out


def run_distributed_bench(*, mode: str, ranks: int, model: Optional[str] = None, draft: Optional[str] = None,
                          samples: int = 1, prompts: Optional[int] = None, max_tokens: int = 64,
                          block_size: Optional[int] = None, seed: int = 0, timeout: float = 1800.0,
                          log: Callable[[str], None] = print) -> dict:
    """Launch ``ranks`` ranks on this machine and collect rank 0's figures."""
    from ..distributed.local import launch
    from ..machine.identity import describe

    cfg = {"mode": mode, "model": model, "draft": draft, "samples": samples, "prompts": prompts,
           "max_tokens": max_tokens, "block_size": block_size, "seed": seed}
    log(f"bench distributed: {mode} over {ranks} ranks on 127.0.0.1")
    results = launch(ranks, [sys.executable, "-m", "dflash2_mlx.eval.bench_distributed", "--rank-run",
                             json.dumps(cfg)], timeout=timeout)
    failed = [r for r in results if r.returncode != 0]
    if failed:
        r = failed[0]
        raise RuntimeError(f"rank {r.rank} ended with {r.returncode}: {r.stderr[-1500:]}")
    line = [ln for ln in results[0].stdout.splitlines() if ln.startswith("{")][-1]
    return {"config": {**cfg, "ranks": ranks}, "machine": describe(), **summarize(json.loads(line), mode)}


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [f"# bench distributed: {report['mode']} over {report['ranks']} ranks", "",
             f"Model {cfg['model'] or 'built-in SmolLM2-135M-Instruct'}, {cfg['max_tokens']} tokens per prompt, T=0, "
             "ranks on one machine (127.0.0.1, ring backend): the traffic and the ratios carry over, the speed does not.",
             ""]
    rows = [[name, r["tokens"], fmt(r["tok_s"], ".1f"), fmt(r["tau"]), fmt(r["calls_per_token"], ".1f"),
             fmt(r["bytes_per_token"] / 1024, ".1f"), fmt(r["comm_s_per_token"] * 1e3, ".2f")]
            for name, r in report["runs"].items()]
    lines += table(["run", "tokens", "tok/s", "tau", "collectives / token", "KiB sent / token / rank",
                    "comm ms / token (loopback)"], rows)
    runs = report["runs"]
    if "plain" in runs and "dflash" in runs and runs["plain"]["tok_s"]:
        lines += ["", f"DFlash / plain here: {runs['dflash']['tok_s'] / runs['plain']['tok_s']:.2f}x tok/s, "
                  f"{runs['dflash']['calls_per_token'] / max(runs['plain']['calls_per_token'], 1e-9):.2f}x collectives "
                  f"per token, {runs['dflash']['bytes_per_token'] / max(runs['plain']['bytes_per_token'], 1e-9):.2f}x bytes per token; "
                  f"T=0 texts equal to plain on {report['same_text']}/{report['prompts']} prompts."]
    lines += ["", "## Modelled on real links (assumed latency and bandwidth, compute as measured here)", ""]
    lines += table(["link", "latency us", "GB/s", "plain ms / token", "DFlash ms / token", "speed-up"],
                   [[link, fmt(LINKS[link][0] * 1e6, ".0f"), fmt(LINKS[link][1] / 1e9, ".1f"),
                     fmt((m["plain_s_per_token"] or 0) * 1e3), fmt((m["dflash_s_per_token"] or 0) * 1e3),
                     fmt(m["speedup"])] for link, m in report["model"].items()])
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir) -> list:
    return write_files(out_dir, f"bench-distributed-{report['mode']}", report, markdown(report))


def main(argv=None):
    parser = argparse.ArgumentParser(description="One rank of `dflash2-mlx bench distributed`.")
    parser.add_argument("--rank-run", required=True, help="the run's settings as JSON")
    args = parser.parse_args(argv)
    out = rank_run(json.loads(args.rank_run))
    if out is not None:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
