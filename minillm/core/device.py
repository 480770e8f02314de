"""Naming the hardware a figure was measured on: every table and plot carries this line."""

from __future__ import annotations

import os
import platform
from contextlib import suppress
from pathlib import Path

import torch


def cpu_name() -> str:
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def hardware_description(device: str | torch.device = "cpu") -> str:
    """E.g. 'Intel Xeon ... (cpu), 2 threads, torch 2.13.0' or 'NVIDIA L4 (cuda), CUDA 12.4, ...'."""
    device = torch.device(device)
    if device.type == "cuda":
        name = f"{torch.cuda.get_device_name(device)} (cuda), CUDA {torch.version.cuda}"
    else:
        name = f"{cpu_name()} ({device.type})"
    return f"{name}, {threads_label(torch.get_num_threads())}, torch {torch.__version__}"


def threads_label(n: int) -> str:
    """'1 thread', '2 threads': how every header and table title names the CPU threads."""
    return f"{n} thread{'s' if n != 1 else ''}"


def best_device() -> torch.device:
    """cuda, then Apple's mps, then the cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def cuda_half_dtype() -> torch.dtype:
    """The 16-bit type a GPU computes natively: bf16 from Ampere on, fp16 before (a T4)."""
    return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that a timer measures it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def set_threads(threads: int | None = None) -> int:
    """Cap PyTorch's CPU threads at ``threads``, or at MINILLM_THREADS when that is set; returns the
    count in force. Processes run side by side (the test suite runs two notebooks at once on two
    cores) must not each take every core: oversubscribed, PyTorch's worker threads wait on each
    other and a decode step gets tens of times slower."""
    if threads is None:
        env = os.environ.get("MINILLM_THREADS")
        if env:
            if not env.isdigit() or int(env) < 1:
                raise ValueError(f"MINILLM_THREADS must be a positive integer, got {env!r}")
            threads = int(env)
    elif isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def set_threads_from_env() -> None:
    """MINILLM_THREADS=n caps PyTorch's CPU threads (see ``set_threads``)."""
    set_threads(None)
