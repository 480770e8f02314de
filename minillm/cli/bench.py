"""``python -m minillm bench BENCHMARK``: the command line of the benchmarks. Each command builds
the benchmark's options, runs it, and ends in ``common.report_figures``: its tables printed, its
figures written to ``--json`` if asked and saved as ``bench_<name>`` under $MINILLM_RESULTS or
./minillm-results (never into the package) unless ``--no-save``. Every benchmark takes
``--threads``, ``--json`` and ``--no-save`` (``common.add_benchmark``); those that start
processes are in ``bench_processes``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ..core.checkpoints import load
from . import common
from .bench_processes import add_process_benchmarks
from .common import DTYPES, CliError, bad_input, parse_device, where
from .figures import report_figures, run_benchmark


def add_bench(commands) -> None:
    bench_parser = commands.add_parser("bench", help="measure: generation speed, KV-cache techniques, ...")
    kinds = bench_parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", title="benchmarks", required=True)
    for add in (add_generate, add_kv, add_decoding, add_batching, add_prefix_cache, add_compression):
        add(kinds)
    add_process_benchmarks(kinds)


# ---------------------------------------------------------------------------------------------
# One process: generation, KV cache, decoding, batching, compression


def cmd_bench_generate(args: argparse.Namespace) -> int:
    from ..bench import generation as bench

    with bad_input():
        o = bench.GenerationBench(
            args.model, args.prompt_len, args.prompt_lens, args.new_tokens, args.repeats, parse_device(args.device)
        )
    peers = peers_options(args, o.device, ("fp32",), model=o.model, prompt_len=o.prompt_len, compile=args.compile)
    progress = not args.no_progress
    vs_transformers = None
    print(f"minillm vs transformers on {o.model} ({where(o.device)})...", file=sys.stderr, flush=True)
    try:
        with bad_input():
            vs_transformers = bench.bench_vs_transformers(
                o.model, o.prompt_len, o.new_tokens, o.repeats, o.device, progress=progress, compile=args.compile
            )
        print(bench.format_vs_transformers(vs_transformers), end="\n\n", flush=True)
    except ImportError as e:
        print(f"skipped the comparison with transformers: {e}", file=sys.stderr, flush=True)
    print(f"KV cache vs recompute at prompts {list(o.prompt_lens)}...", file=sys.stderr, flush=True)
    with bad_input():
        cache = bench.bench_cache_vs_recompute(
            o.model, o.prompt_lens, o.new_tokens, o.repeats, o.device, progress=progress
        )
    figures = {"vs_transformers": vs_transformers, "cache_vs_recompute": cache}
    text = bench.format_cache_vs_recompute(cache)
    if peers is not None:
        figures["peers"] = run_peers(peers)
        text += "\n\n" + format_peers(figures["peers"])
    return report_figures(args, figures, text, device=o.device)


def peers_options(args: argparse.Namespace, device, formats: tuple[str, ...], **weights):
    """``--peers``: the options of ``bench peers``' rows of ``formats`` (``weights``: ``model=``
    or ``shape=``, and what else differs from its defaults), checked before the benchmark's own
    measuring starts; None without ``--peers``. The peers run on the CPU only."""
    if not args.peers:
        return None
    if torch.device(device).type != "cpu":
        raise CliError(f"--peers measures on the CPU (llama.cpp's CPU build), not {device}: pass --device cpu")
    from ..bench.peers import PeersBench

    with bad_input():
        return PeersBench(
            **{"model": None, **weights},
            formats=formats,
            new_tokens=args.new_tokens,
            rounds=args.repeats,
            threads=torch.get_num_threads(),
            progress=not args.no_progress,
        )


def run_peers(options) -> dict:
    """bench peers' rows: llama.cpp and torchao where installed, a row saying how to install them
    where not, each contender a process of its own. A failure is one line in the figures (the
    benchmark's own figures are still reported and saved)."""
    from ..bench.peers import bench_peers

    what = ", ".join(options.formats)
    print(f"beside llama.cpp and torchao ({what}), each in a process...", file=sys.stderr, flush=True)
    try:
        return bench_peers(options)
    except RuntimeError as e:
        print(f"the peers' rows failed: {e}", file=sys.stderr, flush=True)
        return {"error": str(e)}


def format_peers(result: dict) -> str:
    from ..bench.peers import format_peers as format_

    return f"the peers' rows failed: {result['error']}" if "error" in result else format_(result)


def add_generate(kinds) -> None:
    p = common.add_benchmark(
        kinds,
        "generate",
        "generation speed: minillm vs transformers, KV cache vs recompute",
        cmd_bench_generate,
        common.model_option("the model measured"),
        common.repeats_option(5),
        common.new_tokens_option(128),
        common.prompt_len_option(64),
        common.device_option(),
        common.compile_option("minillm and transformers"),
        common.progress_option(),
        common.peers_option("fp32 on the same weights"),
    )
    p.add_argument(
        "--prompt-lens",
        type=int,
        nargs="+",
        default=[64, 256, 512],
        help="prompt lengths of cache vs recompute; --prompt-len is minillm vs transformers' (default: 64 256 512)",
    )


def cmd_bench_kv(args: argparse.Namespace) -> int:
    from ..bench.kv import KVBench, bench_kv, format_kv_bench, mha_shape

    with bad_input():
        dtype = DTYPES[args.dtype] if args.dtype else None
        device = parse_device(args.device)
        progress = not args.no_progress
        options = KVBench(tuple(args.contexts), args.batch, args.new_tokens, args.repeats, device, dtype, progress)
        config = mha_shape(args.shape)
    what = f"KV-cache techniques on a random {args.shape} (as MHA), contexts {args.contexts} ({where(device)})..."
    return run_benchmark(args, what, lambda: bench_kv(config, options), format_kv_bench)


def add_kv(kinds) -> None:
    p = common.add_benchmark(
        kinds,
        "kv",
        "KV-cache techniques: bytes and decode tokens/s at several contexts",
        cmd_bench_kv,
        common.shape_option("the shape timed, made MHA", "SmolLM2-135M"),
        common.repeats_option(3),
        common.new_tokens_option(16),
        common.dtype_option("bfloat16 on CUDA, else float32"),
        common.device_option(),
        common.progress_option(),
    )
    help_ = "tokens in the cache when decoding is timed (default: 256 1024 4096)"
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096], help=help_)
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default: 1)")


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
            not args.no_progress,
            args.compile,
        )
    what = f"greedy, speculative, prompt lookup, lookahead and Medusa decoding of {args.target} ({where(device)})..."
    return run_benchmark(args, what, lambda: bench_decoding(options), format_decoding)


