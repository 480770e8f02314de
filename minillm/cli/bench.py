"""``python -m minillm bench BENCHMARK``: the command line of the benchmarks. Each command builds
the benchmark's options, runs it, prints its tables and, with ``--json``, saves its figures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ..core.checkpoints import load
from ..core.device import best_device, threads_label
from ..measure.metrics import SLO
from .common import DEFAULT_MODEL, DTYPES, CliError, add_threads_option, bad_input, parse_device


def write_json(path: Path, figures: dict) -> None:
    """Write a command's figures to the JSON file it was given, and say where."""
    from ..measure import report

    report.write_json(path, figures)
    print(f"figures written to {path}")


def _where(device: str) -> str:
    """'cpu, 1 thread': what a benchmark runs on, for its first line."""
    return f"{device}, {threads_label(torch.get_num_threads())}" if str(device).startswith("cpu") else str(device)


def cmd_bench_generate(args: argparse.Namespace) -> int:
    from ..bench import generation as bench

    with bad_input():
        o = bench.GenerationBench(
            args.model, args.prompt_len, args.prompt_lens, args.new_tokens, args.repeats, parse_device(args.device)
        )
    vs_transformers = None
    print(f"minillm vs transformers on {o.model} ({_where(o.device)})...", file=sys.stderr, flush=True)
    try:
        with bad_input():
            vs_transformers = bench.bench_vs_transformers(
                o.model, o.prompt_len, o.new_tokens, o.repeats, o.device, progress=True, compile=args.compile
            )
        print(bench.format_vs_transformers(vs_transformers), end="\n\n", flush=True)
    except ImportError as e:
        print(f"skipped the comparison with transformers: {e}", file=sys.stderr, flush=True)
    print(f"KV cache vs recompute at prompts {list(o.prompt_lens)}...", file=sys.stderr, flush=True)
    with bad_input():
        cache = bench.bench_cache_vs_recompute(o.model, o.prompt_lens, o.new_tokens, o.repeats, o.device, progress=True)
    print(bench.format_cache_vs_recompute(cache))
    if args.json:
        write_json(args.json, {"vs_transformers": vs_transformers, "cache_vs_recompute": cache})
    return 0


def cmd_bench_kv(args: argparse.Namespace) -> int:
    from ..bench.kv import KVBench, bench_kv, format_kv_bench, mha_shape

    with bad_input():
        dtype = DTYPES[args.dtype] if args.dtype else None
        device = parse_device(args.device)
        options = KVBench(tuple(args.contexts), args.batch, args.new_tokens, args.repeats, device, dtype, True)
        config = mha_shape(args.shape)
    print(
        f"KV-cache techniques on a random {args.shape} (as MHA), contexts {args.contexts} ({_where(device)})...",
        file=sys.stderr,
        flush=True,
    )
    result = bench_kv(config, options)
    print(format_kv_bench(result))
    if args.json:
        write_json(args.json, result)
    return 0


def cmd_bench_decoding(args: argparse.Namespace) -> int:
    from ..bench.decoding import DecodingBench, bench_decoding, format_decoding

    device = parse_device(args.device)
    with bad_input():
        options = DecodingBench(
            args.target,
            args.draft,
            args.prompts,
            args.prompt_len,
            args.new_tokens,
            args.repeats,
            args.k,
            device,
            True,
            args.compile,
        )
    print(
        f"greedy, speculative, prompt lookup, lookahead and Medusa decoding of {args.target} ({_where(device)})...",
        file=sys.stderr,
        flush=True,
    )
    with bad_input():
        result = bench_decoding(options)
    print(format_decoding(result))
    if args.json:
        write_json(args.json, result)
    return 0


def cmd_bench_batching(args: argparse.Namespace) -> int:
    from ..bench.batching import BatchingBench, bench_batching, format_batching

    with bad_input():
        options = BatchingBench(
            n_requests=args.requests,
            rate=args.rate,
            max_batch=args.max_batch,
            prompt_median=args.prompt_median,
            output_median=args.output_median,
            prefix_requests=args.prefix_requests,
            system_len=args.system_len,
            repeats=args.repeats,
            progress=not args.no_progress,
        )
    device = parse_device(args.device)
    with bad_input():
        model, _ = load(args.model, device=device)
    print(
        f"static vs continuous batching, KV waste, prefix cache on {args.model} ({_where(device)})...",
        file=sys.stderr,
        flush=True,
    )
    with bad_input():
        figures = bench_batching(model, options)
    print(format_batching(figures))
    if args.json:
        write_json(args.json, figures)
    return 0


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
    where = args.url or f"{args.model} served by a new server ({_where(str(best_device()))})"
    print(f"streaming completions over HTTP at {list(options.rates)} req/s: {where}...", file=sys.stderr, flush=True)
    try:
        figures = bench_serve(options)
    except ImportError as e:
        raise CliError(str(e)) from None
    except (RuntimeError, ValueError) as e:
        raise CliError(f"bench serve: {e}") from None
    return report_figures(args, "bench_serve", figures, format_serve(figures))


