"""Notebook setup: every chapter's first code cell calls ``setup()``.

It picks the device (cuda, mps or cpu), a problem ``scale`` (small on a CPU, larger on a GPU,
overridable with the MINILLM_SCALE environment variable), seeds every generator, sets one plot
style, and prints one line naming the hardware, dtype and versions, so that every figure
below it can say where it came from.
"""

from __future__ import annotations

import os
import platform
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..bench.report import load_results
from ..core.device import best_device, hardware_description, set_threads_from_env
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
    ctx = BookContext(dev, dtype, scale, seed, hardware_description(dev))
    if not quiet:
        print(
            f"{ctx.hardware} | {str(dtype).removeprefix('torch.')} | scale={scale} | seed={seed} | "
            f"python {platform.python_version()}"
        )
    return ctx


def saved_results(name: str, results_dir: Path | None = None) -> dict[str, dict]:
    """Figures saved by the benchmark commands, ``results/<hardware>/<name>.json``, by hardware
    folder (the results store of ``minillm.bench.report``).

    Empty when the package is installed without the repository's results (e.g. pip on Colab)."""
    return load_results(name, results_dir)