def add_decoding(kinds) -> None:
    p = common.add_benchmark(
        kinds,
        "decoding",
        "speculative, prompt lookup, lookahead, Medusa vs plain greedy decoding",
        cmd_bench_decoding,
        common.model_option("the model every method decodes with", flag="--target"),
        common.model_option("the draft model of speculative decoding", "minillm-draft", "--draft"),
        common.repeats_option(3),
        common.new_tokens_option(128),
        common.prompt_len_option(64),
        common.device_option(),
        common.compile_option("every method"),
        common.progress_option(),
    )
    p.add_argument("--k", type=int, default=4, help="draft tokens per round (default: 4)")
    p.add_argument("--prompts", type=int, default=4, help="corpus prompts, one run each (default: 4)")


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
    what = f"static vs continuous batching, KV waste, prefix cache on {args.model} ({where(device)})..."
    return run_benchmark(args, what, lambda: bench_batching(model, options), format_batching)


def add_batching(kinds) -> None:
    p = common.add_benchmark(
        kinds,
        "batching",
        "static vs continuous batching, paged KV waste, prefix-cache TTFT",
        cmd_bench_batching,
        common.model_option("the model"),
        common.workload_options(128, 1000.0),
        common.max_batch_option(),
        common.lengths_options(64, 64),
        common.repeats_option(3),
        common.device_option(),
        common.progress_option(),
    )
    p.add_argument("--prefix-requests", type=int, default=8, help="requests sharing a system prompt (default: 8)")
    p.add_argument("--system-len", type=int, default=512, help="system prompt tokens (default: 512)")


def cmd_bench_prefix_cache(args: argparse.Namespace) -> int:
    from ..bench.prefix_cache import PrefixCacheBench, bench_prefix_caches, format_prefix_caches

    with bad_input():
        options = PrefixCacheBench(block_size=args.block_size, num_blocks=args.num_blocks, repeats=args.repeats)
    device = parse_device(args.device)
    with bad_input():
        model, _ = load(args.model, device=device)
    what = f"hash chain vs radix tree prefix caches on {args.model} ({where(device)})..."
    return run_benchmark(args, what, lambda: bench_prefix_caches(model, options), format_prefix_caches)


def add_prefix_cache(kinds) -> None:
    p = common.add_benchmark(
        kinds,
        "prefix-cache",
        "prefix caches, hash chain vs radix tree: hits, TTFT, peak KV on multi-turn, few-shot, branching",
        cmd_bench_prefix_cache,
        common.model_option("the model"),
        common.repeats_option(5),
        common.device_option(),
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    p.add_argument("--num-blocks", type=int, default=512, help="KV pool per engine, in blocks (default: 512)")


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
    what = f"compression: speed on a random {o.shape.name}, quality on {o.model} ({where(o.device)})..."
    # the int8 and int4 rows of a random model of the same shape, decoded after a prompt as long
    # as the context here, each engine's fastest path (compiled)
    peers = peers_options(args, o.device, ("int8", "int4"), shape=o.shape.name, prompt_len=o.context)
    if peers is None:
        return run_benchmark(args, what, lambda: bench_compression(o), format_compression)

    def with_peers() -> dict:
        return {**bench_compression(o), "peers": run_peers(peers)}

    return run_benchmark(args, what, with_peers, lambda r: format_compression(r) + "\n\n" + format_peers(r["peers"]))


def add_compression(kinds) -> None:
    p = common.add_benchmark(
        kinds,
        "compression",
        "quantization and pruning: bytes, decode tokens/s, quality",
        cmd_bench_compression,
        common.shape_option("the shape timed", "SmolLM2-360M"),
        common.model_option("the trained model of the quality table"),
        common.repeats_option(3),
        common.new_tokens_option(8),
        common.device_option(),
        common.progress_option(),
        common.peers_option("int8 and int4 on a random model of the same shape"),
    )
    p.add_argument(
        "--techniques",
        nargs="+",
        default=None,
        metavar="NAME",
        help="a subset of the techniques, by the names the table prints (default: all)",
    )
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="decode batch sizes (default: 1 16)")
    p.add_argument("--context", type=int, default=128, help="tokens in the cache while decoding (default: 128)")
    p.add_argument("--no-speed", action="store_true", help="skip the timed tables")
    p.add_argument("--no-quality", action="store_true", help="skip the quality table")
