"""The strongest peer on the same weights: Hugging Face transformers' ``generate``, timed the way
``bench.generation`` times minillm (greedy, exactly ``new_tokens`` tokens, TTFT from the call)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Run:
    """One timed generation, minillm's or transformers'."""

    seconds: float  # wall time of the whole call, prefill included (measured by the timing harness)
    ttft: float  # seconds to the first new token
    decode_tokens_per_s: float  # tokens after the first / the time after the first
    tokens: list[int]


def import_transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "the comparison with Hugging Face transformers needs it installed: pip install "
            "transformers (a dev dependency, in requirements-dev.txt)"
        ) from e
    return transformers


def hf_call(transformers, hf_model, prompt: list[int], new_tokens: int, compiled: bool = False) -> Callable[[], Run]:
    """A function that runs one greedy ``hf_model.generate`` of exactly ``new_tokens`` tokens.

    ``compiled``: with its static cache (``cache_implementation="static"``) and its forward
    compiled, transformers' own recipe for fast decoding; on a CPU its ``CompileConfig`` has to ask
    for it (``_compile_all_devices``). CUDA graphs on CUDA, as minillm's; Inductor's freezing,
    which minillm's compiled path uses on a CPU, is left off: with transformers' static cache the
    frozen graph indexes out of bounds on its second call (torch 2.13, transformers 5.24)."""
    device = hf_model.device
    options = {}
    if compiled:
        from ..core.compiled import compile_options

        mode = compile_options(device).get("mode", "default")
        config = transformers.CompileConfig(fullgraph=True, dynamic=False, mode=mode)
        config._compile_all_devices = True
        options = {"cache_implementation": "static", "compile_config": config}
    ids = torch.tensor([prompt], device=device)
    pad_id = hf_model.config.pad_token_id if hf_model.config.pad_token_id is not None else 0

    class TokenTimes(transformers.generation.BaseStreamer):
        """Records when each new token reaches the host; generate first puts the prompt."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.calls = 0

        def put(self, value) -> None:
            self.calls += 1
            if self.calls > 1:
                self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    def run() -> Run:
        streamer = TokenTimes()
        start = time.perf_counter()  # TTFT counts from the call, as minillm.generate's does
        with torch.inference_mode():
            # eos_token_id=None: never stop early and never suppress EOS, as minillm here; so
            # min_new_tokens only restates the length and greedy tokens stay comparable.
            out = hf_model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                eos_token_id=None,
                pad_token_id=pad_id,
                streamer=streamer,
                **options,
            )
        t = streamer.times
        decode = (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 else float("nan")
        ttft = t[0] - start if t else float("nan")
        return Run(float("nan"), ttft, decode, out[0, len(prompt) :].tolist())

    return run
