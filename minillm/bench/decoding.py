"""Part III side by side: speculative, prompt-lookup, lookahead and Medusa decoding against plain
greedy decoding, on one model and the same prompts, in one run.

Every method is greedy here, so every method must produce exactly plain greedy's tokens (the
benchmark checks it). For each method: end-to-end tokens/s and the speedup over plain greedy,
tokens per target forward (1 for plain decoding), the acceptance rate per draft position, the
extra parameters it needs in memory and the extra training it needed. Beside them, what one
forward of T new tokens costs on this machine (``measure_forward_ms``): these methods trade
one-token forwards for fewer, wider ones, which pays only where a wide forward costs about what a
narrow one does. Methods run interleaved through the timing harness, after a warmup, and the
figures are medians over the repeats. ``forward_widths`` records how wide each method's forwards
are (chapter 9). Chapter 7's sweeps are in ``bench.speculative``, chapter 8's copy tasks in
``bench.lookup``.

    from minillm.bench.decoding import DecodingBench, bench_decoding, format_decoding
    print(format_decoding(bench_decoding(DecodingBench(prompts=2))))
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.cache import KVCache
from ..core.checkpoints import load, resolve
from ..core.generate import generate
from ..core.model import Transformer
from ..decoding.common import DecodingResult, DecodingStats, merged, modeled_speedup
from ..decoding.lookahead import lookahead_generate
from ..decoding.medusa import CONFIG_FILE, MedusaHeads, medusa_generate
from ..decoding.prompt_lookup import prompt_lookup_generate
from ..decoding.speculative import speculative_generate
from ..measure.report import finish_provenance, format_table, provenance, wrap_line
from ..measure.timing import interleaved
from ..training.corpus import corpus_prompts

Method = Callable[[list[int]], tuple[list[int], DecodingStats | None]]


@dataclass(frozen=True)
class DecodingBench:
    """What ``bench_decoding`` runs: the models, the prompts and how long, how often, K."""

    target: str = "minillm-target"  # the model every method decodes with
    draft: str = "minillm-draft"  # speculative decoding's draft model
    prompts: int = 4  # corpus prompts (validation split), one run each
    prompt_len: int = 64  # tokens per prompt
    new_tokens: int = 128  # tokens generated per prompt
    repeats: int = 3  # timed rounds after a warmup
    k: int = 4  # speculative decoding's draft tokens per round
    device: str = "cpu"
    progress: bool = False  # a progress bar of the timed rounds (on stderr)
    compile: bool = False  # also every method with compiled forwards (``core.compiled``)

    def __post_init__(self) -> None:
        for name in ("prompts", "prompt_len", "new_tokens", "repeats", "k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                option = "--" + name.replace("_", "-")  # the command line's name for it
                raise ValueError(f"{name} ({option}) must be a positive integer, got {value!r}")
        for name in ("target", "draft", "device"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")


def tokens_and_stats(result: DecodingResult) -> tuple[list[int], DecodingStats, tuple[float, float, float]]:
    """A decoder's tokens, statistics and (seconds, of which inside forwards, compile seconds)."""
    return result.tokens[0].tolist(), result.stats, (result.total_time, result.forward_seconds, result.compile_time)


def greedy_tokens(result) -> tuple[list[int], None, tuple[float, float, float]]:
    """``generate``'s tokens, no statistics, and (seconds, not split, compile seconds)."""
    return result.tokens[0].tolist(), None, (result.total_time, float("nan"), result.compile_time)


COMPILED = " compiled"  # the suffix of a method's compiled twin


