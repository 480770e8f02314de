"""Part III side by side: speculative, prompt-lookup, lookahead and Medusa decoding against plain
greedy decoding, on one model and the same prompts, in one run.

Every method is greedy here, so every method must produce exactly plain greedy's tokens (the
benchmark checks it). For each method: end-to-end tokens/s and the speedup over plain greedy,
tokens per target forward (1 for plain decoding), the acceptance rate per draft position, the
extra parameters it needs in memory and the extra training it needed. Beside them, what one
forward of T new tokens costs on this machine: these methods trade one-token forwards for fewer,
wider ones, which pays only where a wide forward costs about what a narrow one does. Methods run interleaved,
after a warmup, and the figures are medians over the repeats.

    from minillm.decoding_bench import bench_decoding, format_decoding
    print(format_decoding(bench_decoding()))
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from . import corpus
from .bench import format_table
from .cache import KVCache
from .checkpoints import load, resolve
from .generate import generate
from .hardware import hardware_description, synchronize
from .lookahead import lookahead_generate
from .medusa import CONFIG_FILE, MedusaHeads, medusa_generate
from .model import Transformer
from .speculative import DecodingStats, prompt_lookup_generate, speculative_generate
from .tokenizer import Tokenizer

Method = Callable[[list[int]], tuple[list[int], DecodingStats | None]]


def realistic_prompts(tokenizer: Tokenizer, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of about ``length`` tokens from the validation split, spread over it; none
    ends in a newline (the tokenizer would then split a continuation differently)."""
    text = corpus.load_text("valid")
    prompts = []
    for i in range(n):
        start = i * len(text) // n
        ids = tokenizer.encode(text[start : start + 8 * length])[:length]
        while len(ids) > 1 and tokenizer.decode(ids[-1:]).endswith("\n"):
            ids = ids[:-1]
        prompts.append(ids)
    return prompts


def decoding_methods(target: Transformer, draft: Transformer, heads: MedusaHeads | None, new_tokens: int,
                     k: int) -> dict[str, Method]:  # fmt: skip
    """Each method as a function prompt -> (greedy tokens, statistics)."""

    def of(result) -> tuple[list[int], DecodingStats]:
        return result.tokens[0].tolist(), result.stats

    methods: dict[str, Method] = {
        "greedy": lambda p: (generate(target, p, new_tokens, eos_token_id=None).tokens[0].tolist(), None),
        f"speculative (draft, K={k})": lambda p: of(
            speculative_generate(target, draft, p, new_tokens, k=k, eos_token_id=None)
        ),  # fmt: skip
        "prompt lookup (K=8, n<=3)": lambda p: of(
            prompt_lookup_generate(target, p, new_tokens, k=8, eos_token_id=None)
        ),  # fmt: skip
        "lookahead (W=5, N=4, G=5)": lambda p: of(lookahead_generate(target, p, new_tokens, eos_token_id=None)),
    }
    if heads is not None:
        methods["medusa (greedy, tree 3x2x1)"] = lambda p: of(medusa_generate(target, heads, p, new_tokens,
                                                                                eos_token_id=None))  # fmt: skip
    return methods


def time_methods(methods: dict[str, Method], prompts: list[list[int]], repeats: int, device) -> dict[str, dict]:
    """Per method: seconds per round over all prompts (warmup first, order alternating), tokens
    of the first round, and the statistics summed over the prompts."""
    out = {name: {"seconds": [], "tokens": None, "stats": []} for name in methods}
    for r in range(repeats + 1):
        for name in list(methods) if r % 2 == 0 else list(methods)[::-1]:
            synchronize(device)
            t0 = time.perf_counter()
            runs = [methods[name](p) for p in prompts]
            synchronize(device)
            if r == 0:  # the warmup: keep its tokens and statistics (they do not change)
                out[name]["tokens"] = [tokens for tokens, _ in runs]
                out[name]["stats"] = [stats for _, stats in runs if stats is not None]
            else:
                out[name]["seconds"].append(time.perf_counter() - t0)
    return out


@torch.inference_mode()
def forward_ms(model: Transformer, sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32), prefix: int = 64,
               repeats: int = 20) -> dict[int, float]:  # fmt: skip
    """Median milliseconds of one forward of T new tokens after ``prefix`` cached ones, for each T:
    what verifying T tokens at once costs here, against decoding one (the T = 1 entry)."""
    gen = torch.Generator().manual_seed(0)
    cache = KVCache.for_model(model, 1, prefix + max(sizes))
    model(torch.randint(0, model.config.vocab_size, (1, prefix), generator=gen).to(model.device), cache=cache)
    out = {}
    for T in sizes:
        ids = torch.randint(0, model.config.vocab_size, (1, T), generator=gen).to(model.device)
        model(ids, cache=cache)  # warmup
        cache.truncate(prefix)
        times = []
        for _ in range(repeats):
            synchronize(model.device)
            t0 = time.perf_counter()
            model(ids, cache=cache)
            synchronize(model.device)
            times.append(time.perf_counter() - t0)
            cache.truncate(prefix)
        out[T] = 1e3 * statistics.median(times)
    return out


