"""What every command of the command line shares: one-line errors with status 2, the parser that
prints them, and the parsing of devices and dtypes. ``cli.main`` (generate, serve, models, corpus,
train) and ``cli.bench`` (the benchmarks) both build on it.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..core.checkpoints import DEFAULT_MODEL
from ..core.device import best_device

__all__ = ["DEFAULT_MODEL", "DTYPES", "ArgumentParser", "CliError", "add_threads_option", "bad_input", "parse_device"]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class CliError(Exception):
    """Bad input: main prints the message on one line and exits with status 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with usage errors on one line (``minillm generate: error: ...``) and status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


@contextmanager
def bad_input() -> Iterator[None]:
    """Turn the library's errors about its input (ValueError, CheckpointError) into CliError."""
    try:
        yield
    except ValueError as e:
        raise CliError(str(e)) from e


def parse_device(name: str | None) -> str:
    """The device a command runs on: the one named, checked to exist here, or the best available
    (cuda, then mps, then the cpu: ``core.device.best_device``, as the notebooks choose)."""
    if name is None:
        return str(best_device())
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise CliError(f"unknown device {name!r}; use cpu, cuda, cuda:N or mps") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CliError(f"device {name!r} asked for, but CUDA is not available on this machine")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise CliError(f"device {name!r} asked for, but MPS is not available on this machine")
    return str(device)


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for PyTorch (default: MINILLM_THREADS when set, else PyTorch's own choice)",
    )
