"""Chapter 16's table: one model from the plain baseline to every technique of the book stacked,
a row at a time (``python -m minillm bench capstone``), the way the gpt-fast write-up took
Llama-7B from 25.5 to 244.7 tokens/s on A100s (PyTorch team, 2023: ``gptfast2023`` in the book's
references).

Three parts, each measured side by side (``timing.interleaved``) on what it needs:

- ``ladder``: batch-1 generation of a true-size random-weight model (speed does not depend on
  the weights' values): recompute everything each step -> KV cache -> int8 weights -> int4
  weights -> compiled decode over a static cache. Each rung's quality is measured on the bundled
  trained model with the same recipe: perplexity, greedy agreement (teacher-forced, chapter 12's
  measure) and how many greedy outputs equal the baseline's token for token;
- ``decoding``: on the bundled trained pair (acceptance depends on trained weights), the last
  rung's recipe with a draft model (speculative decoding), and prompt lookup on prompts whose
  output copies its input, each against plain greedy decoding on the same prompts;
- ``serving``: a Poisson workload with a shared system prompt, served one request at a time,
  then with continuous batching over paged KV blocks, then with prefix caching, then by the HTTP
  server measured from a streaming client: throughput, goodput under an SLO, TTFT/TPOT p50/p99;
  and the same requests handed over at once, as a batch API runs them (no latency promised).

The rungs are recipes of the runtime (``runtime.recipes``: ``Rung``, ``LADDER``); this module
times them, and ``bench.capstone_tables`` prints the figures.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from functools import partial

import torch
from tqdm.auto import tqdm

from ..compression import model_bytes
from ..core.checkpoints import load
from ..core.compiled import compiled_forward_for
from ..core.config import ModelConfig, check_field_types, shape_config
from ..core.device import best_device, cuda_half_dtype
from ..core.generate import generate
from ..core.model import Transformer, random_model
from ..core.tokenizer import Tokenizer
from ..decoding.common import merged
from ..decoding.prompt_lookup import prompt_lookup_generate
from ..decoding.speculative import predicted_speedup, speculative_generate
from ..measure.metrics import SLO, RequestMetrics, span
from ..measure.quality import continuation_agreement, perplexity
from ..measure.report import finish_provenance, provenance
from ..measure.timing import interleaved
from ..runtime.load import RuntimeOptions, compute_dtype
from ..runtime.recipes import (
    LADDER,
    Rung,
    alone_rung,
    generate_as,
    kv_bytes,
    recipe_of,
    rung_models,
    streamed_bytes,
)
from ..serving.client import run_workload, server_process, wait_healthy
from ..serving.engine import EngineConfig
from ..serving.scheduler import SchedulerConfig
from ..serving.workload import Request, chat_trace, random_prompt, requests_from_trace
from ..training.corpus import corpus_prompts
from ..training.train import encode_split
from .batching import SIGMA
from .capstone_tables import format_decoding_rows, format_ladder, format_rate_sweep, format_serving, with_ratios
from .decoding import greedy_tokens, measure_forward_ms, time_methods, tokens_and_stats
from .lookup import copy_task_prompts
from .roofline import measure_bandwidth
from .serve import rate_figures
from .serving import run_measured, serving_figures


@dataclass
class CapstoneBench:
    """The options of ``bench_capstone``. ``device`` defaults to the best one."""

    shape: str | ModelConfig = "SmolLM2-135M"  # (preset of) the random model of the ladder's speed
    model: str = "minillm-target"  # trained model: quality, acceptance, serving
    draft: str = "minillm-draft"  # the draft of speculative decoding (the best bundled one)
    prompt_len: int = 48  # tokens of the ladder's prompt
    new_tokens: int = 24  # tokens generated per run (ladder and decoding rows)
    repeats: int = 3  # timed runs of each, taking turns; the median is reported
    k: int = 4  # draft tokens per round
    decoding_prompts: int = 2  # corpus prompts (and copying prompts) of the decoding rows
    quality_prompts: int = 8  # prompts of the greedy comparisons
    quality_windows: int = 8  # validation windows of 256 tokens for perplexity
    requests: int = 16  # requests of the serving workload
    rate: float = 4.0  # their Poisson arrivals per second
    prompt_median: float = 48  # tokens after the shared system prompt (lognormal)
    output_median: float = 32  # tokens
    system_len: int = 128  # the system prompt every request starts with
    max_batch: int = 8  # sequences per engine step at most (the batch row's too)
    sweep_rates: tuple[float, ...] = (2.0, 4.0, 6.0, 8.0, 12.0)  # arrivals/s of the online sweep
    sweep_requests: int = 32  # requests per rate of the sweep
    num_blocks: int = 256  # KV pool, blocks of 16 tokens (the server's default)
    slo: SLO = field(default_factory=lambda: SLO(ttft=0.5, tpot=0.05))
    compile: bool = True  # False: skip the compiled rungs (and compile nothing)
    http: bool = True  # False: skip the served-over-HTTP row (no server process)
    seed: int = 0
    device: str | torch.device | None = None
    progress: bool = False

    def __post_init__(self) -> None:
        ints = ("prompt_len", "new_tokens", "repeats", "k", "decoding_prompts", "quality_prompts")
        ints += ("quality_windows", "requests", "system_len", "max_batch", "num_blocks", "sweep_requests")
        check_field_types(self, ints=ints, numbers=("rate", "prompt_median", "output_median"))
        if self.rate <= 0 or min(self.prompt_median, self.output_median) < 1:
            raise ValueError("rate must be positive; prompt_median and output_median at least 1 token")
        self.sweep_rates = tuple(float(r) for r in self.sweep_rates)
        if not self.sweep_rates or min(self.sweep_rates) <= 0:
            raise ValueError(f"sweep_rates must be positive arrival rates, got {self.sweep_rates}")
        self.shape = shape_config(self.shape)
        self.device = torch.device(self.device) if self.device is not None else best_device()

    @property
    def rungs(self) -> tuple[Rung, ...]:
        """The ladder's rungs this run measures: the compiled ones only with ``compile``, and the
        bf16 rung only where the baseline is fp32 (on a GPU it is 16-bit already)."""
        dense_fp32 = self.dense_dtype == torch.float32
        return tuple(r for r in LADDER if (self.compile or not r.compiled) and (dense_fp32 or not r.half or r.scheme))

    @property
    def alone(self) -> dict[str, Rung]:
        """For each rung after the KV cache, the rung measuring its technique on the KV-cache
        rung alone (itself where it already is: ``runtime.recipes.alone_rung``)."""
        pairs = ((r.name, alone_rung(r)) for r in self.rungs)
        return {name: a for name, a in pairs if a is not None}

    @property
    def dense_dtype(self) -> torch.dtype:
        """16-bit on a GPU (fp16 where bf16 is not native, a T4); fp32 on a CPU, where bf16
        matmuls without packed weights are slow."""
        if self.device.type == "cuda":
            return cuda_half_dtype()
        return torch.float32 if self.device.type == "cpu" else torch.bfloat16

    @property
    def quantized_dtype(self) -> torch.dtype:
        """What a quantized model computes in: the runtime's choice (``runtime.compute_dtype``: bf16
        on a CPU, where PyTorch's packed int8/int4 kernels are fast in bf16 only), else the 16-bit
        type."""
        return compute_dtype(RuntimeOptions(quantize="int4", device=self.device)) or self.dense_dtype


# ---------------------------------------------------------------------------------------------
# The ladder: batch 1 on a true-size model


@torch.inference_mode()
def ladder_speed(o: CapstoneBench) -> list[dict]:
    """Tokens/s (new tokens over the whole call, prompt included) of every rung on a random
    ``o.shape``, taking turns with the rungs that measure a technique alone; the tokens each made,
    compared with the baseline's and with the previous rung's (a lossless step must make the
    same); and each technique's speed alone on the KV-cache rung (``alone_tokens_per_s``)."""
    base = random_model(o.shape, o.device, o.dense_dtype, seed=o.seed)
    ids = torch.randint(0, o.shape.vocab_size, (1, o.prompt_len), generator=torch.Generator().manual_seed(o.seed))
    extra = tuple({a.name: a for a in o.alone.values() if a.name not in {r.name for r in o.rungs}}.values())
    timed = o.rungs + extra
    models = rung_models(base, timed, o.quantized_dtype)
    length = o.prompt_len + o.new_tokens
    # compiled before the timer starts; the seconds it took are reported apart
    compile_s = {r.name: compiled_forward_for(models[r.name], 1, length).warmup(1) for r in timed if r.compiled}
    runs = {r.name: partial(generate_as, models[r.name], r, ids.to(o.device), o.new_tokens) for r in timed}
    timings = interleaved(runs, o.repeats, o.device, progress="ladder" if o.progress else None)
    tokens = {r.name: timings[r.name].values[0].tokens[0].tolist() for r in timed}
    rows = []
    for i, rung in enumerate(o.rungs):
        t, model = timings[rung.name], models[rung.name]
        alone = o.alone.get(rung.name)
        rows.append(
            {
                "step": rung.name,
                "ran_on": f"random {o.shape.name}, {str(model.dtype).removeprefix('torch.')}",
                "tokens_per_s": o.new_tokens / t.median,
                "seconds_runs": t.seconds,
                "ttft_ms": 1e3 * statistics.median(v.ttft for v in t.values),
                "tpot_ms": 1e3 * statistics.median(v.tpot for v in t.values),
                "compile_s": compile_s.get(rung.name, 0.0),
                "weights_bytes": model_bytes(model),
                "kv_bytes": kv_bytes(model, rung, length),
                "streamed_bytes": streamed_bytes(rung, model_bytes(model), o.shape),
                "same_tokens_as_baseline": tokens[rung.name] == tokens[o.rungs[0].name],
                "same_tokens_as_previous": tokens[rung.name] == tokens[o.rungs[max(i - 1, 0)].name],
                "lossless": rung.lossless,
                "alone": alone.name if alone else None,
                "alone_tokens_per_s": o.new_tokens / timings[alone.name].median if alone else None,
                "alone_seconds_runs": timings[alone.name].seconds if alone else None,
                "alone_compile_s": compile_s.get(alone.name, 0.0) if alone else None,
                "alone_same_tokens_as_kv_cache": (
                    tokens[alone.name] == tokens[LADDER[1].name] if alone and LADDER[1] in o.rungs else None
                ),
            }
        )
    rows = with_ratios(rows)
    kv = next((r["tokens_per_s"] for r in rows if r["step"] == LADDER[1].name), None)
    for row in rows:
        row["alone_vs_kv_cache"] = row["alone_tokens_per_s"] / kv if kv and row["alone_tokens_per_s"] else None
    return rows


