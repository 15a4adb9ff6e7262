"""``dflash2-mlx bench distributed``: plain and DFlash decoding on a target split over N
ranks (tensor or pipeline), side by side in one run, and what crosses the wire.

The ranks run on this machine over the ring backend (``distributed.local``); every rank
generates the same prompts, plain and then with DFlash, at T=0; then one process does the
same (the tokens the split must reproduce, and the compute the link model starts from).  Every collective the
target, the drafter and the loop issue goes through ``mx.distributed``'s functions, which
are counted while the graph is built: calls, and the bytes each rank puts on the wire (the
ring's all_sum sends 2 (N-1)/N of the array, all_gather (N-1)/N of its output, send all of
it).  Per run: tokens/s, calls and bytes per generated token, and the time a rank spends in
communication, estimated from a loopback micro-benchmark of the same collectives at the
same sizes in the same run (decode steps only: each prompt's prefill and first token are
counted apart).  The ranks share this machine's cores, so their speed
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


def bench_prompts(cfg: dict) -> List[str]:
    from ..builtin.bench_sets import default_bench_files
    from .prompts import sample_prompts

    prompts = [p for ps in sample_prompts(default_bench_files(), cfg["samples"], cfg["seed"]).values() for p in ps]
    return prompts[: cfg["prompts"]] if cfg.get("prompts") else prompts


def decode(model, tokenizer, drafter, prompts: List[str], cfg: dict, traffic: Optional[Traffic] = None) -> dict:
    """Generate every prompt (T=0); decode tokens, decode seconds (after each first token),
    texts, mean τ, and with ``traffic`` the collectives of the decode steps alone (each
    prompt's prefill and first token are counted apart)."""
    from ..generate import stream_generate

    tokens, seconds, texts, taus = 0, 0.0, [], []
    decode_calls, decode_bytes, decode_shapes = defaultdict(int), defaultdict(float), defaultdict(int)
    for p in prompts:
        pieces, at_first = [], None
        if traffic is not None:
            traffic.reset()
        for r in stream_generate(model, tokenizer, [{"role": "user", "content": p}], drafter,
                                 max_tokens=cfg["max_tokens"], block_size=cfg.get("block_size") or "auto"):
            pieces.append(r.text)
            if at_first is None and traffic is not None:
                at_first = traffic.snapshot()
        tokens += r.generation_tokens - 1
        seconds += (r.generation_tokens / r.generation_tps) if r.generation_tps else 0.0
        texts.append("".join(pieces))
        taus.append(r.tau)
        if traffic is not None:
            now = traffic.snapshot()
            for op, n in now["calls"].items():
                decode_calls[op] += n - at_first["calls"].get(op, 0)
            for op, b in now["bytes"].items():
                decode_bytes[op] += b - at_first["bytes"].get(op, 0.0)
            first = {(op, nb): c for op, nb, c in at_first["shapes"]}
            for op, nb, c in now["shapes"]:
                decode_shapes[(op, nb)] += c - first.get((op, nb), 0)
    return {"tokens": tokens, "seconds": seconds, "texts": texts, "tau": sum(taus) / len(taus) if taus else 0.0,
            "calls": dict(decode_calls), "bytes": dict(decode_bytes),
            "shapes": [[op, nb, c] for (op, nb), c in decode_shapes.items() if c]}


def rank_run(cfg: dict) -> Optional[dict]:
    """One rank's part: load the split pair, generate plain and DFlash, count the traffic."""
    from ..generate import load

    group = mx.distributed.init(strict=True)
    model, tokenizer, drafter = load(cfg.get("model"), cfg.get("draft"), distributed=cfg["mode"], group=group)
    prompts = bench_prompts(cfg)
    traffic = Traffic(group.size())
    traffic.install()
    try:
        decode(model, tokenizer, drafter, prompts[:1], cfg)  # compile, allocate, calibrate
        runs = {"plain": decode(model, tokenizer, None, prompts, cfg, traffic),
                "dflash": decode(model, tokenizer, drafter, prompts, cfg, traffic)}
    finally:
        traffic.uninstall()
    costs = loopback_costs(group, sorted({(op, nb) for r in runs.values() for op, nb, _ in r["shapes"]}))
    for r in runs.values():
        r["comm_s"] = sum(costs[f"{op}:{nb}"] * c for op, nb, c in r["shapes"])
    return {"rank": group.rank(), "size": group.size(), "runs": runs}


def single_process(cfg: dict) -> dict:
    """The same prompts on one process: the compute the link model starts from, and the
    tokens the split target must reproduce."""
    from ..generate import load

    model, tokenizer, drafter = load(cfg.get("model"), cfg.get("draft"))
    prompts = bench_prompts(cfg)
    decode(model, tokenizer, drafter, prompts[:1], cfg)
    return {"plain": decode(model, tokenizer, None, prompts, cfg),
            "dflash": decode(model, tokenizer, drafter, prompts, cfg)}


def summarize(ranks: List[dict], one: dict, mode: str) -> dict:
    """Per run: decode tok/s split (rank 0's) and on one process, collectives, bytes and
    communication time per decode token of the busiest rank (ranks differ in a pipeline);
    the T=0 texts against one process; the link model."""
    rank0 = next(r for r in ranks if r["rank"] == 0)
    rows, n = {}, rank0["size"]
    for name, r in rank0["runs"].items():
        t = max(1, r["tokens"])
        solo = one[name]
        busiest = max((x["runs"][name] for x in ranks), key=lambda x: sum(x["bytes"].values()))
        r = {**r, "calls": max((x["runs"][name]["calls"] for x in ranks), key=lambda c: sum(c.values())),
             "bytes": busiest["bytes"], "comm_s": max(x["runs"][name]["comm_s"] for x in ranks)}
        rows[name] = {"tokens": r["tokens"], "tok_s": r["tokens"] / r["seconds"] if r["seconds"] else 0.0,
                      "one_process_tok_s": solo["tokens"] / solo["seconds"] if solo["seconds"] else 0.0,
                      "calls_per_token": sum(r["calls"].values()) / t, "bytes_per_token": sum(r["bytes"].values()) / t,
                      "comm_s_per_token": r["comm_s"] / t, "tau": r["tau"], "calls": r["calls"],
                      # A split's compute per token: tensor divides each layer over the ranks
                      # (the ideal), pipeline runs its stages in turn (one machine's).
                      "compute_s_per_token": solo["seconds"] / max(1, solo["tokens"]) / (n if mode == "tensor" else 1),
                      "same_text_as_one_process": sum(a == b for a, b in zip(r["texts"], solo["texts"]))}
    return {"mode": mode, "ranks": n, "runs": rows, "model": link_model(rows), "prompts": len(one["plain"]["texts"])}


def link_model(rows: dict) -> dict:
    """The DFlash speed-up over plain on each link in ``LINKS``: per token, the split's
    compute plus each collective's latency and its bytes over the bandwidth."""
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
    lines = [[ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1] for r in results]
    log("bench distributed: the same prompts on one process")
    one = single_process(cfg)
    return {"config": {**cfg, "ranks": ranks}, "machine": describe(),
            **summarize([json.loads(ln) for ln in lines], one, mode)}


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [f"# bench distributed: {report['mode']} over {report['ranks']} ranks", "",
             f"Model {cfg['model'] or 'built-in SmolLM2-135M-Instruct'}, {cfg['max_tokens']} tokens per prompt, T=0, "
             "ranks on one machine (127.0.0.1, ring backend): the traffic and the ratios carry over, the speed does not.",
             ""]
    rows = [[name, r["tokens"], fmt(r["tok_s"], ".1f"), fmt(r["one_process_tok_s"], ".1f"), fmt(r["tau"]),
             fmt(r["calls_per_token"], ".1f"), fmt(r["bytes_per_token"] / 1024, ".1f"),
             fmt(r["comm_s_per_token"] * 1e3, ".1f"), f"{r['same_text_as_one_process']}/{report['prompts']}"]
            for name, r in report["runs"].items()]
    lines += table(["run", "decode tokens", "tok/s split", "tok/s one process", "tau", "collectives / token",
                    "KiB sent / token (busiest rank)", "comm ms / token (loopback)", "T=0 text = one process"], rows)
    runs = report["runs"]
    if "plain" in runs and "dflash" in runs and runs["plain"]["tok_s"]:
        lines += ["", f"DFlash / plain on the split target here: {runs['dflash']['tok_s'] / runs['plain']['tok_s']:.2f}x "
                  f"tok/s, {runs['dflash']['calls_per_token'] / max(runs['plain']['calls_per_token'], 1e-9):.2f}x "
                  f"collectives per token, {runs['dflash']['bytes_per_token'] / max(runs['plain']['bytes_per_token'], 1e-9):.2f}x "
                  "bytes per token (decode steps only; each prompt's prefill and first token apart)."]
    lines += ["", "## Modelled on real links", "",
              "Per token: the split's compute (one process's decode time here; tensor: divided by the ranks, the "
              "ideal split; pipeline: not divided) + collectives x the link's latency + bytes / its bandwidth. "
              "Latency and bandwidth are assumed, not measured.", ""]
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
    print(json.dumps(rank_run(json.loads(args.rank_run))), flush=True)


if __name__ == "__main__":
    main()
