"""A reply that continues a prefill keeps its first token's leading space
(``generate.detokenizer_after``), with the built-in target's real BPE tokenizer; a reply
of its own reads as mlx-lm's streaming detokenizer reads it."""

import pytest
from mlx_lm import load as mlx_load

from dflash2_mlx.builtin.defaults import default_pair
from dflash2_mlx.generate import stream_generate
from dflash2_mlx.responses import detokenizer_after
from dflash2_mlx.request.prompt import chat_ids


@pytest.fixture(scope="module")
def tokenizer():
    return mlx_load(default_pair()[0])[1]


def streamed(detokenizer, ids):
    parts = []
    for t in ids:
        detokenizer.add_token(t)
        parts.append(detokenizer.last_segment)
    detokenizer.finalize()
    return "".join(parts) + detokenizer.last_segment


def test_after_a_prefill_the_leading_space_stays(tokenizer):
    prefill, reply = tokenizer.encode("The sky is"), tokenizer.encode(" blue today")
    assert streamed(detokenizer_after(tokenizer, prefill), reply) == " blue today"
    # on its own, as mlx-lm's: a text does not start with a space
    assert streamed(detokenizer_after(tokenizer), reply) == streamed(tokenizer.detokenizer, reply) == "blue today"


@pytest.mark.parametrize("tail", [" ", "\U0001F600"])
def test_a_last_token_with_bytes_pending_is_not_fed(tokenizer, tail):
    """A lone space, or the first byte of a character: fed, it would come out with the
    reply's text; so the reply reads as one of its own."""
    prefill = tokenizer.encode("The sky is" + tail)
    last = prefill[-1:]
    assert tokenizer.decode(last) in (" ", "\ufffd")  # what the case is about
    reply = tokenizer.encode(" blue")
    assert streamed(detokenizer_after(tokenizer, prefill), reply) == streamed(tokenizer.detokenizer, reply)


def test_stream_generate_continues(tokenizer):
    model = mlx_load(default_pair()[0])[0]
    ids = chat_ids(tokenizer, [{"role": "user", "content": "Why is the sky blue?"}], "The sky is")
    out = list(stream_generate(model, tokenizer, ids, max_tokens=6, continues=True))
    assert "".join(r.text for r in out) == tokenizer.decode([r.token for r in out])
    assert "".join(r.text for r in out).startswith(" ")
