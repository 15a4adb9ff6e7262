"""``dflash2-mlx bench serve``: the server under concurrent streaming clients, batched
against one request at a time, measured in one run.

Two real ``dflash2-mlx serve`` processes run side by side on loopback with the same model,
drafter and settings: one with continuous batching (``--max-batch N``), one with
``--max-batch 1`` (the one-at-a-time server, the baseline).  For each number of streams S
the batched server gets S concurrent clients, each sending ``requests`` streaming chat
requests one after another (distinct real prompts from the benchmark sets, ``max_tokens``
each); the baseline gets the same load right after, for the stream counts chosen, so a
busy machine slows both alike.  The prefix cache is off (every request runs its whole
prompt) and the user's settings file is not read.

Per row: aggregate tok/s (every completion token of the row over its wall time), per-stream
tok/s (a request's tokens after its first over the time after its first, as mlx-lm counts
generation speed; the mean over requests), τ (accepted draft tokens + the bonus token per
cycle, over all requests), latency p50/p95 (request sent -> last token, queue wait
included), time to first token p50, and the batch's mean size from ``/metrics``.  At T=0
the replies of the two servers to the same prompt must be the same text; differences are
counted.  ``write_report`` saves bench-serve.json and bench-serve.md.
"""

import asyncio
import itertools
import json
import math
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from ..builtin.bench_sets import default_bench_files
from ..machine.identity import describe
from .prompts import sample_prompts
from .report import fmt, write_report as write_files

# httpx (the clients) is imported where the clients run: it comes with the dev extra, not
# with the package, and only this bench needs it.

BATCHED, BASELINE = "batched", "one at a time"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command() -> List[str]:
    script = Path(sys.executable).with_name("dflash2-mlx")
    return [str(script)] if script.exists() else [sys.executable, "-m", "dflash2_mlx.cli.main"]


@contextmanager
def server(args: Sequence[str], log_path: Path, timeout: float = 600.0):
    """A ``dflash2-mlx serve ARGS`` process on a free loopback port, preloaded: its base URL."""
    port = free_port()
    with serving(serve_command() + ["serve", "--port", str(port), "--preload", *args], port, log_path,
                 "the server", timeout) as base:
        yield base


