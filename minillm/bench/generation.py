"""Generation benchmarks that return their figures: minillm against Hugging Face transformers on
the same weights, and the KV cache against recomputing the whole sequence at every step.

Both are batch 1, greedy, with a prompt of real text (the start of the corpus' validation split),
and never stop at an end-of-text token, so every run makes exactly ``new_tokens`` tokens. The
contenders run interleaved, after one warmup run each, so that drift (thermal throttling, a
background job) hits both alike; figures are medians over the repeats. Every result names the
hardware, dtype and model it came from.

    from minillm.bench.generation import bench_vs_transformers, format_vs_transformers
    print(format_vs_transformers(bench_vs_transformers("minillm-target")))
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..core.checkpoints import load, resolve
from ..core.generate import generate
from ..core.hf_config import config_from_hf, read_json
from ..core.model import Transformer
from ..core.tokenizer import Tokenizer
from ..measure.report import finish_provenance, format_table, provenance
from ..measure.timing import interleaved, repeat, timed
from ..training.corpus import corpus_prompt
from .hf import Run, hf_call, import_transformers

PROMPT_SEED = 0  # for the random prompt of a checkpoint that has no tokenizer


# ---------------------------------------------------------------------------------------------
# Where the figures come from


def _provenance(directory: Path, device: str, dtype: torch.dtype, repeats: int, new_tokens: int) -> dict:
    return provenance(
        device,
        model=directory.name,
        dtype=dtype,
        checkpoint=str(directory),
        batch_size=1,
        repeats=repeats,
        new_tokens=new_tokens,
    )


@dataclass
class GenerationBench:
    """The options of ``python -m minillm bench generate``, checked before minutes of measuring:
    the counts, and that every prompt length plus ``new_tokens`` fits the model's context."""

    model: str = "minillm-target"
    prompt_len: int = 64  # the prompt of minillm vs transformers
    prompt_lens: Sequence[int] = (64, 256, 512)  # the prompts of cache vs recompute
    new_tokens: int = 128
    repeats: int = 5
    device: str = "cpu"

    def __post_init__(self) -> None:
        _check_counts(self.repeats, self.new_tokens)
        self.prompt_lens = tuple(self.prompt_lens)
        lengths = [self.prompt_len, *self.prompt_lens]
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
            raise ValueError(f"prompt lengths must be positive integers, got {lengths}")
        context = config_from_hf(read_json(resolve(self.model) / "config.json")).max_seq_len
        too_long = sorted({n for n in lengths if n + self.new_tokens > context})
        if too_long:
            raise ValueError(
                f"prompt lengths {too_long} + new_tokens {self.new_tokens} exceed the context length "
                f"{context} of {self.model}"
            )


def _check_counts(repeats: int, new_tokens: int) -> None:
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    if not isinstance(new_tokens, int) or new_tokens < 2:
        raise ValueError(f"new_tokens must be an integer >= 2 (decode speed needs a second token), got {new_tokens!r}")


# ---------------------------------------------------------------------------------------------
# Prompts and timing


def make_prompt(model: Transformer, tokenizer: Tokenizer | None, length: int) -> tuple[list[int], str]:
    """A prompt of exactly ``length`` ids and where it came from (corpus text, or random ids when
    the checkpoint has no tokenizer)."""
    if length < 1:
        raise ValueError(f"prompt length must be positive, got {length}")
    if tokenizer is None:
        gen = torch.Generator().manual_seed(PROMPT_SEED)
        ids = torch.randint(0, model.config.vocab_size, (length,), generator=gen).tolist()
        return ids, "random ids (the checkpoint has no tokenizer.json)"
    ids = corpus_prompt(tokenizer, length)
    if max(ids) >= model.config.vocab_size:
        raise ValueError(
            f"the tokenizer makes id {max(ids)}, outside the model's vocabulary of {model.config.vocab_size}"
        )
    return ids, "corpus text (validation split)"