def merged(stats: list[DecodingStats]) -> DecodingStats | None:
    """Statistics of several generations as one."""
    if not stats:
        return None
    total = DecodingStats(stats[0].k)
    for s in stats:
        total.reached = [a + b for a, b in zip(total.reached, s.reached)]
        total.accepted = [a + b for a, b in zip(total.accepted, s.accepted)]
        total.target_forwards += s.target_forwards
        total.draft_forwards += s.draft_forwards
        total.new_tokens += s.new_tokens
    return total


def extra_costs(target_dir: Path, draft: Transformer, draft_dir: Path, heads: MedusaHeads | None) -> dict[str, dict]:
    """Extra parameters held in memory and extra training, per method family."""
    draft_log = (
        json.loads((draft_dir / "training_log.json").read_text()) if (draft_dir / "training_log.json").is_file() else {}
    )
    medusa = json.loads((target_dir / CONFIG_FILE).read_text()) if heads is not None else {}
    return {
        "greedy": {"extra_params": 0, "extra_training": "none"},
        "speculative": {"extra_params": draft.num_params(),
                        "extra_training": f"a draft model, {draft_log.get('seconds', float('nan')) / 60:.1f} min"},
        "prompt lookup": {"extra_params": 0, "extra_training": "none"},
        "lookahead": {"extra_params": 0, "extra_training": "none"},
        "medusa": {"extra_params": heads.num_params() if heads is not None else 0,
                   "extra_training": f"heads on frozen base, {medusa.get('seconds', float('nan')) / 60:.1f} min"},
    }  # fmt: skip


def bench_decoding(target_name: str = "minillm-target", draft_name: str = "minillm-draft", n_prompts: int = 4,
                   prompt_len: int = 64, new_tokens: int = 128, repeats: int = 3, k: int = 4,
                   device: str = "cpu") -> dict:  # fmt: skip
    """Every Part III method against plain greedy decoding on the same prompts; see the module."""
    if repeats < 1 or new_tokens < 1 or n_prompts < 1:
        raise ValueError(
            f"repeats, new_tokens and n_prompts must be positive, got {repeats}, {new_tokens}, {n_prompts}"
        )
    target_dir, draft_dir = resolve(target_name), resolve(draft_name)
    target, tokenizer = load(target_dir, device=device)
    draft, _ = load(draft_dir, device=device)
    heads = MedusaHeads.load(target_dir, device=device) if (target_dir / CONFIG_FILE).is_file() else None
    prompts = realistic_prompts(tokenizer, n_prompts, prompt_len)
    load_before = os.getloadavg()[0]  # other work on the machine skews timings: say how much there was
    timed = time_methods(decoding_methods(target, draft, heads, new_tokens, k), prompts, repeats, target.device)
    costs, base = extra_costs(target_dir, draft, draft_dir, heads), timed["greedy"]
    costs_ms = {"target": forward_ms(target), "draft": forward_ms(draft)}
    rows = []
    for name, t in timed.items():
        seconds, stats = statistics.median(t["seconds"]), merged(t["stats"])
        rows.append({"method": name, "tokens_per_s": n_prompts * new_tokens / seconds,
                     "speedup": statistics.median(base["seconds"]) / seconds,
                     "tokens_per_target_forward": stats.tokens_per_target_forward if stats else 1.0,
                     "mean_accepted_length": stats.mean_accepted_length if stats else 0.0,
                     "acceptance_rates": [round(a, 4) for a in stats.acceptance_rates] if stats else [],
                     "same_greedy_tokens": t["tokens"] == base["tokens"],
                     **next(v for key, v in costs.items() if name.startswith(key))})  # fmt: skip
    return {"benchmark": "Part III decoding methods vs plain greedy decoding", "target": target_dir.name,
            "draft": draft_dir.name, "hardware": hardware_description(device), "device": str(device),
            "dtype": str(target.dtype).removeprefix("torch."), "batch_size": 1, "n_prompts": n_prompts,
            "prompt_len": prompt_len, "new_tokens": new_tokens, "repeats": repeats,
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "load_average_before": round(load_before, 2), "load_average_after": round(os.getloadavg()[0], 2),
            "prompt_source": "corpus text (validation split)", "rows": rows,
            "forward_ms_by_new_tokens": costs_ms}  # fmt: skip


def format_decoding(result: dict) -> str:
    columns = {"method": "method", "tokens_per_s": "tokens/s", "speedup": "speedup",
               "tokens_per_target_forward": "tokens/forward", "acceptance": "acceptance by position",
               "extra_params": "extra params", "extra_training": "extra training",
               "same_greedy_tokens": "same tokens"}  # fmt: skip
    rows = [{**r, "acceptance": " ".join(f"{a:.2f}" for a in r["acceptance_rates"]) or "-"} for r in result["rows"]]
    title = (f"{result['benchmark']}: {result['target']} (draft {result['draft']}), {result['dtype']}, batch 1, "
             f"{result['n_prompts']} prompts x {result['new_tokens']} new tokens, median of {result['repeats']}\n"
             f"{result['hardware']}")  # fmt: skip
    costs = result.get("forward_ms_by_new_tokens", {})
    lines = [f"one forward of T tokens, {name} (ms): " + ", ".join(f"T={t}: {ms:.2f}" for t, ms in by_t.items())
             for name, by_t in costs.items()]  # fmt: skip
    return "\n".join([format_table(rows, columns, title=title), *lines])
