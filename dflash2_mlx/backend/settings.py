"""Per-model settings in oMLX's ``model_settings.json`` schema.

The file is ``{"version": 1, "models": {model_id: {field: value, ...}}}`` with oMLX's field
names. Fields this package reads are validated (an invalid value raises SettingsError naming
the field); every other key is kept as it is, so a manager's own settings survive our writes.
``None`` means "unset": such values are dropped on read and remove the key on write.

Writes are atomic (temp file in the same directory, fsync, ``os.replace``) and serialized
across processes with an ``fcntl`` lock on a side file; each write re-reads the file under the
lock and merges only the keys it changes, so concurrent writers never lose each other's updates.

The module imports only the standard library at its top, so that it loads alone, in
milliseconds, without MLX (a manager's writer process; the tests' concurrent writers): the
drafter checks import the package's modules where they run.
"""

import copy
import fcntl
import json
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from ..request.modes import MAX_BUDGET, VERIFY_MODES, verify_kind

SETTINGS_VERSION = 1
SETTINGS_ENV = "DFLASH2_MLX_SETTINGS"
HOME_ENV = "DFLASH2_MLX_HOME"
DEFAULT_SETTINGS = Path("~/.dflash2-mlx/model_settings.json")
DEFAULT_SSD_CACHE_BYTES = 10 * 10**9


