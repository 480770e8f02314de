"""The command line: ``python -m minillm COMMAND`` (or ``minillm COMMAND`` once installed).

    python -m minillm generate --prompt "def fibonacci(n):" --max-new-tokens 64
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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from .bench import generation as bench
from .bench.generation import format_table
from .core.checkpoints import BUNDLED_DIR, bundled_models, config_from_hf, load, resolve
from .core.config import PRESETS, ModelConfig
from .core.generate import GenerationResult, generate
from .core.model import Transformer
from .core.sampling import SamplingParams
from .core.tokenizer import StreamDecoder
from .training.corpus import DATA_DIR, build_corpus
from .training.train import TOKENIZER_DIR, train_bundled, train_tokenizer

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_MODEL = "minillm-target"


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


def parse_device(name: str | None) -> str | None:
    if name is None:
        return None
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise CliError(f"unknown device {name!r}; use cpu, cuda, cuda:N or mps") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CliError(f"device {name!r} asked for, but CUDA is not available on this machine")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise CliError(f"device {name!r} asked for, but MPS is not available on this machine")
    return str(device)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def human_count(n: int) -> str:
    """A parameter count as 8.03B, 135.0M or 12.3K."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}" if suffix == "B" else f"{n / scale:.1f}{suffix}"
    return str(n)


# ---------------------------------------------------------------------------------------------
# generate


def cmd_generate(args: argparse.Namespace) -> int:
    with bad_input():
        SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)  # fail before loading
    if args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens must be a positive integer, got {args.max_new_tokens}")
    device = parse_device(args.device)
    with bad_input():
        model, tokenizer = load(args.model, device=device, dtype=DTYPES[args.dtype] if args.dtype else None)
    if tokenizer is None:
        raise CliError(f"{args.model} has no tokenizer.json, so text cannot be encoded; pick a model that has one")
    stream = StreamDecoder(tokenizer)

    def print_piece(token: torch.Tensor) -> None:
        if not stream.ids:  # the prompt went through: echo it before the first new text
            print(args.prompt, end="")
        print(stream.push(int(token[0])), end="", flush=True)

    with bad_input():
        result = generate(model, tokenizer.encode(args.prompt), args.max_new_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed, on_token=print_piece)  # fmt: skip
    print(stream.flush())
    print(timing_line(result, model))
    return 0


def timing_line(result: GenerationResult, model: Transformer) -> str:
    """TTFT, TPOT and decode tokens/s of one generation, with what it ran on."""
    n = result.lengths[0]
    tpot = f"{1e3 * result.tpot:.1f} ms" if n > 1 else "n/a"
    rate = f"{result.decode_tokens_per_s:.1f} tokens/s" if n > 1 else "n/a tokens/s"
    where = f"{model.config.name}, {model.device.type}, {str(model.dtype).removeprefix('torch.')}"
    return f"TTFT {1e3 * result.ttft:.1f} ms | TPOT {tpot} | {rate} (decode) | {n} new tokens ({where})"


# ---------------------------------------------------------------------------------------------
# bench


def cmd_bench_generate(args: argparse.Namespace) -> int:
    device = parse_device(args.device) or default_device()
    check_bench_args(args)
    vs_transformers = None
    print(f"minillm vs transformers on {args.model} ({device})...", file=sys.stderr, flush=True)
    try:
        with bad_input():
            vs_transformers = bench.bench_vs_transformers(args.model, args.prompt_len, args.new_tokens,
                                                          args.repeats, device)  # fmt: skip
        print(bench.format_vs_transformers(vs_transformers), end="\n\n", flush=True)
    except ImportError as e:
        print(f"skipped the comparison with transformers: {e}", file=sys.stderr, flush=True)
    print(f"KV cache vs recompute at prompts {args.prompt_lens}...", file=sys.stderr, flush=True)
    with bad_input():
        cache = bench.bench_cache_vs_recompute(args.model, tuple(args.prompt_lens), args.new_tokens,
                                               args.repeats, device)  # fmt: skip
    print(bench.format_cache_vs_recompute(cache), end="\n\n")
    goals = bench.check_goals(vs_transformers, cache)
    print(bench.format_goals(goals))
    if args.json:
        write_json(args.json, {"vs_transformers": vs_transformers, "cache_vs_recompute": cache, "goals": goals})
    return 0


def cmd_bench_kv(args: argparse.Namespace) -> int:
    from .book.notebook import set_threads_from_env
    from .kv.gqa import bench_kv, format_kv_bench

    if args.repeats < 1 or args.new_tokens < 1 or min(args.contexts) < 1:
        raise CliError("--repeats, --new-tokens and --contexts must be positive integers")
    if args.shape not in PRESETS:
        raise CliError(f"unknown shape {args.shape!r}; choose one of {', '.join(PRESETS)}")
    set_threads_from_env()
    device = parse_device(args.device) or default_device()
    print(f"KV-cache techniques on a random {args.shape} (as MHA), contexts {args.contexts} ({device})...",
          file=sys.stderr, flush=True)  # fmt: skip
    result = bench_kv(args.shape, tuple(args.contexts), args.batch, args.new_tokens, args.repeats, device,
                      DTYPES[args.dtype] if args.dtype else None)  # fmt: skip
    print(format_kv_bench(result))
    if args.json:
        write_json(args.json, result)
    return 0


