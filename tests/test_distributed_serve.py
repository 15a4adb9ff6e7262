"""`serve --distributed tensor` on 2 ring ranks (127.0.0.1, free ports): rank 0 serves HTTP,
rank 1 follows it in lockstep; greedy replies equal one process's, a streamed request whose
client leaves midway leaves the ranks in step, and SIGTERM to rank 0 ends both ranks."""

import os
import signal
import sys
import subprocess
import threading
import time

import httpx
import pytest

from dflash2_mlx.distributed import local
from dflash2_mlx.generate import load, stream_generate
from dflash2_mlx.request.prompt import chat_ids
from tiny_models import make_drafter, make_target

MESSAGES = [[{"role": "user", "content": "abc"}], [{"role": "user", "content": "hello there"}]]


def single_process(t, d, messages, n):
    model, tok, drafter = load(str(t), str(d))
    ids = chat_ids(tok, messages)
    return [r.text for r in stream_generate(model, tok, ids, drafter, max_tokens=n)]


def launch_serve(tmp_path, prefix_cache_gb: str, grace: float = 20.0):
    """`serve --distributed tensor` on 2 ranks of a tiny pair, launched in a thread, once
    rank 0's /health answers: (target, drafter, port, base URL, the thread, its results)."""
    t, d = tmp_path / "t", tmp_path / "d"
    make_target(t)
    make_drafter(d, t)
    port = local.free_ports(1)[0]
    argv = [sys.executable, "-m", "dflash2_mlx.cli.main", "serve", "-m", f"tiny={t}", "-d", str(d),
            "--distributed", "tensor", "--port", str(port), "--preload", "--prefix-cache-gb", prefix_cache_gb]
    out = {}
    runner = threading.Thread(target=lambda: out.setdefault(
        "ranks", local.launch(2, argv, timeout=240, grace=grace, env={"HOME": str(tmp_path)})), daemon=True)
    runner.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        assert runner.is_alive(), out
        try:
            httpx.get(f"{base}/health", timeout=1)
            return t, d, port, base, runner, out
        except httpx.TransportError:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.3)


def test_serve_two_ranks_in_lockstep(tmp_path):
    t, d, port, base, runner, out = launch_serve(tmp_path, "0.1")
    health = httpx.get(f"{base}/health", timeout=10).json()
    assert health["distributed"] == {"ranks": 2, "mode": "tensor", "ok": True}

    def chat(messages, **kw):
        body = {"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0, **kw}
        return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()

    want = ["".join(single_process(t, d, m, 12)) for m in MESSAGES]
    assert chat(MESSAGES[0])["choices"][0]["message"]["content"] == want[0]
    # A streamed request whose client leaves after a few chunks: both ranks stop at one token.
    body = {"model": "tiny", "messages": MESSAGES[0], "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break
    assert chat(MESSAGES[1])["choices"][0]["message"]["content"] == want[1]
    assert chat(MESSAGES[0])["choices"][0]["message"]["content"] == want[0]
    # SIGTERM to rank 0 only: it tells the follower to stop, and both end.
    os.kill(_rank0_pid(port), signal.SIGTERM)
    runner.join(120)
    ranks = out["ranks"]
    # Rank 0 ends as uvicorn ends on SIGTERM (the signal re-raised), the follower cleanly.
    assert [r.returncode for r in ranks] in ([0, 0], [-signal.SIGTERM, 0]), [r.stderr[-2000:] for r in ranks]


def _rank0_pid(port: int) -> int:
    """The process listening on ``port`` (rank 0)."""
    out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True).stdout
    return int(out.split("pid=")[1].split(",")[0])


@pytest.mark.slow
def test_a_lost_follower_gives_503_not_a_hang(tmp_path):
    """The follower killed while rank 0 serves: the next request ends with a clear error
    (503) in bounded time, /health says the group is lost, and rank 0 still stops on SIGTERM."""
    t, d, port, base, runner, out = launch_serve(tmp_path, "0", grace=120)
    body = {"model": "tiny", "messages": MESSAGES[0], "max_tokens": 8, "temperature": 0}
    assert httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).status_code == 200
    rank0 = _rank0_pid(port)
    pids = [int(p) for p in subprocess.run(["pgrep", "-f", "--", f"--port {port} "], capture_output=True,
                                            text=True).stdout.split()]
    follower = [p for p in pids if p != rank0]
    assert len(follower) == 1, pids
    os.kill(follower[0], signal.SIGKILL)
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 503, r.text
    health = httpx.get(f"{base}/health", timeout=10).json()
    assert health["status"] == "error" and health["distributed"]["ok"] is False, health
    os.kill(rank0, signal.SIGTERM)
    runner.join(150)
    assert not runner.is_alive()
