"""The command line: ``python -m minillm COMMAND`` (or ``minillm COMMAND`` once installed).

    python -m minillm generate --prompt "def fibonacci(n):" --max-new-tokens 64
    python -m minillm generate --prompt "def fibonacci(n):" --tensor-parallel 2   # 2 ranks, same text
    torchrun --nproc-per-node 2 -m minillm generate --prompt "def fibonacci(n):" --tensor-parallel 2
    python -m minillm serve --model minillm-target --port 8000
    python -m minillm bench generate   # saved to ./minillm-results/<hardware>/bench_generate.json
    python -m minillm bench kv --no-save --json kv.json
    python -m minillm models
    python -m minillm export gguf minillm-target target.gguf --type q8_0   # for llama.cpp

The commands live beside this module: ``generate``, ``serve``, ``bench`` (and ``bench_processes``),
``train``, ``export``; ``common`` holds what they share (errors, devices, the options several
take, the end of every benchmark). Each handler imports what it runs when it runs.

Bad input (an invalid sampling parameter, an unknown model, a prompt longer than the context)
prints one line to stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from ..core.checkpoints import BUNDLED_DIR, bundled_models
from ..core.config import PRESETS, ModelConfig
from ..core.device import set_threads
from ..core.hf_config import config_from_hf
from ..training.corpus import DATA_DIR, build_corpus
from .bench import add_bench
from .common import ArgumentParser, CliError, bad_input
from .export import add_export
from .generate import add_generate
from .serve import add_serve
from .train import add_train


def human_count(n: int) -> str:
    """A parameter count as 8.03B, 135.0M or 12.3K."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}" if suffix == "B" else f"{n / scale:.1f}{suffix}"
    return str(n)


# ---------------------------------------------------------------------------------------------
# models, corpus


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
    add_export(commands)
    return parser


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
