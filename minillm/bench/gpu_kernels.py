"""The kernel sections of the GPU check (``minillm.bench.gpu``, which runs them and writes the JSON):

- ``check_correctness``: every kernel of ``kernels/`` in each dtype the GPU supports against its
  PyTorch reference;
- ``attention_speed``: fused attention (FlashAttention-2 style, Dao 2023) TFLOP/s vs torch SDPA's
  flash backend and vs the naive N x N version, FLOPs counted by ``attention_flops``;
- ``paged_bandwidth``: the paged decode kernel's (PagedAttention, Kwon et al. 2023) GB/s, as a
  share of a measured device-to-device copy.

Each fills the dict it is given row by row; a row that fails records its error, a
``SectionTimeout`` (raised by the check's time limit) stops the section. The Triton kernels are
imported inside the functions that run them: a machine without triton still imports this module.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..core.attention import attention_reference
from ..core.config import ceil_div
from ..core.device import cuda_half_dtype
from ..core.model import rms_norm_reference
from ..kv.paged import paged_attention_decode
from ..measure.timing import repeat
from .roofline import measure_bandwidth

GOALS = {
    "attention_vs_sdpa": "fused attention >= SDPA (flash) TFLOP/s at hd 128, seq 4k, causal, bf16",
    "paged_bandwidth": "paged decode >= 70% of the measured copy bandwidth",
    "compiled_decode_mbu": "compiled decode MBU >= 60%",
    "int8_decode_speedup": "int8 weight-only decode >= 1.4x bf16 tokens/s at batch 1 (CUDA graphs)",
    "int4_decode_speedup": "int4 (g128) weight-only decode >= 1.8x bf16 tokens/s at batch 1 (CUDA graphs)",
}


class SectionTimeout(Exception):
    """A section ran past its time limit."""


def attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, causal: bool) -> float:
    """FLOPs of attention's two matmuls, counting only the (query, key) pairs that are computed.

    Each visible pair costs 2 * hd for q.k and 2 * hd for p.v. Non-causal: q_len * kv_len pairs.
    Causal with the queries last (query i at kv_len - q_len + i): kv_len - q_len + i + 1 pairs
    for row i, q_len * (kv_len - q_len) + q_len * (q_len + 1) / 2 in all (about half for q == kv).
    """
    if min(batch, heads, q_len, kv_len, head_dim) <= 0 or q_len > kv_len:
        raise ValueError("sizes must be positive and q_len <= kv_len")
    pairs = q_len * kv_len if not causal else q_len * (kv_len - q_len) + q_len * (q_len + 1) / 2
    return 4.0 * batch * heads * head_dim * pairs


def cuda_time(fn: Callable[[], object], target_s: float = 0.3, max_reps: int = 50) -> float:
    """Median seconds of fn on the GPU (the timing harness, device synced); fewer repeats for slow calls."""
    once = repeat(fn, 1, "cuda", warmup=1).median  # the warm-up call compiles
    reps = int(min(max_reps, max(3, target_s / max(once, 1e-6))))
    return repeat(fn, reps, "cuda", warmup=0).median


def _max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref.float()).abs().max().item()


def _dtypes() -> list[torch.dtype]:
    bf16 = [torch.bfloat16] if torch.cuda.is_bf16_supported(including_emulation=False) else []
    return [torch.float16, *bf16, torch.float32]


TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 1e-4}


def _guarded_row(rows: list, meta: dict, max_err: Callable[[], float], tol: float) -> None:
    """Append one correctness row; an exception (e.g. out of shared memory) is recorded, not raised."""
    try:
        err = max_err()
        rows.append({**meta, "max_err": err, "ok": err < tol})
    except SectionTimeout:
        raise
    except Exception as exc:
        rows.append({**meta, "error": f"{type(exc).__name__}: {exc}"[:500], "ok": False})


def _randn(*shape: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)


def _flash_error(case: tuple, dtype: torch.dtype, g: torch.Generator) -> float:
    """Max error of the fused kernel on one FLASH_CASES entry (B, H, Hkv, T, S, hd, causal)."""
    from minillm.kernels.flash_attention import flash_attention

    B, H, Hkv, T, S, hd, causal = case
    q = _randn(B, H, T, hd, dtype=dtype, g=g)  # (B, H, T, hd)
    k, v = _randn(B, Hkv, S, hd, dtype=dtype, g=g), _randn(B, Hkv, S, hd, dtype=dtype, g=g)  # (B, Hkv, S, hd)
    ref = attention_reference(q.float(), k.float(), v.float(), None, causal)
    return _max_err(flash_attention(q, k, v, causal), ref)


def _paged_error(H, Hkv, hd, bs, lens, dtype, g) -> float:
    from minillm.kernels.paged_attention import paged_attention_decode_triton

    B, width = len(lens), ceil_div(max(lens), bs)
    num_blocks = B * width + 5
    k_pool = _randn(num_blocks, bs, Hkv, hd, dtype=dtype, g=g)  # (num_blocks, bs, Hkv, hd)
    v_pool = _randn(num_blocks, bs, Hkv, hd, dtype=dtype, g=g)
    tables = torch.randperm(num_blocks)[: B * width].view(B, width).cuda()  # (B, M), scattered blocks
    lens_t, q = torch.tensor(lens, device="cuda"), _randn(B, H, hd, dtype=dtype, g=g)
    ref = paged_attention_decode(q.float(), k_pool.float(), v_pool.float(), tables, lens_t)
    return _max_err(paged_attention_decode_triton(q, k_pool, v_pool, tables, lens_t), ref)


def _rms_norm_error(dtype, g) -> float:
    from minillm.kernels.rmsnorm import rms_norm

    x, res = _randn(64, 4096, dtype=dtype, g=g), _randn(64, 4096, dtype=dtype, g=g)  # (rows, D)
    w = 1 + 0.1 * _randn(4096, dtype=dtype, g=g)  # near 1, as trained norms are: outputs stay O(1)
    y, new_res = rms_norm(x, w, 1e-5, residual=res)
    return max(
        _max_err(y, rms_norm_reference(x + res, w, 1e-5)),
        _max_err(new_res, x + res),
        _max_err(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5)),
    )


FLASH_CASES = [
    (2, 8, 8, 300, 300, 64, True),
    (1, 32, 8, 129, 1000, 128, True),
    (2, 8, 1, 77, 77, 128, False),
    (1, 16, 4, 1, 513, 64, False),
]  # (B, H, Hkv, T, S, hd, causal)
PAGED_CASES = [(32, 8, 128, 16, [1, 700, 4097]), (8, 8, 64, 32, [65, 3])]  # (H, Hkv, hd, block_size, lens)


def check_correctness(deadline: float, out: dict) -> None:
    """Every kernel against its reference, in each dtype the GPU supports natively."""
    rows = out["rows"] = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in _dtypes():
        tol, name = TOLERANCE[dtype], str(dtype).removeprefix("torch.")
        for case in FLASH_CASES:
            meta = {"kernel": "flash_attention", "dtype": name, "shape": list(case[:6]), "causal": case[6]}
            _guarded_row(rows, meta, lambda c=case, d=dtype: _flash_error(c, d, g), tol)
        for case in PAGED_CASES:
            meta = {"kernel": "paged_attention_decode", "dtype": name, "shape": list(case)}
            _guarded_row(rows, meta, lambda c=case, d=dtype: _paged_error(*c, d, g), tol)
        meta = {"kernel": "rms_norm", "dtype": name, "shape": [64, 4096]}
        _guarded_row(rows, meta, lambda d=dtype: _rms_norm_error(d, g), tol * 4)
    out["all_ok"] = all(r["ok"] for r in rows)


def _naive_fits(B: int, H: int, T: int) -> bool:
    """attention_reference holds a few fp32 (T, T) matrices per head: allow it 40% of free memory."""
    free, _ = torch.cuda.mem_get_info()
    return 0.4 * free > 4 * B * H * T * T * 4


def _attention_row(hd: int, T: int, causal: bool, dtype: torch.dtype) -> dict:
    """One (head dim, sequence, causal) case: MHA, 2048 / hd heads, about 16k tokens in the batch."""
    from minillm.kernels.flash_attention import flash_attention

    B, H = max(1, 16384 // T), 2048 // hd
    q, k, v = (torch.randn(B, H, T, hd, device="cuda", dtype=dtype) for _ in range(3))  # (B, H, T, hd)
    flops = attention_flops(B, H, T, T, hd, causal)
    row = {"hd": hd, "seq": T, "causal": causal, "batch": B, "heads": H, "dtype": str(dtype).removeprefix("torch.")}
    row["triton_tflops"] = _tflops(flops, lambda: flash_attention(q, k, v, causal))

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    row["sdpa_flash_tflops"] = _tflops(flops, sdpa)
    if _naive_fits(B, H, T):
        row["naive_tflops"] = _tflops(flops, lambda: attention_reference(q, k, v, None, causal))
    else:
        row["naive_tflops"] = "skipped: its N x N scores would not fit"
    return row


def attention_speed(deadline: float, out: dict) -> None:
    """TFLOP/s of the fused kernel, SDPA's flash backend and the naive version; the goal case first."""
    dtype = cuda_half_dtype()
    rows = out["rows"] = []
    for hd in (128, 64):
        for T in (4096, 1024, 16384):
            for causal in (True, False):
                if time.monotonic() > deadline:
                    rows.append({"hd": hd, "seq": T, "causal": causal, "skipped": "time budget"})
                    continue
                rows.append(
                    _guarded(
                        lambda h=hd, t=T, c=causal: _attention_row(h, t, c, dtype),
                        {"hd": hd, "seq": T, "causal": causal},
                    )
                )
                torch.cuda.empty_cache()
    goal_row = next((r for r in rows if r.get("hd") == 128 and r.get("seq") == 4096 and r.get("causal")), {})
    met = _ratio(goal_row.get("triton_tflops"), goal_row.get("sdpa_flash_tflops"))
    out["goal"] = {"text": GOALS["attention_vs_sdpa"], "ratio": met, "met": met is not None and met >= 1}