@torch.inference_mode()
def ladder_quality(o: CapstoneBench) -> tuple[list[dict], dict[str, Transformer], Tokenizer]:
    """Each rung's recipe on the trained ``o.model``: perplexity, its change against the fp32
    baseline, greedy agreement with the baseline (teacher-forced, for the rungs that change the
    weights; None for those that keep the row above's) and how many of ``o.quality_prompts``
    greedy outputs equal the baseline's. Also returns the trained models by rung and the
    tokenizer."""
    reference, tokenizer = load(o.model, device=o.device, dtype=torch.float32)
    valid = encode_split(tokenizer, "valid")
    prompts = corpus_prompts(tokenizer, o.quality_prompts, 32)
    models = rung_models(reference, o.rungs, o.quantized_dtype)
    outputs = {
        r.name: [generate_as(models[r.name], r, p, o.new_tokens).tokens[0].tolist() for p in prompts] for r in o.rungs
    }
    baseline = outputs[LADDER[0].name]
    base_ppl = perplexity(reference, valid, 256, o.quality_windows)
    rows, measured = [], {LADDER[0].weights: (base_ppl, None)}
    for rung in o.rungs:
        model = models[rung.name]
        new_weights = rung.weights not in measured
        if new_weights:
            agreement = continuation_agreement(model, reference, prompts, o.new_tokens)
            measured[rung.weights] = (perplexity(model, valid, 256, o.quality_windows), agreement)
        ppl, agreement = measured[rung.weights]
        agreement = agreement if new_weights else None
        same = sum(a == b for a, b in zip(outputs[rung.name], baseline))
        rows.append(
            {
                "step": rung.name,
                "quality_on": f"{o.model}, {str(model.dtype).removeprefix('torch.')}",
                "perplexity": ppl,
                "ppl_change_pct": 100 * (ppl / base_ppl - 1),
                "agreement": agreement,
                "same_outputs": same,
                "outputs": len(prompts),
                "quality_weights_bytes": model_bytes(model),
            }
        )
    return rows, models, tokenizer


