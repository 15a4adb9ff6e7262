"""Fixtures shared by the test modules: a fresh $DFLASH2_MLX_HOME per session and tiny
prefix-cache pairs.  The repository root goes on sys.path, so tests import the scripts they
check as modules (``scripts.recipe.make_domain_prompts``)."""

import faulthandler
import fcntl
import os
import sys
from pathlib import Path

import pytest

from dflash2_mlx.builtin.smollm2 import MODEL_DIR, cache_home, default_target_path
from dflash2_mlx.machine.contention import SIMULATED_ENV
from tiny_models import make_drafter, make_target, on_worker, worker_reference

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(autouse=True, scope="session")
def _session_home(tmp_path_factory):
    """$DFLASH2_MLX_HOME is this test session's own directory (for the CLI and servers the
    tests start, too): cost models and acceptance histories learned by an earlier run must
    not steer a test, and the tests' tiny pairs leave no files in the user's cache.  The
    built-in model, once converted there, is linked in rather than converted again."""
    real, session = cache_home(), tmp_path_factory.mktemp("dflash2_mlx_home")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # The workers of one run share what a single session would: the built-in target's
        # conversion and what is learned about each pair (its costs calibrated once).
        shared = tmp_path_factory.getbasetemp().parent / "dflash2_mlx_shared_home"
        (shared / "calibration").mkdir(parents=True, exist_ok=True)
        (session / "calibration").symlink_to(shared / "calibration")
        if not (real / MODEL_DIR).exists():
            real = _converted_once(shared)
    for name in (MODEL_DIR, "gguf"):
        if (real / name).exists():
            (session / name).symlink_to(real / name)
    patch = pytest.MonkeyPatch()
    patch.setenv("DFLASH2_MLX_HOME", str(session))
    # The load other processes put on the machine is simulated (quiet unless a test says
    # otherwise): CI hosts vary, and the suite runs two workers side by side.
    patch.setenv(SIMULATED_ENV, "0")
    yield
    patch.undo()


def _converted_once(home: Path) -> Path:
    """The built-in target converted into ``home``, which the workers of one run share: the
    first to get the lock converts it (download included), the others then find it."""
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        default_target_path(home)
    return home


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5", "qwen3_5_moe", "muse_glimmer", "gemma4"])
def cache_pair(request, tmp_path_factory):
    """A tiny target of each kind the prefix cache handles (attention only; hybrid, with
    recurrent layers: qwen3_5, the MoE qwen3_5_moe; sliding windows: muse_glimmer, gemma4 with
    its KV-shared layers), its DFlash 2 drafter, and generate() on them (on the MLX worker)."""
    root = tmp_path_factory.mktemp(request.param)
    target = on_worker(make_target, root / "target", request.param, scale=4.0)
    drafter = on_worker(make_drafter, root / "drafter", target)
    return target, drafter, worker_reference(target, drafter)


# A hang that pytest-timeout's signal cannot interrupt (a thread stuck in native code) still
# ends the run: faulthandler dumps every thread's stack and exits this long after the test's
# own timeout.
BACKSTOP_S = 60


_stderr = {}


def pytest_configure(config):
    # The terminal's stderr, kept before tests capture it: the dump must outlive the process.
    _stderr["file"] = os.fdopen(os.dup(2), "w")
    _share_the_cores(config)


def _share_the_cores(config):
    """Workers split the cores instead of each running a BLAS thread per core: oversubscribed
    OpenBLAS threads spin against each other (the suite spent as long in the kernel as in its
    own code).  Set here, in the controller, before the workers start, so the workers and the
    processes they start read it when their BLAS loads; a serial run, whose BLAS has already
    loaded, is left as it is (the variable would misname its setup)."""
    workers = getattr(config.option, "numprocesses", None) or 0
    if workers in ("auto", "logical"):
        workers = os.cpu_count() or 1
    if workers > 1 and not os.environ.get("PYTEST_XDIST_WORKER") and "OPENBLAS_NUM_THREADS" not in os.environ:
        os.environ["OPENBLAS_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    marker = item.get_closest_marker("timeout")
    marked = (marker.args[0] if marker.args else marker.kwargs.get("timeout")) if marker else None
    timeout = float(marked if marked is not None else item.config.getini("timeout") or 0)
    if timeout > 0:
        faulthandler.dump_traceback_later(timeout + BACKSTOP_S, exit=True, file=_stderr["file"])
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
