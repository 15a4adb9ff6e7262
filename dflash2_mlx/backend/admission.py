"""Admission: who runs, who waits, who is refused. Up to ``max_running`` requests run at
once, first come first served, with at most ``max_waiting`` waiting; one more is refused
with QueueFull when its stream is made, before any chunk (a request holds its place in line
from then on). ``Admission.serve`` is a request's stream: it waits for the turn, hands the
request to a decoding job, relays the job's chunks to the event loop, and frees the turn."""

import asyncio
import collections
import threading
import time
from concurrent.futures import Future
from typing import AsyncIterator, Callable, Dict, List, Optional

from .options import Generation, RequestOptions
from .stats import EngineStats
from .wire import Chunk, QueueFull

# A job's last message for its request: nothing more will come.
DONE = object()


class Turns:
    """First-come-first-served admission: ``max_running`` requests run, ``max_waiting`` may wait."""

    def __init__(self, max_waiting: int, max_running: int = 1):
        self.max_waiting = max_waiting
        self.max_running = max_running
        self.running = 0
        self.waiters = collections.deque()

    def reserve(self) -> asyncio.Future:
        """A place in line, taken now: a future that is done when it is this request's turn.
        Raises QueueFull when ``max_waiting`` are waiting already."""
        turn = asyncio.get_running_loop().create_future()
        if self.running < self.max_running and not self.waiters:
            self.running += 1
            turn.set_result(None)
        elif len(self.waiters) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiters)} requests are already waiting for this model")
        else:
            self.waiters.append(turn)
        return turn

    def resize(self, max_running: int):
        """Change the limit (a settings edit); a raised one lets waiters start now."""
        self.max_running = max_running
        while self.waiters and self.running < self.max_running:
            self.running += 1
            self.leave()

    def cancel(self, turn: asyncio.Future):
        """Give up a place: leave the line, or pass the turn on if it had come."""
        if turn in self.waiters:
            self.waiters.remove(turn)
        elif turn.done() and not turn.cancelled():
            self.leave()

    def leave(self):
        """A running request is done: its place goes to the first waiter (unless the limit
        has been lowered meanwhile)."""
        while self.waiters and self.running <= self.max_running:
            turn = self.waiters.popleft()
            if not turn.done():
                try:
                    turn.set_result(None)
                    return
                except RuntimeError:  # its event loop has closed
                    continue
        self.running -= 1


class Request:
    """One request from its stream's making to its last chunk."""

    def __init__(self, request_id: str, ids: List[int], options: RequestOptions, tools=None,
                 chat: bool = False, continues: bool = False):
        self.id = request_id
        self.ids = ids
        self.options = options
        self.tools = tools
        self.chat = chat
        self.continues = continues  # its reply continues a prefill (responses.detokenizer_after)
        self.generation: Optional[Generation] = None  # what it runs with (set when its turn comes)
        self.plan = None  # how it is decoded, a ``request.plan.Plan`` (set with ``generation``)
        self.settings = None  # the model's settings both were made under
        self.aborted = threading.Event()
        self.finished = False
        self.started = False  # its stream has been iterated
        self.turn: Optional[asyncio.Future] = None
        self.queued = False
        self.chunks: Optional[asyncio.Queue] = None
        self.done: Optional[Future] = None  # in the batch: set when the batch is done with it
        self.push = None  # its chunks' way out (set on the worker)
        self.loop = None  # the event loop its stream runs on (set when the stream starts)
        self.aside = False  # it has passed its turn on while it waits inside its job


# A request's turn has come: start its job (request, push) -> the job's future.
Begin = Callable[[Request, Callable], Future]


