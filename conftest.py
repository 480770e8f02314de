"""Test-session setup shared by tests/ and the notebooks nbval runs.

The chapters run once per ``make test``, and they run like a reader's: from a wheel of this
checkout installed into a folder outside the repository (no editable link), so a file the chapters
read but the wheel leaves out (the corpus, a bundled model, a saved result) fails here as it would
on Colab. The first process builds and installs the wheel and writes a Jupyter kernel spec whose
environment puts that folder first on the path; nbval's kernels use it, and pytest-xdist's workers
inherit it. xdist shares the work out file by file (``--dist loadfile``): a notebook's cells share
one kernel and a test module's tests share its module fixtures (several start processes), so
each runs on one worker. Notebook cells are marked slow, so ``make test-fast`` leaves them out.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
KERNEL_NAME = "minillm-wheel"
SITE_ENV = "MINILLM_TEST_SITE"  # where the wheel was installed, for the workers and tests


def build_installed_site(where: Path) -> Path:
    """Build a wheel of this checkout and install it (no dependencies) into ``where/site``."""
    wheel_dir, site = where / "wheel", where / "site"
    build = [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w"]
    subprocess.run([*build, str(wheel_dir)], check=True, timeout=600, cwd=where, capture_output=True)
    (wheel,) = wheel_dir.glob("minillm-*.whl")
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)]
    subprocess.run(install, check=True, timeout=600, capture_output=True)
    return site


def write_kernel_spec(jupyter_dir: Path, site: Path) -> None:
    """A kernel of this interpreter whose imports find the installed wheel before anything else."""
    spec_dir = jupyter_dir / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "minillm (installed wheel)",
        "language": "python",
        "env": {"PYTHONPATH": str(site)},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec, indent=1))


def _runs_notebooks(config: pytest.Config) -> bool:
    return bool(getattr(config.option, "nbval_lax", False) or getattr(config.option, "nbval", False))


def pytest_configure(config: pytest.Config) -> None:
    if not _runs_notebooks(config):
        return
    if SITE_ENV not in os.environ:  # the first process (xdist's controller): its workers inherit the env
        where = Path(tempfile.mkdtemp(prefix="minillm-wheel-"))
        config._minillm_wheel_dir = where  # removed at the end of the session
        site = build_installed_site(where)
        write_kernel_spec(where / "jupyter", site)
        os.environ[SITE_ENV] = str(site)
        paths = [str(where / "jupyter"), os.environ.get("JUPYTER_PATH")]
        os.environ["JUPYTER_PATH"] = os.pathsep.join(p for p in paths if p)
    config.option.nbval_kernel_name = KERNEL_NAME


def pytest_unconfigure(config: pytest.Config) -> None:
    where = getattr(config, "_minillm_wheel_dir", None)
    if where is not None:
        shutil.rmtree(where, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)
