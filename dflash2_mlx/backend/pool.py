"""Engines loaded on demand from the settings, at most ``max_models`` of them (and, if set,
within a memory budget); the least recently used idle one is stopped to make room.

Model ids are the sub-directories of ``model_dir`` that hold a config.json (oMLX's layout)
plus any ``models`` given explicitly as ``{id: path}``. Settings come from the store on every
load, so a model manager edits ``model_settings.json`` and the next load follows it; an idle
engine whose settings changed is reloaded on its next request, after its drafter settings
are checked against the drafter's config (a bad value leaves the loaded engine as it is). A
settings file that cannot be read, or a model entry with a wrong value, leaves the last good
settings in force (``problem``).
"""

import asyncio
import collections
import logging
import time
from pathlib import Path
from typing import Dict, List, Optional

from ..request.prompt import TemplateVariableError, check_template_variables
from .engine import Engine
from .settings import ModelSettings, SettingsError, SettingsStore

log = logging.getLogger("dflash2_mlx.pool")


class UnknownModel(KeyError):
    def __init__(self, model_id: str):
        super().__init__(model_id)
        self.model_id = model_id

    def __str__(self):
        return f"the model {self.model_id!r} does not exist"


class NoDefaultModel(LookupError):
    def __str__(self):
        return "the request names no model and no model is the default (is_default): name one"


class PoolBusy(RuntimeError):
    """Every loaded model is busy and there is no room for another."""


def _raw(entries: dict, model_id: str, key: str):
    """One key of a model's settings entry as the file has it (None: absent, or no object)."""
    entry = entries.get(model_id)
    return entry.get(key) if isinstance(entry, dict) else None


def weights_bytes(path) -> int:
    """Size of a model directory's safetensors (0 for a hub id not on disk)."""
    p = Path(str(path)).expanduser()
    return sum(f.stat().st_size for f in p.glob("*.safetensors")) if p.is_dir() else 0


