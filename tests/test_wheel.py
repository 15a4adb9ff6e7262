"""The package as a wheel installs it (``pip install .``, a published wheel), not editable
mode: every module of the source tree is in it and imports, every data file the package
reads is in it, and the CLI starts from it."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Source folder -> the package it installs as (cli/ and metal/ sit at the repository root).
SOURCES = {"dflash2_mlx": "dflash2_mlx", "cli": "dflash2_mlx/cli", "metal": "dflash2_mlx/metal"}


def source_files():
    """{path inside the installed package tree: kind} for every file the wheel must carry:
    modules and data (drafters, bench data, cost curves, Metal sources)."""
    files = {}
    for folder, installed in SOURCES.items():
        for path in (ROOT / folder).rglob("*"):
            if not path.is_file() or "__pycache__" in path.parts or path.suffix == ".pyc":
                continue
            rel = path.relative_to(ROOT / folder)
            if folder == "dflash2_mlx" and rel.parts[0] in ("cli", "metal"):
                continue
            files[f"{installed}/{rel.as_posix()}"] = "module" if path.suffix == ".py" else "data"
    return files


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    """A wheel built from this checkout, installed (no editable mode, no dependencies) into
    a fresh venv that borrows this environment's dependencies but not its dflash2_mlx."""
    tmp = tmp_path_factory.mktemp("wheel")
    # Built from a copy of what the sdist holds: a build/ folder left in the checkout by an
    # earlier build would carry modules the package discovery no longer finds.
    src = tmp / "src"
    for name in ("pyproject.toml", "setup.py", "README.md"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, src / name)
    for folder in SOURCES:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"),
         str(src)], capture_output=True, text=True, timeout=240)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    wheel = next((tmp / "dist").glob("dflash2_mlx-*.whl"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
        capture_output=True, text=True, timeout=240)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    # A path line in a .pth is not a site directory: this environment's editable-install
    # hook (a .pth of its own) is not run, so dflash2_mlx can come only from the wheel.
    (Path(site) / "_borrowed_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return venv, Path(site), wheel, env, tmp


def test_the_wheel_carries_every_module_and_data_file(wheel_env):
    _, site, wheel, _, _ = wheel_env
    installed = {p.relative_to(site).as_posix() for p in (site / "dflash2_mlx").rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts}
    missing = sorted(set(source_files()) - installed)
    assert not missing, f"{wheel.name} lacks {missing}"


def test_every_module_imports_and_the_cli_starts_from_the_wheel(wheel_env):
    venv, site, _, env, tmp = wheel_env
    modules = sorted(p[: -len(".py")].replace("/", ".").removesuffix(".__init__")
                     for p, kind in source_files().items() if kind == "module")
    code = (
        "import importlib, sys\n"
        "import dflash2_mlx\n"
        f"assert dflash2_mlx.__file__.startswith({str(site)!r}), dflash2_mlx.__file__\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "from dflash2_mlx.kernels.sources import read_sections\n"
        "assert read_sections('path_selector.metal')\n"
        "from dflash2_mlx.adaptive import curves\n"
        "assert curves.names() and all(curves.relative(n) for n in curves.names())\n"
        "from dflash2_mlx.builtin.defaults import drafter_path, DEFAULT_DRAFTER, V1_DRAFTER\n"
        "from dflash2_mlx.model.checkpoint import load_drafter\n"
        "for name in (DEFAULT_DRAFTER, V1_DRAFTER):\n"
        "    load_drafter(str(drafter_path(name)))\n"
        "from dflash2_mlx.builtin.bench_sets import default_bench_files\n"
        "assert len(default_bench_files()) == 5, default_bench_files()\n"
    )
    run = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=tmp, env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]
    cli = subprocess.run([str(venv / "bin" / "dflash2-mlx"), "--help"], cwd=tmp, env=env,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr[-4000:]
    assert "generate" in cli.stdout and "serve" in cli.stdout
