"""``python -m minillm export gguf MODEL OUT.gguf [--type f32|f16|q8_0|q4_0]``: a bundled model, a
checkpoint directory or a saved quantized one, written as a GGUF file that llama.cpp runs
(``minillm.export.gguf``; needs ``pip install gguf``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import bad_input

GGUF_TYPES = ("f32", "f16", "q8_0", "q4_0")  # export.gguf.FILE_TYPES, named here: the parser imports no export


def cmd_export_gguf(args: argparse.Namespace) -> int:
    from ..export.gguf import export_checkpoint

    with bad_input():
        result = export_checkpoint(args.model, args.out, args.type)
    print(result.summary())
    return 0


def add_export(commands) -> None:
    export = commands.add_parser("export", help="write a model in another runtime's format (GGUF for llama.cpp)")
    formats = export.add_subparsers(dest="format", metavar="FORMAT", title="formats", required=True)
    gguf = formats.add_parser("gguf", help="a GGUF file llama.cpp loads (architecture llama; needs pip install gguf)")
    gguf.add_argument("model", help="a bundled model's name or a checkpoint directory (also one saved quantized)")
    gguf.add_argument("out", type=Path, help="the .gguf file to write")
    type_help = (
        "weights as f32, f16, q8_0 (blocks of 32 int8 with an fp16 scale) or q4_0 (blocks of 32 4-bit codes "
        "with an fp16 scale; the output matrix q8_0); norms stay f32 (default: f32)"
    )
    gguf.add_argument("--type", choices=GGUF_TYPES, default="f32", help=type_help)
    gguf.set_defaults(handler=cmd_export_gguf)