class EnginePool:
    def __init__(self, store: Optional[SettingsStore] = None, *, model_dir=None,
                 models: Optional[Dict[str, str]] = None, overrides: Optional[Dict[str, dict]] = None,
                 max_models: int = 1, memory_budget_gb: Optional[float] = None,
                 max_queue: int = 8, default_max_tokens: int = 512, prefix_cache_gb: float = 1.0,
                 max_batch: int = 8, chat_template_args: Optional[dict] = None, ssd_cache_dir=None):
        self.store = store or SettingsStore()
        self.ssd_cache_dir = ssd_cache_dir
        self.chat_template_args = dict(chat_template_args or {})
        self.model_dir = Path(model_dir).expanduser() if model_dir else None
        self.models = dict(models or {})
        self.overrides = {k: dict(v) for k, v in (overrides or {}).items()}
        self.max_models = max_models
        self.memory_budget = memory_budget_gb * 1e9 if memory_budget_gb else None
        self.max_queue = max_queue
        self.default_max_tokens = default_max_tokens
        self.prefix_cache_gb = prefix_cache_gb
        self.max_batch = max_batch
        self.problem: Optional[str] = None  # why the settings file is not being followed
        self._last_good: Dict[str, dict] = {}
        self.engines: "collections.OrderedDict[str, Engine]" = collections.OrderedDict()
        self._lock = asyncio.Lock()

    # Which models exist -----------------------------------------------------------------
    def model_ids(self) -> List[str]:
        ids = list(self.models)
        if self.model_dir and self.model_dir.is_dir():
            ids += sorted(p.name for p in self.model_dir.iterdir()
                          if (p / "config.json").is_file() and p.name not in self.models)
        return ids

    def resolve(self, name: Optional[str]) -> str:
        """The model id a request names: an id, a ``model_alias``, or (None) the model whose
        settings say ``is_default``, else the only model served.  Raises UnknownModel or
        NoDefaultModel."""
        ids, entries = self.model_ids(), self._entries()
        if name is None:
            default = [m for m in ids if _raw(entries, m, "is_default") is True]
            if not default and len(ids) == 1:  # as mlx_lm.server: one model needs no name
                return ids[0]
            if not default:
                raise NoDefaultModel()
            return default[0]
        if name in ids:
            return name
        for m in ids:
            if _raw(entries, m, "model_alias") == name:
                return m
        raise UnknownModel(name)

    def public_name(self, model_id: str) -> str:
        """The name the API shows for a model: its ``model_alias``, else its id."""
        alias = _raw(self._entries(), model_id, "model_alias")
        return alias if isinstance(alias, str) and alias.strip() else model_id

    def path_of(self, model_id: str) -> str:
        if model_id in self.models:
            return self.models[model_id]
        if self.model_dir and "/" not in model_id and not model_id.startswith("."):
            path = self.model_dir / model_id
            if (path / "config.json").is_file():
                return str(path)
        raise UnknownModel(model_id)

    def _entries(self) -> Dict[str, dict]:
        """The settings file's models, or the last good ones while the file is unreadable;
        a model whose entry has a wrong value keeps its last good entry (one never good
        before keeps the wrong one: its requests are refused, naming the field)."""
        try:
            models = self.store.read()["models"]
        except SettingsError as e:
            return self._degraded(str(e))
        kept, problems = dict(models), []
        for model_id in models:
            try:
                self.settings_of(model_id, models)
            except SettingsError as e:
                kept[model_id] = self._last_good.get(model_id, models[model_id])
                problems.append(str(e))
        self._last_good = kept
        if problems:
            return self._degraded("; ".join(problems))
        if self.problem:
            log.info("settings: %s is readable again", self.store.path)
        self.problem = None
        return self._last_good

    def _degraded(self, problem: str) -> Dict[str, dict]:
        if self.problem != problem:
            log.error("settings: %s; serving with the last good settings", problem)
        self.problem = problem
        return self._last_good

    def settings_problem(self) -> Optional[str]:
        """Why the settings file is not followed now (None when it is)."""
        self._entries()
        return self.problem

    def settings_of(self, model_id: str, entries: Optional[Dict[str, dict]] = None) -> ModelSettings:
        """A model's settings as the file says now (``entries``: the file's models, when the
        caller has just read them for several models)."""
        raw = (self._entries() if entries is None else entries).get(model_id) or {}
        if not isinstance(raw, dict):
            raise SettingsError(f"settings of {model_id} must be a JSON object")
        raw = {**raw, **self.overrides.get(model_id, {})}
        settings = ModelSettings.from_dict(raw, model_id)
        try:
            check_template_variables(settings.chat_template_kwargs or {})
        except TemplateVariableError as e:
            raise SettingsError(f"{model_id}: chat_template_kwargs: {e}", "chat_template_kwargs") from None
        return settings

    # Engines ----------------------------------------------------------------------------
    async def get(self, model_id: str) -> Engine:
        """The running engine for ``model_id``, loading it (and evicting others) if needed."""
        path = self.path_of(model_id)
        engine = self._reuse(model_id, self.settings_of(model_id))
        if engine is not None:
            return engine
        async with self._lock:
            settings = self.settings_of(model_id)
            engine = self._reuse(model_id, settings)
            if engine is not None:
                return engine
            settings.check_drafter(path)
            if model_id in self.engines:
                await self._unload(model_id)  # load settings changed: reload with the new ones
            await self._make_room(path, settings)
            engine = Engine(path, settings, model_id=model_id, max_queue=self.max_queue,
                            default_max_tokens=self.default_max_tokens,
                            prefix_cache_gb=self.prefix_cache_gb, max_batch=self.max_batch,
                            chat_template_args=self.chat_template_args, ssd_cache_dir=self.ssd_cache_dir)
            await engine.start()
            self.engines[model_id] = engine
            return engine

    def _reuse(self, model_id: str, settings: ModelSettings) -> Optional[Engine]:
        """The loaded engine if its load settings still hold (or it is busy)."""
        engine = self.engines.get(model_id)
        if engine is None or not engine.running:
            return None
        if engine.settings.load_key() != settings.load_key() and not engine.has_active_requests():
            return None
        if engine.settings.load_key() == settings.load_key():
            engine.update_settings(settings)
        self.engines.move_to_end(model_id)
        return engine

    async def _make_room(self, path, settings: ModelSettings):
        need = weights_bytes(path) + (weights_bytes(settings.draft) if settings.draft else 0)
        while self.engines and (len(self.engines) >= self.max_models or self._over_budget(need)):
            idle = [m for m, e in self.engines.items()
                    if not e.has_active_requests() and not e.settings.is_pinned]
            if not idle:
                raise PoolBusy(f"all {len(self.engines)} loaded model(s) are busy or pinned; "
                               "try again when a request finishes")
            await self._unload(idle[0])  # OrderedDict order: least recently used first

    def _over_budget(self, need: int) -> bool:
        if self.memory_budget is None:
            return False
        held = sum(weights_bytes(e.model_path) + (weights_bytes(e.settings.draft) if e.settings.draft else 0)
                   for e in self.engines.values())
        return held + need > self.memory_budget

    async def _unload(self, model_id: str):
        engine = self.engines.pop(model_id)
        await engine.stop()

    async def unload(self, model_id: str) -> bool:
        async with self._lock:
            if model_id not in self.engines:
                return False
            await self._unload(model_id)
            return True

    async def expire(self, now: Optional[float] = None) -> List[str]:
        """Unload the engines idle for longer than their ``ttl_seconds`` (not pinned ones,
        not busy ones); the ids unloaded."""
        now = time.monotonic() if now is None else now
        gone = []
        async with self._lock:
            entries = self._entries() if self.engines else {}  # one read a tick, not one a model
            for model_id, engine in list(self.engines.items()):
                try:
                    s = self.settings_of(model_id, entries)
                except SettingsError:
                    s = engine.settings
                if (s.ttl_seconds and not s.is_pinned and not engine.has_active_requests()
                        and now - engine.last_used > s.ttl_seconds):
                    await self._unload(model_id)
                    gone.append(model_id)
        for model_id in gone:
            log.info("unloaded %s: idle for longer than its ttl_seconds", model_id)
        return gone

    async def stop(self):
        async with self._lock:
            for model_id in list(self.engines):
                await self._unload(model_id)

    def get_stats(self) -> dict:
        return {m: e.get_stats() for m, e in self.engines.items()}

    def has_active_requests(self) -> bool:
        return any(e.has_active_requests() for e in self.engines.values())
