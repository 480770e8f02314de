"""``python -m minillm bench serve | serve-stack | disagg | parallel | capstone | peers``: the
benchmarks that start other processes (an HTTP server, worker processes, ranks, other engines)
and turn those processes' failures into one line. Like every benchmark they end in ``common.report_figures``.
"""

from __future__ import annotations

import argparse

import torch

from ..core.device import best_device
from ..measure.metrics import SLO
from . import common
from .common import bad_input, parse_device, where
from .figures import run_benchmark


def add_process_benchmarks(kinds) -> None:
    for add in (add_disagg, add_serve, add_serve_stack, add_parallel, add_capstone, add_peers):
        add(kinds)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from ..bench.serve import ServeBench, bench_serve, format_serve

    with bad_input():
        options = ServeBench(
            model=args.model,
            url=args.url,
            n_requests=args.requests,
            rates=tuple(args.rate),
            seed=args.seed,
            prompt_median=args.prompt_median,
            output_median=args.output_median,
            max_batch=args.max_batch,
            threads=torch.get_num_threads(),
            slo=SLO(ttft=args.slo_ttft, tpot=args.slo_tpot),
            progress=not args.no_progress,
        )
    where_ = args.url or f"{args.model} served by a new server ({where(str(best_device()))})"
    what = f"streaming completions over HTTP at {list(options.rates)} req/s: {where_}..."
    errors = (ImportError, RuntimeError, ValueError)  # no httpx; a server that fails to start; bad input
    return run_benchmark(args, what, lambda: bench_serve(options), format_serve, errors)


def add_serve(kinds) -> None:
    p = common.add_benchmark(
        kinds,
        "serve",
        "the HTTP server from a client: TTFT, ITL, TPOT, goodput vs the engine's own",
        cmd_bench_serve,
        common.workload_options(32, [2.0, 8.0], seed=0),
        common.lengths_options(64, 32),
        common.max_batch_option(),
        common.slo_options(0.5, 0.05),
        common.progress_option(),
    )
    server = p.add_mutually_exclusive_group()
    common.add_model(server, "the model of the server it starts")
    server.add_argument(
        "--url", default=None, help="measure a running minillm server instead, e.g. http://127.0.0.1:8000"
    )


def cmd_bench_disagg(args: argparse.Namespace) -> int:
    from ..bench.disagg import DisaggBench, SimulatedSweep, bench_disagg, format_disagg
    from ..serving.disagg import WorkerError

    with bad_input():
        options = DisaggBench(
            model=args.model,
            rates=tuple(args.rate),
            n_requests=args.requests,
            slo=SLO(ttft=args.slo_ttft, tpot=args.slo_tpot),
            seed=args.seed,
        )
        simulated = None if args.no_simulated else SimulatedSweep(duration=args.sim_duration)
    what = (
        f"colocated, chunked and disaggregated serving of {args.model}, 2 worker processes each, "
        f"at {list(options.rates)} req/s" + ("" if simulated is None else "; then the simulated GPU sweeps") + "..."
    )
    return run_benchmark(args, what, lambda: bench_disagg(options, simulated), format_disagg, (WorkerError, ValueError))


def add_disagg(kinds) -> None:
    p = common.add_benchmark(
        kinds,
        "disagg",
        "colocated vs chunked vs disaggregated prefill/decode (worker processes)",
        cmd_bench_disagg,
        common.model_option("the model every worker loads"),
        common.workload_options(32, [1.0, 2.0, 3.0], seed=0),
        common.slo_options(1.0, 0.1),
    )
    p.add_argument("--no-simulated", action="store_true", help="skip the simulated GPU-sized sweeps (minutes)")
    help_ = "seconds of arrivals per simulated run (default: 20)"
    p.add_argument("--sim-duration", type=float, default=20.0, help=help_)


def cmd_bench_parallel(args: argparse.Namespace) -> int:
    from ..bench.parallel import ParallelBench, bench_parallel, format_parallel
    from ..parallel.launch import RankError

    with bad_input():
        changes = {"model": args.model, "ranks": tuple(args.ranks), "replicas": tuple(args.replicas)}
        for name in ("prompt_len", "decode_tokens", "repeats"):
            if getattr(args, name) is not None:
                changes[name] = getattr(args, name)
        options = ParallelBench.quick(**changes) if args.quick else ParallelBench(**changes)
        options.check()  # a bad split or model fails here, before any process starts
    what = (
        f"tensor and pipeline parallel {args.model} on {list(options.ranks)} ranks (1 thread each), "
        f"then {list(options.replicas)} replicas" + (" (quick: not saved)" if args.quick else "") + "..."
    )
    errors = (RankError, ValueError)  # a worker's failure is a RankError too
    # a quick run's figures are a test, not a result
    return run_benchmark(args, what, lambda: bench_parallel(options), format_parallel, errors, save=not args.quick)


def add_parallel(kinds) -> None:
    p = common.add_benchmark(
        kinds,
        "parallel",
        "tensor, pipeline and data parallelism: times, tokens, bytes vs formulas",
        cmd_bench_parallel,
        common.model_option("the model every rank shards"),
        common.prompt_len_option(None, "128"),
        common.repeats_option(None, "5; 1 with --quick"),
    )
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="rank counts (default: 1 2 4)")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2], help="replica counts (default: 1 2)")
    help_ = "timed decode steps per round (default: 32; 4 with --quick)"
    p.add_argument("--decode-tokens", type=int, default=None, help=help_)
    p.add_argument("--quick", action="store_true", help="a run of seconds (few steps, one round; never saved)")


