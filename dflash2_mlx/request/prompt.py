"""A prompt's token ids: text, token ids, or chat messages rendered with the tokenizer's chat
template (and the variables a template may be given), as every surface encodes them."""

from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .arguments import check_messages


def encode_prompt(tokenizer: TokenizerWrapper, prompt) -> mx.array:
    """Text, token ids, or chat messages (rendered with the chat template)."""
    if isinstance(prompt, mx.array):
        ids = prompt.tolist()
    elif isinstance(prompt, str):
        add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
        ids = tokenizer.encode(prompt, add_special_tokens=add_special)
    elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
        ids = chat_ids(tokenizer, prompt)
    elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    else:
        raise TypeError("prompt must be text, a list of token ids, or a list of chat messages")
    if len(ids) == 0:
        raise ValueError("prompt is empty: give at least one token")
    return mx.array(ids, dtype=mx.uint32)


# apply_chat_template's own arguments: not variables a template may be given
TEMPLATE_RESERVED = frozenset({"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                               "continue_final_message", "tokenize", "sanitize_control_tokens", "padding",
                               "truncation", "max_length", "return_tensors", "return_dict",
                               "return_assistant_tokens_mask", "tokenizer_kwargs"})


class TemplateVariableError(ValueError):
    """Chat-template variables that would set apply_chat_template's own arguments."""


def check_template_variables(variables: dict):
    """Raise TemplateVariableError if ``variables`` would set apply_chat_template's own arguments."""
    clash = sorted(TEMPLATE_RESERVED.intersection(variables))
    if clash:
        raise TemplateVariableError(f"chat template variables may not set {', '.join(clash)} "
                                    "(arguments of apply_chat_template itself)")


def chat_ids(tokenizer, messages, prefill: Optional[str] = None, tools: Optional[list] = None,
             template_kwargs: Optional[dict] = None) -> List[int]:
    """Token ids of chat messages rendered with the chat template, ready for the assistant's
    reply, or (``prefill``) continuing an assistant reply that starts with it, as
    mlx_lm.generate's --prefill-response does.  ``template_kwargs``: variables for the
    template (e.g. ``{"enable_thinking": False}``)."""
    check_messages(messages)
    template_kwargs = dict(template_kwargs or {})
    check_template_variables(template_kwargs)
    messages = list(messages)
    if prefill is not None:
        messages.append({"role": "assistant", "content": prefill})
    if tools:
        template_kwargs["tools"] = tools
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=prefill is None,
                                        continue_final_message=prefill is not None, **template_kwargs)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # some tokenizers return an encoding
        ids = ids["input_ids"]
    return list(ids)
