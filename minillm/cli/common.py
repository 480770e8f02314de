"""What every command of the command line shares: one-line errors with status 2, the parser that
prints them, the parsing of devices, the options several commands take, each written once as an
argparse parent parser (``parents=[model_option("the model"), device_option(), ...]``), and the
parser of every benchmark (``add_benchmark``). It imports core only: building the parser costs no
technique. What a command does with its figures is ``cli.figures``.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ..core.checkpoints import DEFAULT_MODEL
from ..core.device import best_device, threads_label

__all__ = [
    "DEFAULT_MODEL",
    "DTYPES",
    "ArgumentParser",
    "CliError",
    "add_benchmark",
    "add_model",
    "bad_input",
    "compile_option",
    "device_option",
    "dtype_option",
    "lengths_options",
    "max_batch_option",
    "model_option",
    "new_tokens_option",
    "output_options",
    "parse_device",
    "progress_option",
    "prompt_len_option",
    "quantize_options",
    "repeats_option",
    "shape_option",
    "slo_options",
    "threads_option",
    "where",
    "workload_options",
]

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


def where(device: str) -> str:
    """'cpu, 1 thread': what a command runs on, for its first line."""
    return f"{device}, {threads_label(torch.get_num_threads())}" if str(device).startswith("cpu") else str(device)


# ---------------------------------------------------------------------------------------------
# The options several commands take, each once: a parent parser (``parents=[...]``); where a
# default differs from one command to the next, it is the builder's parameter.


def parent() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(add_help=False)


def add_model(container, role: str, default: str = DEFAULT_MODEL, flag: str = "--model") -> None:
    """--model (or --target, --draft): into a parser or a group, such as bench serve's --model | --url."""
    help_ = f"{role}: a bundled model's name, a checkpoint directory or a hub id (default: {default})"
    container.add_argument(flag, default=default, help=help_)


def model_option(role: str, default: str = DEFAULT_MODEL, flag: str = "--model") -> argparse.ArgumentParser:
    p = parent()
    add_model(p, role, default, flag)
    return p


def device_option() -> argparse.ArgumentParser:
    p = parent()
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: the best available)")
    return p


def dtype_option(default: str) -> argparse.ArgumentParser:
    p = parent()
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help=f"the weights' dtype (default: {default})")
    return p


def threads_option() -> argparse.ArgumentParser:
    p = parent()
    help_ = "CPU threads for PyTorch (default: MINILLM_THREADS when set, else PyTorch's own choice)"
    p.add_argument("--threads", type=int, default=None, help=help_)
    return p


def quantize_options() -> argparse.ArgumentParser:
    """--quantize and --group-size, for the runtime (generate and serve), which checks them."""
    p = parent()
    p.add_argument(
        "--quantize",
        default=None,
        metavar="SCHEME",
        help="quantization after loading (round to nearest): int8, int4, fp8 (weights only; on a CPU in bf16) "
        "or w8a8 (int8 weights and activations)",
    )
    p.add_argument("--group-size", type=int, default=None, help="int4 weights per scale (default: 128)")
    return p


def compile_option(what: str) -> argparse.ArgumentParser:
    p = parent()
    help_ = f"also {what} compiled (torch.compile, static cache); compile times reported apart"
    p.add_argument("--compile", action="store_true", help=help_)
    return p


def peers_option(formats: str) -> argparse.ArgumentParser:
    p = parent()
    help_ = f"also llama.cpp and torchao, {formats} (bench peers' rows; needs minillm[peers])"
    p.add_argument("--peers", action="store_true", help=help_)
    return p


def repeats_option(default: int | None, shown: str | None = None) -> argparse.ArgumentParser:
    """--repeats; ``shown`` says the default when the benchmark's options choose it (``default=None``)."""
    p = parent()
    help_ = f"timed runs of each measurement (default: {shown or default})"
    p.add_argument("--repeats", type=int, default=default, help=help_)
    return p


def new_tokens_option(default: int) -> argparse.ArgumentParser:
    p = parent()
    p.add_argument("--new-tokens", type=int, default=default, help=f"tokens decoded per timed run (default: {default})")
    return p


def prompt_len_option(default: int | None, shown: str | None = None) -> argparse.ArgumentParser:
    p = parent()
    help_ = f"tokens per prompt (default: {shown or default})"
    p.add_argument("--prompt-len", type=int, default=default, help=help_)
    return p


def shape_option(role: str, default: str) -> argparse.ArgumentParser:
    p = parent()
    p.add_argument("--shape", default=default, help=f"{role}: a preset's name, random weights (default: {default})")
    return p


def max_batch_option(default: int = 16) -> argparse.ArgumentParser:
    p = parent()
    help_ = f"sequences per engine step at most (default: {default})"
    p.add_argument("--max-batch", type=int, default=default, help=help_)
    return p


def lengths_options(prompt_median: float, output_median: float) -> argparse.ArgumentParser:
    """The workload's median prompt and output lengths (lognormal around them)."""
    p = parent()
    help_ = "median {} tokens of the workload's requests (default: {:g})"
    p.add_argument("--prompt-median", type=float, default=prompt_median, help=help_.format("prompt", prompt_median))
    p.add_argument("--output-median", type=float, default=output_median, help=help_.format("output", output_median))
    return p


def progress_option() -> argparse.ArgumentParser:
    p = parent()
    p.add_argument("--no-progress", action="store_true", help="no progress bars (on stderr)")
    return p


def slo_options(ttft: float, tpot: float) -> argparse.ArgumentParser:
    p = parent()
    p.add_argument("--slo-ttft", type=float, default=ttft, help=f"SLO on TTFT, seconds (default: {ttft})")
    p.add_argument("--slo-tpot", type=float, default=tpot, help=f"SLO on TPOT, seconds (default: {tpot})")
    return p


def workload_options(requests: int, rate: float | list[float], seed: int | None = None) -> argparse.ArgumentParser:
    """--requests and --rate (several rates, one run each, when the default is a list), and --seed
    when the workload takes one."""
    p = parent()
    p.add_argument("--requests", type=int, default=requests, help=f"requests per run (default: {requests})")
    several = isinstance(rate, list)
    shown = " ".join(f"{r:g}" for r in rate) if several else f"{rate:g}"
    p.add_argument(
        "--rate",
        type=float,
        nargs="+" if several else None,
        default=rate,
        help=f"Poisson arrivals per second{', one run each' if several else ''} (default: {shown})",
    )
    if seed is not None:
        p.add_argument("--seed", type=int, default=seed, help=f"seed of the workload (default: {seed})")
    return p


def output_options(name: str) -> argparse.ArgumentParser:
    """--json and --no-save: where a command's figures go besides the results store."""
    p = parent()
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    help_ = f"do not save them (to $MINILLM_RESULTS or ./minillm-results, as <hardware>/{name}.json)"
    p.add_argument("--no-save", action="store_true", help=help_)
    p.set_defaults(result_name=name)
    return p


# ---------------------------------------------------------------------------------------------
# Every benchmark's parser: its own options, then --threads, --json and --no-save


def add_benchmark(kinds, name: str, help_: str, handler, *parents: argparse.ArgumentParser) -> ArgumentParser:
    """``bench NAME``: its own options (``parents``), then --threads, --json and --no-save."""
    saved = f"bench_{name.replace('-', '_')}"  # a file name of one word, like the results' others
    p = kinds.add_parser(name, help=help_, parents=[*parents, threads_option(), output_options(saved)])
    p.set_defaults(handler=handler)
    return p