class Admission:
    """The line of one model's requests, the requests it knows, and the worker jobs it waits
    for when the model stops."""

    def __init__(self, stats: EngineStats, max_queue: int, model_id: str):
        self.stats, self.max_queue, self.model_id = stats, max_queue, model_id
        self.turns = Turns(max_queue)
        self.requests: Dict[str, Request] = {}
        self.jobs = set()
        self.last_used = time.monotonic()

    def admit(self, request: Request, max_running: int):
        """Take the request's place in line, or refuse it with QueueFull."""
        self.turns.resize(max_running)
        try:
            request.turn = self.turns.reserve()
        except QueueFull:
            self.stats.move(rejected=1)
            raise QueueFull(f"{self.max_queue} requests are already waiting for model {self.model_id}") from None
        request.queued = not request.turn.done()
        self.stats.move(queued=int(request.queued))
        self.requests[request.id] = request

    def abort(self, request_id: Optional[str] = None) -> int:
        """Stop one request (or all); returns how many were told to stop."""
        hit = [r for r in self.requests.values() if request_id in (None, r.id)]
        for r in hit:
            r.aborted.set()
        return len(hit)

    def track(self, job: Future):
        """A worker job to wait for at stop."""
        self.jobs = {j for j in self.jobs if not j.done()}
        self.jobs.add(job)

    async def settle(self):
        """Wait until every job is done."""
        while True:  # a finished job may still be listed: its loop closed before it ended
            pending = [j for j in self.jobs if not j.done()]
            if not pending:
                break
            await asyncio.wait([asyncio.wrap_future(j) for j in pending])
        self.jobs.clear()

    def drop_unstarted(self, request: Request):
        """A stream dropped before it was iterated (its response never started)."""
        if not request.started:
            self._release(request)

    async def serve(self, request: Request, max_running: Callable[[], int], begin: Begin) -> AsyncIterator[Chunk]:
        """The request's stream: its turn, then its job's chunks as they come."""
        request.started = True
        loop = request.loop = asyncio.get_running_loop()
        request.chunks = asyncio.Queue()
        job = None
        try:
            if request.turn is None:
                self.admit(request, max_running())
            await request.turn
            self._unqueue(request)

            def push(item):
                call_soon(loop, request.chunks.put_nowait, item)

            job = begin(request, push)
            self.jobs.add(job)
            job.add_done_callback(lambda f: call_soon(loop, self._finished, request, f))
            while True:
                item = await request.chunks.get()
                if item is DONE:  # the worker's last act for this request
                    self._finished(request, job)
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            request.aborted.set()  # a consumer that stops early stops the generation
            if job is None:  # never reached the worker
                self._release(request)

    def step_aside(self, request: Request, aside: bool = True):
        """From the worker: a request that waits inside its job for another (a long prompt
        behind one being read) passes its turn on, so the next in line runs meanwhile; it
        takes a place again (``aside=False``) when its wait is over, above the limit if need be."""
        call_soon(request.loop, self._step_aside, request, aside)

    def _step_aside(self, request: Request, aside: bool):
        if request.finished or request.aside == aside:
            return
        request.aside = aside
        if aside:
            self.turns.leave()
        else:
            self.turns.running += 1

    def _unqueue(self, request: Request):
        if request.queued:
            request.queued = False
            self.stats.move(queued=-1)

    def _release(self, request: Request):
        """Free the place of a request that never reached the worker (its client left, or
        its stream was dropped, while it waited): an aborted request for the counters."""
        self._unqueue(request)
        if self.requests.pop(request.id, None) is not None:
            self.stats.add(prompt_tokens=len(request.ids), finish_reason="abort")
        if request.turn is not None:
            self.turns.cancel(request.turn)

    def _finished(self, request: Request, job):
        """Free the request's turn: when its consumer sees the end, or (if the consumer
        has gone) when the worker's job completes. Runs once."""
        if request.finished:
            return
        request.finished = True
        self.jobs.discard(job)
        self.requests.pop(request.id, None)
        if not request.aside:  # one that stepped aside has passed its turn on already
            self.turns.leave()
        self.last_used = time.monotonic()


def call_soon(loop, fn, *args):
    """Run ``fn`` on the event loop; if that loop has closed, run it here."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        try:
            fn(*args)
        except RuntimeError:
            pass


def in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False
