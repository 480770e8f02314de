"""The disaggregation section of the GPU check (``minillm.bench.gpu`` runs it): chapter 14's
step costs measured instead of estimated.

- ``steps``: minillm's serving engine (continuous batching on paged KV) runs a random-weight
  Llama-3-8B-shaped model in bf16 through a chat-like burst of requests; chapter 13's cost model
  (a fixed cost per forward, per decode row, per prompt token) is fitted to its measured steps,
  beside the roofline estimate chapter 14 uses on a CPU.
- ``handoff``: one 1024-token prompt's K/V read out of the pool (``PrefillEngine.read_kv``) and
  copied to pinned host memory and back: the bytes equal the formula, and the copy rates are what
  a handoff through host memory would see on this machine's PCIe (with one GPU there is no
  peer to send to).
- ``simulated``: chapter 14's goodput-vs-rate sweep with the fitted step costs instead of the
  roofline's (simulated clock, short runs), colocated vs chunked vs 1:1 disaggregated.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch

from ..core.device import synchronize as _sync
from ..core.model import random_model
from ..measure.links import kv_bytes
from ..serving.engine import Engine, EngineConfig
from ..serving.handoff import PrefillEngine
from ..serving.scheduler import SchedulerConfig
from ..serving.step_cost import fit_step_cost
from ..serving.workload import Request, chat_trace, requests_from_trace
from .disagg_simulated import SimulatedSweep, simulated_goodput

MODEL = "Llama-3-8B"


def disagg_steps(deadline: float, out: dict, device: str = "cuda", model_config=MODEL) -> None:
    """Fill ``out`` with the three parts (see the module's docstring); ``device`` and ``model_config``
    let a test run it small on a CPU."""
    device = torch.device(device)
    model = random_model(model_config, device, torch.bfloat16)
    config = EngineConfig(2048, 16, False, SchedulerConfig("continuous", 32))
    warm = Engine(model, config)
    warm.run([Request([1] * 256, 4, id=0), Request([2] * 8, 4, id=1)])
    trace = chat_trace(48, rate=40.0, prompt_median=512, output_median=32, max_len=2048, seed=0)
    engine = Engine(model, config)
    engine.run(requests_from_trace(trace, model.config.vocab_size))
    cost = fit_step_cost(engine.step_log)
    out["steps"] = {"count": engine.steps, "fitted": asdict(cost), "seconds": engine.now}
    if time.monotonic() < deadline:
        out["handoff"] = _handoff(model, config)
    del model, warm, engine
    torch.cuda.empty_cache()
    if time.monotonic() < deadline:
        sweep = SimulatedSweep(duration=5.0, rates=(8.0, 16.0, 24.0), step_cost=cost)
        out["simulated"] = {
            "clock": "simulated, step costs fitted to this GPU's measured steps",
            "rows": simulated_goodput(sweep),
        }


def _handoff(model, config: EngineConfig) -> dict:
    prefill = PrefillEngine(model, config)
    prefill.add_request(Request(list(range(1, 1025)), 2, id=0))
    while prefill.unfinished:
        prefill.step()
    (h,) = prefill.take_handoffs()
    kv = h.kv.clone()  # made under inference mode: a clone can be written
    host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=kv.is_cuda)
    rates = {}
    for name, src, dst in (("to_host", kv, host), ("to_device", host, kv)):
        dst.copy_(src, non_blocking=True)
        _sync(kv.device)
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        _sync(kv.device)
        rates[f"{name}_gb_s"] = 5 * kv.nbytes / (time.perf_counter() - t0) / 1e9
    formula = kv_bytes(model.config, 1024, 2)
    return {"tokens": 1024, "bytes": kv.nbytes, "formula_bytes": formula, "equal": kv.nbytes == formula, **rates}
