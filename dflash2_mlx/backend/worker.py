"""The one thread that runs every MLX call of the backend.

MLX streams and arrays must not be shared across threads, so model loading, generation and
freeing all happen here. A job is a plain function (run once) or a generator (stepped: each
``next`` does a little work, then other jobs get a turn), so a long generation for one model
does not hold up another model's requests. Results come back as concurrent futures.

The thread is a daemon that never ends: MLX keeps per-thread state (the ``mx.compile``
cache) whose destructor calls back into Python, and a thread that exits while the
interpreter shuts down aborts the process from there. A thread still parked at exit is
simply discarded.
"""

import collections
import inspect
import queue
import threading
from concurrent.futures import Future


class _Job:
    __slots__ = ("fn", "gen", "future")

    def __init__(self, fn):
        self.fn, self.gen, self.future = fn, None, Future()


class Worker:
    def __init__(self, name: str = "dflash2-mlx-worker"):
        self._inbox = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def submit(self, fn, *args, **kwargs) -> Future:
        """Run ``fn(*args, **kwargs)`` on the worker; a generator function is stepped."""
        job = _Job(lambda: fn(*args, **kwargs))
        self._inbox.put(job)
        return job.future

    def _loop(self):
        active = collections.deque()
        while True:  # never returns: see the module docstring
            block = not active
            while True:
                try:
                    active.append(self._inbox.get(block=block))
                except queue.Empty:
                    break
                block = False
            job = active.popleft()
            try:
                if job.gen is None:
                    if not job.future.set_running_or_notify_cancel():
                        continue  # cancelled before it started
                    out = job.fn()
                    if not inspect.isgenerator(out):
                        job.future.set_result(out)
                        continue
                    job.gen = out
                next(job.gen)
                active.append(job)
            except StopIteration as stop:
                job.future.set_result(stop.value)
            except BaseException as e:  # the job failed; the worker keeps serving
                job.future.set_exception(e)


_worker = None
_worker_lock = threading.Lock()


def worker() -> Worker:
    """The process-wide MLX worker, started on first use."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = Worker()
        return _worker
