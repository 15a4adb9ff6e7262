"""Prompt cache files, as ``mlx_lm.cache_prompt`` writes them and ``mlx_lm.generate
--prompt-cache-file`` reads them: a long prefix processed once, then questions after it.

The file holds the target's KV cache and, as metadata, the model it was made with and that
model's tokenizer config; not the prefix's tokens.  So DFlash continues from it with a
drafter that has not seen the prefix (its context starts with the new tokens): the output
is the target's all the same, only the first cycles are accepted less.
"""

import json
from pathlib import Path
from typing import List, Optional, Tuple

from mlx_lm.models.cache import QuantizedKVCache, load_prompt_cache

QUERY = "<query>"


def read_prompt_cache(path, model: Optional[str] = None, kv_bits: Optional[int] = None,
                      kv_group_size: int = 64) -> Tuple[list, str, dict]:
    """(cache, the model it was made with, its tokenizer config), checked as mlx_lm.generate
    checks them: ``model``, when given, must be that model; a quantized cache must have
    ``kv_bits`` (when given) and ``kv_group_size`` of its own."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt cache file {path}: no such file")
    try:
        cache, metadata = load_prompt_cache(str(path), return_metadata=True)
        made_with = metadata["model"]
        tokenizer_config = json.loads(metadata.get("tokenizer_config", "{}"))
    except Exception as e:  # a truncated file, another safetensors file, bad metadata
        raise ValueError(f"{path} is not a prompt cache saved by mlx_lm.cache_prompt "
                         f"({type(e).__name__}: {e})") from None
    if model is not None and model != made_with:
        raise ValueError(f"Providing a different model ({model}) than that used to create the "
                         f"prompt cache ({made_with}) is an error.")
    if isinstance(cache[0], QuantizedKVCache):
        if kv_bits is not None and kv_bits != cache[0].bits:
            raise ValueError("--kv-bits does not match the kv cache loaded from --prompt-cache-file.")
        if kv_group_size != cache[0].group_size:
            raise ValueError("--kv-group-size does not match the kv cache loaded from --prompt-cache-file.")
    return cache, made_with, tokenizer_config


def query_ids(tokenizer, messages: List[dict], prefill: Optional[str] = None,
              template_kwargs: Optional[dict] = None) -> List[int]:
    """The chat-templated tokens that follow a cached prefix: the rendered conversation from
    where the last user turn's text begins (the cache ends inside that turn, as
    ``mlx_lm.cache_prompt`` leaves it)."""
    kw = dict(template_kwargs or {})
    turns = messages + ([{"role": "assistant", "content": prefill}] if prefill is not None else [])
    last = max((i for i, m in enumerate(turns) if m["role"] == "user"), default=None)
    if last is None:
        raise ValueError("a prompt cache continues a user turn: the messages have none")

    def render(turns):
        return tokenizer.apply_chat_template(turns, tokenize=False, continue_final_message=prefill is not None,
                                             add_generation_prompt=prefill is None, **kw)

    probe = [dict(m, content=QUERY) if i == last else m for i, m in enumerate(turns)]
    text = render(turns)
    return tokenizer.encode(text[render(probe).index(QUERY):], add_special_tokens=False)