class SettingsError(ValueError):
    """An invalid settings value or an unreadable settings file; ``param``: the field."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


def _bool(v):
    return isinstance(v, bool)


def _int(v, lo=None, choices=None, hi=None):
    if not isinstance(v, int) or isinstance(v, bool):
        return False
    if choices is not None and v not in choices:
        return False
    return (lo is None or v >= lo) and (hi is None or v <= hi)


def _num(v, lo=None, hi=None, lo_open=False):
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    if lo is not None and (v <= lo if lo_open else v < lo):
        return False
    return hi is None or v <= hi


# field -> (check, what a valid value is); the fields this package reads.
FIELDS = {
    "dflash_enabled": (_bool, "true or false"),
    "dflash_draft_model": (lambda v: isinstance(v, str) and v.strip() != "", "a drafter directory or hub id"),
    "dflash_draft_quant_enabled": (_bool, "true or false"),
    "dflash_draft_quant_weight_bits": (lambda v: _int(v, choices=(2, 4, 8)), "2, 4 or 8"),
    "dflash_draft_quant_activation_bits": (lambda v: _int(v, choices=(16, 32)), "16 or 32"),
    "dflash_draft_quant_group_size": (lambda v: _int(v, choices=(32, 64, 128)), "32, 64 or 128"),
    "dflash_block_size": (lambda v: _int(v, lo=1), "an integer >= 1"),
    "dflash_verify_mode": (lambda v: v in VERIFY_MODES, " or ".join(repr(m) for m in VERIFY_MODES)),
    "dflash_tree_budget": (lambda v: v == "auto" or _int(v, lo=1, hi=MAX_BUDGET),
                           f"'auto' or an integer in 1..{MAX_BUDGET} (drafted nodes per tree, verify mode 'tree')"),
    "dflash_max_ctx": (lambda v: _int(v, lo=0), "an integer >= 0 (0 = no limit)"),
    "dflash_draft_window": (lambda v: _int(v, lo=0), "an integer >= 0 (0 = the whole context)"),
    "dflash_copies": (_bool, "true or false"),
    "dflash_exact": (_bool, "true or false"),
    "dflash_draft_window_size": (lambda v: _int(v, lo=0), "an integer >= 0 (0 = the whole context)"),
    "dflash_draft_sink_size": (lambda v: _int(v, lo=0), "an integer >= 0"),
    "dflash_in_memory_cache": (_bool, "true or false"),
    "dflash_in_memory_cache_max_bytes": (lambda v: _int(v, lo=0), "an integer >= 0 (bytes)"),
    "dflash_in_memory_cache_max_entries": (lambda v: _int(v, lo=1), "an integer >= 1"),
    "dflash_ssd_cache": (_bool, "true or false"),
    "dflash_ssd_cache_max_bytes": (lambda v: _int(v, lo=0), "an integer >= 0 (bytes)"),
    "max_context_window": (lambda v: _int(v, lo=1), "an integer >= 1"),
    "max_tokens": (lambda v: _int(v, lo=1), "an integer >= 1"),
    "temperature": (lambda v: _num(v, lo=0), "a number >= 0"),
    "top_p": (lambda v: _num(v, lo=0, hi=1, lo_open=True), "a number in (0, 1]"),
    "top_k": (lambda v: _int(v, lo=0), "an integer >= 0"),
    "min_p": (lambda v: _num(v, lo=0, hi=1), "a number in [0, 1]"),
    "repetition_penalty": (lambda v: _num(v, lo=0, lo_open=True), "a number > 0 (1 = none)"),
    "presence_penalty": (lambda v: _num(v, lo=-2, hi=2), "a number in [-2, 2] (0 = none)"),
    "is_pinned": (_bool, "true or false"),
    "is_default": (_bool, "true or false (the model of requests that name none)"),
    "model_alias": (lambda v: isinstance(v, str) and v.strip() != "", "a name for the API"),
    "ttl_seconds": (lambda v: _int(v, lo=1), "an integer >= 1 (seconds idle before unloading)"),
    "prefix_cache_gb": (lambda v: _num(v, lo=0), "a number >= 0 (GB; 0 turns the prefix cache off)"),
    "max_batch": (lambda v: _int(v, lo=1), "an integer >= 1 (requests run at once; 1: one at a time)"),
    "chat_template_kwargs": (lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
                             "a JSON object of chat-template variables"),
    "forced_ct_kwargs": (lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v),
                         "a list of chat_template_kwargs keys that requests may not override"),
    "enable_thinking": (_bool, "true or false (the template variable enable_thinking)"),
    "preserve_thinking": (_bool, "true or false (the template variable preserve_thinking)"),
}


def first_set(*values):
    """The first value that is not None (None if all are)."""
    return next((v for v in values if v is not None), None)


def check_value(name: str, value):
    """Raise SettingsError if ``value`` is not valid for the known field ``name``."""
    if name not in FIELDS or value is None:
        return
    ok, expected = FIELDS[name]
    if ok(value):
        return
    raise SettingsError(f"{name} must be {expected}, got {value!r}", name)


@dataclass
class ModelSettings:
    """One model's settings: the fields this package reads, typed; the rest in ``extra``."""
    dflash_enabled: bool = False
    dflash_draft_model: Optional[str] = None
    dflash_draft_quant_enabled: bool = False
    dflash_draft_quant_weight_bits: Optional[int] = None
    dflash_draft_quant_activation_bits: Optional[int] = None
    dflash_draft_quant_group_size: Optional[int] = None
    dflash_block_size: Optional[int] = None
    dflash_verify_mode: Optional[str] = None
    dflash_tree_budget: Any = None  # verify mode "tree": nodes per tree, or "auto" (the default)
    dflash_max_ctx: Optional[int] = None
    dflash_draft_window: Optional[int] = None  # context rows a draft reads (the latest)
    dflash_copies: bool = True  # copy where the text repeats itself (lookup.py); False: always draft
    # Verify rows bit-identical to one-row decode steps (generate's exact=True): each request
    # then decodes alone, as the batch has no exact mode.
    dflash_exact: bool = False
    # oMLX's names: the draft window (dflash_draft_window wins when both are set), the first
    # context rows every draft reads besides it, and the prefix cache (prefix_cache_gb wins).
    dflash_draft_window_size: Optional[int] = None
    dflash_draft_sink_size: Optional[int] = None
    dflash_in_memory_cache: Optional[bool] = None
    dflash_in_memory_cache_max_bytes: Optional[int] = None
    dflash_in_memory_cache_max_entries: Optional[int] = None
    dflash_ssd_cache: Optional[bool] = None  # the prefix cache's disk tier (ssd_cache.py)
    dflash_ssd_cache_max_bytes: Optional[int] = None
    max_context_window: Optional[int] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None  # a request's own wins, as sampling's do
    presence_penalty: Optional[float] = None
    is_pinned: bool = False  # never unloaded to make room, nor for its ttl
    is_default: bool = False  # the model of requests that name none
    model_alias: Optional[str] = None  # the name the API shows (the id still works)
    ttl_seconds: Optional[int] = None  # idle seconds before the server unloads it
    prefix_cache_gb: Optional[float] = None  # the server's --prefix-cache-gb when unset
    max_batch: Optional[int] = None  # the server's --max-batch when unset
    chat_template_kwargs: Optional[Dict[str, Any]] = None  # template variables of every request
    forced_ct_kwargs: Optional[List[str]] = None  # ... that a request may not override
    enable_thinking: Optional[bool] = None  # over chat_template_kwargs' enable_thinking
    preserve_thinking: Optional[bool] = None
    extra: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict, model_id: str = "") -> "ModelSettings":
        if not isinstance(data, dict):
            raise SettingsError(f"settings of {model_id or 'a model'} must be a JSON object")
        known, extra = {}, {}
        for k, v in data.items():
            if v is None:
                continue
            if k in FIELDS:
                try:
                    check_value(k, v)
                except SettingsError as e:
                    raise SettingsError(f"{model_id}: {e}" if model_id else str(e), e.param) from None
                known[k] = v
            else:
                extra[k] = v
        return cls(**known, extra=extra)

    def to_dict(self) -> dict:
        out = dict(self.extra)
        defaults = ModelSettings.__dataclass_fields__
        for name in FIELDS:
            v = getattr(self, name)
            if v is not None and v != defaults[name].default:
                out[name] = v
        return out

    # What the engine uses -------------------------------------------------------------
    def template_variables(self, request: Optional[dict] = None, defaults: Optional[dict] = None) -> dict:
        """A request's chat-template variables, merged as oMLX merges them (later wins): the
        server's ``defaults`` (``serve --chat-template-args``), this model's
        ``chat_template_kwargs``, its ``enable_thinking`` / ``preserve_thinking``, then the
        request's own, except the keys in ``forced_ct_kwargs`` (the model's stand)."""
        merged = {**(defaults or {}), **(self.chat_template_kwargs or {})}
        for name in ("enable_thinking", "preserve_thinking"):
            if getattr(self, name) is not None:
                merged[name] = getattr(self, name)
        forced = set(self.forced_ct_kwargs or ())
        merged.update((k, v) for k, v in (request or {}).items() if k not in forced)
        return merged

    @property
    def draft(self) -> Optional[str]:
        """The drafter to load, or None for plain decoding."""
        return self.dflash_draft_model if self.dflash_enabled and self.dflash_draft_model else None

    @property
    def draft_window(self) -> Optional[int]:
        """Context rows a draft reads, the latest ones (None: all)."""
        return first_set(self.dflash_draft_window, self.dflash_draft_window_size) or None

    @property
    def draft_sink(self) -> int:
        """The first context rows a windowed draft reads as well."""
        return self.dflash_draft_sink_size or 0

    def prefix_cache_bytes(self, default_gb: float) -> int:
        """The prefix cache's budget: ``prefix_cache_gb``, else oMLX's
        ``dflash_in_memory_cache`` (false: none) and its byte budget, else ``default_gb``."""
        if self.prefix_cache_gb is not None:
            return int(self.prefix_cache_gb * 1e9)
        if self.dflash_in_memory_cache is False:
            return 0
        return first_set(self.dflash_in_memory_cache_max_bytes, int(default_gb * 1e9))

    def ssd_cache_bytes(self) -> int:
        """The prefix cache's disk budget: ``dflash_ssd_cache_max_bytes`` (default
        DEFAULT_SSD_CACHE_BYTES) when ``dflash_ssd_cache`` is on, else 0 (no disk tier)."""
        if not self.dflash_ssd_cache:
            return 0
        return first_set(self.dflash_ssd_cache_max_bytes, DEFAULT_SSD_CACHE_BYTES)

    def load_kwargs(self) -> dict:
        """Keyword arguments of ``dflash2_mlx.load`` for the drafter."""
        kw = {}
        if self.draft and self.dflash_draft_quant_enabled:
            kw["draft_bits"] = self.dflash_draft_quant_weight_bits or 4
            kw["draft_group_size"] = self.dflash_draft_quant_group_size or 64
        if self.draft and self.dflash_draft_quant_activation_bits:
            kw["draft_activation_bits"] = self.dflash_draft_quant_activation_bits
        return kw

    def load_key(self) -> tuple:
        """What a loaded engine depends on: a change means reloading it."""
        return (self.draft, tuple(sorted(self.load_kwargs().items())), self.dflash_block_size,
                self.max_context_window)

    def verify_mode(self, prompt_tokens: int) -> str:
        """'off' (plain decoding) above ``dflash_max_ctx`` prompt tokens or when disabled;
        'adaptive' chooses the block size every cycle (``dflash_block_size`` is then the
        largest); 'dflash' with no ``dflash_block_size`` is adaptive too."""
        if self.draft is None:
            return "off"
        if self.dflash_max_ctx and prompt_tokens > self.dflash_max_ctx:
            return "off"
        return self.dflash_verify_mode or "dflash"

    def engine(self, prompt_tokens: int = 0) -> dict:
        """How a request of ``prompt_tokens`` is decoded: DFlash on/off, the drafter, the
        verify mode and the block size (a number, or "auto": chosen every cycle)."""
        mode = self.verify_mode(prompt_tokens)
        block = None
        if mode != "off":
            fixed = mode == "dflash" and self.dflash_block_size is not None
            block = self.dflash_block_size if fixed else "auto"
        out = {"dflash": mode != "off", "drafter": drafter_name(self.draft), "verify_mode": mode,
               "block_size": block}
        if verify_kind(mode) == "tree":
            out["tree_budget"] = self.dflash_tree_budget or "auto"
        if mode != "off" and self.dflash_exact:
            out["exact"] = True
        return out

    def check_drafter(self, model_path=None):
        """Raise SettingsError (naming the field) when the drafter cannot work as set: a
        missing or mismatched drafter, a block size beyond its trained one. Config files
        only; a drafter config that cannot be read otherwise is left to loading."""
        if self.draft is None:
            return
        from ..model.config import DrafterConfig
        from .compat import is_compatible, read_json_config

        try:
            drafter = DrafterConfig.from_dict(read_json_config(self.draft))
        except FileNotFoundError as e:
            raise SettingsError(f"dflash_draft_model: {e}", "dflash_draft_model") from None
        except Exception:
            return
        if model_path is not None:
            ok, reason = is_compatible(model_path, self.draft)
            if not ok and "cannot read the target" not in reason:
                raise SettingsError(f"dflash_draft_model {self.draft}: {reason}", "dflash_draft_model")
        if self.dflash_block_size is not None and self.dflash_block_size > drafter.block_size:
            raise SettingsError(
                f"dflash_block_size {self.dflash_block_size} is impossible for the drafter "
                f"{self.draft}: use 1..{drafter.block_size} (its trained block size), or unset it "
                "for 'auto'", "dflash_block_size")

    def is_compatible(self, model_path) -> tuple:
        """(ok, reason) for this model's drafter against the target at ``model_path``."""
        from .compat import is_compatible

        if not self.dflash_enabled:
            return False, "DFlash is not enabled for this model (dflash_enabled is false)"
        if not self.dflash_draft_model:
            return False, "no drafter set (dflash_draft_model)"
        return is_compatible(model_path, self.dflash_draft_model)


