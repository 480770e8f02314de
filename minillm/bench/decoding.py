"""Part III side by side: speculative, prompt-lookup, lookahead and Medusa decoding against plain
greedy decoding, on one model and the same prompts, in one run.

Every method is greedy here, so every method must produce exactly plain greedy's tokens (the
benchmark checks it). For each method: end-to-end tokens/s and the speedup over plain greedy,
tokens per target forward (1 for plain decoding), the acceptance rate per draft position, the
extra parameters it needs in memory and the extra training it needed. Beside them, what one
forward of T new tokens costs on this machine: these methods trade one-token forwards for fewer,
wider ones, which pays only where a wide forward costs about what a narrow one does. Methods run interleaved,
after a warmup, and the figures are medians over the repeats.

    from .decoding import bench_decoding, format_decoding
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

from ..core.cache import KVCache
from ..core.checkpoints import load, resolve
from ..core.device import hardware_description, synchronize
from ..core.generate import generate
from ..core.model import Transformer
from ..core.tokenizer import Tokenizer
from ..decoding.lookahead import lookahead_generate
from ..decoding.medusa import CONFIG_FILE, MedusaHeads, medusa_generate
from ..decoding.speculative import DecodingStats, prompt_lookup_generate, speculative_generate
from ..training import corpus
from .report import format_table

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


def forward_ms(model: Transformer, sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32), prefix: int = 64,
               repeats: int = 20) -> dict[int, float]:  # fmt: skip
    """Median milliseconds of one forward of T new tokens after ``prefix`` cached ones, for each T:
    what verifying T tokens at once costs here, against decoding one (the T = 1 entry)."""
    return forward_costs(model, sizes, prefix, repeats, summary=statistics.median)


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


# ---------------------------------------------------------------------------------------------
# Chapter 9: how wide each method's forwards are, and what that width costs here


@torch.inference_mode()
def forward_widths(models: dict[str, torch.nn.Module], method: Method, prompts: list[list[int]]) -> dict[str, list]:
    """Per model: the number of new tokens of each forward while ``method`` runs on each prompt,
    without each model's first forward per prompt (the one that also reads the prompt)."""
    widths: dict[str, list[int]] = {name: [] for name in models}
    for prompt in prompts:
        seen: dict[str, list[int]] = {name: [] for name in models}

        def recorder(out: list[int]):
            return lambda _module, args, kwargs: out.append((args[0] if args else kwargs["input_ids"]).shape[1])

        hooks = [m.register_forward_pre_hook(recorder(seen[name]), with_kwargs=True) for name, m in models.items()]
        try:
            method(prompt)
        finally:
            for hook in hooks:
                hook.remove()
        for name in models:
            widths[name] += seen[name][1:]
    return widths


def cost_at(forward_ms_by_width: dict, width: float) -> float:
    """Milliseconds of one forward of ``width`` new tokens, interpolated linearly between the measured widths."""
    points = sorted((int(t), ms) for t, ms in forward_ms_by_width.items())
    for (t0, ms0), (t1, ms1) in zip(points, points[1:]):
        if width <= t1:
            return ms0 + (ms1 - ms0) * (max(width, t0) - t0) / (t1 - t0)
    return points[-1][1] * width / points[-1][0]  # past the last width: proportional


def modeled_speedup(tokens_per_forward: float, width: float, target_ms: dict, draft_forwards: float = 0.0,
                    draft_ms: dict | None = None) -> float:  # fmt: skip
    """The speedup over plain decoding if a step cost only its forwards: tokens per target forward,
    times cost(1) over what one step costs (a target forward of ``width`` tokens, plus
    ``draft_forwards`` one-token draft forwards). Python overheads come on top of this."""
    step = cost_at(target_ms, width) + (draft_forwards * cost_at(draft_ms, 1) if draft_forwards else 0.0)
    return tokens_per_forward * cost_at(target_ms, 1) / step


# ---------------------------------------------------------------------------------------------
# Chapters 7 and 8: speculative decoding against K and temperature, prompt lookup by task


def mean_acceptance(stats: DecodingStats) -> float:
    """Accepted proposals over proposals checked, all positions together: one alpha for the model."""
    reached = sum(stats.reached)
    return sum(stats.accepted) / reached if reached else float("nan")