def bench_ladder(o: CapstoneBench) -> tuple[list[dict], Transformer, Tokenizer]:
    """Speed and quality of every rung, one row each; the last rung's trained model, its tokenizer."""
    speed = ladder_speed(o)
    quality, models, tokenizer = ladder_quality(o)
    rows = [{**s, **q} for s, q in zip(speed, quality)]
    return rows, models[o.rungs[-1].name], tokenizer


# ---------------------------------------------------------------------------------------------
# Decoding: the trained pair


@torch.inference_mode()
def bench_decoding_rows(o: CapstoneBench, target: Transformer, tokenizer: Tokenizer, recipe: str) -> list[dict]:
    """Greedy, speculative with the draft model, and (on copying prompts) prompt lookup, all
    on ``target`` (the last rung's recipe on the trained model), compiled when ``o.compile``."""
    draft, _ = load(o.draft, device=o.device, dtype=target.dtype)
    n, c = o.new_tokens, o.compile
    free = corpus_prompts(tokenizer, o.decoding_prompts, o.prompt_len)
    tasks = copy_task_prompts(target, tokenizer, o.decoding_prompts, o.prompt_len, n)
    copying = [p for task in ("rewrite a function", "regenerate an answer") for p in tasks[task]]

    def greedy(p):
        return greedy_tokens(generate(target, p, n, eos_token_id=None, compile=c))

    def spec(p):
        return tokens_and_stats(speculative_generate(target, draft, p, n, o.k, eos_token_id=None, compile=c))

    def lookup(p):
        return tokens_and_stats(prompt_lookup_generate(target, p, n, k=8, eos_token_id=None, compile=c))

    where = f"{o.model} ({recipe}), draft {o.draft}"
    rows = []
    for label, prompts, name, method in (
        ("chat prompts", free, f"+ speculative (draft model, K={o.k})", spec),
        ("copying prompts", copying, "prompt lookup instead (K=8)", lookup),
    ):
        timed = time_methods({"greedy": greedy, name: method}, prompts, o.repeats, o.device)
        total = len(prompts) * n
        base, fast = (statistics.median(timed[m]["seconds"]) for m in ("greedy", name))
        stats = merged(timed[name]["stats"])
        rows.append(
            {
                "step": name,
                "ran_on": where if "speculative" in name else f"{o.model} ({recipe})",
                "workload": f"{len(prompts)} {label}" if len(prompts) > 1 else f"1 {label[:-1]}",
                "tokens_per_s": total / fast,
                "greedy_tokens_per_s": total / base,
                "vs_greedy": base / fast,
                "acceptance_rate": stats.acceptance_rate,
                "fraction_kept": stats.fraction_kept,
                "tokens_per_target_forward": stats.tokens_per_target_forward,
                "same_tokens_as_greedy": timed[name]["tokens"] == timed["greedy"]["tokens"],
                "first_difference": first_difference(target, prompts, timed["greedy"]["tokens"], timed[name]["tokens"]),
                "weights_bytes": model_bytes(target) + (model_bytes(draft) if "speculative" in name else 0),
                "lossless": True,
            }
        )
    rows[0].update(draft_costs(target, draft, o.k, rows[0]["acceptance_rate"]))
    return rows


