"""Model compression, measured side by side: bytes, speed and quality of each technique of
chapter 12 (``python -m minillm bench compression``).

- ``matmul_times``: one linear layer (x (M, K) @ W^T) in each weight format, at M = 1 token
  (decode: bandwidth-bound) up to hundreds (prefill: compute-bound), taking turns;
- ``decode_speed``: decode tokens/s at batch 1 and 16 of a true-size random-weight model (speed
  does not depend on the weights' values) in every format and after structured pruning;
- ``quality``: the bundled target's perplexity, greedy agreement and logit difference after
  each technique, trained weights this time (quality does depend on them);
- ``bench_compression``: all three with their provenance, the figures the chapter plots.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..compression import model_bytes, quantize
from ..compression.calibration import calibration_batches
from ..compression.prune import prune
from ..compression.quant import QuantizedLinear, QuantSpec, quantized_layers
from ..compression.structured import prune_structured
from ..core.cache import KVCache
from ..core.checkpoints import load
from ..core.config import ModelConfig, shape_config
from ..core.device import best_device
from ..core.model import Transformer, random_model
from ..measure.quality import continuation_agreement, logit_difference, perplexity
from ..measure.report import describe, finish_provenance, format_table, provenance, signed_pct, wrap_line
from ..measure.timing import interleaved
from ..training.corpus import corpus_prompts
from ..training.train import encode_split
from .kv import decode_steps, fill_with_random, roll_back

BASELINE = "bf16"


@dataclass(frozen=True)
class Technique:
    """One row of the benchmark: how to make the compressed model from a loaded one."""

    name: str
    apply: Callable[[Transformer, torch.Tensor | None], Transformer]  # (model, calibration) -> model
    needs: str  # what it takes: "-", "calibration", "training"...
    speed_as: str | None = None  # times exactly like this other row (same kernel): not timed again


def _quantizer(scheme: str, group: int | None = None, method: str = "rtn"):
    return lambda m, calib: quantize(m, scheme, group, method=method, calibration=calib)


TECHNIQUES = [
    Technique("fp32", lambda m, c: m.float(), "-"),
    Technique("bf16", lambda m, c: m, "-"),
    Technique("int8", _quantizer("int8"), "-"),
    Technique("int4 g32", _quantizer("int4", 32), "-"),
    Technique("int4 g64", _quantizer("int4", 64), "-"),
    Technique("int4 g128", _quantizer("int4", 128), "-"),
    Technique("int4 g128 GPTQ", _quantizer("int4", 128, "gptq"), "calibration", speed_as="int4 g128"),
    Technique("int4 g128 AWQ", _quantizer("int4", 128, "awq"), "calibration", speed_as="int4 g128"),
    Technique("fp8 e4m3", _quantizer("fp8"), "-"),
    Technique("w8a8", _quantizer("w8a8"), "-"),
    Technique("magnitude 50%", lambda m, c: prune(m, "magnitude", 0.5), "-", speed_as="bf16"),
    Technique("Wanda 50%", lambda m, c: prune(m, "wanda", 0.5, calibration=c), "calibration", speed_as="bf16"),
    Technique("Wanda 2:4", lambda m, c: prune(m, "wanda", 0.5, "2:4", calibration=c), "calibration", speed_as="bf16"),
    Technique(
        "structured 25%",
        lambda m, c: prune_structured(m, heads=0.25, neurons=0.25, calibration=c),
        "calibration; recovery: training",
    ),
]
TECHNIQUE_NAMES = tuple(t.name for t in TECHNIQUES)


def technique(name: str) -> Technique:
    for t in TECHNIQUES:
        if t.name == name:
            return t
    raise ValueError(f"unknown technique {name!r}: choose from {', '.join(TECHNIQUE_NAMES)}")


@dataclass
class CompressionBench:
    """How to run the compression benchmark. ``device`` defaults to the best one."""

    shape: str | ModelConfig = "SmolLM2-360M"  # (preset of) the random-weight model decode is timed on
    model: str = "minillm-target"  # trained model that quality is measured on
    techniques: Sequence[str] = TECHNIQUE_NAMES
    batches: Sequence[int] = (1, 16)  # sequences decoded together
    context: int = 128  # tokens in the cache when decode is timed
    new_tokens: int = 8  # decode steps per timed run
    repeats: int = 3  # timed runs of each, taking turns; the median is reported
    matmul_shape: tuple[int, int] = (4096, 4096)  # (out, in) of the single-layer table
    matmul_rows: Sequence[int] = (1, 16, 64, 256)  # tokens per matmul: decode 1, prefill many
    matmul_formats: Sequence[str] = ()  # the single-layer table's formats; () = MATMUL_FORMATS
    quality_windows: int = 16  # validation windows of 256 tokens for perplexity
    calibration: int = 32  # calibration windows of 256 training tokens (GPTQ, AWQ, Wanda)
    device: str | torch.device | None = None
    progress: bool = False
    measure_speed: bool = True  # the single-layer and decode tables (random weights)
    measure_quality: bool = True  # the quality table (trained weights)

    def __post_init__(self):
        self.techniques = tuple(self.techniques)
        self.matmul_formats = tuple(self.matmul_formats) or MATMUL_FORMATS
        unknown = set(self.matmul_formats) - set(MATMUL_FORMATS) - {BASELINE, "fp32"}
        if unknown or not {BASELINE, "fp32"} <= set(self.matmul_formats):
            raise ValueError(
                f"matmul_formats: {sorted(unknown)} unknown, or fp32 and bf16 missing; from {MATMUL_FORMATS}"
            )
        for name in self.techniques:
            technique(name)
        for name in ("context", "new_tokens", "repeats", "quality_windows", "calibration"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("batches", "matmul_rows"):
            values = tuple(getattr(self, name))
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name} must be positive integers, got {list(values)}")
            setattr(self, name, values)
        self.shape = shape_config(self.shape)
        self.device = torch.device(self.device) if self.device is not None else best_device()


# ---------------------------------------------------------------------------------------------
# One layer: where weight-only quantization pays and where it costs


MATMUL_FORMATS = ("fp32", "bf16", "int8", "int4 g128", "int4 g32", "fp8 e4m3", "w8a8")


def _format_layer(name: str, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """y = x @ W^T with W stored in format ``name``; x in bf16 (fp32 for the fp32 row)."""
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device)
    lin.weight.data = weight.float()
    if name == "fp32":
        return lambda x: F.linear(x.float(), lin.weight)
    if name == "bf16":
        w = weight.bfloat16()
        return lambda x: F.linear(x, w)
    scheme, _, group = name.partition(" g")
    scheme = "fp8" if scheme.startswith("fp8") else scheme
    layer = QuantizedLinear.from_linear(lin, QuantSpec.make(scheme, int(group) if group else None))
    layer.to(torch.bfloat16)
    return layer


ROTATE_BYTES = 256e6  # fp32 weight bytes the copies of one layer span: more than any last-level cache


def matmul_copies(shape: tuple[int, int]) -> int:
    """How many copies of an (N, K) layer the single-layer timing cycles through, so that each call
    reads weights no earlier call left in the cache: enough for ``ROTATE_BYTES`` of fp32, at most 16."""
    return max(1, min(16, math.ceil(ROTATE_BYTES / (4 * shape[0] * shape[1]))))


@torch.inference_mode()
def matmul_times(o: CompressionBench) -> list[dict]:
    """Median ms of one (N, K) linear layer in each format, at each number of input rows. Each
    format cycles through ``matmul_copies`` layers of its own (different random weights), one per
    call, so that a timing reads its weights from memory, as a decode step reads a model larger
    than the cache, rather than from a last-level cache the previous call filled."""
    n, k = o.matmul_shape
    copies = matmul_copies(o.matmul_shape)
    weights = [torch.randn(n, k, device=o.device) * 0.02 for _ in range(copies)]
    layers = {name: [_format_layer(name, w) for w in weights] for name in o.matmul_formats}
    warm = torch.randn(1, k, device=o.device).bfloat16()
    for fs in layers.values():  # each copy once, untimed: a kernel packs its weights on first use
        for f in fs:
            f(warm)
    turns = {name: itertools.cycle(fs) for name, fs in layers.items()}
    rows = []
    for m in o.matmul_rows:
        x = torch.randn(m, k, device=o.device).bfloat16()
        runs = {name: lambda t=t, x=x: next(t)(x) for name, t in turns.items()}
        timings = interleaved(runs, o.repeats + 2, o.device)
        paths = {name: getattr(fs[0], "path", "dense") for name, fs in layers.items()}
        bf16, fp32 = timings[BASELINE].median, timings["fp32"].median
        for name in layers:
            t = timings[name].median
            row = {"format": name, "rows": m, "ms": 1e3 * t, "vs_bf16": bf16 / t, "vs_fp32": fp32 / t}
            rows.append({**row, "kernel": paths[name]})
    return rows


# ---------------------------------------------------------------------------------------------
# A true-size model: decode speed


def structured_shape(config: ModelConfig, heads: float = 0.25, neurons: float = 0.25) -> ModelConfig:
    """The shape structured pruning leaves: ``heads`` of the K/V head groups (whole groups, so that
    GQA stays regular) and ``neurons`` of the FFN neurons removed from every layer."""
    kv = max(1, round(config.n_kv_heads * (1 - heads)))
    group = config.n_heads // config.n_kv_heads
    return config.replace(n_kv_heads=kv, n_heads=kv * group, ffn_dim=round(config.ffn_dim * (1 - neurons)))


def _speed_model(name: str, config: ModelConfig, device: torch.device) -> Transformer:
    if name == "structured 25%":
        return random_model(structured_shape(config), device, torch.bfloat16)
    fp32 = name == "fp32" or (name == "w8a8" and device.type == "cpu")  # integers inside: no bf16 needed
    model = random_model(config, device, torch.float32 if fp32 else torch.bfloat16)
    return technique(name).apply(model, None) if name not in ("fp32", "bf16") else model


@torch.inference_mode()
def decode_speed(o: CompressionBench) -> list[dict]:
    """Decode tokens/s of each technique at each batch on a random ``o.shape`` model, taking turns."""
    config = o.shape
    # a row that times like another (same kernel) is timed once, under the other's name
    timed = list(dict.fromkeys([BASELINE] + [technique(n).speed_as or n for n in o.techniques]))
    models = {name: _speed_model(name, config, o.device) for name in timed}
    return [row for batch in o.batches for row in _decode_at(batch, models, o)]


def _decode_at(batch: int, models: dict[str, Transformer], o: CompressionBench) -> list[dict]:
    """Every model decoding ``batch`` sequences, taking turns (the caches are freed on return)."""
    caches = {name: KVCache.for_model(m, batch, o.context + o.new_tokens + 1) for name, m in models.items()}
    for name, m in models.items():
        fill_with_random(caches[name], m.config, o.context)
    timings = interleaved(
        {name: lambda m=m, c=caches[name]: decode_steps(m, c, o.new_tokens) for name, m in models.items()},
        o.repeats,
        o.device,
        after=lambda name: roll_back(caches[name], o.new_tokens),
        progress=f"decode, batch {batch}" if o.progress else None,
    )
    base = timings[BASELINE].median
    rows = []
    for name, m in models.items():
        paths = sorted({layer.path for layer in quantized_layers(m).values()}) or ["dense"]
        t = timings[name].median
        rows.append(
            {
                "technique": name,
                "batch": batch,
                "tokens_per_s": batch * o.new_tokens / t,
                "vs_bf16": base / t,
                "model_bytes": model_bytes(m),
                "parameters": m.num_params(),
                "kernel": ", ".join(paths),
            }
        )
    return rows


# ---------------------------------------------------------------------------------------------
# Trained weights: what each technique costs in quality


@torch.inference_mode()
def quality(o: CompressionBench) -> list[dict]:
    """Perplexity (validation windows of 256), greedy agreement over 32 generated tokens after 8
    prompts, and logit difference of each technique on the trained ``o.model``, in fp32."""
    reference, tokenizer = load(o.model, device=o.device, dtype=torch.float32)
    valid = encode_split(tokenizer, "valid")
    calib = calibration_batches(tokenizer, o.calibration, 256)
    prompts = corpus_prompts(tokenizer, 8, 32)
    ids = valid[: 4 * 256].view(4, 256).to(o.device)
    rows = [{"technique": "fp32 (reference)", "perplexity": perplexity(reference, valid, 256, o.quality_windows)}]
    for name in o.techniques:
        t = technique(name)
        if name in ("fp32", "bf16"):
            model = reference if name == "fp32" else copy.deepcopy(reference).bfloat16()
        else:
            with torch.enable_grad():  # calibrated methods may train (recovery) or solve in fp32
                model = t.apply(copy.deepcopy(reference), calib.to(o.device))
        diff = logit_difference(model, reference, ids)
        rows.append(
            {
                "technique": name,
                "perplexity": perplexity(model, valid, 256, o.quality_windows),
                "agreement": continuation_agreement(model, reference, prompts, 32),
                "max_logit_diff": diff["max_abs"],
                "mean_logit_diff": diff["mean_abs"],
                "model_bytes": model_bytes(model),
                "needs": t.needs,
            }
        )
    return rows


def bench_compression(o: CompressionBench) -> dict:
    """The benchmark command's figures with their provenance."""
    config = o.shape
    models = [f"random {config.name} (speed)" if o.measure_speed else None, o.model if o.measure_quality else None]
    dtypes = ["bfloat16 (speed)" if o.measure_speed else None, "float32 (quality)" if o.measure_quality else None]
    if o.measure_quality and o.measure_speed:
        models[1] += " (quality)"
    result = provenance(
        o.device,
        model=", ".join(m for m in models if m),
        dtype=", ".join(d for d in dtypes if d),
        shape=config.name,
        parameters=config.num_params(),
        batches=list(o.batches),
        context=o.context,
        new_tokens=o.new_tokens,
        repeats=o.repeats,
        matmul_shape=list(o.matmul_shape),
        matmul_copies=matmul_copies(o.matmul_shape),
        quality_model=o.model,
        quality_tokens=o.quality_windows * 256,
        calibration_tokens=o.calibration * 256,
    )
    if o.measure_speed:
        result["matmul"] = matmul_times(o)
        result["decode"] = decode_speed(o)
    if o.measure_quality:
        result["quality"] = quality(o)
    return finish_provenance(result)