def decoding_methods(
    target: Transformer,
    draft: Transformer,
    heads: MedusaHeads | None,
    new_tokens: int,
    k: int,
    compile: bool = False,
) -> dict[str, Method]:
    """Each method as a function prompt -> (greedy tokens, statistics, (seconds, in forwards));
    with ``compile``, each also compiled (its name + " compiled")."""
    methods: dict[str, Method] = {}
    for c in (False, True) if compile else (False,):
        suffix = COMPILED if c else ""
        methods |= {
            "greedy" + suffix: lambda p, c=c: greedy_tokens(
                generate(target, p, new_tokens, eos_token_id=None, compile=c)
            ),
            f"speculative (draft, K={k})" + suffix: lambda p, c=c: tokens_and_stats(
                speculative_generate(target, draft, p, new_tokens, k=k, eos_token_id=None, compile=c)
            ),
            "prompt lookup (K=8, n<=3)" + suffix: lambda p, c=c: tokens_and_stats(
                prompt_lookup_generate(target, p, new_tokens, k=8, eos_token_id=None, compile=c)
            ),
            "lookahead (W=5, N=4, G=5)" + suffix: lambda p, c=c: tokens_and_stats(
                lookahead_generate(target, p, new_tokens, eos_token_id=None, compile=c)
            ),
        }
        if heads is not None:
            methods["medusa (greedy, tree 3x2x1)" + suffix] = lambda p, c=c: tokens_and_stats(
                medusa_generate(target, heads, p, new_tokens, eos_token_id=None, compile=c)
            )
    return methods


def time_methods(
    methods: dict[str, Method], prompts: list[list[int]], repeats: int, device, progress: str | None = None
) -> dict[str, dict]:
    """Per method: seconds per round over all prompts (``timing.interleaved``: a warmup first, order
    alternating), the tokens of each prompt and its statistics (those of the first timed round:
    every round makes the same)."""
    rounds = {name: (lambda method=method: [method(p) for p in prompts]) for name, method in methods.items()}
    timings = interleaved(rounds, repeats, device, progress=progress)
    out = {}
    for name, timing in timings.items():
        runs = timing.values[0]
        out[name] = {
            "seconds": timing.seconds,
            "tokens": [tokens for tokens, _, _ in runs],
            "stats": [stats for _, stats, _ in runs if stats is not None],
            "split": [split for _, _, split in runs],  # (seconds, inside forwards, compiling) per prompt
        }
    return out


@torch.inference_mode()
def measure_forward_ms(
    model: Transformer,
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
    prefix: int = 64,
    repeats: int = 10,
    statistic: str = "fastest",
) -> dict[int, float]:
    """Milliseconds of one forward of T new tokens after ``prefix`` cached ones, for each T: what
    verifying T tokens at once costs here, against decoding one (the T = 1 entry). The widths take
    turns (``timing.interleaved``, a warm-up round first, the cache rolled back after each call);
    each keeps the ``statistic`` of its times: "fastest" (on a shared machine other work only ever
    adds time) or "median". The analytic cost of a forward is ``measure.roofline.forward_cost``."""
    if statistic not in ("fastest", "median"):
        raise ValueError(f"statistic must be 'fastest' or 'median', got {statistic!r}")
    gen = torch.Generator().manual_seed(0)
    cache = KVCache.for_model(model, 1, prefix + max(sizes))
    model(torch.randint(0, model.config.vocab_size, (1, prefix), generator=gen).to(model.device), cache=cache)
    ids = {T: torch.randint(0, model.config.vocab_size, (1, T), generator=gen).to(model.device) for T in sizes}

    def forward(T: int) -> None:
        model(ids[T], cache=cache)

    contenders = {T: (lambda T=T: forward(T)) for T in sizes}
    timings = interleaved(contenders, repeats, model.device, after=lambda _: cache.truncate(prefix))
    return {T: getattr(t, f"{statistic}_ms") for T, t in timings.items()}


def extra_costs(target_dir: Path, draft: Transformer, draft_dir: Path, heads: MedusaHeads | None) -> dict[str, dict]:
    """Extra parameters held in memory and extra training, per method family."""
    log_file = draft_dir / "training_log.json"
    draft_log = json.loads(log_file.read_text()) if log_file.is_file() else {}
    medusa = json.loads((target_dir / CONFIG_FILE).read_text()) if heads is not None else {}
    draft_minutes = draft_log.get("seconds", float("nan")) / 60
    medusa_minutes = medusa.get("seconds", float("nan")) / 60
    none = {"extra_params": 0, "extra_training": "none"}
    return {
        "greedy": none,
        "speculative": {
            "extra_params": draft.num_params(),
            "extra_training": f"a draft model, {draft_minutes:.1f} min",
        },
        "prompt lookup": none,
        "lookahead": none,
        "medusa": {
            "extra_params": heads.num_params() if heads is not None else 0,
            "extra_training": f"heads on frozen base, {medusa_minutes:.1f} min",
        },
    }


