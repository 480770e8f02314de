"""The command line: ``python -m minillm COMMAND`` (or ``minillm COMMAND`` once installed).

    python -m minillm generate --prompt "def fibonacci(n):" --max-new-tokens 64
    python -m minillm generate --prompt "def fibonacci(n):" --tensor-parallel 2   # 2 ranks, same text
    torchrun --nproc-per-node 2 -m minillm generate --prompt "def fibonacci(n):" --tensor-parallel 2
    python -m minillm serve --model minillm-target --port 8000
    python -m minillm bench generate --json results/cpu/generate.json
    python -m minillm models

Bad input (an invalid sampling parameter, an unknown model, a prompt longer than the context)
prints one line to stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..core.checkpoints import BUNDLED_DIR, bundled_models, load, read_config, resolve
from ..core.config import PRESETS, ModelConfig
from ..core.device import set_threads
from ..core.generate import GenerationResult, check_max_new_tokens, check_request
from ..core.hf_config import config_from_hf
from ..core.model import Transformer
from ..core.sampling import SamplingParams
from ..core.tokenizer import Tokenizer
from ..training.corpus import DATA_DIR, build_corpus
from .bench import add_bench, write_json
from .common import (
    DEFAULT_MODEL,
    DTYPES,
    ArgumentParser,
    CliError,
    add_threads_option,
    bad_input,
    parse_device,
)

if TYPE_CHECKING:  # annotations only: each handler imports what it runs when it runs
    from ..parallel.cli_ranks import GenerateRequest
    from ..parallel.launch import RankError
    from ..runtime import RuntimeOptions


def human_count(n: int) -> str:
    """A parameter count as 8.03B, 135.0M or 12.3K."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}" if suffix == "B" else f"{n / scale:.1f}{suffix}"
    return str(n)


# ---------------------------------------------------------------------------------------------
# generate


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
# serve


def cmd_serve(args: argparse.Namespace) -> int:
    from ..serving import http  # the web framework itself is imported only by run_server

    with bad_input():  # fail before loading
        options = http.ServerOptions(
            model=args.model,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            max_batch=args.max_batch,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            device=parse_device(args.device),
            dtype=DTYPES[args.dtype] if args.dtype else None,
            shutdown_timeout=args.shutdown_timeout,
            quantize=args.quantize,
            group_size=args.group_size,
        )
    try:
        http.require_serve_extra()
    except ImportError as e:
        raise CliError(str(e)) from None
    with bad_input():
        return http.run_server(options)


def add_quantize_options(p) -> None:
    """--quantize and --group-size, for the runtime (generate and serve), which checks them."""
    p.add_argument(
        "--quantize",
        default=None,
        metavar="SCHEME",
        help="weight-only quantization after loading: int8, int4 or fp8 (round to nearest); on a CPU in bf16",
    )
    p.add_argument("--group-size", type=int, default=None, help="int4 weights per scale (default: 128)")


def add_serve(commands) -> None:
    p = commands.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, /metrics)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model to serve (default: {DEFAULT_MODEL})")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every /v1 request")
    p.add_argument("--max-batch", type=int, default=16, help="sequences per engine step at most (default: 16)")
    p.add_argument("--num-blocks", type=int, default=256, help="KV pool size in blocks (default: 256)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    p.add_argument("--device", default=None, help="cpu, cuda or mps (default: the best available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="weights' dtype (default: as generate)")
    add_quantize_options(p)
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="on SIGINT/SIGTERM, seconds requests in flight may take to finish before they are aborted (default: 5)",
    )
    add_threads_option(p)
    p.set_defaults(handler=cmd_serve)


# ---------------------------------------------------------------------------------------------
# models, corpus, train


def cmd_models(args: argparse.Namespace) -> int:
    from ..measure.report import format_table

    bundled = [config_from_hf(json.loads((BUNDLED_DIR / n / "config.json").read_text()), n) for n in bundled_models()]
    if bundled:
        print(format_table([config_row(c) for c in bundled], title="Bundled models (trained weights)"))
    else:
        print("Bundled models: none yet (python -m minillm train model --size draft|target makes them)")
    print()
    title = "Shape presets (random weights of the real sizes: minillm.random_model(name))"
    print(format_table([config_row(c) for c in PRESETS.values()], title=title))
    return 0


def config_row(config: ModelConfig) -> dict:
    return {
        "name": config.name,
        "params": human_count(config.num_params()),
        "layers": config.n_layers,
        "dim": config.dim,
        "heads": config.n_heads,
        "kv heads": config.n_kv_heads,
        "vocab": config.vocab_size,
        "context": config.max_seq_len,
    }


def cmd_corpus(args: argparse.Namespace) -> int:
    manifest = build_corpus()
    for split, info in manifest["splits"].items():
        print(f"{split}: {len(info['documents'])} documents, {info['characters']:,} characters")
    print(f"written to {DATA_DIR} (from Python {manifest['python']})")
    return 0


def cmd_train_tokenizer(args: argparse.Namespace) -> int:
    from ..training.train import TOKENIZER_DIR, train_tokenizer

    torch.set_num_threads(os.cpu_count() or 1)
    tokenizer = train_tokenizer()
    print(f"tokenizer of {tokenizer.vocab_size} tokens written to {TOKENIZER_DIR}")
    return 0


def cmd_train_model(args: argparse.Namespace) -> int:
    from ..training.train import train_bundled

    torch.set_num_threads(os.cpu_count() or 1)
    with bad_input():
        out = train_bundled(args.size, args.out, args.steps)
    print(f"model written to {out}")
    return 0


