"""The server under generated requests: schemathesis reads the server's own /openapi.json
and sends requests built from every route's declared body and parameters (valid ones and
ones that break the schema), a bounded number per route; none may be answered with a 5xx.
A real `dflash2-mlx serve` on a tiny DFlash pair, on loopback."""

import collections

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from dflash2_mlx.backend.settings import SettingsStore
from helpers import start_server, stop_server
from tiny_models import make_drafter, make_target, on_worker

pytestmark = pytest.mark.slow
EXAMPLES = 60  # per route


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    target = on_worker(make_target, root / "models" / "tiny")
    drafter = on_worker(make_drafter, root / "drafter", target)
    settings_file = root / "model_settings.json"
    # A small context window bounds what any generated max_tokens can ask for.
    SettingsStore(settings_file).set("tiny", dflash_enabled=True, dflash_draft_model=str(drafter),
                                     max_context_window=256)
    proc, base = start_server(root, ["--model-dir", root / "models", "--settings", settings_file,
                                     "--max-tokens", "16", "--log-level", "warning"])
    try:
        yield schemathesis.openapi.from_url(base + "/openapi.json")
    finally:
        stop_server(proc)
        log = (root / "server.log").read_text()
        assert "Traceback" not in log, log[-4000:]


def test_no_generated_request_gets_a_server_error(api_schema):
    """Each route in turn (schemathesis' pytest plugin is driven by hand: its lazy fixture
    does not run on this pytest), ``EXAMPLES`` generated requests each."""
    routes, sent = 0, []
    for result in api_schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def fuzz(case):
            sent.append(case.call_and_validate(checks=[not_a_server_error], timeout=60).status_code)

        fuzz()
        routes += 1
    assert routes >= 20  # every API's routes were declared and sent
    print(f"{routes} routes, {len(sent)} requests: status {sorted(collections.Counter(sent).items())}")
