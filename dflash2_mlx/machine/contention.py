"""How much of this machine other processes used while we measured something.

A calibration taken while other work runs prices multi-row passes far above their quiet cost
(two cores shared three ways), and a cost file kept for days keeps that price.  ``Watch``
reads the system's CPU time and this process's own over a window: what the system spent that
we did not is the others' share of the machine's cores.  The CPU counts for CPU work; on a
GPU the measurement still says whether the host was busy.
"""

import os
import time

import psutil

# Above this share of the machine's cores used by other processes, a measurement is busy.
BUSY_SHARE = 0.3
# Set, this share stands for what other processes used: a test suite that runs beside other
# work (or beside itself, two workers on two cores) must not change course with the load.
SIMULATED_ENV = "DFLASH2_MLX_SIMULATED_LOAD"


class Watch:
    """Started on creation; ``others()``: the share of all cores other processes used since."""

    def __init__(self):
        self.me = psutil.Process()
        self.start = self._now()

    def _now(self):
        system = psutil.cpu_times()
        mine = self.me.cpu_times()
        busy = sum(system) - system.idle - getattr(system, "iowait", 0.0)
        return time.perf_counter(), busy, mine.user + mine.system

    def others(self) -> float:
        simulated = os.environ.get(SIMULATED_ENV)
        if simulated:
            return float(simulated)
        wall0, busy0, mine0 = self.start
        wall1, busy1, mine1 = self._now()
        seconds = max(wall1 - wall0, 1e-6) * (psutil.cpu_count() or 1)
        return max(0.0, (busy1 - busy0) - (mine1 - mine0)) / seconds

    def busy(self) -> bool:
        return self.others() > BUSY_SHARE