def minillm_call(
    model: Transformer, prompt: list[int], new_tokens: int, use_cache: bool = True, compile: bool = False
) -> Callable[[], Run]:
    """A function that runs one greedy minillm generation of exactly ``new_tokens`` tokens."""

    def run() -> Run:
        result = generate(model, prompt, new_tokens, eos_token_id=None, use_cache=use_cache, compile=compile)
        return Run(float("nan"), result.ttft, result.decode_tokens_per_s, result.tokens[0].tolist())

    return run


def interleaved_runs(
    contenders: Mapping[str, Callable[[], Run]], repeats: int, device, progress: str | None = None
) -> dict[str, list[Run]]:
    """The contenders through the timing harness (a warm-up round, then ``repeats`` rounds taking
    turns), each run with the wall seconds the harness measured around it."""
    timings = interleaved(contenders, repeats, device, progress=progress)
    return {name: [replace(run, seconds=s) for s, run in zip(t.seconds, t.values)] for name, t in timings.items()}


def summarize(runs: Sequence[Run], new_tokens: int) -> dict[str, float]:
    """Medians over runs: wall seconds, end-to-end tokens/s, decode-only tokens/s, TTFT (ms)."""
    seconds = statistics.median(r.seconds for r in runs)
    return {
        "seconds": seconds,
        "tokens_per_s": new_tokens / seconds,
        "decode_tokens_per_s": statistics.median(r.decode_tokens_per_s for r in runs),
        "ttft_ms": 1e3 * statistics.median(r.ttft for r in runs),
    }


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where two token lists differ (or where one ends); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _all_same(runs: Sequence[Run], reference: Sequence[int]) -> bool:
    return all(first_mismatch(r.tokens, reference) is None for r in runs)


# ---------------------------------------------------------------------------------------------
# minillm vs transformers


def bench_vs_transformers(
    model_name: str = "minillm-target",
    prompt_len: int = 64,
    new_tokens: int = 128,
    repeats: int = 5,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
    compile: bool = False,
) -> dict:
    """minillm.generate (with its KV cache) against transformers' ``generate`` on the same weights.

    Returns end-to-end tokens/s (prompt in, ``new_tokens`` out, wall time), decode-only tokens/s
    and TTFT of each, the speedup ratios, and whether both made the same greedy tokens.
    ``compile``: also both compiled (minillm's ``compile=True``; transformers' static cache and
    compiled forward), with each one's compile time, measured apart on a first call.
    """
    _check_counts(repeats, new_tokens)
    transformers = import_transformers()
    directory = resolve(model_name)
    model, tokenizer = load(directory, device=device, dtype=dtype)
    prompt, source = make_prompt(model, tokenizer, prompt_len)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
    contenders = {
        "minillm": minillm_call(model, prompt, new_tokens),
        "transformers": hf_call(transformers, hf_model, prompt, new_tokens),
    }
    compile_seconds = {}
    if compile:
        hf_compiled = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
        contenders |= {
            "minillm compiled": minillm_call(model, prompt, new_tokens, compile=True),
            "transformers compiled": hf_call(transformers, hf_compiled, prompt, new_tokens, compiled=True),
        }
        for name in ("minillm compiled", "transformers compiled"):  # the first call compiles
            compile_seconds[name], _ = timed(contenders[name], device)
    runs = interleaved_runs(contenders, repeats, device, "minillm vs transformers" if progress else None)
    ours, theirs = summarize(runs["minillm"], new_tokens), summarize(runs["transformers"], new_tokens)
    reference = runs["transformers"][0].tokens
    mismatch = first_mismatch(runs["minillm"][0].tokens, reference)
    compiled = {}
    if compile:
        mine, peer = (summarize(runs[n], new_tokens) for n in ("minillm compiled", "transformers compiled"))
        compiled = {
            "minillm_compiled": mine,
            "transformers_compiled": peer,
            "compile_seconds": compile_seconds,
            "compiled_vs_transformers": mine["decode_tokens_per_s"] / theirs["decode_tokens_per_s"],
            "compiled_vs_transformers_compiled": mine["decode_tokens_per_s"] / peer["decode_tokens_per_s"],
            "compiled_vs_eager": mine["decode_tokens_per_s"] / ours["decode_tokens_per_s"],
            "compiled_same_greedy_tokens": all(
                _all_same(runs[n], reference) for n in ("minillm compiled", "transformers compiled")
            ),
        }
    return finish_provenance(
        {
            "benchmark": "minillm vs transformers, greedy generation",
            **_provenance(directory, device, dtype, repeats, new_tokens),
            "prompt_len": prompt_len,
            "prompt_source": source,
            "transformers_version": transformers.__version__,
            "transformers_class": type(hf_model).__name__,
            "transformers_attention": getattr(hf_model.config, "_attn_implementation", None),
            "minillm": ours,
            "transformers": theirs,
            "speedup": ours["tokens_per_s"] / theirs["tokens_per_s"],
            "decode_speedup": ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"],
            "same_greedy_tokens": mismatch is None and _all_same(runs["minillm"] + runs["transformers"], reference),
            "first_mismatch": mismatch,
            **compiled,
        }
    )


