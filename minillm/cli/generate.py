"""``python -m minillm generate``: text from a prompt, streamed, then TTFT, TPOT and tokens/s. One
process loads the model through the runtime (``runtime.load_model``: quantized, compiled, in the
dtype asked); ``--tensor-parallel N`` and ``--pipeline-parallel N`` check everything first, then
spawn N ranks (or, under torchrun, this process is one of them).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..core.checkpoints import read_config, resolve
from ..core.generate import GenerationResult, check_max_new_tokens, check_request
from ..core.model import Transformer
from ..core.sampling import SamplingParams
from ..core.tokenizer import Tokenizer
from .common import (
    DTYPES,
    CliError,
    bad_input,
    device_option,
    dtype_option,
    model_option,
    parse_device,
    quantize_options,
    threads_option,
)

if TYPE_CHECKING:  # annotations only: each handler imports what it runs when it runs
    from ..parallel.cli_ranks import GenerateRequest
    from ..parallel.launch import RankError
    from ..runtime import RuntimeOptions


def cmd_generate(args: argparse.Namespace) -> int:
    from ..parallel.cli_ranks import stream_generate

    with bad_input():  # fail before loading
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
        check_max_new_tokens(args.max_new_tokens)
    if args.tensor_parallel is not None or args.pipeline_parallel is not None:
        return generate_parallel(args, sampling)
    device = parse_device(args.device)
    with bad_input():
        model, tokenizer = load_for_generate(args, device)
    if tokenizer is None:
        raise CliError(no_tokenizer(args.model))
    if args.compile:
        print("compiling the decode step (once per model and cache size) ...", file=sys.stderr, flush=True)
    with bad_input():
        result = stream_generate(
            model,
            tokenizer,
            args.prompt,
            tokenizer.encode(args.prompt),
            args.max_new_tokens,
            sampling,
            compile=args.compile,
        )
    if args.compile:
        print(f"compile time: {result.compile_time:.1f} s, not counted in the timings", file=sys.stderr)
    line = timing_line(result, model)
    print(line[:-1] + ", compiled)" if args.compile else line)
    return 0


def no_tokenizer(model: str) -> str:
    return f"{model} has no tokenizer.json, so text cannot be encoded; pick a model that has one"


def runtime_options(args: argparse.Namespace, device: str | None) -> RuntimeOptions:
    """The runtime's options from ``generate``'s flags: the runtime refuses what does not compose."""
    from ..runtime import RuntimeOptions

    return RuntimeOptions(
        quantize=args.quantize,
        group_size=args.group_size,
        dtype=DTYPES[args.dtype] if args.dtype else None,
        compile=args.compile,
        tensor_parallel=args.tensor_parallel or 1,
        device=device,
    )


def load_for_generate(args: argparse.Namespace, device: str | None) -> tuple[Transformer, object]:
    """The model to generate with, through the runtime (a quantized checkpoint as such; on a CPU a
    quantized model computes in bf16 unless --dtype says otherwise)."""
    from ..compression import model_bytes
    from ..compression.quant import quantized_layers
    from ..runtime import load_model

    model, tokenizer = load_model(args.model, runtime_options(args, device))
    layers = quantized_layers(model)
    if args.quantize and layers:
        paths = sorted({layer.path for layer in layers.values()} - {"reference"})
        kernel = f", kernels: {', '.join(paths)}" if paths else ""
        print(f"quantized to {args.quantize}: {model_bytes(model) / 1e6:.1f} MB{kernel}", file=sys.stderr)
    return model, tokenizer


def timing_line(result: GenerationResult, model: Transformer) -> str:
    """TTFT, TPOT and decode tokens/s of one generation, with what it ran on."""
    from ..parallel.cli_ranks import model_timing_line

    return model_timing_line(result, model)


# ---------------------------------------------------------------------------------------------
# generate on N ranks

RANK_TIMEOUT_S = 600.0  # bounds a parallel run, and every collective in it


def generate_parallel(args: argparse.Namespace, sampling: SamplingParams) -> int:
    """--tensor-parallel N or --pipeline-parallel N: every check before a process starts, then
    the ranks, spawned here (or, under torchrun, this process is one of them)."""
    from ..compression.saving import is_quantized_checkpoint
    from ..parallel.cli_ranks import GenerateRequest, rank_threads, tensor_parallel_generate
    from ..parallel.launch import RankError, launch, under_torchrun
    from ..parallel.pipeline import PipelineSpec, check_pipeline, pipeline_generate
    from ..parallel.tensor import check_tensor_parallel

    tp, pp = args.tensor_parallel, args.pipeline_parallel
    if tp is not None and pp is not None:
        raise CliError("--tensor-parallel and --pipeline-parallel together are not supported; pick one")
    flag, n = ("--tensor-parallel", tp) if tp is not None else ("--pipeline-parallel", pp)
    if n < 1:
        raise CliError(f"{flag} must be a positive number of ranks, got {n}")
    with bad_input():  # the runtime says what does not compose with tensor parallelism
        runtime_options(args, None)
    options = (("--quantize", args.quantize), ("--group-size", args.group_size), ("--compile", args.compile))
    for option, value in options if pp is not None else ():
        if value:
            raise CliError(f"{option} with {flag} is not supported; drop one of them")
    if pp is not None and sampling.temperature > 0:
        raise CliError("--pipeline-parallel generates greedily only: drop --temperature, or use --tensor-parallel")
    with bad_input():
        directory = resolve(args.model)
        if is_quantized_checkpoint(directory):
            raise CliError(f"{args.model} is a quantized checkpoint; {flag} is not supported on it")
        config, raw = read_config(directory)
        if tp is not None:
            check_tensor_parallel(config, tp)
        else:
            check_pipeline(config, pp)
    if not (directory / "tokenizer.json").is_file():
        raise CliError(no_tokenizer(args.model))
    with bad_input():
        prompt_ids = Tokenizer.from_dir(directory).encode(args.prompt)
        check_request([prompt_ids], args.max_new_tokens, config)
    device = parallel_device(args.device, n)
    dtype = args.dtype or ("float32" if device == "cpu" else checkpoint_dtype(raw))
    request = GenerateRequest(
        str(directory), args.prompt, tuple(prompt_ids), args.max_new_tokens, sampling, dtype, device
    )
    if under_torchrun():
        return join_torchrun(request, flag, n)
    threads = rank_threads(args.threads, n)
    try:
        if tp is not None:
            launch(tensor_parallel_generate, tp, request, timeout=RANK_TIMEOUT_S, threads=threads, device=device)
        else:
            spec = PipelineSpec(request.model_dir, (request.prompt_ids,), request.max_new_tokens, 1, dtype, device)
            stages = launch(pipeline_generate, pp, spec, timeout=RANK_TIMEOUT_S, threads=threads, device=device)
            print_pipeline(request, stages[-1], config.name, threads)
    except RankError as e:
        print(f"minillm generate: error: {rank_failure(e)}", file=sys.stderr)
        return 1
    return 0


def print_pipeline(request: GenerateRequest, last, name: str, threads: int) -> None:
    """The last stage's tokens as the single process prints them (cut after the first EOS), then
    the timing line."""
    from ..parallel.cli_ranks import pipeline_result, print_tokens, until_eos
    from ..parallel.cli_ranks import timing_line as parallel_timing_line

    tokens = until_eos(last.tokens[0], request.model_dir)
    print_tokens(Tokenizer.from_dir(request.model_dir), request.prompt, tokens)
    result = pipeline_result(last, tokens, len(request.prompt_ids))
    device = torch.device(request.device)
    parallel = f"pipeline-parallel {last.rank + 1} stages"  # the last stage is rank p - 1
    print(parallel_timing_line(result, name, device, DTYPES[request.dtype], threads, parallel), flush=True)


def join_torchrun(request: GenerateRequest, flag: str, n: int) -> int:
    """Under torchrun: join the group from the environment and run this rank. With tensor
    parallelism rank 0 prints; with pipeline parallelism the last stage (which has the tokens)."""
    from ..parallel.cli_ranks import tensor_parallel_generate
    from ..parallel.launch import init_from_env
    from ..parallel.pipeline import PipelineSpec, pipeline_generate

    world = int(os.environ["WORLD_SIZE"])
    if world != n:
        raise CliError(f"torchrun started {world} processes but {flag} is {n}; they must be equal")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank on this machine, as launch assumes
    rank, world = init_from_env(request.device, timeout=RANK_TIMEOUT_S)
    try:
        if flag == "--tensor-parallel":
            tensor_parallel_generate(rank, world, request)
        else:
            last = pipeline_generate(
                rank,
                world,
                PipelineSpec(
                    request.model_dir, (request.prompt_ids,), request.max_new_tokens, 1, request.dtype, request.device
                ),
            )
            if last.tokens is not None:
                config, _ = read_config(Path(request.model_dir))
                print_pipeline(request, last, config.name, torch.get_num_threads())
    except Exception as e:  # torchrun stops the other ranks
        message = " ".join(f"{type(e).__name__}: {e}".split())
        print(f"minillm generate: error: rank {rank} of {world} failed: {message}", file=sys.stderr)
        return 1
    finally:
        torch.distributed.destroy_process_group()
    return 0


def parallel_device(name: str | None, ranks: int) -> str:
    """cpu, or cuda with one GPU per rank (the default when this machine has enough of them)."""
    if name is None:
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= ranks else "cpu"
    kind = torch.device(parse_device(name)).type
    if kind == "cuda" and torch.cuda.device_count() < ranks:
        raise CliError(f"{ranks} ranks need {ranks} GPUs, one each; this machine has {torch.cuda.device_count()}")
    if kind not in ("cpu", "cuda"):
        raise CliError(f"ranks run on cpu or cuda, not {name}")
    return kind


def checkpoint_dtype(raw: dict) -> str:
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return name if name in DTYPES else "float32"


def rank_failure(error: RankError) -> str:
    """RankError's message on one line: which rank failed, and its traceback's last line (the cause)."""
    head, _, traceback = str(error).partition("\n")
    if not traceback.strip():
        return " ".join(head.split())
    cause = traceback.split("\nthen: ")[0].strip().splitlines()[-1]
    return f"{head} {' '.join(cause.split())}"


# ---------------------------------------------------------------------------------------------
# The parser


def add_generate(commands) -> None:
    p = commands.add_parser(
        "generate",
        help="generate text from a prompt, streamed, then TTFT, TPOT and tokens/s",
        parents=[
            model_option("the model"),
            device_option(),
            dtype_option("float32 on a CPU, the checkpoint's own on a GPU"),
            quantize_options(),
            threads_option(),
        ],
    )
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="at most this many new tokens (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), 1 = the model's own")
    p.add_argument("--top-k", type=int, default=None, help="sample only from the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample only from the nucleus of probability p")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling, for reproducible output")
    p.add_argument(
        "--compile",
        action="store_true",
        help="decode through torch.compile over a static KV cache (CUDA graphs on CUDA); "
        "compiling takes seconds, reported apart",
    )
    for flag, what in (
        ("--tensor-parallel", "tensor parallelism: every layer split over N ranks (spawned, or torchrun's)"),
        ("--pipeline-parallel", "pipeline parallelism: the layers in N stages (spawned; greedy only)"),
    ):
        p.add_argument(flag, type=int, default=None, metavar="N", help=what)
    p.set_defaults(handler=cmd_generate)
