"""``bench agent``'s session through the four wire formats: the same conversation built for
each API reaches the engine as the same prompt, so the replies at T=0 are the same text,
and every API reports the prefix cache's reuse from the second turn on."""

import httpx
import pytest

from dflash2_mlx.eval.bench_agent import APIS, messages_for, one_turn, session_files
from helpers import start_server, stop_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent")
    settings = root / "model_settings.json"
    settings.write_text('{"version": 1, "models": {}}')
    proc, base = start_server(root, ["--settings", settings, "--max-batch", "1", "--log-level", "warning"])
    try:
        yield base
    finally:
        stop_server(proc)


def test_every_api_reads_the_same_session(server):
    from mlx_lm.utils import load_tokenizer

    from dflash2_mlx.builtin.smollm2 import default_target_path

    results = session_files(load_tokenizer(default_target_path()), sizes=(60, 90))
    model = "SmolLM2-135M-Instruct"
    with httpx.Client(base_url=server, timeout=240) as http:
        turns = {}
        for api in APIS:
            # The same header for every API: the second API's first turn reuses the first's prefix.
            first = one_turn(http, api, model, messages_for(api, "Session: test.", results[:1], []), 6)
            second = one_turn(http, api, model, messages_for(api, "Session: test.", results, [first["text"]]), 6)
            turns[api] = (first, second)
    texts = {api: (a["text"], b["text"]) for api, (a, b) in turns.items()}
    assert len(set(texts.values())) == 1, texts
    assert all(t[0]["tokens"] >= 1 and t[1]["tokens"] >= 1 for t in turns.values())
    # From the second request on, each API's usage shows the cached prefix.
    cached = {api: (a["cached_tokens"], b["cached_tokens"]) for api, (a, b) in turns.items()}
    assert all(b > 0 for _, b in cached.values()), cached
    assert all(a > 0 for api, (a, _) in cached.items() if api != APIS[0]), cached
    assert all(isinstance(t[1]["tau"], float) for t in turns.values())


def test_an_unknown_api_is_refused():
    with pytest.raises(ValueError, match="unknown API"):
        messages_for("grpc", "x", [], [])
