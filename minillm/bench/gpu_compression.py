"""The compression section of the GPU check (``minillm.bench.gpu`` runs it and writes the JSON):

- ``decode``: tokens/s of a random-weight Llama-3-8B-shaped model at batch 1 and 16, in bf16
  and quantized weight-only with ``minillm.compression.quantize`` (round to nearest) to int8,
  int4 (groups of 128) and fp8 (compute capability >= 8.9), with the path each layer took
  (``QuantizedLinear.path``), the model's bytes and the GB/s a step achieved. A decode step
  reads every weight once: at batch 1 its time is weight bytes / bandwidth, and quantization
  pays exactly insofar as the kernels read the packed weights at the speed of a copy.
- ``kernels``: one linear of the down projection's shape (4096 x 14336) at 1 and 16 rows,
  through every candidate kernel of ``minillm.compression.cuda_kernels`` (and the dense and
  dequantize-then-matmul references): which is fastest, and whether the preferred one is.
- ``sparse_2_4``: one 4096 -> 14336 linear with a 2:4 semi-structured sparse fp16 weight
  (two of every four weights zero, Mishra et al., 2021; ``torch.sparse.to_sparse_semi_structured``)
  against the same weight dense.

Decode runs eagerly once (which picks and checks each layer's kernel and compiles the Triton
ones), then as one CUDA graph per step (``torch.cuda.CUDAGraph``, no ``torch.compile``: four
8B models compile in no time limit this check can afford; the decode section measures what
compilation adds on top). The models are built one at a time, quantized in place layer by
layer on the GPU, and freed before the next: at most one bf16 copy (16 GB) is held.
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..compression import cuda_kernels, model_bytes, quantize
from ..compression.fastpath import check_kernel
from ..compression.quant import QuantizedLinear, QuantSpec, quantized_layers
from ..core.device import cuda_half_dtype
from ..core.model import Transformer, random_model
from .gpu_decode import TIMER, cuda_graphed, decode_bytes, decode_step, median_step_seconds
from .gpu_kernels import GOALS, SectionTimeout, _guarded, cuda_time
from .roofline import measure_bandwidth

SCHEMES = [(None, None), ("int8", None), ("int4", 128), ("fp8", None), ("w8a8", None)]  # None: as built
BATCHES = (1, 16)
STEPS, MAX_LEN = 48, 256
SPEEDUP_GOALS = [("int8_decode_speedup", "int8", 1.4), ("int4_decode_speedup", "int4-g128", 1.8)]  # vs the 16-bit row
KERNEL_SHAPE = (4096, 14336)  # (N, K) of Llama-3-8B's down projection: the deepest K
SPARSE_SHAPE = (14336, 4096)  # (N, K) of one of its gate / up projections


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _decode_entry(model: Transformer, batch: int, steps: int, eager: bool, graphed: bool) -> dict:
    step, cache = decode_step(model, batch, MAX_LEN)
    nbytes = decode_bytes(model, cache)
    entry: dict = {"bytes_per_step": nbytes}
    if eager:
        entry["eager_tokens_per_s"] = batch / median_step_seconds(step, batch, steps, model.device)
    if graphed:
        seconds = median_step_seconds(cuda_graphed(step, batch), batch, steps, model.device)
        entry.update(graphed_tokens_per_s=batch / seconds, GB_s=nbytes / seconds / 1e9)
    return entry


def scheme_row(
    make_model: Callable[[], Transformer],
    label: str,
    scheme: str | None,
    group_size: int | None,
    batches: tuple[int, ...] = BATCHES,
    steps: int = STEPS,
    graphed: bool = True,
) -> dict:
    """Build a model, quantize it in place (``scheme`` None: as it is), decode at each batch size;
    the model is freed before this returns."""
    cuda_kernels.rejected.clear()
    model = make_model()
    try:
        return _measure(model, label, scheme, group_size, batches, steps, graphed)
    finally:
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _measure(model, label, scheme, group_size, batches, steps, graphed) -> dict:
    """Eager decoding only at the first batch size (it also picks and checks each layer's kernel)."""
    row: dict = {"scheme": label}
    if scheme is not None:
        t0 = time.perf_counter()
        quantize(model, scheme, group_size)
        _sync(model.device)
        row["quantize_s"] = time.perf_counter() - t0
    row["model_bytes"] = model_bytes(model)
    for i, batch in enumerate(batches):
        row[f"batch_{batch}"] = _guarded(
            lambda b=batch, eager=i == 0: _decode_entry(model, b, steps, eager, graphed), {"batch": batch}
        )
    paths = Counter(layer.path for layer in quantized_layers(model).values())
    row["paths"] = dict(paths) or {"nn.Linear (dense)": sum(isinstance(m, nn.Linear) for m in model.modules())}
    row["rejected"] = dict(cuda_kernels.rejected)  # candidates passed over, and why
    return row


def speedup_goals(rows: list[dict]) -> list[dict]:
    """The batch-1 decode speedups over the 16-bit model (CUDA-graphed tokens/s) against their goals."""
    rate = {r.get("scheme"): r.get("batch_1", {}).get("graphed_tokens_per_s") for r in rows}
    base = rate.get("bf16", rate.get("fp16"))
    goals = []
    for key, label, target in SPEEDUP_GOALS:
        got = rate.get(label)
        ratio = got / base if isinstance(got, float) and isinstance(base, float) and base > 0 else None
        goals.append({"text": GOALS[key], "speedup": ratio, "met": ratio is not None and ratio >= target})
    return goals


# ---------------------------------------------------------------------------------------------
# One linear, kernel by kernel


def _time_row(meta: dict, fn: Callable[[Tensor], Tensor], xs: dict[int, Tensor], nbytes: int) -> dict:
    """Microseconds and GB/s (weight bytes + x's) of fn at each row count M."""
    row = dict(meta)
    for m, x in xs.items():
        seconds = cuda_time(lambda x=x: fn(x))
        row[f"M{m}_us"] = seconds * 1e6
        row[f"M{m}_GB_s"] = (nbytes + x.nbytes) / seconds / 1e9
    return row


def kernel_rows(dtype: torch.dtype, deadline: float) -> list[dict]:
    """Every candidate kernel of every scheme on one (N, K) = KERNEL_SHAPE linear, M = 1 and 16."""
    n, k = KERNEL_SHAPE
    linear = nn.Linear(k, n, bias=False, device="cuda", dtype=dtype)
    nn.init.normal_(linear.weight, std=0.02)
    xs = {m: torch.randn(m, k, device="cuda", dtype=dtype) for m in (1, 16)}
    rows = [_time_row({"kernel": f"dense {str(dtype)[6:]} (F.linear)"}, linear, xs, linear.weight.nbytes)]
    specs = [QuantSpec.make("int8"), QuantSpec.make("int4", 128)]
    if torch.cuda.get_device_capability() >= (8, 9):
        specs.append(QuantSpec.make("fp8"))
    for spec in specs:
        rows += _scheme_kernel_rows(QuantizedLinear.from_linear(linear, spec), dtype, xs, deadline)
    return rows


def _scheme_kernel_rows(layer: QuantizedLinear, dtype: torch.dtype, xs: dict[int, Tensor], deadline: float) -> list:
    nbytes = sum(b.nbytes for b in (layer.qweight, layer.scales, layer.zeros) if b is not None)
    meta = _meta(layer.spec, "reference (dequantize, then F.linear)")
    rows = [_guarded(lambda m=meta: _time_row(m, layer.forward_reference, xs, nbytes), meta)]
    for name, build in cuda_kernels.candidates(layer, dtype):
        meta = _meta(layer.spec, name)
        if time.monotonic() > deadline:
            rows.append({**meta, "skipped": "time budget"})
            continue
        rows.append(_guarded(lambda m=meta, b=build: _candidate_row(m, b, layer, dtype, xs, nbytes), meta))
    return rows


def _meta(spec: QuantSpec, kernel: str) -> dict:
    return {"scheme": spec.label, "kernel": kernel}


def _candidate_row(meta, build, layer, dtype, xs, nbytes) -> dict:
    try:
        kernel = check_kernel(build(layer, dtype), layer, torch.device("cuda"), dtype)
    except cuda_kernels.Unsupported as exc:
        return {**meta, "skipped": str(exc)}
    if kernel is None:
        return {**meta, "error": "disagrees with the dequantize-then-matmul reference"}
    x = xs[max(xs)]
    ref = layer.forward_reference(x).float()
    rel_err = ((kernel(x).float() - ref).abs().max() / ref.abs().max()).item()  # bf16 here, which the CPU tests skip
    return _time_row({**meta, "rel_err": rel_err}, kernel, xs, nbytes)


# ---------------------------------------------------------------------------------------------
# 2:4 semi-structured sparsity


def two_four_mask(w: Tensor) -> Tensor:
    """Keep the 2 largest-magnitude weights of every 4 consecutive ones along K: w (N, K) -> bool (N, K)."""
    n, k = w.shape
    if k % 4:
        raise ValueError(f"2:4 sparsity needs K a multiple of 4, got {k}")
    quads = w.abs().view(n, k // 4, 4)
    keep = torch.zeros_like(quads, dtype=torch.bool).scatter_(-1, quads.topk(2, dim=-1).indices, True)
    return keep.view(n, k)


def sparse_rows(deadline: float) -> dict:
    """Dense vs 2:4 semi-structured sparse fp16 matmul of one SPARSE_SHAPE linear."""
    if torch.cuda.get_device_capability() < (8, 0):
        return {"skipped": "2:4 sparse tensor cores need compute capability 8.0"}
    from torch.sparse import to_sparse_semi_structured

    n, k = SPARSE_SHAPE
    w = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
    w = w * two_four_mask(w)  # (N, K), half of it zeros
    sparse = to_sparse_semi_structured(w)
    out = {"shape": [n, k], "dtype": "float16", "cusparselt": _cusparselt(), "rows": []}
    for m in (1, 16, 4096):
        if time.monotonic() > deadline:
            out["rows"].append({"M": m, "skipped": "time budget"})
            continue
        out["rows"].append(_guarded(lambda m=m: _sparse_row(m, w, sparse), {"M": m}))
    return out


def _cusparselt() -> bool:
    """Whether PyTorch has cuSPARSELt (else its 2:4 matmuls run on CUTLASS kernels)."""
    backend = getattr(torch.backends, "cusparselt", None)
    return bool(backend is not None and backend.is_available())


def _sparse_row(m: int, w: Tensor, sparse: Tensor) -> dict:
    x = torch.randn(m, w.shape[1], device="cuda", dtype=w.dtype)
    err = (F.linear(x, sparse).float() - F.linear(x, w).float()).abs().max().item()
    dense_s = cuda_time(lambda: F.linear(x, w))
    sparse_s = cuda_time(lambda: F.linear(x, sparse))
    return {
        "M": m,
        "dense_us": dense_s * 1e6,
        "sparse_us": sparse_s * 1e6,
        "speedup": dense_s / sparse_s,
        "max_abs_err": err,
    }


# ---------------------------------------------------------------------------------------------
# The section


def compression_speed(deadline: float, out: dict) -> None:
    """Decode of Llama-3-8B in 16 bits, int8 and int4; the kernel and 2:4 sparse tables; fp8 decode."""
    dtype = cuda_half_dtype()
    copy_bw = max(measure_bandwidth("cuda", megabytes=1024) for _ in range(3))
    out.update(
        model="Llama-3-8B (random weights)",
        dtype=str(dtype)[6:],
        method="rtn; eager once, then one CUDA graph per step",
        steps=STEPS,
        timer=TIMER,
        cache_slots=MAX_LEN,
        copy_GB_s=copy_bw / 1e9,
    )
    rows = out["decode"] = []
    free = torch.cuda.mem_get_info()[0]
    for scheme, group in SCHEMES[:3]:  # the goals' rows first; fp8 after the two small tables
        rows.append(_decode_row(scheme, group, dtype, free, copy_bw, deadline))
        out["goals"] = speedup_goals(rows)
    out["kernels"] = _section_part(lambda: kernel_rows(dtype, deadline), deadline)
    out["sparse_2_4"] = _section_part(lambda: sparse_rows(deadline), deadline)
    for scheme, group in SCHEMES[3:]:
        rows.append(_decode_row(scheme, group, dtype, free, copy_bw, deadline))


def _decode_row(scheme: str | None, group: int | None, dtype: torch.dtype, free: int, copy_bw: float, deadline) -> dict:
    label = QuantSpec.make(scheme, group).label if scheme else str(dtype)[6:]
    meta = {"scheme": label}
    if free < 20e9:
        return {**meta, "skipped": f"needs ~20 GB free for Llama-3-8B in 16 bits, {free / 1e9:.1f} GB free"}
    if scheme == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        return {**meta, "skipped": "fp8 e4m3 needs compute capability 8.9"}
    if time.monotonic() > deadline:
        return {**meta, "skipped": "time budget"}

    def make() -> Transformer:
        return random_model("Llama-3-8B", "cuda", dtype)

    row = _guarded(lambda: scheme_row(make, label, scheme, group), meta)
    for batch in BATCHES:
        entry = row.get(f"batch_{batch}", {})
        if "GB_s" in entry:
            entry["pct_of_copy"] = entry["GB_s"] * 1e9 / copy_bw
    return row


def _section_part(make: Callable[[], object], deadline: float):
    """make(), or why not: past the soft deadline, or its error (a time-limit stop propagates)."""
    if time.monotonic() > deadline:
        return {"skipped": "time budget"}
    try:
        return make()
    except SectionTimeout:
        raise
    except Exception as exc:
        torch.cuda.empty_cache()
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