@torch.inference_mode()
def first_difference(target: Transformer, prompts, greedy: list, other: list) -> dict | None:
    """Where ``other``'s tokens first leave greedy decoding's (None if nowhere), and how far apart
    the target's two best logits are there (one plain forward): a gap of one rounding step of
    the model's dtype is a near-tie that a forward over several positions can round the other
    way, as 16-bit verification does; exact arithmetic would keep it."""
    for prompt, a, b in zip(prompts, greedy, other):
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if at is None:
            continue
        ids = torch.tensor([list(prompt) + a[:at]], device=target.device)
        top2 = target(ids)[0, -1].float().topk(2).values
        return {"prompt": prompts.index(prompt), "position": at, "top2_gap": (top2[0] - top2[1]).item()}
    return None


def draft_costs(target: Transformer, draft: Transformer, k: int, alpha: float) -> dict:
    """What a draft forward costs against a target forward here (eager forwards of one token after
    64, fastest of 5), and the speedup chapter 7's formula predicts from it and the measured
    acceptance: speculative decoding pays only when the draft is cheap next to the target."""
    target_ms = measure_forward_ms(target, (1, k + 1), repeats=5)
    draft_ms = measure_forward_ms(draft, (1,), repeats=5)[1]
    return {
        "target_ms": target_ms[1],
        "draft_ms": draft_ms,
        "draft_cost_ratio": draft_ms / target_ms[1],
        "predicted_vs_greedy": predicted_speedup(alpha, k, draft_ms, target_ms),
    }


# ---------------------------------------------------------------------------------------------
# Serving: a Poisson workload