# ---------------------------------------------------------------------------------------------
# Tables


def format_matmul(result: dict) -> str:
    n, k = result["matmul_shape"]
    copies = result.get("matmul_copies")
    cycled = f", cycling {copies} copies ({copies * n * k * 4 / 1e6:.0f} MB in fp32)" if copies else ""
    title = f"One {n} x {k} linear layer{cycled}, median ms (x in bf16) on {describe(result)}"
    rows = [{**r, "speed": f"{r['vs_bf16']:.2f}x", "vs32": f"{r['vs_fp32']:.2f}x"} for r in result["matmul"]]
    columns = {
        "format": "weights",
        "rows": "tokens",
        "ms": "ms",
        "speed": "vs bf16",
        "vs32": "vs fp32",
        "kernel": "kernel",
    }
    return format_table(rows, columns, title=title)


def format_decode(result: dict) -> str:
    title = (
        f"Decode on a random {result['shape']}, context {result['context']}, median of "
        f"{result['repeats']} x {result['new_tokens']} steps, on {describe(result)}"
    )
    rows = [
        {**r, "mb": r["model_bytes"] / 1e6, "speed": f"{r['vs_bf16']:.2f}x"}
        for r in sorted(result["decode"], key=lambda r: (r["batch"], TECHNIQUE_NAMES.index(r["technique"])))
    ]
    columns = {
        "technique": "technique",
        "batch": "batch",
        "mb": "MB",
        "tokens_per_s": "tok/s",
        "speed": "vs bf16",
        "kernel": "kernel",
    }
    return format_table(rows, columns, title=title)


