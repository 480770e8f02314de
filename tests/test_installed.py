"""Install like a reader: a wheel of this checkout, installed with no editable link and nothing
from the source tree on the path. The chapters run from it under nbval (the root conftest.py builds
it once per session and gives nbval's kernels a spec that puts it first on the path); these tests
hold what that relies on: the wheel installs one top-level package, ``minillm``, and a process
started the kernels' way imports minillm, its kernels and its data from the wheel."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import KERNEL_NAME, SITE_ENV, build_installed_site

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The session's installed wheel when nbval built one, else a fresh one."""
    if os.environ.get(SITE_ENV):
        return Path(os.environ[SITE_ENV])
    return build_installed_site(tmp_path_factory.mktemp("installed"))


def test_the_wheel_installs_one_top_level_package(site):
    # what pip puts beside the packages: the metadata, and bin/ with the `minillm` console script
    packages = sorted(p.name for p in site.iterdir() if not p.name.endswith((".dist-info", ".data", "bin")))
    assert packages == ["minillm"]
    (info,) = site.glob("minillm-*.dist-info")
    assert (info / "top_level.txt").read_text().split() == ["minillm"]


def test_a_process_on_the_wheel_reads_everything_from_it(site, tmp_path):
    """What the chapters read, from a folder outside the checkout: the package, its kernels (the
    C source and the C++ operators built afresh where compilers are), the corpus, a bundled model and a saved run."""
    code = (
        "import json, minillm, minillm.kernels as k\n"
        "from minillm.kernels import native\n"
        "from minillm.training.corpus import load_text\n"
        "from minillm.book import saved_results\n"
        "model, tok = minillm.load('minillm-draft')\n"
        "built = native.library() is not None or native.compiler() is None\n"
        "ops = native.operators() is not None or native.cxx_compiler() is None\n"
        "print(json.dumps([minillm.__file__, k.__file__, len(load_text('valid')) > 0,\n"
        "                  len(tok.encode('def f(x):')) > 0, bool(saved_results('bench_generate')),\n"
        "                  native.SOURCE.is_file(), built, native.OPS_SOURCE.is_file(), ops]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "MINILLM_CACHE": str(tmp_path / "cache")}
    run = dict(cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = subprocess.run([sys.executable, "-c", code], **run)
    assert out.returncode == 0, out.stderr
    package, kernels, *read = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(package).is_relative_to(site) and Path(kernels).is_relative_to(site)
    assert not Path(package).is_relative_to(ROOT)
    assert read == [True] * 7


def test_nbval_kernels_run_on_the_wheel():
    """The kernel spec the notebooks run under puts the wheel first (only when nbval runs)."""
    if not os.environ.get(SITE_ENV):
        pytest.skip("no notebooks in this session: nbval's kernel spec is made only when they run")
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    assert spec.env["PYTHONPATH"] == os.environ[SITE_ENV] and spec.argv[0] == sys.executable
