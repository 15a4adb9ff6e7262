"""One sequence's failure stays its own (issue 41): a sampler or logits processor that raises
inside a running batch ends that sequence alone with an "error" response carrying what
raised; the others go on and emit exactly what they emit without it, and the global random
key is where it was. The server refuses up front every option that could make mlx-lm's
samplers raise, so the failures come in through the public batch API: a top_k the
vocabulary cannot give (a sampler that raises while tracing, inside the sequence's stream)
and a real logits processor that raises on its Nth call (mid-batch, in the verify pass)."""

import mlx.core as mx
import pytest

from dflash2_mlx.batch import BatchGenerator
from dflash2_mlx.request.sampling import SamplingParams
from tiny_models import abcd_pair

PROMPTS = ["abcab dcba", "dd cb", "abcdabcdabcd ab"]
N = 20


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return abcd_pair(tmp_path_factory.mktemp("isolation"))


class RaisesOnCall:
    """A logits processor (mlx-lm's signature) that adds nothing, then raises on call ``n``."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, tokens, logits):
        self.calls += 1
        if self.calls == self.n:
            raise ValueError("processor failed on purpose")
        return logits


def run(gen):
    tokens, last = {}, {}
    while len(gen):
        for r in gen.next():
            if r.error is None:
                tokens.setdefault(r.uid, []).append(r.token)
            last[r.uid] = r
    return tokens, last


def alone(model, drafter, tok, prompt, **kw):
    gen = BatchGenerator(model, drafter, block_size=4)
    uid = gen.insert(tok.encode(prompt), max_tokens=N, **kw)
    return run(gen)[0][uid]


SAMPLED = dict(params=SamplingParams(temp=1.0), seed=5)


@pytest.mark.parametrize("failure", ["processor mid-batch", "sampler at the first token"])
def test_a_failing_sequence_fails_alone(pair, failure):
    model, tok, drafter = pair
    refs = [alone(model, drafter, tok, p) for p in PROMPTS[:2]] + [alone(model, drafter, tok, PROMPTS[2], **SAMPLED)]
    mx.random.seed(99)
    outer = mx.random.state[0].tolist()
    gen = BatchGenerator(model, drafter, block_size=4)
    uids = [gen.insert(tok.encode(p), max_tokens=N) for p in PROMPTS[:2]]
    uids.append(gen.insert(tok.encode(PROMPTS[2]), max_tokens=N, **SAMPLED))
    if failure == "processor mid-batch":
        processor = RaisesOnCall(10)  # its rows are processed one by one: a later cycle
        bad = gen.insert(tok.encode("cab"), max_tokens=N, logits_processors=[processor])
    else:
        bad = gen.insert(tok.encode("cab"), max_tokens=N, seed=8,
                         params=SamplingParams(temp=1.0, top_k=10 ** 6))
    tokens, last = run(gen)
    assert last[bad].finish_reason == "error" and last[bad].error is not None
    if failure == "processor mid-batch":
        assert processor.calls == 10 and 1 < len(tokens[bad]) < N  # it had emitted, then failed
        assert "on purpose" in str(last[bad].error)
    else:
        assert bad not in tokens
    for uid, ref in zip(uids, refs):
        assert tokens[uid] == ref, "a sequence beside the failing one diverged"
        assert last[uid].finish_reason in ("length", "stop")
    assert mx.random.state[0].tolist() == outer  # seeded sequences only: the global key untouched
    mx.random.uniform(shape=(2,)).tolist()


def test_the_batch_goes_on_after_a_failure(pair):
    """A sequence inserted after another failed runs as it runs alone."""
    model, tok, drafter = pair
    ref = alone(model, drafter, tok, PROMPTS[0])
    gen = BatchGenerator(model, drafter, block_size=4)
    bad = gen.insert(tok.encode("cab"), max_tokens=N, logits_processors=[RaisesOnCall(2)])
    other = gen.insert(tok.encode(PROMPTS[1]), max_tokens=N)
    failed = []
    while not failed:
        failed = [r.uid for r in gen.next() if r.error is not None]
    assert failed == [bad]
    late = gen.insert(tok.encode(PROMPTS[0]), max_tokens=N)
    tokens, last = run(gen)
    assert tokens[late] == ref and last[other].finish_reason in ("length", "stop")