def format_quality(result: dict) -> str:
    rows = [r for r in result["quality"] if r["technique"] != "fp32 (reference)"]
    base = baseline_perplexity(result)
    shown = [
        {
            **r,
            "mb": r["model_bytes"] / 1e6,
            "ppl_change": signed_pct(100 * (r["perplexity"] / base - 1)) if base else "-",
            "agree": f"{r['agreement']:.1%}",
        }
        for r in rows
    ]
    title = (
        f"Quality on {result['quality_model']} ({result['quality_tokens']:,} validation tokens, fp32), "
        f"{result['hardware']}"
    )
    columns = {
        "technique": "technique",
        "mb": "MB",
        "perplexity": "perplexity",
        "ppl_change": "vs fp32",
        "agree": "greedy agreement",
        "max_logit_diff": "max |dlogit|",
        "needs": "needs",
    }
    return format_table(rows=shown, columns=columns, title=title)


def baseline_perplexity(result: dict) -> float | None:
    """The unquantized model's perplexity: the quality table's reference row (or its fp32 row)."""
    rows = {r["technique"]: r["perplexity"] for r in result.get("quality", [])}
    return rows.get("fp32 (reference)", rows.get("fp32"))


def summary_rows(result: dict, batch: int = 1) -> list[dict]:
    """One row per technique: bytes on the speed model, decode speed vs bf16, perplexity change
    vs fp32 on the trained model, and what it needs."""
    decode = {r["technique"]: r for r in result.get("decode", []) if r["batch"] == batch}
    qual = {r["technique"]: r for r in result.get("quality", [])}
    base_ppl = baseline_perplexity(result)
    rows = []
    for t in TECHNIQUES:
        if t.name not in decode and t.name not in qual:
            continue
        d = decode.get(t.speed_as or t.name)
        q = qual.get(t.name)
        # a row timed as another (same stored format, or a dense matrix of zeros) says so: *
        borrowed = t.speed_as is not None and t.speed_as != t.name
        rows.append(
            {
                "technique": t.name,
                "bytes": (f"{d['model_bytes'] / decode[BASELINE]['model_bytes']:.2f}x" + "*" * borrowed) if d else "-",
                "speed": (f"{d['vs_bf16']:.2f}x" + "*" * borrowed) if d else "-",
                "quality": signed_pct(100 * (q["perplexity"] / base_ppl - 1)) + " ppl" if q and base_ppl else "-",
                "needs": t.needs,
            }
        )
    return rows


