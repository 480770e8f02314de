"""One contender of ``bench peers`` in a process of its own: ``python -m minillm.bench.peer_worker``.

It reads one JSON request per line on stdin and answers each with one JSON line on stdout:
``{"load": spec}`` loads the contender (and decodes once, untimed: warm-up and compiling; a
compiled contender first decodes a few tokens eagerly, answered as ``eager_tokens``);
``{"run": true}`` decodes the spec's prompt and answers the timing and the tokens;
``{"stop": true}`` ends it. An error answers ``{"error": "..."}`` and the worker goes on.

A spec: ``engine`` ("minillm", "torchao" or "llama.cpp"), ``format``, ``path`` (a checkpoint
directory; a GGUF file for llama.cpp), ``compile``, ``prompt`` (token ids), ``new_tokens``. Each
engine decodes greedily, one token a step after the prompt's prefill, and reports the decode
steps' time apart from the prefill's: the figure compared is decode tokens per second.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

MINILLM_FORMATS = {  # format -> (quantize, group size); None: the checkpoint's fp32 weights
    "fp32": (None, None),
    "int8": ("int8", None),
    "w8a8": ("w8a8", None),
    "int4": ("int4", 32),
}
TORCHAO_FORMATS = ("int8", "w8a8", "int4")
CHECK_TOKENS = 4  # a compiled contender's first tokens are checked against its own eager ones


class Contender:
    """A loaded model that decodes ``new_tokens`` greedy tokens after ``prompt``."""

    def run(self, prompt: list[int], new_tokens: int) -> dict:  # {"tokens", "prefill_s", "decode_s"}
        raise NotImplementedError

    def eager_tokens(self, prompt: list[int]) -> list[int] | None:  # None: nothing compiled to check
        return None


class MinillmContender(Contender):
    """minillm's runtime (chapter 16's recipe): load, quantize with minillm or torchao, decode
    through ``minillm.generate`` (compiled: one graph over a static cache)."""

    def __init__(self, spec: dict):
        import torch

        import minillm
        from minillm.runtime import RuntimeOptions, load_model

        self.generate, self.compile = minillm.generate, bool(spec.get("compile"))
        fmt = spec["format"]
        if spec["engine"] == "minillm":
            scheme, group = MINILLM_FORMATS[fmt]
            options = RuntimeOptions(quantize=scheme, group_size=group, device="cpu")
            self.model, _ = load_model(spec["path"], options)
        else:
            self.model, _ = load_model(spec["path"], RuntimeOptions(device="cpu", dtype=torch.bfloat16))
            torchao_quantize(self.model, fmt)
        self.model.requires_grad_(False)

    def run(self, prompt: list[int], new_tokens: int, compile: bool | None = None) -> dict:
        compile = self.compile if compile is None else compile
        out = self.generate(self.model, prompt, new_tokens, eos_token_id=None, compile=compile)
        return {"tokens": out.tokens[0].tolist(), "prefill_s": out.ttft, "decode_s": sum(out.token_times)}

    def eager_tokens(self, prompt: list[int]) -> list[int] | None:
        """The first ``CHECK_TOKENS`` greedy tokens decoded eagerly, when the timed runs compile:
        the parent checks the compiled path against them (a compiler that breaks a model's kernels
        decodes fast and wrong)."""
        return self.run(prompt, CHECK_TOKENS, compile=False)["tokens"] if self.compile else None


def torchao_quantize(model, fmt: str) -> None:
    """torchao's own configs on minillm's model (bf16 activations, as torchao's CPU kernels want):
    int8 weight-only, int8 dynamic activations with int8 weights, int4 weight-only (groups of 32,
    the CPU's packed layout)."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

    if fmt == "int8":
        config = Int8WeightOnlyConfig()
    elif fmt == "w8a8":
        config = Int8DynamicActivationInt8WeightConfig()
    else:
        try:  # torchao 0.15 and later: the CPU's packed int4 layout is a prototype config of its own
            from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

            config = PrototypeInt4WeightOnlyConfig(group_size=32)
        except ImportError:
            from torchao.quantization import Int4WeightOnlyConfig

            config = Int4WeightOnlyConfig(group_size=32, int4_packing_format="opaque")
    quantize_(model, config)


class LlamaCppContender(Contender):
    """llama.cpp through llama-cpp-python, one thread, on a GGUF file: ``eval`` the prompt, then
    one ``eval`` per token, each token the argmax of the last logits."""

    def __init__(self, spec: dict):
        import llama_cpp

        threads = int(os.environ.get("MINILLM_THREADS", "1"))
        n_ctx = len(spec["prompt"]) + spec["new_tokens"] + 8
        self.llm = llama_cpp.Llama(
            spec["path"],
            n_ctx=n_ctx,
            n_batch=max(8, len(spec["prompt"])),
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
        self.n_vocab = self.llm.n_vocab()

    def last_argmax(self) -> int:
        """The argmax of the logits llama.cpp computed last (without ``logits_all`` it computes
        them for a batch's last token only, and llama-cpp-python keeps no copy: read them in place)."""
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.n_vocab,))
        return int(np.argmax(logits))

    def run(self, prompt: list[int], new_tokens: int) -> dict:
        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        tokens = [self.last_argmax()]
        t1 = time.perf_counter()
        for _ in range(new_tokens - 1):
            llm.eval(tokens[-1:])
            tokens.append(self.last_argmax())
        t2 = time.perf_counter()
        return {"tokens": tokens, "prefill_s": t1 - t0, "decode_s": t2 - t1}


def load(spec: dict) -> Contender:
    if spec["engine"] == "llama.cpp":
        return LlamaCppContender(spec)
    if spec["engine"] in ("minillm", "torchao"):
        return MinillmContender(spec)
    raise ValueError(f"unknown engine {spec['engine']!r}")


def main() -> int:
    threads = int(os.environ.get("MINILLM_THREADS", "1"))
    import torch

    torch.set_num_threads(threads)
    contender, spec = None, None
    out = sys.stdout
    sys.stdout = sys.stderr  # whatever a library prints goes to stderr: stdout carries the answers
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if "stop" in request:
                break
            if "load" in request:
                spec = request["load"]
                t0 = time.perf_counter()
                contender = load(spec)
                eager = contender.eager_tokens(spec["prompt"])
                contender.run(spec["prompt"], spec["new_tokens"])  # warm-up (and compiling)
                answer = {"loaded_s": time.perf_counter() - t0, "eager_tokens": eager}
            else:
                answer = contender.run(spec["prompt"], spec["new_tokens"])
        except Exception as exc:  # the parent reports it; the worker stays up for the next request
            answer = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        out.write(json.dumps(answer) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