def report_figures(args: argparse.Namespace, name: str, figures: dict, text: str) -> int:
    """Print a benchmark's tables, write its figures to --json, save them unless --no-save."""
    print(text)
    if args.json:
        write_json(args.json, figures)
    if not args.no_save:
        from ..measure.report import save_result

        print(f"figures saved to {save_result(name, figures)}")
    return 0


def add_compile_option(p, what: str) -> None:
    p.add_argument(
        "--compile",
        action="store_true",
        help=f"also {what} compiled (torch.compile, static cache); compile times reported apart",
    )


def add_bench(commands) -> None:
    bench_parser = commands.add_parser("bench", help="measure: generation speed, KV-cache techniques, ...")
    kinds = bench_parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", title="benchmarks", required=True)
    p = kinds.add_parser("generate", help="generation speed: minillm vs transformers, KV cache vs recompute")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model to measure (default: {DEFAULT_MODEL})")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each, after a warmup (default: 5)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per run (default: 128)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens, vs transformers (default: 64)")
    p.add_argument(
        "--prompt-lens",
        type=int,
        nargs="+",
        default=[64, 256, 512],
        help="prompt lengths, cache vs recompute (default: 64 256 512)",
    )
    p.add_argument("--device", default=None, help="cpu, cuda or mps (default: the best available)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    add_compile_option(p, "minillm and transformers")
    p.set_defaults(handler=cmd_bench_generate)
    p = kinds.add_parser("kv", help="KV-cache techniques: bytes and decode tokens/s at several contexts")
    p.add_argument("--shape", default="SmolLM2-135M", help="preset shape, made MHA (default: SmolLM2-135M)")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096], help="(default: 256 1024 4096)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default: 1)")
    p.add_argument("--new-tokens", type=int, default=16, help="decode steps per timed run (default: 16)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported (default: 3)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on CUDA, else float32")
    p.add_argument("--device", default=None, help="cpu, cuda or mps (default: the best available)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    p.set_defaults(handler=cmd_bench_kv)
    p = kinds.add_parser("decoding", help="speculative, prompt lookup, lookahead, Medusa vs plain greedy decoding")
    p.add_argument("--target", default=DEFAULT_MODEL, help=f"the model (default: {DEFAULT_MODEL})")
    p.add_argument(
        "--draft", default="minillm-draft", help="draft model of speculative decoding (default: minillm-draft)"
    )
    p.add_argument("--k", type=int, default=4, help="draft tokens per round (default: 4)")
    p.add_argument("--prompts", type=int, default=4, help="corpus prompts, one run each (default: 4)")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (default: 64)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per prompt (default: 128)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after a warmup (default: 3)")
    p.add_argument("--device", default=None, help="cpu, cuda or mps (default: the best available)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    add_compile_option(p, "every method")
    p.set_defaults(handler=cmd_bench_decoding)
    add_bench_batching(kinds)
    add_bench_disagg(kinds)
    add_bench_serve(kinds)
    add_bench_compression(kinds)
    add_bench_parallel(kinds)
    add_bench_capstone(kinds)
    for benchmark in kinds.choices.values():  # every benchmark honours --threads (and MINILLM_THREADS)
        add_threads_option(benchmark)


def cmd_bench_compression(args: argparse.Namespace) -> int:
    from ..bench.compression import TECHNIQUE_NAMES, CompressionBench, bench_compression, format_compression

    with bad_input():
        o = CompressionBench(
            shape=args.shape,
            model=args.model,
            techniques=args.techniques or TECHNIQUE_NAMES,
            batches=args.batches,
            context=args.context,
            new_tokens=args.new_tokens,
            repeats=args.repeats,
            device=parse_device(args.device),
            progress=not args.no_progress,
            measure_speed=not args.no_speed,
            measure_quality=not args.no_quality,
        )
    print(
        f"compression: speed on a random {o.shape.name}, quality on {o.model} ({_where(o.device)})...",
        file=sys.stderr,
        flush=True,
    )
    with bad_input():
        figures = bench_compression(o)
    print(format_compression(figures))
    if args.json:
        write_json(args.json, figures)
    if not args.no_save:
        from ..measure.report import save_result

        print(f"figures saved to {save_result('bench_compression', figures)}")
    return 0


def add_bench_compression(kinds) -> None:
    p = kinds.add_parser("compression", help="quantization and pruning: bytes, decode tokens/s, quality")
    p.add_argument("--shape", default="SmolLM2-360M", help="random-weight shape timed (default: SmolLM2-360M)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"trained model for quality (default: {DEFAULT_MODEL})")
    p.add_argument(
        "--techniques",
        nargs="+",
        default=None,
        metavar="NAME",
        help="a subset of the techniques, by the names the table prints (default: all)",
    )
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="decode batch sizes (default: 1 16)")
    p.add_argument("--context", type=int, default=128, help="tokens in the cache while decoding (default: 128)")
    p.add_argument("--new-tokens", type=int, default=8, help="decode steps per timed run (default: 8)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs, taking turns (default: 3)")
    p.add_argument("--device", default=None, help="cpu, cuda or mps (default: the best available)")
    p.add_argument("--no-speed", action="store_true", help="skip the timed tables")
    p.add_argument("--no-quality", action="store_true", help="skip the quality table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    p.add_argument(
        "--no-save", action="store_true", help="do not save them to minillm/results/<hardware>/bench_compression.json"
    )
    p.set_defaults(handler=cmd_bench_compression)


def add_bench_batching(kinds) -> None:
    p = kinds.add_parser("batching", help="static vs continuous batching, paged KV waste, prefix-cache TTFT")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"the model (default: {DEFAULT_MODEL})")
    p.add_argument("--requests", type=int, default=128, help="requests in the workload (default: 128)")
    p.add_argument("--rate", type=float, default=1000.0, help="Poisson arrivals per second (default: 1000)")
    p.add_argument("--max-batch", type=int, default=16, help="sequences per step at most (default: 16)")
    p.add_argument("--prompt-median", type=float, default=64, help="median prompt tokens (default: 64)")
    p.add_argument("--output-median", type=float, default=64, help="median output tokens (default: 64)")
    p.add_argument("--prefix-requests", type=int, default=8, help="requests sharing a system prompt (default: 8)")
    p.add_argument("--system-len", type=int, default=512, help="system prompt tokens (default: 512)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each batching policy, taking turns (default: 3)")
    p.add_argument("--device", default=None, help="cpu, cuda or mps (default: the best available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    p.set_defaults(handler=cmd_bench_batching)


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
    print(
        f"colocated, chunked and disaggregated serving of {args.model}, 2 worker processes each, "
        f"at {list(options.rates)} req/s" + ("" if simulated is None else "; then the simulated GPU sweeps") + "...",
        file=sys.stderr,
        flush=True,
    )
    try:
        figures = bench_disagg(options, simulated)
    except (WorkerError, ValueError) as e:
        raise CliError(f"bench disagg: {e}") from None
    return report_figures(args, "bench_disagg", figures, format_disagg(figures))


def add_bench_disagg(kinds) -> None:
    p = kinds.add_parser("disagg", help="colocated vs chunked vs disaggregated prefill/decode (worker processes)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"the model every worker loads (default: {DEFAULT_MODEL})")
    p.add_argument(
        "--rate",
        type=float,
        nargs="+",
        default=[1.0, 2.0, 3.0],
        help="Poisson arrivals/s, one run each (default: 1 2 3)",
    )
    p.add_argument("--requests", type=int, default=32, help="requests per rate (default: 32)")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="SLO on TTFT, seconds (default: 1.0)")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="SLO on TPOT, seconds (default: 0.1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload (default: 0)")
    p.add_argument("--no-simulated", action="store_true", help="skip the simulated GPU-sized sweeps (minutes)")
    p.add_argument(
        "--sim-duration", type=float, default=20.0, help="seconds of arrivals per simulated run (default: 20)"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    p.add_argument(
        "--no-save", action="store_true", help="do not save them to minillm/results/<hardware>/bench_disagg.json"
    )
    p.set_defaults(handler=cmd_bench_disagg)


def add_bench_serve(kinds) -> None:
    p = kinds.add_parser("serve", help="the HTTP server from a client: TTFT, ITL, TPOT, goodput vs the engine's own")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"model of the server it starts (default: {DEFAULT_MODEL})"
    )
    where.add_argument(
        "--url", default=None, help="measure a running minillm server instead, e.g. http://127.0.0.1:8000"
    )
    p.add_argument("--requests", type=int, default=32, help="requests per rate (default: 32)")
    p.add_argument(
        "--rate", type=float, nargs="+", default=[2.0, 8.0], help="Poisson arrivals/s, one run each (default: 2 8)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the workload (default: 0)")
    p.add_argument("--prompt-median", type=float, default=64, help="median prompt tokens (default: 64)")
    p.add_argument("--output-median", type=float, default=32, help="median output tokens (default: 32)")
    p.add_argument("--max-batch", type=int, default=16, help="the started server's max batch (default: 16)")
    p.add_argument("--slo-ttft", type=float, default=0.5, help="SLO on TTFT, seconds (default: 0.5)")
    p.add_argument("--slo-tpot", type=float, default=0.05, help="SLO on TPOT, seconds (default: 0.05)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    p.add_argument(
        "--no-save", action="store_true", help="do not save them to minillm/results/<hardware>/bench_serve.json"
    )
    p.set_defaults(handler=cmd_bench_serve)


def cmd_bench_parallel(args: argparse.Namespace) -> int:
    from ..bench.parallel import ParallelBench, bench_parallel, format_parallel
    from ..parallel.launch import RankError
    from ..serving.disagg import WorkerError

    with bad_input():
        changes = {"model": args.model, "ranks": tuple(args.ranks), "replicas": tuple(args.replicas)}
        for name in ("prompt_len", "decode_tokens", "repeats"):
            if getattr(args, name) is not None:
                changes[name] = getattr(args, name)
        options = ParallelBench.quick(**changes) if args.quick else ParallelBench(**changes)
        options.check()  # a bad split or model fails here, before any process starts
    print(
        f"tensor and pipeline parallel {args.model} on {list(options.ranks)} ranks (1 thread each), "
        f"then {list(options.replicas)} replicas" + (" (quick: not saved)" if args.quick else "") + "...",
        file=sys.stderr,
        flush=True,
    )
    try:
        figures = bench_parallel(options)
    except (RankError, WorkerError, ValueError) as e:
        raise CliError(f"bench parallel: {e}") from None
    args.no_save = args.no_save or args.quick  # a quick run's figures are a test, not a result
    return report_figures(args, "bench_parallel", figures, format_parallel(figures))


def add_bench_parallel(kinds) -> None:
    p = kinds.add_parser("parallel", help="tensor, pipeline and data parallelism: times, tokens, bytes vs formulas")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"the model every rank shards (default: {DEFAULT_MODEL})")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="rank counts (default: 1 2 4)")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2], help="replica counts (default: 1 2)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens of the prefill (default: 128)")
    p.add_argument("--decode-tokens", type=int, default=None, help="timed decode steps per round (default: 32)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds after a warm-up (default: 5)")
    p.add_argument("--quick", action="store_true", help="a run of seconds (few steps, one round; never saved)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    p.add_argument(
        "--no-save", action="store_true", help="do not save them to minillm/results/<hardware>/bench_parallel.json"
    )
    p.set_defaults(handler=cmd_bench_parallel)


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
            slo=SLO(ttft=args.slo_ttft, tpot=args.slo_tpot),
            compile=not args.no_compile,
            http=not args.no_http,
            device=parse_device(args.device),
            progress=not args.no_progress,
        )
    print(
        f"chapter 16's table: the ladder on a random {options.shape.name}, quality, decoding and serving on "
        f"{options.model} ({_where(options.device)}); the first run compiles for minutes...",
        file=sys.stderr,
        flush=True,
    )
    try:
        figures = bench_capstone(options)
    except (RuntimeError, ValueError) as e:
        raise CliError(f"bench capstone: {e}") from None
    return report_figures(args, "bench_capstone", figures, format_capstone(figures))