def serving_workload(o: CapstoneBench, vocab_size: int, rate: float | None = None, n: int | None = None) -> list:
    """The requests: Poisson arrivals at ``o.rate`` (or ``rate``), chat-like lengths after a
    shared system prompt of ``o.system_len`` tokens, ``o.requests`` of them (or ``n``). Every
    configuration serves these same requests; each run starts a new engine, so none finds
    another run's prompts in its prefix cache."""
    import numpy as np

    rng = np.random.default_rng(o.seed + 1000)
    system = random_prompt(o.system_len, vocab_size, rng)
    max_len = 2 * (o.system_len + 4 * int(o.prompt_median))
    rate, n = rate or o.rate, n or o.requests
    trace = chat_trace(n, rate, o.prompt_median, SIGMA, o.output_median, SIGMA, max_len, o.seed)
    return requests_from_trace(trace, vocab_size, o.seed, shared_prefix=system)


OFFLINE = "batch: all at once"
SERVED = (
    ("one request at a time", SchedulerConfig("static", 1), False),
    ("+ continuous batching, paged KV", None, False),
    ("+ prefix caching", None, True),
)


@torch.inference_mode()
def bench_serving_rows(o: CapstoneBench) -> list[dict]:
    """The three engine configurations on the same workload and, as a batch API would run it, the
    same requests handed over at once (taking turns); with ``o.http``, the server on the
    workload too, measured from a streaming client."""
    model, _ = load(o.model, device=o.device)
    requests = serving_workload(o, model.config.vocab_size)

    def serve(scheduler, prefix, workload=requests):
        scheduler = scheduler or SchedulerConfig("continuous", o.max_batch)
        config = EngineConfig(o.num_blocks, 16, prefix_caching=prefix, scheduler=scheduler)
        outputs, engine = run_measured(model, workload, config)
        figures = serving_figures(outputs, engine, o.slo)
        good = good_tokens_per_s([out.metrics for out in outputs], o.slo)
        block_bytes = engine.pool.nbytes // o.num_blocks
        return {**figures, "good_tokens_per_s": good, "kv_bytes": engine.peak_blocks * block_bytes}

    runs = {name: partial(serve, s, prefix) for name, s, prefix in SERVED}
    # a batch API: the same requests handed over at once, the same max batch, no latency promised
    at_once = [Request(list(r.prompt), r.max_tokens, 0.0, id=r.id) for r in requests]
    runs[OFFLINE] = partial(serve, SchedulerConfig("continuous", o.max_batch), True, at_once)
    timings = interleaved(runs, o.repeats, o.device, warmup=0, progress="serving" if o.progress else None)
    rows = []
    for name in runs:
        values = sorted(timings[name].values, key=lambda f: f["tokens_per_s"])
        f = values[(len(values) - 1) // 2]  # the median run, by throughput
        rows.append({"step": name, "ran_on": f"{o.model} engine", **_served_row(f), "kv_bytes": f["kv_bytes"]})
    if o.http:
        rows.insert(len(SERVED), http_row(o, requests))
    for row in rows:
        row["weights_bytes"], row["lossless"] = model_bytes(model), True
    return rows


@torch.inference_mode()
def bench_rate_sweep(o: CapstoneBench) -> list[dict]:
    """The online service at its best (continuous batching over paged KV with prefix caching, max
    batch ``o.max_batch``) offered ``o.sweep_requests`` requests at each of ``o.sweep_rates``,
    the rates taking turns ``o.repeats`` times (the median run by throughput is kept), and the
    same requests handed over at once at the same max batch: the most an online service can
    sell within the SLO from this machine, against what a batch run makes of it."""
    model, _ = load(o.model, device=o.device)
    vocab = model.config.vocab_size
    config = EngineConfig(o.num_blocks, 16, prefix_caching=True, scheduler=SchedulerConfig("continuous", o.max_batch))

    def serve(workload):
        outputs, engine = run_measured(model, workload, config)
        figures = serving_figures(outputs, engine, o.slo)
        return {**figures, "good_tokens_per_s": good_tokens_per_s([out.metrics for out in outputs], o.slo)}

    runs = {rate: partial(serve, serving_workload(o, vocab, rate, o.sweep_requests)) for rate in o.sweep_rates}
    every = serving_workload(o, vocab, o.sweep_rates[0], o.sweep_requests)
    runs[OFFLINE] = partial(serve, [Request(list(r.prompt), r.max_tokens, 0.0, id=r.id) for r in every])
    timings = interleaved(runs, o.repeats, o.device, warmup=0, progress="rate sweep" if o.progress else None)
    rows = []
    for rate in runs:
        values = sorted(timings[rate].values, key=lambda f: f["tokens_per_s"])
        f = values[(len(values) - 1) // 2]  # the median run, by throughput
        rows.append({"rate": None if rate == OFFLINE else rate, **_served_row(f), "mean_batch": f["mean_batch"]})
    return rows


def good_tokens_per_s(metrics: list[RequestMetrics], slo: SLO) -> float:
    """Output tokens of the requests that met ``slo``, per second of the run: the throughput an
    online service can sell under that promise."""
    return sum(m.output_tokens for m in metrics if slo.met_by(m)) / span(metrics)


def _served_row(f: dict) -> dict:
    return {
        "throughput": f["tokens_per_s"],
        "good_tokens_per_s": f["good_tokens_per_s"],
        "goodput_rps": f["goodput_rps"],
        "slo_met_pct": f["slo_met_pct"],
        "ttft_p50_ms": f["ttft_p50_ms"],
        "ttft_p99_ms": f["ttft_p99_ms"],
        "tpot_p50_ms": f["tpot_p50_ms"],
        "tpot_p99_ms": f["tpot_p99_ms"],
    }


def http_row(o: CapstoneBench, requests: list) -> dict:
    """The workload streamed to ``python -m minillm serve`` (continuous batching, paged KV, prefix
    caching) in a process of its own, measured at the client."""
    with server_process(o.model, o.max_batch, timeout=120.0) as url:
        card = wait_healthy(url, 60.0)
        with tqdm(total=len(requests), desc="over HTTP", unit="req", disable=not o.progress) as bar:
            measured = run_workload(url, card["id"], requests, bar)
    figures = rate_figures(o.rate, measured, o.slo)
    client = figures["client"]
    return {
        "step": "+ served over HTTP",
        "ran_on": f"{o.model} server",
        "throughput": figures["output_tokens_per_s"],
        "good_tokens_per_s": good_tokens_per_s([m.client for m in measured], o.slo),
        "goodput_rps": client["goodput_rps"],
        "slo_met_pct": client["slo_met_pct"],
        "ttft_p50_ms": client["ttft_ms"]["p50"],
        "ttft_p99_ms": client["ttft_ms"]["p99"],
        "tpot_p50_ms": client["tpot_ms"]["p50"],
        "tpot_p99_ms": client["tpot_ms"]["p99"],
        "kv_bytes": None,  # the server's pool use is not visible from the client
    }


# ---------------------------------------------------------------------------------------------
# All of it


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def bench_capstone(o: CapstoneBench | None = None) -> dict:
    """The three parts with their provenance: the figures chapter 16 prints and plots."""
    o = o or CapstoneBench()
    result = provenance(
        o.device,
        model=f"random {o.shape.name} (speed), {o.model} (quality, decoding, serving)",
        dtype=f"{_name(o.dense_dtype)}; {_name(o.quantized_dtype)} from the bf16 rung on",
        shape=o.shape.name,
        quality_model=o.model,
        draft=o.draft,
        prompt_len=o.prompt_len,
        new_tokens=o.new_tokens,
        repeats=o.repeats,
        workload={
            "requests": o.requests,
            "rate": o.rate,
            "system_len": o.system_len,
            "prompt_median": o.prompt_median,
            "output_median": o.output_median,
            "max_batch": o.max_batch,
            "sweep_rates": list(o.sweep_rates),
            "sweep_requests": o.sweep_requests,
        },
        slo={"ttft_s": o.slo.ttft, "tpot_s": o.slo.tpot},
    )
    # what one core streams, the yardstick of a decode step's weight reads (section 16.3)
    result["copy_GB_s"] = measure_bandwidth(o.device, megabytes=128) / 1e9
    result["ladder"], target, tokenizer = bench_ladder(o)
    result["decoding"] = bench_decoding_rows(o, target, tokenizer, recipe_of(o.rungs[-1]))
    result["serving"] = bench_serving_rows(o)
    result["rate_sweep"] = bench_rate_sweep(o)
    return finish_provenance(result)


def format_capstone(result: dict) -> str:
    """The three parts' tables (``bench.capstone_tables``), as ``python -m minillm bench capstone``
    prints them."""
    tables = [format_ladder(result), format_decoding_rows(result), format_serving(result)]
    return "\n\n".join(tables + [format_rate_sweep(result)] * ("rate_sweep" in result))