def _of(result) -> tuple[list[int], DecodingStats]:
    return result.tokens[0].tolist(), result.stats


def speculative_sweep(target: Transformer, draft: Transformer, prompts: list[list[int]], new_tokens: int,
                      ks=(1, 2, 3, 4, 6, 8), temperatures=(0.0,), repeats: int = 1,
                      seed: int = 0) -> list[dict]:  # fmt: skip
    """Speculative decoding for each (K, temperature) against plain decoding at the same
    temperature, timed interleaved on the same prompts: one row per pair, the fastest of the
    repeats (other work on the machine only ever adds time)."""
    rows = []
    for temp in temperatures:
        plain = {"plain": lambda p, t=temp: (generate(target, p, new_tokens, temperature=t, seed=seed,
                                                      eos_token_id=None).tokens[0].tolist(), None)}  # fmt: skip
        spec = {k: (lambda p, k=k, t=temp: _of(speculative_generate(target, draft, p, new_tokens, k=k, temperature=t,
                                                                     seed=seed, eos_token_id=None)))
                for k in ks}  # fmt: skip
        timed = time_methods({**plain, **spec}, prompts, repeats, target.device)
        base = min(timed["plain"]["seconds"])
        for k in ks:
            seconds, stats = min(timed[k]["seconds"]), merged(timed[k]["stats"])
            rows.append({"k": k, "temperature": temp, "speedup": base / seconds,
                         "tokens_per_s": len(prompts) * new_tokens / seconds,
                         "tokens_per_target_forward": stats.tokens_per_target_forward,
                         "alpha": mean_acceptance(stats), "acceptance_rates": stats.acceptance_rates,
                         "ms_per_round": 1e3 * seconds / stats.target_forwards,
                         "ms_per_plain_token": 1e3 * base / (len(prompts) * new_tokens)})  # fmt: skip
    return rows


@torch.inference_mode()
def teacher_forced_acceptance(target: Transformer, draft: Transformer, ids: list[int],
                              temperatures=(0.0, 0.25, 0.5, 0.75, 1.0, 1.5)) -> dict[float, float]:  # fmt: skip
    """Mean chance that one draft proposal is accepted, at each temperature, over the positions of
    a real text ``ids``: sum_x min(p, q) of the two models' next-token distributions (at T = 0,
    how often their argmaxes agree). No generation needed: one forward of each model."""
    from ..core.sampling import SamplingParams, probabilities
    from ..decoding.speculative import acceptance_probability

    x = torch.tensor([ids], device=target.device)
    lp, lq = target(x)[0].float(), draft(x)[0].float()  # (T, V) each
    out = {}
    for temp in temperatures:
        if temp == 0:
            out[temp] = float((lp.argmax(-1) == lq.argmax(-1)).float().mean())
        else:
            params = SamplingParams(temperature=temp)
            out[temp] = float(acceptance_probability(probabilities(lp, params), probabilities(lq, params)).mean())
    return out


