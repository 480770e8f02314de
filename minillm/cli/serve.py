"""``python -m minillm serve``: the continuous-batching engine behind an OpenAI-compatible HTTP
server (``serving.http``); the web framework is imported only when the server starts.
"""

from __future__ import annotations

import argparse
import os

from .common import (
    DTYPES,
    CliError,
    bad_input,
    device_option,
    dtype_option,
    max_batch_option,
    model_option,
    parse_device,
    quantize_options,
    threads_option,
)


def cmd_serve(args: argparse.Namespace) -> int:
    from ..serving import http  # the web framework itself is imported only by run_server

    with bad_input():  # fail before loading
        options = http.ServerOptions(
            model=args.model,
            host=args.host,
            port=args.port,
            api_key=args.api_key or os.environ.get(http.API_KEY_VARIABLE) or None,
            max_batch=args.max_batch,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            device=parse_device(args.device),
            dtype=DTYPES[args.dtype] if args.dtype else None,
            shutdown_timeout=args.shutdown_timeout,
            **({} if args.max_body_bytes is None else {"max_body_bytes": args.max_body_bytes}),
            served_model_name=args.served_model_name,
            log_level=args.log_level,
            quantize=args.quantize,
            group_size=args.group_size,
            compile=args.compile,
            tensor_parallel=args.tensor_parallel,
            speculative_model=args.speculative_model,
            num_speculative_tokens=args.num_speculative_tokens,
            prompt_lookup=args.prompt_lookup,
            max_model_len=args.max_model_len,
            prefix_cache=args.prefix_cache,
        )
    try:
        http.require_serve_extra()
    except ImportError as e:
        raise CliError(str(e)) from None
    with bad_input():
        return http.run_server(options)


def add_serve(commands) -> None:
    p = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (completions, chat, /metrics)",
        parents=[
            model_option("the model served"),
            device_option(),
            dtype_option("as generate"),
            quantize_options(),
            max_batch_option(),
            threads_option(),
        ],
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every /v1 request (default: $MINILLM_API_KEY, "
        "which, unlike the command line, ps does not show)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients send as 'model' and /v1/models lists (default: --model as given)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="info (default): a line per request (id, status, tokens, TTFT, total, finish); warning: problems only",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="largest request body accepted; a larger one is a 413 (default: 4 MiB)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="decode steps through torch.compile, batches padded to size buckets (compiled before serving)",
    )
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help="shard the model over N rank processes; this one schedules, every rank runs each step (default: 1)",
    )
    p.add_argument(
        "--speculative-model",
        default=None,
        metavar="MODEL",
        help="speculative decoding with this draft model (it must share the model's tokenizer)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        metavar="K",
        help="proposals of the draft model per step (default: 4)",
    )
    p.add_argument(
        "--prompt-lookup",
        type=int,
        default=None,
        metavar="K",
        help="speculative decoding by prompt lookup: up to K tokens copied from the text so far",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + output tokens per request at most (default: the model's context)",
    )
    p.add_argument(
        "--prefix-cache",
        choices=("hash", "radix"),
        default="hash",
        help="prefix cache: hash (whole blocks, default) or radix (a token radix tree, to the token)",
    )
    p.add_argument("--num-blocks", type=int, default=256, help="KV pool size in blocks (default: 256)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="on SIGINT/SIGTERM, seconds requests in flight may take to finish before they are aborted (default: 5)",
    )
    p.set_defaults(handler=cmd_serve)