def cmd_bench_decoding(args: argparse.Namespace) -> int:
    from .bench.decoding import bench_decoding, format_decoding

    if min(args.repeats, args.new_tokens, args.prompts, args.prompt_len, args.k) < 1:
        raise CliError("--repeats, --new-tokens, --prompts, --prompt-len and --k must be positive integers")
    device = parse_device(args.device) or default_device()
    print(f"greedy, speculative, prompt lookup, lookahead and Medusa decoding of {args.target} ({device})...",
          file=sys.stderr, flush=True)  # fmt: skip
    with bad_input():
        result = bench_decoding(args.target, args.draft, args.prompts, args.prompt_len, args.new_tokens,
                                args.repeats, args.k, device)  # fmt: skip
    print(format_decoding(result))
    if args.json:
        write_json(args.json, result)
    return 0


def cmd_bench_batching(args: argparse.Namespace) -> int:
    from .bench.batching import bench_batching, check_goals, format_batching

    counts = (args.requests, args.max_batch, args.prefix_requests, args.system_len, args.prompt_median,
              args.output_median, args.repeats)  # fmt: skip
    if min(counts) < 1 or args.rate <= 0:
        raise CliError("--requests, --max-batch, --prefix-requests, --system-len, --prompt-median, --output-median, "
                       "--repeats and --rate must be positive")  # fmt: skip
    device = parse_device(args.device) or default_device()
    with bad_input():
        model, _ = load(args.model, device=device)
    print(f"static vs continuous batching, KV waste, prefix cache on {args.model} ({device})...",
          file=sys.stderr, flush=True)  # fmt: skip
    with bad_input():
        figures = bench_batching(model, args.requests, args.rate, args.max_batch, args.prompt_median,
                                 args.output_median, prefix_requests=args.prefix_requests,
                                 system_len=args.system_len, repeats=args.repeats,
                                 progress=not args.no_progress)  # fmt: skip
    figures["goals"] = check_goals(figures)
    print(format_batching(figures))
    if args.json:
        write_json(args.json, figures)
    return 0


def check_bench_args(args: argparse.Namespace) -> None:
    """Fail in a second, not after minutes of measuring: counts, and prompts that fit the context."""
    if args.repeats < 1:
        raise CliError(f"--repeats must be a positive integer, got {args.repeats}")
    if args.new_tokens < 2:
        raise CliError(f"--new-tokens must be at least 2 (decode speed needs a second token), got {args.new_tokens}")
    prompt_lens = [args.prompt_len, *args.prompt_lens]
    if min(prompt_lens) < 1:
        raise CliError(f"prompt lengths must be positive, got {prompt_lens}")
    with bad_input():
        config_path = resolve(args.model) / "config.json"
        if not config_path.is_file():
            raise CliError(f"no config.json in {config_path.parent}")
        context = config_from_hf(json.loads(config_path.read_text())).max_seq_len
    too_long = sorted({p for p in prompt_lens if p + args.new_tokens > context})
    if too_long:
        raise CliError(f"prompt lengths {too_long} + --new-tokens {args.new_tokens} exceed the context length "
                       f"{context} of {args.model}")  # fmt: skip


def write_json(path: Path, figures: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=1) + "\n")
    print(f"figures written to {path}")


# ---------------------------------------------------------------------------------------------
# models, corpus, train


def cmd_models(args: argparse.Namespace) -> int:
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
    return {"name": config.name, "params": human_count(config.num_params()), "layers": config.n_layers,
            "dim": config.dim, "heads": config.n_heads, "kv heads": config.n_kv_heads,
            "vocab": config.vocab_size, "context": config.max_seq_len}  # fmt: skip


def cmd_corpus(args: argparse.Namespace) -> int:
    manifest = build_corpus()
    for split, info in manifest["splits"].items():
        print(f"{split}: {len(info['documents'])} documents, {info['characters']:,} characters")
    print(f"written to {DATA_DIR} (from Python {manifest['python']})")
    return 0


def cmd_train_tokenizer(args: argparse.Namespace) -> int:
    torch.set_num_threads(os.cpu_count() or 1)
    tokenizer = train_tokenizer()
    print(f"tokenizer of {tokenizer.vocab_size} tokens written to {TOKENIZER_DIR}")
    return 0


def cmd_train_model(args: argparse.Namespace) -> int:
    if args.steps is not None and args.steps < 1:
        raise CliError(f"--steps must be a positive integer, got {args.steps}")
    torch.set_num_threads(os.cpu_count() or 1)
    out = train_bundled(args.size, args.out, args.steps)
    print(f"model written to {out}")
    return 0


