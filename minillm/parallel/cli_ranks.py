"""``python -m minillm generate`` on N ranks: what each rank of ``--tensor-parallel N`` and
``--pipeline-parallel N`` runs, and the printing that the single-process command shares with them.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) leaves ``generate`` unchanged: every rank
loads only its own rows and columns of each matrix (``load_tensor_parallel``), runs the same
loop, and after each layer's all-reduce holds the same logits as every other rank. So with the
same seed every rank samples the same token, and rank 0 alone can stream the text with exactly
the code the single process uses (``stream_generate``): a spawned rank writes to the terminal's
own stdout.

Pipeline parallelism (GPipe, Huang et al. 2019) produces the tokens on the last stage, all at
the end: ``pipeline_text`` turns them into the same text the single process prints, cut after
the first EOS as ``generate`` stops there. Its timing comes from the last stage's recorded
intervals: TTFT is the end of its prefill, each later token the gap between two decode steps.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from ..core.checkpoints import read_config, resolve
from ..core.generate import GenerationResult, check_max_new_tokens, generate, resolve_eos
from ..core.model import Transformer
from ..core.sampling import SamplingParams
from ..core.tokenizer import StreamDecoder, Tokenizer
from .comm import Comm
from .launch import rank_device
from .pipeline import DTYPES, StageResult
from .tensor import load_tensor_parallel

# ---------------------------------------------------------------------------------------------
# The printing, shared by the single process and rank 0


def stream_generate(
    model: Transformer,
    tokenizer: Tokenizer,
    prompt: str,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingParams,
    show: bool = True,
    compile: bool = False,
) -> GenerationResult:
    """``generate``, printing the prompt and then each new piece of text as it comes (when ``show``),
    then a newline."""
    stream = StreamDecoder(tokenizer)

    def print_piece(token: torch.Tensor) -> None:
        if not stream.ids:  # the prompt went through: echo it before the first new text
            print(prompt, end="")
        print(stream.push(int(token[0])), end="", flush=True)

    result = generate(
        model,
        prompt_ids,
        max_new_tokens,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        seed=sampling.seed,
        on_token=print_piece if show else None,
        compile=compile,
    )
    if show:
        print(stream.flush(), flush=True)
    return result


def print_tokens(tokenizer: Tokenizer, prompt: str, tokens: list[int]) -> None:
    """What ``stream_generate`` prints, for tokens that all arrive at once (the same pieces, joined)."""
    stream = StreamDecoder(tokenizer)
    pieces = [stream.push(t) for t in tokens]
    print(prompt + "".join(pieces) + stream.flush(), flush=True)


def timing_line(
    result: GenerationResult, name: str, device: torch.device, dtype: torch.dtype, threads: int, parallel: str = ""
) -> str:
    """TTFT, TPOT and decode tokens/s of one generation, with what it ran on (and on how many ranks)."""
    n = result.lengths[0]
    tpot = f"{1e3 * result.tpot:.1f} ms" if n > 1 else "n/a"
    rate = f"{result.decode_tokens_per_s:.1f} tokens/s" if n > 1 else "n/a tokens/s"
    where = f"{name}, {torch.device(device).type}, {str(dtype).removeprefix('torch.')}"
    if torch.device(device).type == "cpu":
        where += f", {threads} thread{'s' if threads != 1 else ''}" + (" per rank" if parallel else "")
    if parallel:
        where += f", {parallel}"
    return f"TTFT {1e3 * result.ttft:.1f} ms | TPOT {tpot} | {rate} (decode) | {n} new tokens ({where})"


def model_timing_line(result: GenerationResult, model: Transformer, parallel: str = "") -> str:
    return timing_line(result, model.config.name, model.device, model.dtype, torch.get_num_threads(), parallel)


# ---------------------------------------------------------------------------------------------
# What the ranks run


@dataclass(frozen=True)
class GenerateRequest:
    """One generate command, as every rank receives it: the checkpoint directory, the prompt (text
    and ids, encoded once by the launcher), and the options."""

    model_dir: str
    prompt: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    dtype: str = "float32"
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not isinstance(self.model_dir, str):
            raise ValueError(f"GenerateRequest.model_dir must be a directory path, got {self.model_dir!r}")
        if not self.prompt_ids:
            raise ValueError("GenerateRequest.prompt_ids must not be empty")
        check_max_new_tokens(self.max_new_tokens)
        if self.dtype not in DTYPES:
            raise ValueError(f"GenerateRequest.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")


def tensor_parallel_generate(rank: int, world: int, request: GenerateRequest) -> list[int]:
    """Rank function: load this rank's shards, run ``generate``; rank 0 streams the text and
    prints the timing line. Returns the new tokens (the same on every rank)."""
    comm = Comm()
    device = rank_device(request.device, rank)
    model = load_tensor_parallel(request.model_dir, comm, device=device, dtype=DTYPES[request.dtype])
    tokenizer = Tokenizer.from_dir(request.model_dir) if rank == 0 else None
    result = stream_generate(
        model,
        tokenizer,
        request.prompt,
        list(request.prompt_ids),
        request.max_new_tokens,
        request.sampling,
        show=rank == 0,
    )
    if rank == 0:
        print(model_timing_line(result, model, f"tensor-parallel {world} ranks"), flush=True)
    sys.stdout.flush()
    return result.token_lists()[0]


def until_eos(tokens: list[int], model_dir: str) -> list[int]:
    """The tokens ``generate`` would have made: up to and including the first EOS."""
    config, _ = read_config(resolve(model_dir))
    eos = set(resolve_eos("config", config))
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def pipeline_result(last: StageResult, tokens: list[int], prompt_len: int) -> GenerationResult:
    """A ``GenerationResult`` from the last stage's intervals (seconds from the start barrier):
    TTFT = the end of its prefill; the n-th token's time = the end of decode step n minus the end
    of step n - 1 (the whole flush through every stage, and the token's trip back)."""
    ends: dict[int, float] = {}
    for iv in last.timeline:
        ends[iv.step] = max(ends.get(iv.step, 0.0), iv.end)
    steps = [ends[s] for s in sorted(ends)][: len(tokens)]
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    return GenerationResult(
        tokens=torch.tensor([tokens]),
        lengths=[len(tokens)],
        prompt_lengths=[prompt_len],
        ttft=steps[0],
        token_times=gaps,
        total_time=steps[-1],
    )


def rank_threads(threads: int | None, world: int) -> int:
    """PyTorch threads per rank: ``threads`` when given, else MINILLM_THREADS, else the cores shared out."""
    if threads is not None:
        return threads
    env = os.environ.get("MINILLM_THREADS")
    if env and env.isdigit() and int(env) >= 1:
        return int(env)
    return max(1, (os.cpu_count() or 1) // world)
