"""The model-manager backend: settings (oMLX's model_settings.json), engine, engine pool,
and the OpenAI-compatible server (``dflash2_mlx.backend.server``)."""

from .compat import is_compatible
from .engine import Chunk, Completion, Engine, EngineError, PromptTooLong, QueueFull
from .pool import EnginePool, PoolBusy, UnknownModel
from .settings import ModelSettings, SettingsError, SettingsStore

__all__ = ["Engine", "EnginePool", "ModelSettings", "SettingsStore", "SettingsError", "is_compatible",
           "Chunk", "Completion", "EngineError", "PromptTooLong", "QueueFull", "PoolBusy", "UnknownModel"]