def _guarded(make_row: Callable[[], dict], meta: dict) -> dict:
    """make_row(), or meta with the error when it raises (a time-limit stop still propagates)."""
    try:
        return make_row()
    except SectionTimeout:
        raise
    except Exception as exc:
        torch.cuda.empty_cache()
        return {**meta, "error": f"{type(exc).__name__}: {exc}"[:500]}


def _tflops(flops: float, fn: Callable[[], object]) -> float | str:
    try:
        return flops / cuda_time(fn) / 1e12
    except SectionTimeout:
        raise
    except Exception as exc:  # one backend failing (e.g. SDPA flash unavailable) must not sink the row
        torch.cuda.empty_cache()
        return f"error: {type(exc).__name__}: {exc}"[:300]


def _ratio(a, b) -> float | None:
    return a / b if isinstance(a, float) and isinstance(b, float) and b > 0 else None


def _paged_row(B: int, ctx: int, H: int, Hkv: int, hd: int, bs: int, dtype: torch.dtype, copy_bw: float) -> dict:
    """B sequences of ctx tokens each, their blocks shuffled over the pool."""
    from minillm.kernels.paged_attention import paged_attention_decode_triton

    width = ctx // bs
    k_pool, v_pool = (torch.randn(B * width, bs, Hkv, hd, device="cuda", dtype=dtype) for _ in range(2))
    tables = torch.randperm(B * width, device="cuda").view(B, width)  # (B, M)
    lens = torch.full((B,), ctx, device="cuda")
    q = torch.randn(B, H, hd, device="cuda", dtype=dtype)  # (B, H, hd)
    nbytes = 2 * B * ctx * Hkv * hd * k_pool.element_size()  # K and V, each read once
    seconds = cuda_time(lambda: paged_attention_decode_triton(q, k_pool, v_pool, tables, lens))
    row = {"batch": B, "context": ctx, "GB_s": nbytes / seconds / 1e9, "pct_of_copy": nbytes / seconds / copy_bw}
    if B * ctx <= 262144:
        ref_s = cuda_time(lambda: paged_attention_decode(q, k_pool, v_pool, tables, lens), max_reps=10)
        row["gather_reference_GB_s"] = nbytes / ref_s / 1e9
    return row


def paged_bandwidth(deadline: float, out: dict) -> None:
    """GB/s of the paged decode kernel (Llama-3-8B attention shape, blocks scattered) vs a plain copy."""
    copy_bw = max(measure_bandwidth("cuda", megabytes=1024) for _ in range(3))
    out["copy_GB_s"] = copy_bw / 1e9
    dtype = cuda_half_dtype()
    shape = out["shape"] = {"H": 32, "Hkv": 8, "hd": 128, "bs": 16}
    rows = out["rows"] = []
    for B, ctx in [(64, 4096), (16, 16384), (8, 32768), (1, 131072)]:
        if time.monotonic() > deadline:
            rows.append({"batch": B, "context": ctx, "skipped": "time budget"})
            continue
        rows.append(
            _guarded(
                lambda b=B, c=ctx: _paged_row(b, c, **shape, dtype=dtype, copy_bw=copy_bw), {"batch": B, "context": ctx}
            )
        )
        torch.cuda.empty_cache()
    best = max((r["pct_of_copy"] for r in rows if "pct_of_copy" in r), default=None)
    out["goal"] = {"text": GOALS["paged_bandwidth"], "best_pct": best, "met": best is not None and best >= 0.7}
