"""Notebook setup: every chapter's first code cell calls ``setup()``.

It picks the device (cuda, mps or cpu), a problem ``scale`` (small on a CPU, larger on a GPU,
overridable with the MINILLM_SCALE environment variable), seeds every generator, sets one plot
style, and prints one line naming the hardware, dtype and versions, so that every figure
below it can say where it came from.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..core.device import best_device, hardware_description, set_threads_from_env
from ..measure.report import join_fitting, load_results, wrap_line
from ..viz.style import set_plot_style

SCALES = ("tiny", "small", "medium", "large")  # tiny: tests; small: a laptop CPU; medium/large: GPUs


@dataclass(frozen=True)
class BookContext:
    device: torch.device
    dtype: torch.dtype
    scale: str
    seed: int
    hardware: str  # one line naming the hardware, for titles of figures and tables

    def pick(self, **by_scale):
        """The value for this scale, e.g. ``ctx.pick(tiny=16, small=64, medium=512, large=2048)``.

        A scale that is not given falls back to the nearest smaller one that is."""
        order = SCALES[: SCALES.index(self.scale) + 1]
        for scale in reversed(order):
            if scale in by_scale:
                return by_scale[scale]
        raise ValueError(f"no value for scale {self.scale!r} or any smaller one in {sorted(by_scale)}")

    def label(self, model: str | None = None) -> str:
        """A figure title suffix: hardware, dtype and (optionally) model."""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.hardware.split(',')[0]}, {dtype}" + (f", {model}" if model else "")


def default_scale(device: torch.device) -> str:
    scale = os.environ.get("MINILLM_SCALE")
    if scale:
        if scale not in SCALES:
            raise ValueError(f"MINILLM_SCALE must be one of {SCALES}, got {scale!r}")
        return scale
    return "small" if device.type == "cpu" else "medium"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)  # noqa: NPY002 (readers' own np.random calls use the global generator)
    torch.manual_seed(seed)


def setup(seed: int = 0, device: str | None = None, scale: str | None = None, quiet: bool = False) -> BookContext:
    """Detect the device, pick the scale, seed everything, set the plot style, print one line."""
    set_threads_from_env()
    dev = torch.device(device) if device else best_device()
    scale = scale or default_scale(dev)
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    native_bf16 = dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 0)  # not on a T4
    dtype = torch.bfloat16 if native_bf16 else torch.float32
    seed_everything(seed)
    set_plot_style()
    register_magics()
    ctx = BookContext(dev, dtype, scale, seed, hardware_description(dev))
    if not quiet:
        dtype_name = str(dtype).removeprefix("torch.")
        details = [dtype_name, f"scale={scale}", f"seed={seed}", f"python {platform.python_version()}"]
        print(join_fitting([ctx.hardware, *details]))
    return ctx


# Where a module a cell may need can be had, for the line that says the cell was skipped.
INSTALL_HINTS = {"triton": "Triton installs on Linux x86-64 only, e.g. Colab"}


def missing_modules(names: list[str]) -> list[str]:
    """The modules among ``names`` that cannot be imported here."""
    return [name for name in names if importlib.util.find_spec(name) is None]


def needs(line: str, cell: str) -> None:
    """The ``%%needs triton`` cell magic: run the cell if every module named on the magic's line
    can be imported, otherwise print one line saying which is missing and skip it."""
    from IPython import get_ipython

    missing = missing_modules(line.split())
    if missing:
        hints = "; ".join(INSTALL_HINTS.get(name, f"pip install {name}") for name in missing)
        print("\n".join(wrap_line(f"Skipped: needs {', '.join(missing)}, not installed ({hints}).")))
        return
    get_ipython().run_cell(cell).raise_error()


def register_magics() -> None:
    """Make ``%%needs`` available when running inside IPython (a notebook); nothing otherwise."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None:
        shell.register_magic_function(needs, magic_kind="cell")


def saved_results(name: str, results_dir: Path | None = None) -> dict[str, dict]:
    """Figures saved by the benchmark commands, ``minillm/results/<hardware>/<name>.json``, by hardware
    folder (the results store of ``minillm.measure.report``).

    The store ships with the package, so a wheel installed on Colab sees the same saved runs."""
    return load_results(name, results_dir)
