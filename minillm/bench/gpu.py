"""One script for a CUDA machine: are the kernels correct there, and how fast are they?

``make gpu-check`` (or ``python -m minillm.bench.gpu``) writes minillm/results/<gpu>/gpu_check.json:

- correctness of every kernel in fp16 and bf16 (and fp32) against its PyTorch reference;
- fused attention (FlashAttention-2 style, Dao 2023) TFLOP/s vs torch SDPA's flash backend and vs
  the naive N x N PyTorch version, at sequence 1k/4k/16k, head dim 64/128, causal and not;
- the paged decode kernel's (PagedAttention, Kwon et al. 2023) achieved bandwidth at long
  contexts, in GB/s and as a share of a measured device-to-device copy;
- decode tokens/s and MBU of a random-weight Llama-3-8B-shaped model, eager vs the compiled
  decode path of ``generate(compile=True)`` (``core.compiled``: torch.compile with
  ``mode="reduce-overhead"``, CUDA graphs), its compile time apart;
- the same model's decode quantized weight-only to int8, int4 and fp8 vs bf16, each linear
  through the kernel ``minillm.compression.cuda_kernels`` picks; those kernels one by one; and a
  2:4 semi-structured sparse matmul (``minillm.bench.gpu_compression``);
- chapter 14's serving step costs (``minillm.bench.gpu_disagg``);
- the decode step of one tensor-parallel rank's shard of Llama-2-7B for tp = 1, 2, 4, 8 (the
  compute part of TP, measured), plus the predicted all-reduces over NVLink: a predicted
  multi-GPU speedup beside gpt-fast's published one (``minillm.bench.gpu_parallel``);
- chapter 16's first two rungs, recompute vs KV cache on the same Llama-3-8B, which with the
  decode and compression sections make the GPU ladder (the rungs: ``minillm.runtime.recipes``;
  its rows: ``minillm.bench.capstone_tables.gpu_ladder_rows``);
- chapter 13's composed engine on the same model: its eager decode step against the compiled one
  (a CUDA graph per batch bucket, the Triton paged-decode kernel), greedy tokens compared
  (``minillm.bench.gpu_serving``).

Every section runs under its own time limit and inside try/except: a failure is recorded in the
JSON and the next section runs. The JSON is rewritten after each section, so a run cut short
keeps what it measured. Without CUDA the script says so and exits 0, writing nothing.

The three kernel sections live in ``minillm.bench.gpu_kernels``, the compression section in
``minillm.bench.gpu_compression``, the disaggregation section in ``minillm.bench.gpu_disagg``,
the tensor-parallel section in ``minillm.bench.gpu_parallel``, the decode step all of them time
(its bytes, CUDA graph and timer) in ``minillm.bench.gpu_decode``; this module holds the decode
section and the runner.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from ..core.compiled import CompiledForward
from ..core.device import cuda_half_dtype, hardware_description
from ..core.model import random_model
from ..measure.report import gpu_slug, result_path
from ..measure.roofline import DATASHEETS
from ..measure.timing import repeat
from ..runtime.recipes import LADDER, generate_as
from .gpu_compression import compression_speed
from .gpu_decode import TIMER, decode_bytes, decode_step, median_step_seconds
from .gpu_disagg import disagg_steps
from .gpu_kernels import GOALS, SectionTimeout, attention_speed, check_correctness, paged_bandwidth
from .gpu_parallel import tp_shard_decode
from .gpu_serving import composed_engine
from .roofline import measure_bandwidth

SECTION_LIMITS_S = {  # 539 s in all: under 9 minutes
    "correctness": 60,
    "attention_speed": 72,
    "paged_bandwidth": 32,
    "decode": 133,
    "compression": 97,
    "disagg": 30,
    "parallel": 25,
    "capstone": 30,
    "serving": 60,
}


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


def llama3_8b(out: dict):
    """A random Llama-3-8B in bf16 (fp16 where bf16 is not native) on the GPU, or None with the
    reason in ``out["skipped"]`` when it would not fit."""
    dtype = cuda_half_dtype()
    free, _ = torch.cuda.mem_get_info()
    if free < 20e9:
        out["skipped"] = f"needs ~17 GB free for Llama-3-8B in 16 bits, {free / 1e9:.1f} GB free"
        return None
    return random_model("Llama-3-8B", "cuda", dtype)


def decode_speed(deadline: float, out: dict, gpu_name: str) -> None:
    """Batch-1 greedy decode of a random Llama-3-8B-shaped model: eager vs torch.compile + CUDA graphs."""
    model = llama3_8b(out)
    if model is None:
        return
    dtype = model.dtype
    max_len, steps = 512, 64
    step, cache = decode_step(model, 1, max_len)
    step_bytes = decode_bytes(model, cache)  # every weight and the whole masked cache
    peak = datasheet_bandwidth(gpu_name)
    copy_bw = max(measure_bandwidth("cuda", megabytes=1024) for _ in range(3))

    out.update(
        model="Llama-3-8B (random weights)",
        dtype=str(dtype)[6:],
        batch=1,
        cache_slots=max_len,
        timer=TIMER,
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

    def compiled_step():  # the library's compiled path, the one generate(compile=True) decodes with
        fwd = CompiledForward(model, 1, max_len, widths=(1,))
        out["compile_seconds"] = fwd.warmup(1)  # torch.compile, mode="reduce-overhead": a CUDA graph
        return lambda token, pos: fwd(token)[:, -1].argmax(-1, keepdim=True)

    for name, make in [("eager", lambda: step), ("compiled", compiled_step)]:
        if time.monotonic() > deadline:
            out[name] = {"skipped": "time budget"}
            continue
        try:
            tps = 1 / median_step_seconds(make(), 1, steps, "cuda")
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


@torch.inference_mode()
def gpu_first_rungs(deadline: float, out: dict) -> None:
    """``make gpu-check``'s capstone section: the ladder's first two rungs (recompute, KV cache) on
    a random Llama-3-8B in bf16 at batch 1. The compiled and quantized rungs are the check's
    decode and compression sections (CUDA graphs); ``gpu_ladder_rows`` puts them together."""
    model = llama3_8b(out)
    if model is None:
        return
    dtype = model.dtype
    prompt_len, new_tokens = 64, 32
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len), device="cuda")
    out.update(model="Llama-3-8B (random weights)", dtype=str(dtype)[6:], prompt_len=prompt_len, new_tokens=new_tokens)
    for rung in LADDER[:2]:
        if time.monotonic() > deadline:
            out[rung.name] = {"skipped": "time budget"}
            continue
        timing = repeat(partial(generate_as, model, rung, ids, new_tokens), 3, "cuda")
        tpot = statistics.median(v.tpot for v in timing.values)
        out[rung.name] = {
            "tokens_per_s": new_tokens / timing.median,
            "tpot_ms": 1e3 * tpot,
            "decode_tokens_per_s": 1 / tpot,
        }


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
        goals = (section.get("goals") or [section.get("goal")]) if isinstance(section, dict) else []
        for goal in filter(None, goals):
            figures = {k: v for k, v in goal.items() if k not in ("text", "met")}
            print(f"  [{'MET' if goal['met'] else 'not met'}] {goal['text']}: {figures}")
        if not any(goals) and "error" in section:
            print(f"  [error] {name}: {section['error'][:200]}")
    correctness = report["sections"].get("correctness", {})
    if "all_ok" in correctness:
        print(f"  [{'OK' if correctness['all_ok'] else 'FAILED'}] every kernel matches its reference")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--results", default=None, help="root folder of the results (default: the package's store, minillm/results)"
    )
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
        "compression": compression_speed,
        "disagg": disagg_steps,
        "parallel": tp_shard_decode,
        "capstone": gpu_first_rungs,
        "serving": composed_engine,
    }
    for name, fn in sections.items():
        run_section(report, name, fn, out_path)
    print(f"[gpu_check] wrote {out_path}")
    print_goals(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