def default_path() -> Path:
    """``$DFLASH2_MLX_SETTINGS``; else ``model_settings.json`` in ``$DFLASH2_MLX_HOME`` where
    that is set (a home of its own keeps everything in it); else ``~/.dflash2-mlx/``."""
    if os.environ.get(SETTINGS_ENV):
        return Path(os.environ[SETTINGS_ENV]).expanduser()
    if os.environ.get(HOME_ENV):
        return Path(os.environ[HOME_ENV]).expanduser() / DEFAULT_SETTINGS.name
    return DEFAULT_SETTINGS.expanduser()


class SettingsStore:
    """``model_settings.json`` on disk: read, validated updates, atomic locked writes."""

    def __init__(self, path=None):
        self.path = Path(path).expanduser() if path is not None else default_path()
        self.lock_path = self.path.with_name(self.path.name + ".lock")

    # Reading ---------------------------------------------------------------------------
    def read(self) -> dict:
        """The whole file as ``{"version", "models"}``; an absent file is empty."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {"version": SETTINGS_VERSION, "models": {}}
        except (OSError, UnicodeDecodeError) as e:  # a directory, no permission, not text
            raise SettingsError(f"{self.path} cannot be read: {e}") from e
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SettingsError(f"{self.path} is not valid JSON: {e}") from e
        if not isinstance(data, dict) or not isinstance(data.get("models", {}), dict):
            raise SettingsError(f"{self.path} must hold {{\"version\": 1, \"models\": {{...}}}}")
        data.setdefault("version", SETTINGS_VERSION)
        data.setdefault("models", {})
        return data

    def model_ids(self):
        return list(self.read()["models"])

    def raw(self, model_id: str) -> dict:
        return copy.deepcopy(self.read()["models"].get(model_id, {}))

    def get(self, model_id: str) -> ModelSettings:
        """A model's settings (defaults for a model the file does not mention)."""
        return ModelSettings.from_dict(self.raw(model_id), model_id)

    # Writing ---------------------------------------------------------------------------
    def update(self, model_id: str, changes: dict) -> ModelSettings:
        """Set the given keys of one model (``None`` removes a key); returns the result."""
        for k, v in changes.items():
            try:
                check_value(k, v)
            except SettingsError as e:
                raise SettingsError(f"{model_id}: {e}", e.param) from None
        with self.locked():
            data = self.read()
            entry = {k: v for k, v in data["models"].get(model_id, {}).items() if v is not None}
            for k, v in changes.items():
                if v is None:
                    entry.pop(k, None)
                else:
                    entry[k] = v
            result = ModelSettings.from_dict(entry, model_id)
            data["models"][model_id] = entry
            self._write(data)
        return result

    def set(self, model_id: str, **changes) -> ModelSettings:
        return self.update(model_id, changes)

    def remove(self, model_id: str) -> bool:
        with self.locked():
            data = self.read()
            found = data["models"].pop(model_id, None) is not None
            if found:
                self._write(data)
        return found

    @contextmanager
    def locked(self):
        """An exclusive lock shared by every process that writes this file."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _write(self, data: dict):
        """Temp file + fsync + rename: readers see the old file or the new one, never half."""
        data = {"version": data.get("version", SETTINGS_VERSION), **data}
        text = json.dumps(data, indent=2, sort_keys=False) + "\n"
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            if self.path.exists():
                os.chmod(tmp, self.path.stat().st_mode & 0o777)
            else:
                os.chmod(tmp, 0o644)
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def drafter_name(draft: Optional[str]) -> Optional[str]:
    """The drafter as clients are told it: a local directory by its name (never the
    server's filesystem path), a hub id as it is."""
    if draft is None:
        return None
    path = Path(draft).expanduser()
    return path.name if path.is_absolute() or path.exists() else draft