def format_summary(result: dict, batch: int = 1) -> str:
    columns = {
        "technique": "technique",
        "bytes": "bytes vs bf16",
        "speed": f"decode at batch {batch} vs bf16",
        "quality": "perplexity",
        "needs": "needs",
    }
    where = [f"random {result['shape']} (speed)" if "shape" in result else None]
    where.append(f"{result.get('quality_model', 'minillm-target')} (quality)" if "quality" in result else None)
    title = f"Summary: {', '.join(w for w in where if w)}, on {result['hardware']}"
    rows = summary_rows(result, batch)
    text = format_table(rows, columns, title=title)
    if any(r["speed"].endswith("*") for r in rows):
        note = (
            "* not timed: the row's bytes and speed are those of the format it stores (GPTQ and AWQ: "
            "int4 g128's codes), or of bf16 for unstructured and 2:4 sparsity, which a dense kernel "
            "multiplies at full price (no sparse kernel here)."
        )
        text += "\n" + "\n".join(wrap_line(note))
    return text


def format_compression(result: dict) -> str:
    parts = []
    if "matmul" in result:
        parts += [format_matmul(result), format_decode(result)]
    if "quality" in result:
        parts.append(format_quality(result))
    parts.append(format_summary(result))
    return "\n\n".join(parts)


