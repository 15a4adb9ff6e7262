"""Run N ranks of a command on this machine over the ring backend (127.0.0.1), as
``mlx.launch -n N`` does, but with free ports, a bound on every wait, and each rank's output
kept apart: what the tests and ``bench distributed`` use.  A rank that fails or hangs ends
the run: the others get ``grace`` seconds to stop on their own (a dead neighbour must end
them with an error), then they are killed."""

import atexit
import json
import os
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence


_running: set = set()  # every rank process not yet waited for, killed if the caller exits first


@atexit.register
def _kill_running():
    """A caller that exits mid-launch (a failed test whose launch ran in a daemon thread)
    takes its ranks with it, rather than leaving them running."""
    for p in list(_running):
        if p.poll() is None:
            p.kill()


@dataclass
class RankResult:
    rank: int
    returncode: Optional[int]  # None: killed after the timeout or the grace period
    stdout: str
    stderr: str


def free_ports(n: int) -> List[int]:
    """``n`` ports free on 127.0.0.1 now (held together while chosen, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def ring_hostfile(n: int) -> str:
    """A ring hostfile for ``n`` ranks on 127.0.0.1, one free port each (JSON)."""
    return json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)])


def launch(n: int, argv: Sequence[str], *, timeout: float, grace: float = 20.0,
           env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None) -> List[RankResult]:
    """Run ``argv`` as ranks 0..n-1 and wait for all of them, at most ``timeout`` seconds."""
    with tempfile.TemporaryDirectory(prefix="dflash2-ranks-") as tmp:
        hostfile = os.path.join(tmp, "hosts.json")
        with open(hostfile, "w") as f:
            f.write(ring_hostfile(n))
        procs, outs = [], []
        for rank in range(n):
            out = open(os.path.join(tmp, f"rank{rank}.out"), "w+")
            err = open(os.path.join(tmp, f"rank{rank}.err"), "w+")
            rank_env = {**os.environ, **(env or {}), "MLX_HOSTFILE": hostfile, "MLX_RANK": str(rank),
                        "MLX_WORLD_SIZE": str(n)}
            procs.append(subprocess.Popen(list(argv), stdout=out, stderr=err, env=rank_env, cwd=cwd))
            _running.add(procs[-1])
            outs.append((out, err))
        deadline, ended_at = time.monotonic() + timeout, None
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if ended_at is None and any(p.poll() not in (None, 0) for p in procs):
                ended_at = time.monotonic()  # one failed: the rest have ``grace`` to follow
            if ended_at is not None and time.monotonic() > ended_at + grace:
                break
            time.sleep(0.05)
        codes = []
        for p in procs:
            codes.append(p.poll())
            if codes[-1] is None:
                p.kill()
                p.wait()
            _running.discard(p)
        results = []
        for rank, (out, err) in enumerate(outs):
            out.seek(0), err.seek(0)
            results.append(RankResult(rank, codes[rank], out.read(), err.read()))
            out.close(), err.close()
        return results
