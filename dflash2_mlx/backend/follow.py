"""``serve`` over ``mx.distributed`` ranks: rank 0 serves HTTP, the other ranks follow it.

The target is split across the ranks, so every rank must run every target pass.  Rank 0's
engine tells the followers, on its worker thread and before it acts, what it is about to
do: load a model, run a request (its prompt ids, options and the model's settings), free a
model, or stop.  A message is JSON bytes: its length in one ``all_sum``, then the bytes in
another (followers add zeros).  The followers run the same engine code path (so the caches,
the prefix cache's included, evolve alike) and drop the output.  What rank 0 alone decides
is sent too: a sampled request without a seed gets one from rank 0, and after every token
one tiny ``all_sum`` carries rank 0's "stop here" (a client that went away).  One request
runs at a time in this mode (the engine's ``max_running`` is 1).  A lost peer turns every
later request into a 503 (``RankLost``) and shows in /health; followers exit when rank 0 is
gone.  An idle follower waits in a collective: the ring backend takes long waits."""

import asyncio
import json
import logging
import random
import sys
from dataclasses import asdict, replace
from typing import Callable, Dict, Optional

import mlx.core as mx

from .wire import EngineError

log = logging.getLogger("dflash2_mlx.distributed")
_current: Optional["Lockstep"] = None


class RankLost(EngineError):
    """A rank of the distributed server is gone: nothing more can be served."""


def current() -> Optional["Lockstep"]:
    """This process's part in a distributed server (None: not distributed)."""
    return _current


def install(lockstep: Optional["Lockstep"]):
    global _current
    _current = lockstep


class Lockstep:
    """What rank 0 and its followers share: the group, the split mode and the collectives."""

    def __init__(self, group, mode: str):
        self.group, self.mode = group, mode
        self.lost: Optional[str] = None  # why the group can no longer be used

    @property
    def rank(self) -> int:
        return self.group.rank()

    def load_kwargs(self) -> dict:
        return {"distributed": self.mode, "group": self.group}

    def health(self) -> dict:
        return {"ranks": self.group.size(), "mode": self.mode, "ok": self.lost is None,
                **({"problem": self.lost} if self.lost else {})}

    def all_sum(self, x: mx.array) -> mx.array:
        if self.lost:
            raise RankLost(f"distributed serving stopped: {self.lost}; restart every rank")
        try:
            out = mx.distributed.all_sum(x, group=self.group)
            mx.eval(out)
            return out
        except RuntimeError as e:
            self.lost = f"a rank is gone ({e})"
            raise RankLost(f"distributed serving stopped: {self.lost}; restart every rank") from None

    def stop_here(self, stop: bool) -> bool:
        """Rank 0's "stop here" after a token, the same on every rank."""
        return bool(self.all_sum(mx.array([int(stop)], dtype=mx.int32)).item())

    def exchange(self, message: Optional[dict]) -> dict:
        """Rank 0 gives ``message``, the followers (None) receive it."""
        data = json.dumps(message).encode() if message is not None else b""
        n = int(self.all_sum(mx.array([len(data)], dtype=mx.int64)).item())
        payload = mx.array(list(data), dtype=mx.uint8) if data else mx.zeros((n,), dtype=mx.uint8)
        return json.loads(bytes(self.all_sum(payload).tolist()))

    # The engine's hooks: rank 0 announces, followers have heard it already.
    def loading(self, engine):
        pass

    def freeing(self, engine):
        pass

    def announce(self, engine, request):
        pass


class Leader(Lockstep):
    """Rank 0: announces each step to the followers before it takes it."""

    def loading(self, engine):
        self.exchange({"op": "load", "model": engine.model_id, "path": engine.model_path,
                       "settings": engine.settings.to_dict()})

    def freeing(self, engine):
        try:  # a follower already gone must not stop rank 0 from freeing its own part
            self.exchange({"op": "free", "model": engine.model_id})
        except RankLost as e:
            log.error("%s", e)

    def announce(self, engine, request):
        g = request.generation
        if g.sampling.temp > 0 and g.seed is None:  # the followers must draw what rank 0 draws
            seed = random.getrandbits(63)
            request.options, request.generation = replace(request.options, seed=seed), replace(g, seed=seed)
            request.plan = request.plan and replace(request.plan, seed=seed)
        self.exchange({"op": "run", "model": engine.model_id, "ids": request.ids,
                       "options": asdict(request.options), "tools": request.tools, "chat": request.chat,
                       "settings": engine.settings.to_dict()})

    def finish(self) -> bool:
        """The followers stop (the server is done; on the worker, after the models are freed)."""
        try:
            self.exchange({"op": "stop"})
            return True
        except RankLost as e:
            log.error("%s", e)
            return False


class Follower(Lockstep):
    """Ranks 1..n-1: run what rank 0 announces."""


def follow(lockstep: Follower, make_engine: Callable) -> int:
    """The follower's loop until rank 0 stops (0) or is gone (1). ``make_engine(model_id,
    path, settings)``: an engine built as rank 0's pool builds it."""
    from .admission import Request
    from .options import RequestOptions
    from .settings import ModelSettings
    from .solo import solo_job
    from .worker import worker

    engines: Dict[str, object] = {}
    try:
        while True:
            msg = worker().submit(lockstep.exchange, None).result()
            op = msg["op"]
            if op == "stop":
                return 0
            if op == "load":
                engine = make_engine(msg["model"], msg["path"], ModelSettings.from_dict(msg["settings"]))
                asyncio.run(engine.start())
                engines[msg["model"]] = engine
            elif op == "free":
                asyncio.run(engines.pop(msg["model"]).stop())
            elif op == "run":
                engine = engines[msg["model"]]
                engine.update_settings(ModelSettings.from_dict(msg["settings"]))
                request = Request("follow", msg["ids"], RequestOptions(**msg["options"]), msg["tools"], msg["chat"])
                engine.settle(request)
                solo_job(engine, request, _discard).result()
    except RankLost as e:
        print(f"dflash2-mlx serve (rank {lockstep.rank}): {e}", file=sys.stderr, flush=True)
        return 1


def _discard(item):
    if isinstance(item, BaseException):
        log.error("follower: the request failed here too: %s", item)


def distributed_setup(mode: str):
    """This rank's part (installed for the engines), and the pool limits the mode needs:
    (lockstep, max_batch 1, max_models 1)."""
    from ..distributed import check_mode

    check_mode(mode)
    group = mx.distributed.init()
    lockstep = (Leader if group.rank() == 0 else Follower)(group, mode)
    install(lockstep)
    return lockstep, 1, 1
