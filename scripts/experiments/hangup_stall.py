"""Does a client that hangs up during a long prompt hold the server up?

The scenario of issue 48, through `dflash2-mlx serve` on the built-in pair: a streamed chat
whose user message is --words words of text (CPython's own docs, from the standard library's
docstrings), the connection dropped after --hangup seconds; at once a short request ("Hi",
max_tokens 3). Prints when the short request's reply came, when /health stopped reporting
active requests, and then the same for a long prompt that is *not* given up (a short request
sent while it is read: how long it waited); then a streamed short reply's time to first token
and gaps between its chunks, alone and while the long prompt is read.

    python scripts/experiments/hangup_stall.py [--words 4500] [--hangup 2]
"""

import argparse
import ast
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import httpx


def text_of(words: int, skip: int = 0) -> str:
    out = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
                doc = ast.get_docstring(node)
                if doc:
                    out += doc.split()
        if len(out) >= skip + words:
            break
    return " ".join(out[skip : skip + words])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def short(base: str) -> float:
    tic = time.perf_counter()
    r = httpx.post(f"{base}/v1/chat/completions", timeout=600, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    r.raise_for_status()
    return time.perf_counter() - tic


def streamed(base: str, tokens: int = 96) -> tuple:
    """A streamed short reply (its end of sequence held off): time to its first content
    chunk, and the gaps between its chunks."""
    body = {"messages": [{"role": "user", "content": "Count from one to fifty in words."}],
            "max_tokens": tokens, "stream": True, "logit_bias": {"2": -100}}
    tic, times = time.perf_counter(), []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content": "' in line and '"content": ""' not in line:
                times.append(time.perf_counter())
    return times[0] - tic, [b - a for a, b in zip(times, times[1:])]


def percentile(values, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def idle_after(base: str, since: float) -> float:
    while httpx.get(f"{base}/health", timeout=10).json().get("active_requests"):
        time.sleep(0.05)
    return time.perf_counter() - since


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--words", type=int, default=4500)  # SmolLM2 reads 8,192 tokens at most
    ap.add_argument("--hangup", type=float, default=2.0)
    ap.add_argument("--alone", action="store_true", help="only time the long prompt, alone on the server")
    args = ap.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "dflash2_mlx.cli.main", "serve", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        short(base)  # first use: load the pair, calibrate
        body = {"messages": [{"role": "user", "content": f"Summarize this text.\n\n{text_of(args.words)}"}],
                "max_tokens": 32, "stream": True}
        if args.alone:
            tic = time.perf_counter()
            r = httpx.post(f"{base}/v1/chat/completions", timeout=900, json={**body, "stream": False})
            r.raise_for_status()
            print(f"{r.json()['usage']['prompt_tokens']} prompt tokens, alone: answered in "
                  f"{time.perf_counter() - tic:.1f} s")
            return
        # 1. A hang-up during the long prompt.
        with httpx.Client(timeout=600) as client:
            with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                time.sleep(args.hangup)
        hung_up = time.perf_counter()
        print(f"{args.words} words, hung up after {args.hangup:.0f} s: the next short reply took "
              f"{short(base):.2f} s; /health idle {idle_after(base, hung_up):.2f} s after the hang-up")
        # 2. A long prompt read to the end, a short request sent meanwhile.
        done = {}
        long = threading.Thread(target=lambda: done.setdefault("long", httpx.post(
            f"{base}/v1/chat/completions", timeout=900, json={**body, "stream": False})))
        tic = time.perf_counter()
        long.start()
        time.sleep(args.hangup)
        waited = short(base)
        long.join()
        r = done["long"]
        r.raise_for_status()
        print(f"the same prompt ({r.json()['usage']['prompt_tokens']} tokens) answered: "
              f"{time.perf_counter() - tic:.1f} s; a short request sent {args.hangup:.0f} s into it "
              f"took {waited:.2f} s")
        # 3. A streamed short reply alone, then while another long prompt (none of it in the
        # prefix cache) is read.
        first, gaps = streamed(base)
        other = {**body, "stream": False,
                 "messages": [{"role": "user", "content": f"Summarize this text.\n\n{text_of(args.words, args.words)}"}]}
        long = threading.Thread(target=lambda: httpx.post(f"{base}/v1/chat/completions", timeout=900, json=other))
        long.start()
        time.sleep(args.hangup)
        first_busy, gaps_busy = streamed(base)
        long.join()
        print(f"a streamed short reply alone: first token {first:.2f} s, gaps p50 {percentile(gaps, 0.5):.3f} s "
              f"p95 {percentile(gaps, 0.95):.3f} s; while the long prompt is read: first token {first_busy:.2f} s, "
              f"gaps p50 {percentile(gaps_busy, 0.5):.3f} s p95 {percentile(gaps_busy, 0.95):.3f} s "
              f"({percentile(gaps_busy, 0.95) / percentile(gaps, 0.95):.2f}x)")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