def format_gpu_decode(gpu_check: dict) -> str | None:
    """The compression rows of a saved ``make gpu-check`` (None if it has none): decode of a random
    Llama-3-8B in 16 bits and quantized, CUDA-graphed tokens/s at batch 1 and 16."""
    section = gpu_check.get("sections", {}).get("compression", {})
    rows = []
    for r in section.get("decode", []):
        b1, b16 = r.get("batch_1", {}), r.get("batch_16", {})
        rows.append(
            {
                "weights": r.get("scheme"),
                "GB": r["model_bytes"] / 1e9 if "model_bytes" in r else None,
                "b1": b1.get("graphed_tokens_per_s"),
                "b16": b16.get("graphed_tokens_per_s"),
                "GB/s": b1.get("GB_s"),
                "note": r.get("skipped") or r.get("error", "")[:40] or None,
            }
        )
    if not rows:
        return None
    columns = {
        "weights": "weights",
        "GB": "GB",
        "b1": "tok/s b1",
        "b16": "tok/s b16",
        "GB/s": "GB/s b1",
        "note": "note",
    }
    title = f"make gpu-check: {section.get('model', 'Llama-3-8B')}, CUDA graphs, on {gpu_check.get('gpu', '?')}"
    return format_table(rows, columns, title=title)
