"""Does the prefix cache's budget bound the server's real memory?

200 mixed requests, one after another, through `dflash2-mlx serve` (the built-in pair unless
--model/--draft are given): chats of one to three turns, completions, short and long prompts,
some sharing a long system message and some not, so the cache fills, evicts and reuses. The
server's resident memory (RSS, from `ps`) is sampled after every request, with the prefix
cache at --prefix-cache-gb and with it off (0). Prints, for each: RSS at the first request,
after a quarter, half and three quarters of them, at the end and at its peak, and the bytes
and entries the cache counts at the end.

    python scripts/experiments/prefix_cache_memory.py                       # 200 requests, 1 GB budget
    python scripts/experiments/prefix_cache_memory.py --requests 50 --prefix-cache-gb 0.05
"""

import argparse
import random
import socket
import subprocess
import sys
import time

import httpx

WORDS = ("the cache keeps the rows of earlier prompts so that a later one that starts the same way "
         "skips their prefill while the budget says how much of it may stay in memory").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    return int(subprocess.check_output(["ps", "-o", "rss=", "-p", str(pid)]).decode()) / 1024


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def requests(n: int, seed: int = 0):
    """(path, body) of ``n`` mixed requests; the same ones on every run."""
    rng = random.Random(seed)
    systems = [text(rng, rng.choice((200, 600, 1200))) for _ in range(6)]
    out = []
    while len(out) < n:
        kind = rng.random()
        if kind < 0.5:  # a chat of 1-3 turns, often under a shared system message
            messages = [{"role": "system", "content": rng.choice(systems)}] if rng.random() < 0.7 else []
            for _ in range(rng.randint(1, 3)):
                messages.append({"role": "user", "content": text(rng, rng.randint(5, 80))})
                out.append(("/v1/chat/completions", {"messages": list(messages), "max_tokens": 16}))
                messages.append({"role": "assistant", "content": text(rng, 12)})
        else:  # a completion, short or long, unrelated to the rest
            out.append(("/v1/completions", {"prompt": text(rng, rng.choice((20, 150, 800))), "max_tokens": 16}))
    return out[:n]


def run(args, cache_gb: float) -> dict:
    port = free_port()
    command = [sys.executable, "-m", "dflash2_mlx.cli.main", "serve", "--port", str(port),
               "--prefix-cache-gb", str(cache_gb), "--log-level", "warning"]
    if args.model:
        command += ["--model", args.model] + (["--draft", args.draft] if args.draft else [])
    proc = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not come up (exit code {proc.poll()})")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        samples = []
        for path, body in requests(args.requests):
            r = httpx.post(base + path, json=body, timeout=600)
            r.raise_for_status()
            samples.append(rss_mb(proc.pid))
        stats = next(iter(httpx.get(base + "/metrics").json()["models"].values()))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    quarters = [samples[len(samples) * q // 4 - 1] for q in (1, 2, 3)]
    return {"first": samples[0], "quarters": quarters, "end": samples[-1], "peak": max(samples),
            "cache_mb": stats.get("prefix_cache_bytes", 0) / 2**20, "entries": stats.get("prefix_cache_entries", 0)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="target (default: the built-in pair)")
    ap.add_argument("--draft", help="drafter of --model")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--prefix-cache-gb", type=float, default=1.0)
    ap.add_argument("--skip-off", action="store_true", help="skip the run with the cache off")
    args = ap.parse_args()
    print(f"{args.requests} mixed requests, RSS in MB after each")
    n = args.requests
    marks = "".join(f"{'at ' + str(n * q // 4):>8}" for q in (1, 2, 3))
    print(f"{'prefix cache':>14} {'first':>8}{marks} {'end':>8} {'peak':>8} {'cache MB':>9} {'entries':>8}")
    for gb in (args.prefix_cache_gb,) + (() if args.skip_off else (0.0,)):
        r = run(args, gb)
        quarters = "".join(f"{x:8.0f}" for x in r["quarters"])
        print(f"{str(gb) + ' GB':>14} {r['first']:8.0f}{quarters} {r['end']:8.0f} {r['peak']:8.0f} "
              f"{r['cache_mb']:9.1f} {r['entries']:8d}", flush=True)


if __name__ == "__main__":
    main()