# ---------------------------------------------------------------------------------------------
# KV cache vs recompute


def bench_cache_vs_recompute(
    model_name: str = "minillm-target",
    prompt_lens: Sequence[int] = (64, 256, 512),
    new_tokens: int = 128,
    repeats: int = 5,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
) -> dict:
    """minillm.generate with ``use_cache=True`` against ``use_cache=False`` at each prompt length.

    Returns one row per prompt length: end-to-end and decode-only tokens/s of each path, the
    speedup of the cache, and whether both made the same greedy tokens (they must: the cache
    is lossless).
    """
    _check_counts(repeats, new_tokens)
    directory = resolve(model_name)
    model, tokenizer = load(directory, device=device, dtype=dtype)
    too_long = [p for p in prompt_lens if p + new_tokens > model.config.max_seq_len]
    if too_long:
        raise ValueError(
            f"prompt lengths {too_long} + new_tokens={new_tokens} exceed the context length "
            f"max_seq_len={model.config.max_seq_len} of {directory.name}"
        )
    rows, source = [], ""
    for prompt_len in prompt_lens:
        prompt, source = make_prompt(model, tokenizer, prompt_len)
        contenders = {
            "cache": minillm_call(model, prompt, new_tokens, use_cache=True),
            "recompute": minillm_call(model, prompt, new_tokens, use_cache=False),
        }
        runs = interleaved_runs(contenders, repeats, device, f"prompt {prompt_len}" if progress else None)
        rows.append(_cache_row(prompt_len, runs, new_tokens))
    return finish_provenance(
        {
            "benchmark": "KV cache vs recompute, greedy generation",
            **_provenance(directory, device, dtype, repeats, new_tokens),
            "prompt_source": source,
            "rows": rows,
        }
    )


def _cache_row(prompt_len: int, runs: dict[str, list[Run]], new_tokens: int) -> dict:
    cache, recompute = summarize(runs["cache"], new_tokens), summarize(runs["recompute"], new_tokens)
    return {
        "prompt_len": prompt_len,
        "cache_tokens_per_s": cache["tokens_per_s"],
        "recompute_tokens_per_s": recompute["tokens_per_s"],
        "speedup": cache["tokens_per_s"] / recompute["tokens_per_s"],
        "cache_decode_tokens_per_s": cache["decode_tokens_per_s"],
        "recompute_decode_tokens_per_s": recompute["decode_tokens_per_s"],
        "cache_ttft_ms": cache["ttft_ms"],
        "recompute_ttft_ms": recompute["ttft_ms"],
        "same_greedy_tokens": _all_same(runs["cache"] + runs["recompute"], runs["cache"][0].tokens),
    }


# ---------------------------------------------------------------------------------------------
# Tables