def add_bench_capstone(kinds) -> None:
    p = kinds.add_parser("capstone", help="chapter 16: every technique stacked, one row each, one table")
    p.add_argument("--shape", default="SmolLM2-135M", help="random model of the speed rows (default: SmolLM2-135M)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"trained model: quality, serving (default: {DEFAULT_MODEL})")
    p.add_argument("--draft", default="minillm-draft", help="draft of speculative decoding (default: minillm-draft)")
    p.add_argument("--prompt-len", type=int, default=48, help="prompt tokens (default: 48)")
    p.add_argument("--new-tokens", type=int, default=24, help="tokens generated per run (default: 24)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each, taking turns (default: 3)")
    p.add_argument("--requests", type=int, default=16, help="requests of the serving workload (default: 16)")
    p.add_argument("--rate", type=float, default=4.0, help="their Poisson arrivals/s (default: 4)")
    p.add_argument("--slo-ttft", type=float, default=0.5, help="SLO on TTFT, seconds (default: 0.5)")
    p.add_argument("--slo-tpot", type=float, default=0.05, help="SLO on TPOT, seconds (default: 0.05)")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled rows (no compile time)")
    p.add_argument("--no-http", action="store_true", help="skip the served-over-HTTP row (no server process)")
    p.add_argument("--device", default=None, help="cpu, cuda or mps (default: the best available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    p.add_argument(
        "--no-save", action="store_true", help="do not save them to minillm/results/<hardware>/bench_capstone.json"
    )
    p.set_defaults(handler=cmd_bench_capstone)
