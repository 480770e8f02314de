"""One script for a CUDA machine: are the kernels correct there, and how fast are they?

``make gpu-check`` (or ``python -m minillm.bench.gpu``) writes results/<gpu>/gpu_check.json:

- correctness of every kernel in fp16 and bf16 (and fp32) against its PyTorch reference;
- fused attention (FlashAttention-2 style, Dao 2023) TFLOP/s vs torch SDPA's flash backend and vs
  the naive N x N PyTorch version, at sequence 1k/4k/16k, head dim 64/128, causal and not;
- the paged decode kernel's (PagedAttention, Kwon et al. 2023) achieved bandwidth at long
  contexts, in GB/s and as a share of a measured device-to-device copy;
- decode tokens/s and MBU of a random-weight Llama-3-8B-shaped model, eager vs
  ``torch.compile(mode="reduce-overhead")`` (CUDA graphs).

Every section runs under its own time limit and inside try/except: a failure is recorded in the
JSON and the next section runs. The JSON is rewritten after each section, so a run cut short
keeps what it measured. Without CUDA the script says so and exits 0, writing nothing.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..core.device import hardware_description
from ..core.model import attention_reference, random_model, rms_norm_reference
from ..kv.paged import paged_attention_decode
from ..kv.static import StaticDecodeCache
from ..measure.roofline import DATASHEETS
from .report import gpu_slug, result_path
from .roofline import measure_bandwidth
from .timing import repeat, timed

GOALS = {
    "attention_vs_sdpa": "fused attention >= SDPA (flash) TFLOP/s at hd 128, seq 4k, causal, bf16",
    "paged_bandwidth": "paged decode >= 70% of the measured copy bandwidth",
    "compiled_decode_mbu": "compiled decode MBU >= 60%",
}
SECTION_LIMITS_S = {"correctness": 75, "attention_speed": 130, "paged_bandwidth": 50, "decode": 190}  # 7.4 min in all


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


def datasheet_bandwidth(gpu_name: str) -> float | None:
    """Peak memory bandwidth (bytes/s) from minillm.measure.roofline.DATASHEETS when the GPU is listed."""
    key = gpu_slug(gpu_name)
    for acc in DATASHEETS:
        if acc.name.lower().split("-")[0] in key:
            return acc.bandwidth_tb_s * 1e12
    return None


@contextmanager
def time_limit(seconds: int):
    """Raise SectionTimeout in the main thread after ``seconds`` (checked between Python bytecodes)."""

    def _raise(signum, frame):
        raise SectionTimeout(f"ran past its {seconds} s limit")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


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


def _flash_error(B, H, Hkv, T, S, hd, causal, dtype, g) -> float:
    from kernels.flash_attention import flash_attention

    q = _randn(B, H, T, hd, dtype=dtype, g=g)  # (B, H, T, hd)
    k, v = _randn(B, Hkv, S, hd, dtype=dtype, g=g), _randn(B, Hkv, S, hd, dtype=dtype, g=g)  # (B, Hkv, S, hd)
    ref = attention_reference(q.float(), k.float(), v.float(), None, causal)
    return _max_err(flash_attention(q, k, v, causal), ref)


def _paged_error(H, Hkv, hd, bs, lens, dtype, g) -> float:
    from kernels.paged_attention import paged_attention_decode_triton

    B, width = len(lens), -(-max(lens) // bs)
    num_blocks = B * width + 5
    k_pool = _randn(num_blocks, bs, Hkv, hd, dtype=dtype, g=g)  # (num_blocks, bs, Hkv, hd)
    v_pool = _randn(num_blocks, bs, Hkv, hd, dtype=dtype, g=g)
    tables = torch.randperm(num_blocks)[: B * width].view(B, width).cuda()  # (B, M), scattered blocks
    lens_t, q = torch.tensor(lens, device="cuda"), _randn(B, H, hd, dtype=dtype, g=g)
    ref = paged_attention_decode(q.float(), k_pool.float(), v_pool.float(), tables, lens_t)
    return _max_err(paged_attention_decode_triton(q, k_pool, v_pool, tables, lens_t), ref)


def _rms_norm_error(dtype, g) -> float:
    from kernels.rmsnorm import rms_norm

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
            _guarded_row(rows, meta, lambda c=case, d=dtype: _flash_error(*c, d, g), tol)
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
    from kernels.flash_attention import flash_attention

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
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
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
    from kernels.paged_attention import paged_attention_decode_triton

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
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
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


def _decode_tokens_per_s(step: Callable, steps: int, compiled: bool) -> float:
    token = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    position = 0

    def run(n: int) -> None:
        nonlocal token, position
        for _ in range(n):
            _mark_step(compiled)
            token = step(token, torch.full((1, 1), position, device="cuda")).clone()
            position += 1

    run(3)  # warm-up; compilation and graph capture happen here
    seconds, _ = timed(lambda: run(steps), "cuda")
    return steps / seconds


def _mark_step(compiled: bool) -> None:
    if compiled and hasattr(torch.compiler, "cudagraph_mark_step_begin"):
        torch.compiler.cudagraph_mark_step_begin()


def decode_speed(deadline: float, out: dict, gpu_name: str) -> None:
    """Batch-1 greedy decode of a random Llama-3-8B-shaped model: eager vs torch.compile + CUDA graphs."""
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    free, _ = torch.cuda.mem_get_info()
    if free < 20e9:
        out["skipped"] = f"needs ~17 GB free for Llama-3-8B in 16 bits, {free / 1e9:.1f} GB free"
        return
    model = random_model("Llama-3-8B", "cuda", dtype)
    max_len, steps = 512, 64
    cache = StaticDecodeCache(model.config, 1, max_len, dtype)
    embed = model.embed_tokens.weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - embed.nbytes + embed[0].nbytes
    step_bytes = weight_bytes + cache.k.nbytes + cache.v.nbytes  # every weight and the whole masked cache
    peak = datasheet_bandwidth(gpu_name)
    copy_bw = max(measure_bandwidth("cuda", megabytes=1024) for _ in range(3))

    @torch.no_grad()
    def step(token, pos):  # (1, 1), (1, 1) -> next token (1, 1)
        return model(token, pos, cache)[:, -1].argmax(-1, keepdim=True)

    out.update(
        model="Llama-3-8B (random weights)",
        dtype=str(dtype)[6:],
        batch=1,
        cache_slots=max_len,
        bytes_per_step=step_bytes,
        datasheet_GB_s=peak and peak / 1e9,
        copy_GB_s=copy_bw / 1e9,
    )
    out["goal"] = {
        "text": GOALS["compiled_decode_mbu"],
        "mbu": None,
        "met": False,
        "mbu_against": "datasheet" if peak else "measured copy bandwidth",
    }
    for name, fn, compiled in [("eager", step, False), ("compiled", None, True)]:
        if time.monotonic() > deadline:
            out[name] = {"skipped": "time budget"}
            continue
        try:
            fn = fn or torch.compile(step, mode="reduce-overhead")
            tps = _decode_tokens_per_s(fn, steps, compiled)
            bw = tps * step_bytes
            out[name] = {
                "tokens_per_s": tps,
                "GB_s": bw / 1e9,
                "mbu": bw / (peak or copy_bw),
                "mbu_vs_copy": bw / copy_bw,
            }
        except Exception as exc:  # a time-limit stop included: the eager figures are kept
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            if isinstance(exc, SectionTimeout):
                break
    mbu = out.get("compiled", {}).get("mbu")
    out["goal"].update(mbu=mbu, met=mbu is not None and mbu >= 0.6)


def run_section(report: dict, name: str, fn: Callable[[float, dict], None], out_path: Path) -> None:
    """Run one section under its time limit, filling its dict as it goes (so a failure or a time-out
    keeps what was measured before it); record any error, then save the JSON."""
    limit = SECTION_LIMITS_S[name]
    t0 = time.monotonic()
    print(f"[gpu_check] {name} (limit {limit} s) ...", flush=True)
    section = report["sections"][name] = {}
    try:
        with time_limit(limit):
            fn(t0 + 0.8 * limit, section)  # soft deadline: stop starting new cases
    except Exception as exc:
        section["error"] = f"{type(exc).__name__}: {exc}"
        section["traceback"] = traceback.format_exc()[-2000:]
    section["seconds"] = round(time.monotonic() - t0, 1)
    torch.cuda.empty_cache()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2, default=str))


def print_goals(report: dict) -> None:
    for name, section in report["sections"].items():
        goal = section.get("goal") if isinstance(section, dict) else None
        if goal:
            figures = {k: v for k, v in goal.items() if k not in ("text", "met")}
            print(f"  [{'MET' if goal['met'] else 'not met'}] {goal['text']}: {figures}")
        elif "error" in section:
            print(f"  [error] {name}: {section['error'][:200]}")
    correctness = report["sections"].get("correctness", {})
    if "all_ok" in correctness:
        print(f"  [{'OK' if correctness['all_ok'] else 'FAILED'}] every kernel matches its reference")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="results", help="root folder of the results (default: results)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check needs a CUDA GPU (torch.cuda.is_available() is False): nothing measured, nothing written.")
        return 0
    import triton

    gpu_name = torch.cuda.get_device_name()
    out_path = result_path("gpu_check", gpu_slug(gpu_name), args.results)
    report = {
        "hardware": hardware_description("cuda"),
        "gpu": gpu_name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "goals": GOALS,
        "sections": {},
    }
    sections = {
        "correctness": check_correctness,
        "attention_speed": attention_speed,
        "paged_bandwidth": paged_bandwidth,
        "decode": lambda deadline, out: decode_speed(deadline, out, gpu_name),
    }
    for name, fn in sections.items():
        run_section(report, name, fn, out_path)
    print(f"[gpu_check] wrote {out_path}")
    print_goals(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