def format_vs_transformers(result: dict) -> str:
    rows = [{"implementation": name, **result[name]} for name in ("minillm", "transformers")]
    names = {"minillm_compiled": "minillm compiled", "transformers_compiled": "transformers compiled"}
    rows += [{"implementation": label, **result[key]} for key, label in names.items() if key in result]
    columns = {
        "implementation": "implementation",
        "tokens_per_s": "tokens/s (end to end)",
        "decode_tokens_per_s": "decode tokens/s",
        "ttft_ms": "TTFT ms",
        "seconds": "seconds",
    }
    parity = "yes" if result["same_greedy_tokens"] else f"NO (first difference at token {result['first_mismatch']})"
    return "\n".join(
        [
            format_table(rows, columns, title=_title(result, f"prompt {result['prompt_len']} tokens, ")),
            f"minillm eager over transformers eager: {result['speedup']:.2f}x end to end, "
            f"{result['decode_speedup']:.2f}x decode only",
            *_compiled_lines(result),
            f"same greedy tokens: {parity}"
            + (
                f" (eager runs); {'yes' if result['compiled_same_greedy_tokens'] else 'NO'} (compiled runs)"
                if "minillm_compiled" in result
                else ""
            ),
            f"transformers {result['transformers_version']} ({result['transformers_class']}, "
            f"attention: {result['transformers_attention']})",
        ]
    )


def _compiled_lines(result: dict) -> list[str]:
    """Decode speed ratios of minillm compiled, and each compile time (paid once, not in the table)."""
    if "minillm_compiled" not in result:
        return []
    paid = ", ".join(f"{name} {s:.0f} s" for name, s in result["compile_seconds"].items())
    return [
        f"minillm compiled, decode: {result['compiled_vs_eager']:.2f}x minillm eager,",
        f"  {result['compiled_vs_transformers']:.2f}x transformers eager, "
        f"{result['compiled_vs_transformers_compiled']:.2f}x transformers compiled",
        f"compile time (first call, not in the table): {paid}".replace(" compiled ", " "),
    ]


def format_cache_vs_recompute(result: dict) -> str:
    columns = {
        "prompt_len": "prompt",
        "cache_tokens_per_s": "cache tok/s",
        "recompute_tokens_per_s": "recompute tok/s",
        "speedup": "speedup",
        "cache_decode_tokens_per_s": "cache decode tok/s",
        "recompute_decode_tokens_per_s": "recompute decode tok/s",
        "same_greedy_tokens": "same tokens",
    }
    return format_table(result["rows"], columns, title=_title(result))


def _title(result: dict, prompt: str = "") -> str:
    """Two lines: what was measured (model, dtype, batch, lengths, repeats), and on what hardware."""
    return (
        f"{result['benchmark']}: {result['model']}, {result['dtype']}, batch {result['batch_size']}, "
        f"{prompt}{result['new_tokens']} new tokens, median of {result['repeats']}\n"
        f"{result['hardware']}"
    )


# ---------------------------------------------------------------------------------------------
# Prefill vs decode (chapter 1)


def prefill_vs_decode(
    model: Transformer, tokenizer: Tokenizer | None, prompt_lens: Sequence[int], new_tokens: int = 32, repeats: int = 3
) -> list[dict]:
    """For each prompt length: the prefill time (TTFT) and the time of one decode step (TPOT),
    medians over ``repeats`` greedy generations with the KV cache."""
    _check_counts(repeats, new_tokens)
    rows = []
    for n in prompt_lens:
        prompt, _ = make_prompt(model, tokenizer, n)
        timing = repeat(lambda p=prompt: generate(model, p, new_tokens, eos_token_id=None), repeats, model.device)
        runs = timing.values
        ttft = statistics.median(r.ttft for r in runs)
        tpot = statistics.median(r.tpot for r in runs)
        rows.append(
            {
                "prompt_tokens": n,
                "prefill_ms": 1e3 * ttft,
                "decode_step_ms": 1e3 * tpot,
                "prefill_tokens_per_s": n / ttft,
                "decode_tokens_per_s": 1 / tpot,
            }
        )
    return rows