def bench_decoding(options: DecodingBench | None = None) -> dict:
    """Every Part III method against plain greedy decoding on the same prompts; see the module."""
    o = options or DecodingBench()
    target_dir, draft_dir = resolve(o.target), resolve(o.draft)
    target, tokenizer = load(target_dir, device=o.device)
    draft, _ = load(draft_dir, device=o.device)
    heads = MedusaHeads.load(target_dir, device=o.device) if (target_dir / CONFIG_FILE).is_file() else None
    prompts = corpus_prompts(tokenizer, o.prompts, o.prompt_len)
    record = provenance(
        o.device,
        model=target_dir.name,
        dtype=target.dtype,
        benchmark="Part III decoding methods vs plain greedy decoding",
        target=target_dir.name,
        draft=draft_dir.name,
        batch_size=1,
        n_prompts=o.prompts,
        prompt_len=o.prompt_len,
        new_tokens=o.new_tokens,
        repeats=o.repeats,
        k=o.k,
        prompt_source="corpus text (validation split)",
    )
    methods = decoding_methods(target, draft, heads, o.new_tokens, o.k, o.compile)
    compile_seconds = {name: methods[name](prompts[0])[2][2] for name in methods if name.endswith(COMPILED)}
    timed = time_methods(methods, prompts, o.repeats, target.device, "decoding methods" if o.progress else None)
    costs = extra_costs(target_dir, draft, draft_dir, heads)
    models = {"target": target, "draft": draft}
    forward_ms = {name: measure_forward_ms(m, repeats=20, statistic="median") for name, m in models.items()}
    rows = [
        decoding_row(name, t, timed, o, costs, compile_seconds.get(name, 0.0), forward_ms, models, methods, prompts)
        for name, t in timed.items()
    ]
    record["compile"] = o.compile
    return finish_provenance(record | {"rows": rows, "forward_ms_by_new_tokens": forward_ms})


def decoding_row(name, t, timed, o, costs, compile_s, forward_ms, models, methods, prompts) -> dict:
    """One method's figures: speed against plain greedy (of the same kind, eager or compiled, and
    eager), tokens per target forward, acceptance, time per round inside and outside the forwards,
    and (eager) the speedup the measured forward costs predict."""
    compiled = name.endswith(COMPILED)
    base = timed["greedy" + (COMPILED if compiled else "")]
    seconds, stats = statistics.median(t["seconds"]), merged(t["stats"])
    total = sum(split[0] for split in t["split"])
    rounds = stats.target_forwards if stats else o.prompts * o.new_tokens
    plain_step_ms = 1e3 * sum(split[0] for split in base["split"]) / (o.prompts * o.new_tokens)
    inside = sum(split[1] for split in t["split"])
    row = {
        "method": name,
        "tokens_per_s": o.prompts * o.new_tokens / seconds,
        "speedup": statistics.median(base["seconds"]) / seconds,
        "speedup_vs_eager_greedy": statistics.median(timed["greedy"]["seconds"]) / seconds,
        "tokens_per_target_forward": stats.tokens_per_target_forward if stats else 1.0,
        "mean_accepted_length": stats.mean_accepted_length if stats else 0.0,
        "acceptance_rates": [round(a, 4) for a in stats.acceptance_rates] if stats else [],
        "same_greedy_tokens": t["tokens"] == timed["greedy"]["tokens"],
        "ms_per_round": 1e3 * total / rounds,
        "forward_ms_per_round": 1e3 * inside / rounds,
        "other_ms_per_round": 1e3 * (total - inside) / rounds,
        "plain_step_ms": plain_step_ms,
        "compile_seconds": compile_s,
        **next(v for key, v in costs.items() if name.startswith(key)),
    }
    row["other_vs_plain_step"] = row["other_ms_per_round"] / plain_step_ms
    if stats and not compiled:  # the cost model of decoding.common with this run's forward costs
        widths = forward_widths(models, methods[name], prompts[:1])
        width = statistics.mean(widths["target"]) if widths["target"] else 1
        row["mean_target_width"] = width
        row["predicted_speedup"] = modeled_speedup(
            stats.tokens_per_target_forward,
            width,
            forward_ms["target"],
            stats.draft_forwards / stats.target_forwards,
            forward_ms["draft"],
        )
    return row


