"""How much does the prefix cache cut the time to first token of a multi-turn chat through the server?

Time to first token of a 3-turn chat through `dflash2-mlx serve`, with the prefix cache and
without it (--prefix-cache-gb 0), on the built-in pair unless --model/--draft are given.

The chat opens with a long system message (worked GSM8K answers from the shipped prompt
set, about --context characters / 4 tokens with the first question); each reply (greedy, --max-tokens)
goes back into the history. Prints per turn: prompt tokens, cached tokens, time to first
token, and the ratio to turn 1; then whether both servers wrote the same replies.

    python scripts/experiments/chat_prefix_cache.py            # ~3,000-token chat on the built-in pair
"""

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from dflash2_mlx.builtin.bench_sets import SHIPPED_BENCH_DIR

QUESTIONS = ["How many eggs does Janet sell each day? Answer in one sentence.",
             "Now explain the robe problem step by step.",
             "Which of the answers above was the largest number?"]


def worked_answers(tokens: int) -> str:
    """Worked GSM8K answers from the shipped prompt set, about ``tokens`` tokens of them."""
    data = SHIPPED_BENCH_DIR / "gsm8k_test.jsonl"
    parts, size = [], 0
    for line in data.read_text().splitlines():
        row = json.loads(line)
        parts.append(f"Q: {row['question']}\nA: {row['answer']}")
        size += len(parts[-1]) // 4  # about 4 characters a token
        if size >= tokens:
            break
    return "\n\n".join(parts)


def system_text(tokens: int) -> str:
    return "You answer questions about these worked examples.\n\n" + worked_answers(tokens)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, cache_gb: float):
    port = free_port()
    cmd = [str(Path(sys.executable).with_name("dflash2-mlx")), "serve", "--port", str(port),
           "--prefix-cache-gb", str(cache_gb), "--log-level", "warning", "--preload",
           "--max-tokens", str(args.max_tokens)]
    for m in args.model:
        cmd += ["--model", m]
    if args.draft:
        cmd += ["--draft", args.draft]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start")


def turn(base, model, messages, max_tokens):
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0, first, text, usage = time.perf_counter(), None, "", None
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                if choice["delta"].get("content"):
                    first = first or time.perf_counter() - t0
                    text += choice["delta"]["content"]
    return first, text, usage


def chat(args, cache_gb: float):
    proc, base = start_server(args, cache_gb)
    try:
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        messages = [{"role": "system", "content": system_text(args.context)}]
        rows = []
        for q in QUESTIONS:
            messages.append({"role": "user", "content": q})
            ttft, text, usage = turn(base, model, messages, args.max_tokens)
            messages.append({"role": "assistant", "content": text})
            rows.append((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], ttft, text))
        return rows
    finally:
        proc.terminate()
        proc.wait(30)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", default=[])
    ap.add_argument("--draft")
    ap.add_argument("--context", type=int, default=1900, help="about this many system-message tokens")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    results = {}
    for name, gb in (("prefix cache", 1.0), ("no cache", 0.0)):
        rows = results[name] = chat(args, gb)
        print(f"{name}:")
        for i, (prompt, cached, ttft, _) in enumerate(rows, 1):
            print(f"  turn {i}: prompt {prompt} tokens, cached {cached}, first token {ttft:.3f} s "
                  f"({ttft / rows[0][2]:.1%} of turn 1)")
    same = [a[3] == b[3] for a, b in zip(results["prefix cache"], results["no cache"])]
    print(f"same replies with and without the cache: {same}")


if __name__ == "__main__":
    main()
