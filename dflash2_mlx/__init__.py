"""DFlash 2 speculative decoding for MLX."""

from .generate import GenerationResponse, generate, load, stream_generate

__all__ = ["load", "generate", "stream_generate", "GenerationResponse"]
__version__ = "0.1.0"
