"""``python -m minillm train tokenizer | model | medusa | gqa``: retrain what the package bundles
(the tokenizer, the models, Medusa heads) and uptrain the target into GQA and MQA, whose perplexity
curves are figures like a benchmark's (``--json``, and the results store unless ``--no-save``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from ..core.checkpoints import DEFAULT_MODEL, load
from .common import bad_input, model_option, output_options
from .figures import report_figures


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
    lines = [
        f"{n} K/V heads: perplexity " + " -> ".join(f"{p:.1f} (step {s})" for s, p in c) for n, c in curves.items()
    ]
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
    figures = {**finish_provenance(figures), "curves": {str(n): c for n, c in curves.items()}}
    return report_figures(args, figures, "\n".join(lines))


def cmd_train_medusa(args: argparse.Namespace) -> int:
    from ..decoding.medusa_train import MedusaTrainConfig, train_medusa

    with bad_input():
        config = MedusaTrainConfig(n_heads=args.heads, steps=args.steps, n_sequences=args.sequences)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    with bad_input():
        out = train_medusa(args.model, args.out, config)
    print(f"Medusa heads written to {out}")
    return 0


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
    medusa = what.add_parser(
        "medusa",
        help="Medusa heads on a frozen model, from text it generates (2 threads)",
        parents=[model_option("the frozen base model")],
    )
    medusa.add_argument("--heads", type=int, default=4, help="extra heads (default: 4)")
    medusa.add_argument("--steps", type=int, default=300, help="optimizer steps (default: 300)")
    medusa.add_argument("--sequences", type=int, default=384, help="self-generated training texts (default: 384)")
    medusa.add_argument("--out", type=Path, default=None, help="output directory (default: beside the model)")
    medusa.set_defaults(handler=cmd_train_medusa)
    gqa = what.add_parser(
        "gqa",
        help="uptrain the bundled target converted to GQA and MQA; perplexity curves",
        parents=[output_options("uptrain_gqa")],
    )
    kv_heads_help = "K/V head counts; the model's own is the control (default: 8 2 1)"
    gqa.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2, 1], help=kv_heads_help)
    gqa.add_argument("--steps", type=int, default=200, help="optimizer steps each (default: 200)")
    gqa.add_argument("--eval-every", type=int, default=25, help="steps between evaluations (default: 25)")
    gqa.set_defaults(handler=cmd_train_gqa)