def cmd_train_gqa(args: argparse.Namespace) -> int:
    from .core.device import hardware_description
    from .kv.gqa import uptrain_curves
    from .training.train import encode_split

    if args.steps < 1 or args.eval_every < 1:
        raise CliError(f"--steps and --eval-every must be positive integers, got {args.steps} and {args.eval_every}")
    torch.set_num_threads(os.cpu_count() or 1)
    model, tokenizer = load(DEFAULT_MODEL)
    valid = encode_split(tokenizer, "valid")[: 24 * 128 + 1]
    with bad_input():
        curves = uptrain_curves(model, args.kv_heads, args.steps, args.eval_every, valid)
    for n, curve in curves.items():
        print(f"{n} K/V heads: perplexity " + " -> ".join(f"{ppl:.1f} (step {s})" for s, ppl in curve))
    if args.json:
        figures = {
            "model": DEFAULT_MODEL,
            "n_heads": model.config.n_heads,
            "steps": args.steps,
            "batch_size": 8,
            "seq_len": 128,
            "lr": 5e-4,
            "valid_tokens": len(valid) - 1,
            "hardware": hardware_description(),
        }
        write_json(args.json, {**figures, "curves": {str(n): c for n, c in curves.items()}})
    return 0


def cmd_train_medusa(args: argparse.Namespace) -> int:
    from .decoding.medusa import MedusaTrainConfig, train_medusa

    if min(args.steps, args.heads, args.sequences) < 1:
        raise CliError("--steps, --heads and --sequences must be positive integers")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    with bad_input():
        config = MedusaTrainConfig(n_heads=args.heads, steps=args.steps, n_sequences=args.sequences)
        out = train_medusa(args.model, args.out, config)
    print(f"Medusa heads written to {out}")
    return 0


# ---------------------------------------------------------------------------------------------
# The parser


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="minillm", description="minillm: LLM inference optimization from scratch.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands", required=True)
    add_generate(commands)
    add_bench(commands)
    models = commands.add_parser("models", help="list the bundled models and the shape presets, with sizes")
    models.set_defaults(handler=cmd_models)
    corpus = commands.add_parser("corpus", help="rebuild the training corpus from this Python's stdlib")
    corpus.set_defaults(handler=cmd_corpus)
    add_train(commands)
    return parser


def add_generate(commands) -> None:
    p = commands.add_parser("generate", help="generate text from a prompt, streamed, then TTFT, TPOT and tokens/s")
    p.add_argument("--model", default=DEFAULT_MODEL, help="bundled model name, checkpoint directory or hub id "
                   f"(default: {DEFAULT_MODEL})")  # fmt: skip
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="at most this many new tokens (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), 1 = the model's own")
    p.add_argument("--top-k", type=int, default=None, help="sample only from the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample only from the nucleus of probability p")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling, for reproducible output")
    p.add_argument("--device", default=None, help="cpu, cuda or mps (default: the best available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="weights' dtype (default: float32 on a CPU, the checkpoint's own on a GPU)")  # fmt: skip
    p.set_defaults(handler=cmd_generate)


def add_bench(commands) -> None:
    bench_parser = commands.add_parser("bench", help="measure: generation speed, KV-cache techniques, ...")
    kinds = bench_parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", title="benchmarks", required=True)
    p = kinds.add_parser("generate", help="generation speed: minillm vs transformers, KV cache vs recompute")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model to measure (default: {DEFAULT_MODEL})")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each, after a warmup (default: 5)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per run (default: 128)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens, vs transformers (default: 64)")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[64, 256, 512],
                   help="prompt lengths, cache vs recompute (default: 64 256 512)")  # fmt: skip
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    p.set_defaults(handler=cmd_bench_generate)
    p = kinds.add_parser("kv", help="KV-cache techniques: bytes and decode tokens/s at several contexts")
    p.add_argument("--shape", default="SmolLM2-135M", help="preset shape, made MHA (default: SmolLM2-135M)")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096], help="(default: 256 1024 4096)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default: 1)")
    p.add_argument("--new-tokens", type=int, default=16, help="decode steps per timed run (default: 16)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported (default: 3)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on CUDA, else float32")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
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
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    p.set_defaults(handler=cmd_bench_decoding)
    add_bench_batching(kinds)


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
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    p.set_defaults(handler=cmd_bench_batching)


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
    gqa.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2, 1],
                     help="K/V head counts; the model's own is the control (default: 8 2 1)")  # fmt: skip
    gqa.add_argument("--steps", type=int, default=200, help="optimizer steps each (default: 200)")
    gqa.add_argument("--eval-every", type=int, default=25, help="steps between evaluations (default: 25)")
    gqa.add_argument("--json", type=Path, default=None, help="also write the curves to this JSON file")
    gqa.set_defaults(handler=cmd_train_gqa)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m minillm`` and the ``minillm`` script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except CliError as e:
        message = " ".join(str(e).split())  # one line, even when a library's message has several
        print(f"minillm {args.command}: error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