def cmd_bench_capstone(args: argparse.Namespace) -> int:
    from ..bench.capstone import CapstoneBench, bench_capstone, format_capstone

    with bad_input():
        options = CapstoneBench(
            shape=args.shape,
            model=args.model,
            draft=args.draft,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            repeats=args.repeats,
            requests=args.requests,
            rate=args.rate,
            sweep_rates=tuple(args.sweep_rate),
            sweep_requests=args.sweep_requests,
            slo=SLO(ttft=args.slo_ttft, tpot=args.slo_tpot),
            compile=not args.no_compile,
            http=not args.no_http,
            device=parse_device(args.device),
            progress=not args.no_progress,
        )
    what = (
        f"chapter 16's table: the ladder on a random {options.shape.name}, quality, decoding and serving on "
        f"{options.model} ({where(options.device)}); the first run compiles for minutes..."
    )
    errors = (RuntimeError, ValueError)
    return run_benchmark(args, what, lambda: bench_capstone(options), format_capstone, errors)


def add_capstone(kinds) -> None:
    p = common.add_benchmark(
        kinds,
        "capstone",
        "chapter 16: every technique stacked, one row each, one table",
        cmd_bench_capstone,
        common.shape_option("the shape of the speed rows", "SmolLM2-135M"),
        common.model_option("the trained model of quality and serving"),
        common.model_option("the draft model of speculative decoding", "minillm-draft", "--draft"),
        common.prompt_len_option(48),
        common.new_tokens_option(24),
        common.repeats_option(3),
        common.workload_options(16, 4.0),
        common.slo_options(0.5, 0.05),
        common.device_option(),
        common.progress_option(),
    )
    p.add_argument("--no-compile", action="store_true", help="skip the compiled rows (no compile time)")
    p.add_argument("--no-http", action="store_true", help="skip the served-over-HTTP row (no server process)")
    p.add_argument(
        "--sweep-rate",
        type=float,
        nargs="+",
        default=[2.0, 4.0, 6.0, 8.0, 12.0],
        help="arrival rates (requests/s) of the online-against-batch sweep",
    )
    p.add_argument("--sweep-requests", type=int, default=32, help="requests per rate of that sweep")


def cmd_bench_serve_stack(args: argparse.Namespace) -> int:
    from ..bench.serve_stack import ServeStackBench, bench_serve_stack, format_serve_stack, stack_only

    with bad_input():
        options = ServeStackBench(
            model=args.model,
            rates=tuple(args.rate),
            n_requests=args.requests,
            prompts=args.prompts,
            prompt_median=args.prompt_median,
            output_median=args.output_median,
            max_batch=args.max_batch,
            threads=torch.get_num_threads(),
            slo=SLO(ttft=args.slo_ttft, tpot=args.slo_tpot),
            seed=args.seed,
            progress=not args.no_progress,
        )
        if args.only:
            unknown = set(args.only) - {name for name, _ in options.stack}
            if unknown:
                raise ValueError(f"--only names no configuration {sorted(unknown)}: {[n for n, _ in options.stack]}")
            options = stack_only(options, tuple(args.only))
    names = ", ".join(name for name, _ in options.stack)
    what = f"{args.model} served as {names}, each at {list(options.rates)} req/s ({where('cpu')})..."
    errors = (ImportError, RuntimeError, ValueError)
    return run_benchmark(args, what, lambda: bench_serve_stack(options), format_serve_stack, errors)


def add_serve_stack(kinds) -> None:
    p = common.add_benchmark(
        kinds,
        "serve-stack",
        "the server with each technique, then all: highest goodput within the SLO vs eager fp32",
        cmd_bench_serve_stack,
        common.model_option("the model every server serves"),
        common.workload_options(32, [1.0, 2.0, 4.0, 8.0], seed=0),
        common.lengths_options(64, 48),
        common.max_batch_option(8),
        common.slo_options(0.5, 0.05),
        common.progress_option(),
    )
    p.add_argument(
        "--prompts",
        choices=("edits", "random"),
        default="edits",
        help="edits (default): code to rewrite, answers that copy the prompt; random: prompt ids with nothing to copy",
    )
    p.add_argument("--only", nargs="+", default=None, metavar="NAME", help="these configurations only (and eager fp32)")


def cmd_bench_peers(args: argparse.Namespace) -> int:
    from ..bench.peers import FORMATS, PeersBench, bench_peers, format_peers

    with bad_input():
        options = PeersBench(
            model=None if args.shape else args.model,
            shape=args.shape,
            formats=tuple(args.formats or FORMATS),
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            rounds=args.repeats,
            compile=not args.eager,
            threads=torch.get_num_threads(),
            seed=args.seed,
            progress=not args.no_progress,
        )
    weights = f"random {args.shape}" if args.shape else args.model
    what = f"{weights}: minillm, torchao and llama.cpp decoding the same weights, each in a process ({where('cpu')})..."
    return run_benchmark(args, what, lambda: bench_peers(options), format_peers, (RuntimeError, ValueError))


def add_peers(kinds) -> None:
    p = common.add_benchmark(
        kinds,
        "peers",
        "minillm vs llama.cpp and torchao on the same weights, per format: decode tokens/s (peers optional)",
        cmd_bench_peers,
        common.model_option("the trained model measured"),
        common.repeats_option(5),
        common.new_tokens_option(128),
        common.prompt_len_option(64),
        common.progress_option(),
    )
    p.add_argument("--shape", default=None, help="random weights of this preset instead of --model (e.g. SmolLM2-360M)")
    p.add_argument("--formats", nargs="+", choices=("fp32", "int8", "int4"), default=None, help="(default: all three)")
    p.add_argument("--eager", action="store_true", help="minillm and torchao not compiled (default: compiled)")
    p.add_argument("--seed", type=int, default=0, help="of the random weights and prompt (default: 0)")