def copy_task_prompts(model: Transformer, tokenizer: Tokenizer, n: int = 4, prompt_len: int = 64,
                      new_tokens: int = 64) -> dict[str, list[list[int]]]:  # fmt: skip
    """Prompts of three kinds, from the validation split:

    - "free": corpus text to continue (nothing to copy but what the model repeats itself);
    - "rewrite a function": a method's source, then its ``def`` line again, as when asking for an
      edited version (the output may re-quote the body);
    - "regenerate an answer": a corpus prompt, the model's own greedy answer, then the same prompt
      again, as in a chat asked to answer again or revise (the answer is in the prompt).
    """
    import re

    free = realistic_prompts(tokenizer, n, prompt_len)
    text = corpus.load_text("valid")
    methods = [m for m in re.findall(r"\n(    def \w+\(.*?\n)(?=\n    def )", text, re.S) if 200 < len(m) < 700]
    chosen = methods[:: max(1, len(methods) // n)][:n]
    rewrite = [tokenizer.encode(m.rstrip("\n") + "\n\n" + m.split("\n")[0]) for m in chosen]
    sep = tokenizer.encode("\n\n")
    regenerate = [p + generate(model, p, new_tokens, eos_token_id=None).tokens[0].tolist() + sep + p for p in free]
    return {"free": free, "rewrite a function": rewrite, "regenerate an answer": regenerate}


def lookup_by_task(model: Transformer, tasks: dict[str, list[list[int]]], new_tokens: int, k: int = 8,
                   max_ngram: int = 3, repeats: int = 2) -> list[dict]:  # fmt: skip
    """Prompt lookup against plain greedy decoding, prompt by prompt (timed interleaved): per
    prompt the task, the share of the output a lookup could copy, tokens per forward, speedup."""
    from ..decoding.speculative import copyable_fraction

    rows = []
    for task, prompts in tasks.items():
        for prompt in prompts:
            methods = {
                "greedy": lambda p: (generate(model, p, new_tokens, eos_token_id=None).tokens[0].tolist(), None),
                "lookup": lambda p: _of(
                    prompt_lookup_generate(model, p, new_tokens, k=k, max_ngram=max_ngram, eos_token_id=None)
                ),
            }
            timed = time_methods(methods, [prompt], repeats, model.device)
            output, stats = timed["lookup"]["tokens"][0], timed["lookup"]["stats"][0]
            seconds = {name: min(t["seconds"]) for name, t in timed.items()}  # the least disturbed run
            rows.append({"task": task, "prompt_len": len(prompt), "copyable": copyable_fraction(prompt, output),
                         "tokens_per_target_forward": stats.tokens_per_target_forward,
                         "speedup": seconds["greedy"] / seconds["lookup"],
                         "tokens_per_s": new_tokens / seconds["lookup"],
                         "greedy_tokens_per_s": new_tokens / seconds["greedy"],
                         "same_greedy_tokens": output == timed["greedy"]["tokens"][0]})  # fmt: skip
    return rows


def summarize_by_task(rows: list[dict]) -> list[dict]:
    """Medians per task of ``lookup_by_task``'s rows."""
    out = []
    for task in dict.fromkeys(r["task"] for r in rows):
        mine = [r for r in rows if r["task"] == task]
        out.append({"task": task, "prompts": len(mine),
                    **{key: statistics.median(r[key] for r in mine)
                       for key in ("copyable", "tokens_per_target_forward", "speedup", "tokens_per_s",
                                   "greedy_tokens_per_s")},
                    "same_greedy_tokens": all(r["same_greedy_tokens"] for r in mine)})  # fmt: skip
    return out


def plot_break_even(relative_cost: dict[str, dict], methods: dict[str, tuple[float, float]], title: str = ""):
    """Cost of a forward of T tokens relative to T = 1 (one line per device or model), and each
    method at (its mean width, its tokens per target forward): a method above a line gains there."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for name, by_t in relative_cost.items():
        ts = sorted(int(t) for t in by_t)
        ax.plot(ts, [by_t[t] if t in by_t else by_t[str(t)] for t in ts], "o-", label=name)
    for i, (name, (width, tokens)) in enumerate(methods.items()):
        ax.plot([width], [tokens], "*", ms=13, color=f"C{i + 3}", label=f"{name}: {tokens:.2f} tokens/forward")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="tokens in one forward (T)", ylabel="cost relative to a 1-token forward\nor tokens per forward",
           title=title)  # fmt: skip
    ax.legend(fontsize=7)
    return fig


def plot_speculative_sweep(rows: list[dict], predicted: dict[str, list[float]], title: str = ""):
    """Against K: tokens per target forward (measured, and the i.i.d. model at the measured alpha),
    and the speedup over plain decoding (measured, and each prediction in ``predicted``)."""
    import matplotlib.pyplot as plt

    from ..decoding.speculative import expected_tokens_per_forward

    ks = [r["k"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax1.plot(ks, [r["tokens_per_target_forward"] for r in rows], "o-", label="measured")
    ax1.plot(ks, [expected_tokens_per_forward(r["alpha"], r["k"]) for r in rows], "s--",
             label="(1 - a^(K+1)) / (1 - a), measured a")  # fmt: skip
    ax1.set(xlabel="K, proposals per round", ylabel="new tokens per target forward")
    ax2.plot(ks, [r["speedup"] for r in rows], "o-", color="black", label="measured")
    for (name, values), style in zip(predicted.items(), ["s--", "^:", "v-."]):
        ax2.plot(ks, values, style, label=name)
    ax2.axhline(1, color="gray", lw=1)
    ax2.set(xlabel="K, proposals per round", ylabel="speedup over plain decoding (x)")
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_acceptance_vs_temperature(curve: dict[float, float], measured: dict[float, float], title: str = ""):
    """Chance of accepting one proposal against temperature: from the two models' distributions
    on real text (a line), and measured while generating (points)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot(list(curve), list(curve.values()), "o-", label="sum min(p, q) on corpus text (teacher-forced)")
    ax.plot(list(measured), list(measured.values()), "s", ms=9, label="measured while generating")
    ax.set(xlabel="temperature (0 = greedy: argmax agreement)", ylabel="acceptance rate per proposal",
           ylim=(0, 1), title=title)  # fmt: skip
    ax.legend(fontsize=8)
    return fig


def plot_speedup_map(k: int, points: dict[str, tuple[float, float]], title: str = ""):
    """The expected speedup (1 - a^(K+1)) / ((1 - a)(K c + 1)) over acceptance a and cost ratio c,
    the break-even line dashed, and measured (a, c) pairs as points."""
    import matplotlib.pyplot as plt
    import numpy as np

    from ..decoding.speculative import expected_speedup

    alphas, cs = np.linspace(0, 0.99, 100), np.linspace(0.0, 1.0, 101)
    grid = np.array([[expected_speedup(float(a), k, float(c)) for a in alphas] for c in cs])
    fig, ax = plt.subplots()
    filled = ax.contourf(alphas, cs, grid, levels=sorted({0, 0.5, 0.75, 1, 1.5, 2, 3, 4, k + 1}), cmap="RdYlGn")
    ax.contour(alphas, cs, grid, levels=[1], colors="black", linestyles="--")
    fig.colorbar(filled, label="expected speedup (x)")
    for name, (a, c) in points.items():
        ax.plot(a, c, "ko")
        right = a > 0.7
        ax.annotate(name, (a, c), textcoords="offset points", xytext=(-5 if right else 5, -12 if c > 0.9 else 5),
                    ha="right" if right else "left", fontsize=8)  # fmt: skip
    ax.set(xlabel="acceptance rate a", ylabel="draft / target cost per forward, c", title=title)
    return fig


def plot_lookup_by_task(rows: list[dict], title: str = ""):
    """Per prompt: prompt lookup's speedup and tokens per forward against the share of the output
    that could be copied, one colour per task."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for task in dict.fromkeys(r["task"] for r in rows):
        mine = [r for r in rows if r["task"] == task]
        x = [100 * r["copyable"] for r in mine]
        ax1.plot(x, [r["speedup"] for r in mine], "o", label=task)
        ax2.plot(x, [r["tokens_per_target_forward"] for r in mine], "o", label=task)
    ax1.axhline(1, color="gray", lw=1)
    ax1.set(xlabel="output tokens a 3-gram lookup could copy (%)", ylabel="speedup over greedy (x)")
    ax2.set(xlabel="output tokens a 3-gram lookup could copy (%)", ylabel="new tokens per forward")
    ax1.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


@torch.inference_mode()
def forward_costs(model: Transformer, sizes: tuple[int, ...], prefix: int = 64, repeats: int = 10,
                  summary: Callable[[list[float]], float] = min) -> dict[int, float]:  # fmt: skip
    """Milliseconds of one forward of T new tokens after ``prefix`` cached ones, for each T. The
    widths take turns within each repeat (a warm-up round first), and each keeps ``summary`` of its
    times: by default the fastest, since on a shared machine other work only ever adds time."""
    gen = torch.Generator().manual_seed(0)
    cache = KVCache.for_model(model, 1, prefix + max(sizes))
    model(torch.randint(0, model.config.vocab_size, (1, prefix), generator=gen).to(model.device), cache=cache)
    ids = {T: torch.randint(0, model.config.vocab_size, (1, T), generator=gen).to(model.device) for T in sizes}
    times: dict[int, list[float]] = {T: [] for T in sizes}
    for r in range(repeats + 1):  # round 0 warms up
        for T in sizes:
            synchronize(model.device)
            t0 = time.perf_counter()
            model(ids[T], cache=cache)
            synchronize(model.device)
            if r:
                times[T].append(1e3 * (time.perf_counter() - t0))
            cache.truncate(prefix)
    return {T: summary(t) for T, t in times.items()}