def cmd_train_gqa(args: argparse.Namespace) -> int:
    from ..kv.gqa import Uptraining, uptrain_curves
    from ..measure.report import finish_provenance, provenance
    from ..training.train import encode_split

    with bad_input():
        options = Uptraining(steps=args.steps, eval_every=args.eval_every)
    torch.set_num_threads(os.cpu_count() or 1)
    model, tokenizer = load(DEFAULT_MODEL)
    valid = encode_split(tokenizer, "valid")[: 24 * 128 + 1]
    with bad_input():  # K/V-head counts that do not divide the model's are refused before any training
        curves = uptrain_curves(model, args.kv_heads, options, valid)
    for n, curve in curves.items():
        print(f"{n} K/V heads: perplexity " + " -> ".join(f"{ppl:.1f} (step {s})" for s, ppl in curve))
    if args.json:
        figures = provenance(
            "cpu",
            model=DEFAULT_MODEL,
            n_heads=model.config.n_heads,
            steps=options.steps,
            batch_size=options.batch_size,
            seq_len=options.seq_len,
            lr=options.lr,
            valid_tokens=len(valid) - 1,
        )
        write_json(args.json, {**finish_provenance(figures), "curves": {str(n): c for n, c in curves.items()}})
    return 0


def cmd_train_medusa(args: argparse.Namespace) -> int:
    from ..decoding.medusa_train import MedusaTrainConfig, train_medusa

    with bad_input():
        config = MedusaTrainConfig(n_heads=args.heads, steps=args.steps, n_sequences=args.sequences)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    with bad_input():
        out = train_medusa(args.model, args.out, config)
    print(f"Medusa heads written to {out}")
    return 0


# ---------------------------------------------------------------------------------------------
# The parser


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="minillm", description="minillm: LLM inference optimization from scratch.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands", required=True)
    add_generate(commands)
    add_serve(commands)
    add_bench(commands)
    models = commands.add_parser("models", help="list the bundled models and the shape presets, with sizes")
    models.set_defaults(handler=cmd_models)
    corpus = commands.add_parser("corpus", help="rebuild the training corpus from this Python's stdlib")
    corpus.set_defaults(handler=cmd_corpus)
    add_train(commands)
    return parser


def add_generate(commands) -> None:
    p = commands.add_parser("generate", help="generate text from a prompt, streamed, then TTFT, TPOT and tokens/s")
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"bundled model name, checkpoint directory or hub id (default: {DEFAULT_MODEL})",
    )
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="at most this many new tokens (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), 1 = the model's own")
    p.add_argument("--top-k", type=int, default=None, help="sample only from the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample only from the nucleus of probability p")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling, for reproducible output")
    p.add_argument("--device", default=None, help="cpu, cuda or mps (default: the best available)")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="weights' dtype (default: float32 on a CPU, the checkpoint's own on a GPU)",
    )
    add_quantize_options(p)
    p.add_argument(
        "--compile",
        action="store_true",
        help="decode through torch.compile over a static KV cache (CUDA graphs on CUDA); "
        "compiling takes seconds, reported apart",
    )
    add_threads_option(p)
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=None,
        metavar="N",
        help="tensor parallelism: every layer split over N ranks (spawned, or torchrun's)",
    )
    p.add_argument(
        "--pipeline-parallel",
        type=int,
        default=None,
        metavar="N",
        help="pipeline parallelism: the layers in N stages (spawned; greedy only)",
    )
    p.set_defaults(handler=cmd_generate)


def add_train(commands) -> None:
    train = commands.add_parser("train", help="retrain the bundled tokenizer or models (uses every CPU core)")
    what = train.add_subparsers(dest="what", metavar="WHAT", title="what to train", required=True)
    tok = what.add_parser("tokenizer", help="the byte-level BPE tokenizer, on the corpus' training split")
    tok.set_defaults(handler=cmd_train_tokenizer)
    model = what.add_parser("model", help="one bundled model, saved in Hugging Face layout")
    model.add_argument("--size", choices=("target", "draft"), required=True, help="which bundled model")
    model.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the bundled recipe)")
    model.add_argument("--out", type=Path, default=None, help="output directory (default: minillm/bundled/NAME)")
    model.set_defaults(handler=cmd_train_model)
    medusa = what.add_parser("medusa", help="Medusa heads on a frozen model, from text it generates (2 threads)")
    medusa.add_argument("--model", default=DEFAULT_MODEL, help=f"the base model (default: {DEFAULT_MODEL})")
    medusa.add_argument("--heads", type=int, default=4, help="extra heads (default: 4)")
    medusa.add_argument("--steps", type=int, default=300, help="optimizer steps (default: 300)")
    medusa.add_argument("--sequences", type=int, default=384, help="self-generated training texts (default: 384)")
    medusa.add_argument("--out", type=Path, default=None, help="output directory (default: beside the model)")
    medusa.set_defaults(handler=cmd_train_medusa)
    gqa = what.add_parser("gqa", help="uptrain the bundled target converted to GQA and MQA; perplexity curves")
    kv_heads_help = "K/V head counts; the model's own is the control (default: 8 2 1)"
    gqa.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2, 1], help=kv_heads_help)
    gqa.add_argument("--steps", type=int, default=200, help="optimizer steps each (default: 200)")
    gqa.add_argument("--eval-every", type=int, default=25, help="steps between evaluations (default: 25)")
    gqa.add_argument("--json", type=Path, default=None, help="also write the curves to this JSON file")
    gqa.set_defaults(handler=cmd_train_gqa)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m minillm`` and the ``minillm`` script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if hasattr(args, "threads"):
            with bad_input():
                set_threads(args.threads)
        return args.handler(args)
    except CliError as e:
        message = " ".join(str(e).split())  # one line, even when a library's message has several
        print(f"minillm {args.command}: error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