def _acceptance(rates: list[float]) -> str:
    """Acceptance by draft position; '-' for a position no round reached (no rate to give)."""
    return " ".join("-" if a != a else f"{a:.2f}" for a in rates) or "-"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def format_decoding(result: dict) -> str:
    columns = {
        "method": "method",
        "tokens_per_s": "tokens/s",
        "speedup": "speedup",
        "tokens_per_target_forward": "tokens/forward",
        "acceptance": "acceptance by position",
        "extra_params": "extra params",
        "extra_training": "extra training",
        "same_greedy_tokens": "same tokens",
    }
    rows = [{**r, "acceptance": _acceptance(r["acceptance_rates"])} for r in result["rows"]]
    title = (
        f"{result['benchmark']}: {result['target']} (draft {result['draft']}), {result['dtype']}, batch 1, "
        f"{_count(result['n_prompts'], 'prompt')} x {result['new_tokens']} new tokens, median of {result['repeats']}\n"
        f"{result['hardware']}"
    )
    lines = [
        wrapped
        for name, by_t in result.get("forward_ms_by_new_tokens", {}).items()
        for wrapped in wrap_line(
            f"one forward of T tokens, {name} (ms): " + ", ".join(f"T={t}: {ms:.2f}" for t, ms in by_t.items()),
            indent="  ",
        )
    ]
    rounds = ["", format_rounds(result)] if "other_ms_per_round" in result["rows"][0] else []  # older runs: no split
    return "\n".join([format_table(rows, columns, title=title), *lines, *rounds])


def format_rounds(result: dict) -> str:
    """Where a round's time goes: inside the model's forwards and outside them (the loop's own
    bookkeeping), against one plain greedy step; the speedup the forward costs alone predict."""
    columns = {
        "method": "method",
        "ms_per_round": "ms per round",
        "forward_ms_per_round": "in forwards (ms)",
        "other_ms_per_round": "outside forwards (ms)",
        "outside_share": "outside, vs a plain step",
        "predicted": "predicted speedup",
        "speedup": "measured speedup",
        "compile": "compile (s)",
    }
    rows = [
        {
            **r,
            "outside_share": "-" if r["method"].startswith("greedy") else f"{r['other_vs_plain_step']:.0%}",
            "predicted": f"{r['predicted_speedup']:.2f}" if "predicted_speedup" in r else "-",
            "compile": f"{r['compile_seconds']:.0f}" if r.get("compile_seconds") else "-",
        }
        for r in result["rows"]
    ]
    return format_table(rows, columns, title="time per round (a round: one target forward; greedy: one step)")


# ---------------------------------------------------------------------------------------------
# Chapter 9: how wide each method's forwards are (what that width costs: ``decoding.common.cost_at``)


@torch.inference_mode()
def forward_widths(models: dict[str, torch.nn.Module], method: Method, prompts: list[list[int]]) -> dict[str, list]:
    """Per model: the number of new tokens of each forward while ``method`` runs on each prompt,
    without each model's first forward per prompt (the one that also reads the prompt)."""
    widths: dict[str, list[int]] = {name: [] for name in models}

    def recorder(out: list[int]):
        return lambda _module, args, kwargs: out.append((args[0] if args else kwargs["input_ids"]).shape[1])

    for prompt in prompts:
        seen: dict[str, list[int]] = {name: [] for name in models}
        hooks = [m.register_forward_pre_hook(recorder(seen[name]), with_kwargs=True) for name, m in models.items()]
        try:
            method(prompt)
        finally:
            for hook in hooks:
                hook.remove()
        for name in models:
            widths[name] += seen[name][1:]
    return widths