@contextmanager
def serving(command: Sequence[str], port: int, log_path: Path, name: str, timeout: float = 600.0):
    """``command`` (an HTTP server on ``port``) until its /health answers 200: its base URL;
    the process is stopped when the block ends."""
    import httpx

    with open(log_path, "w") as log:
        proc = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited: {log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"{name} did not start in {timeout:.0f} s (log: {log_path})")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _request(http, model: str, prompt: str, max_tokens: int, temp: float) -> dict:
    """One streaming chat request: its text, tokens, timings and DFlash statistics."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": temp, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first = None
    text, usage, dflash = [], {}, {}
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
            usage, dflash = event.get("usage") or usage, event.get("dflash") or dflash
    end = time.perf_counter()
    return {"prompt": prompt, "text": "".join(text), "sent": sent, "first": first or end, "end": end,
            "tokens": usage.get("completion_tokens", 0), "prompt_tokens": usage.get("prompt_tokens", 0),
            "tau": dflash.get("tau", 0.0), "cycles": dflash.get("cycles", 0)}


async def _load(base: str, model: str, prompts: List[List[str]], max_tokens: int, temp: float) -> List[dict]:
    """Concurrent clients, client i sending ``prompts[i]`` one after another."""
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=base, timeout=3600, limits=limits) as http:
        async def client(mine):
            return [await _request(http, model, p, max_tokens, temp) for p in mine]

        runs = await asyncio.gather(*(client(mine) for mine in prompts))
    return [r for run in runs for r in run]


def _metrics(base: str, model: str) -> dict:
    import httpx

    return httpx.get(base + "/metrics", timeout=30).json()["models"].get(model, {})


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between ranks."""
    xs = sorted(values)
    if not xs:
        return 0.0
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(records: List[dict], server: str, streams: int, batch: Optional[dict] = None) -> dict:
    """One table row from a load's request records (see the module docstring)."""
    wall = max(r["end"] for r in records) - min(r["sent"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    rates = [(r["tokens"] - 1) / (r["end"] - r["first"]) for r in records
             if r["tokens"] > 1 and r["end"] > r["first"]]
    cycles = sum(r["cycles"] for r in records)
    latency = [r["end"] - r["sent"] for r in records]
    row = {"server": server, "streams": streams, "requests": len(records), "tokens": tokens,
           "seconds": wall, "aggregate_tps": tokens / wall if wall else 0.0,
           "per_stream_tps": statistics.mean(rates) if rates else 0.0,
           "tau": sum(r["tau"] * r["cycles"] for r in records) / cycles if cycles else 0.0,
           "latency_p50": percentile(latency, 50), "latency_p95": percentile(latency, 95),
           "ttft_p50": percentile([r["first"] - r["sent"] for r in records], 50)}
    if batch is not None:
        row["mean_batch_size"] = batch.get("mean_batch_size", 0.0)
    return row


def _batch_delta(before: dict, after: dict) -> dict:
    steps = after.get("batch_steps", 0) - before.get("batch_steps", 0)
    seqs = (after.get("mean_batch_size", 0.0) * after.get("batch_steps", 0)
            - before.get("mean_batch_size", 0.0) * before.get("batch_steps", 0))
    return {"mean_batch_size": seqs / steps if steps else 0.0}


def prompt_pool(bench_files: Sequence, count: int, seed: int) -> List[str]:
    """``count`` distinct prompts drawn from the benchmark sets in turn (a set's prompts repeat
    only when there are too few of them all)."""
    per_set = max(1, math.ceil(count / max(1, len(bench_files))))
    sets = list(sample_prompts(bench_files, per_set, seed).values())
    pool = [p for group in itertools.zip_longest(*sets) for p in group if p is not None]
    if not pool:
        raise ValueError("no prompts in the benchmark files")
    return [pool[i % len(pool)] for i in range(count)]


def run_serve_bench(*, model: Optional[str] = None, draft: Optional[str] = None,
                    streams: Sequence[int] = (1, 2, 4, 8), requests: int = 4, max_tokens: int = 64,
                    max_batch: int = 8, baseline_streams: Optional[Sequence[int]] = None,
                    temp: float = 0.0, bench_files: Sequence = (), seed: int = 0,
                    block_size: Optional[int] = None, work_dir: Optional[Path] = None,
                    log: Callable[[str], None] = print) -> dict:
    """The whole benchmark (see the module docstring); the report as a dict."""
    streams = sorted(set(streams))
    if baseline_streams is None:
        baseline_streams = sorted({streams[0], streams[-1]})
    bench_files = list(bench_files) or default_bench_files()
    work = Path(work_dir or tempfile.mkdtemp(prefix="bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    model_id = Path(str(model)).name if model else "SmolLM2-135M-Instruct"
    settings = work / "model_settings.json"  # not the user's: only what this bench sets
    entry = {"dflash_block_size": block_size} if block_size else {}
    settings.write_text(json.dumps({"version": 1, "models": {model_id: entry}}))
    common = ["--settings", str(settings), "--prefix-cache-gb", "0", "--queue-size", str(max(streams)),
              "--max-tokens", str(max_tokens), "--log-level", "warning"]
    if model:
        common += ["--model", f"{model_id}={model}"] + (["--draft", draft] if draft else [])
    # Every request of a row gets its own prompt; rows reuse the pool (no prefix cache).
    pool = prompt_pool(bench_files, max(streams) * requests, seed)
    rows, texts, mismatches = [], {BATCHED: {}, BASELINE: {}}, []
    log(f"bench serve: {model_id}, streams {streams}, {requests} request(s) each of {max_tokens} "
        f"tokens, max_batch {max_batch}, baseline at {list(baseline_streams)} stream(s)")
    with server(common + ["--max-batch", str(max_batch)], work / "server-batched.log") as batched, \
            server(common + ["--max-batch", "1"], work / "server-one.log") as one:
        for base in (batched, one):  # compile, allocate, calibrate (and fill a batch) untimed
            warm = [[p] for p in pool[: max(streams)]]
            asyncio.run(_load(base, model_id, warm, min(8, max_tokens), temp))
        for s in streams:
            loads = [(BATCHED, batched)] + ([(BASELINE, one)] if s in baseline_streams else [])
            for name, base in loads:
                prompts = [pool[i * requests:(i + 1) * requests] for i in range(s)]
                before = _metrics(base, model_id)
                records = asyncio.run(_load(base, model_id, prompts, max_tokens, temp))
                row = summarize(records, name, s, _batch_delta(before, _metrics(base, model_id)))
                rows.append(row)
                for r in records:
                    texts[name].setdefault(r["prompt"], r["text"])
                log(_row_line(row))
    if temp == 0:
        for prompt, text in texts[BASELINE].items():
            if prompt in texts[BATCHED] and texts[BATCHED][prompt] != text:
                mismatches.append({"prompt": prompt[:200], "batched": texts[BATCHED][prompt],
                                   "one_at_a_time": text})
    checked = len(set(texts[BASELINE]) & set(texts[BATCHED])) if temp == 0 else 0
    return {"config": {"model": model or model_id, "draft": draft, "streams": streams, "requests": requests,
                       "max_tokens": max_tokens, "max_batch": max_batch,
                       "baseline_streams": list(baseline_streams), "temp": temp, "seed": seed,
                       "block_size": block_size or "auto", "bench_files": [str(f) for f in bench_files]},
            "machine": describe(), "rows": rows, "ratios": ratios(rows),
            "parity_checked": checked, "mismatches": mismatches}


def ratios(rows: List[dict]) -> List[dict]:
    """Batched over one at a time at each stream count measured on both servers."""
    one = {r["streams"]: r for r in rows if r["server"] == BASELINE}
    out = []
    for r in rows:
        b = one.get(r["streams"])
        if r["server"] == BATCHED and b:
            out.append({"streams": r["streams"],
                        "aggregate_tps": r["aggregate_tps"] / b["aggregate_tps"] if b["aggregate_tps"] else None,
                        "latency_p95": r["latency_p95"] / b["latency_p95"] if b["latency_p95"] else None,
                        "per_stream_tps": r["per_stream_tps"] / b["per_stream_tps"] if b["per_stream_tps"] else None})
    return out


def _row_line(row: dict) -> str:
    return (f"  {row['server']:>13} x{row['streams']}: {row['aggregate_tps']:.1f} tok/s aggregate, "
            f"{row['per_stream_tps']:.1f} per stream, tau {row['tau']:.2f}, "
            f"p50 {row['latency_p50']:.2f} s, p95 {row['latency_p95']:.2f} s")


def markdown(report: dict) -> str:
    cfg, m = report["config"], report["machine"]
    lines = ["# dflash2-mlx bench serve", "",
             f"{cfg['model']} with {cfg['draft'] or 'its shipped DFlash 2 drafter'}; {cfg['requests']} streaming chat "
             f"request(s) per stream, max {cfg['max_tokens']} tokens each, T={cfg['temp']:g}, block size "
             f"{cfg['block_size']}; batched server `--max-batch {cfg['max_batch']}` against the "
             "one-at-a-time server (`--max-batch 1`), run side by side; prefix cache off.", "",
             f"Machine: {m['platform']}, {m['cpus']} CPUs, MLX {m['mlx']}, Metal {m['metal']}.", "",
             "| server | streams | requests | aggregate tok/s | per-stream tok/s | τ | p50 latency (s) "
             "| p95 latency (s) | p50 first token (s) | mean batch |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        batch = f"{r['mean_batch_size']:.2f}" if r.get("mean_batch_size") else "-"
        lines.append(f"| {r['server']} | {r['streams']} | {r['requests']} | {r['aggregate_tps']:.1f} "
                     f"| {r['per_stream_tps']:.1f} | {r['tau']:.2f} | {r['latency_p50']:.2f} "
                     f"| {r['latency_p95']:.2f} | {r['ttft_p50']:.2f} | {batch} |")
    if report["ratios"]:
        lines += ["", "Batched / one at a time:", ""]
        for q in report["ratios"]:
            lines.append(f"- {q['streams']} stream(s): aggregate tok/s x{fmt(q['aggregate_tps'])}, "
                         f"p95 latency x{fmt(q['latency_p95'])}, per-stream tok/s x{fmt(q['per_stream_tps'])}")
    if report["parity_checked"]:
        bad = len(report["mismatches"])
        lines += ["", f"T=0 parity: {report['parity_checked'] - bad} of {report['parity_checked']} prompts "
                  "got the same reply from both servers" + (" (differences in bench-serve.json)." if bad else ".")]
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir) -> List[Path]:
    """bench-serve.json and bench-serve.md under ``out_dir``."""
    return write_files(out_dir, "bench-serve", report, markdown(report))
