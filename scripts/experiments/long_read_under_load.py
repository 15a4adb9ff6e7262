"""How long an uncached long prompt takes to be read while other clients keep the batch busy,
and what the decoding clients' token gaps are meanwhile: the soak's setting (issue 59: its
fourth hour read a 5.3k-token text in 1,180 s beside its load), reproduced in minutes.

The soak's server (`dflash2_mlx/eval/soak.py`: the built-in pair, a 20 MB memory tier over a
1 GB disk tier, `--max-batch 4`), --decoders clients looping streamed greedy short prompts,
then the soak's second long text, streamed; with --profile, py-spy records the server
(`pip install py-spy`) while the long prompt is read, into OUT/profile.txt (collapsed stacks
with thread names: the worker's share per function is read off it).

    python scripts/experiments/long_read_under_load.py --out /tmp/lr [--home H] [--profile]
"""

import argparse
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from dflash2_mlx.eval.soak import Clients, Server, SoakConfig, inputs, p95


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--home", type=Path, help="a DFLASH2_MLX_HOME whose calibration serves (default: OUT/home)")
    ap.add_argument("--decoders", type=int, default=3)
    ap.add_argument("--long", type=int, default=1, help="which of the soak's long texts (0 or 1)")
    ap.add_argument("--words", type=int, default=0, help="cut the long text to this many words (0: whole)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    cfg = SoakConfig()
    data = inputs(cfg)
    server = Server(args.out, cfg, args.home or args.out / "home")
    print(f"server started in {server.start():.1f} s (pid {server.proc.pid})", flush=True)
    stop, spans = threading.Event(), []
    try:
        c = Clients(server.base)
        tic = time.time()
        c.send("openai-chat", "soak", [{"role": "user", "content": "hi"}], 4)
        print(f"first reply in {time.time() - tic:.1f} s", flush=True)

        def decoder(i):
            c = Clients(server.base)
            k = i
            while not stop.is_set():
                text = data["short"][k % len(data["short"])]["text"]
                k += args.decoders
                t0 = time.time()
                r = c.send("openai-chat", "soak", [{"role": "user", "content": text}], cfg.max_tokens, stream=True)
                spans.append((t0, time.time(), r["gaps"]))

        threads = [threading.Thread(target=decoder, args=(i,), daemon=True) for i in range(args.decoders)]
        for t in threads:
            t.start()
        time.sleep(30)
        spy = None
        if args.profile:
            spy_bin = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
            spy = subprocess.Popen([spy_bin, "record", "--pid", str(server.proc.pid), "--format", "raw", "--threads",
                                    "--rate", "20", "--output", str(args.out / "profile.txt")],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0 = time.time()
        text = data["long"][args.long]["text"]
        if args.words:
            text = " ".join(text.split()[:args.words]) + "\n\nSummarize the text above in one sentence."
        r = c.send("openai-chat", "soak", [{"role": "user", "content": text}], 8, stream=True)
        t1 = time.time()
        if spy is not None:
            spy.send_signal(2)
            spy.wait(timeout=60)
        stop.set()
        for t in threads:
            t.join(timeout=600)
        during = [g for a, b, gs in spans if a < t1 and b > t0 for g in gs]
        before = [g for a, b, gs in spans if b <= t0 for g in gs]
        print(f"long prompt: first token after {r['ttft']:.1f} s ({t1 - t0:.1f} s in all)")
        print(f"decoders' replies: {len(spans)}; token gaps before it p95 {p95(before) or 0:.3f} s "
              f"({len(before)}), while it was read p95 {p95(during) or 0:.3f} s ({len(during)})")
    finally:
        stop.set()
        server.stop()


if __name__ == "__main__":
    main()
