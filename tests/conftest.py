"""Fixtures shared by the test modules: a fresh $DFLASH2_MLX_HOME per session and tiny
prefix-cache pairs.  The repository root goes on sys.path, so tests import the scripts they
check as modules (``scripts.recipe.make_domain_prompts``)."""

import sys
from pathlib import Path

import pytest

from dflash2_mlx.builtin.smollm2 import MODEL_DIR, cache_home
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
    for name in (MODEL_DIR, "gguf"):
        if (real / name).exists():
            (session / name).symlink_to(real / name)
    patch = pytest.MonkeyPatch()
    patch.setenv("DFLASH2_MLX_HOME", str(session))
    yield
    patch.undo()


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5", "qwen3_5_moe", "muse_glimmer", "gemma4"])
def cache_pair(request, tmp_path_factory):
    """A tiny target of each kind the prefix cache handles (attention only; hybrid, with
    recurrent layers: qwen3_5, the MoE qwen3_5_moe; sliding windows: muse_glimmer, gemma4 with
    its KV-shared layers), its DFlash 2 drafter, and generate() on them (on the MLX worker)."""
    root = tmp_path_factory.mktemp(request.param)
    target = on_worker(make_target, root / "target", request.param, scale=4.0)
    drafter = on_worker(make_drafter, root / "drafter", target)
    return target, drafter, worker_reference(target, drafter)
