"""Offline batch generation (nano-vllm's and vLLM's ``LLM``): load a model through the runtime,
hand every prompt to the continuous-batching engine at once, and get the completions back in the
order of the prompts.

    llm = LLM("minillm-target", quantize="int8")
    for out in llm.generate(["def add(a, b):", "class Stack:"], SamplingParams(temperature=0.8, seed=0)):
        print(out.text)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.generate import resolve_eos
from ..core.sampling import SamplingParams
from .options import EngineOptions, build_engine
from .workload import Request


@dataclass
class Completion:
    prompt: str | list[int]  # as given
    token_ids: list[int]  # the generated ids
    text: str | None  # their text (None for a model without a tokenizer)
    finish_reason: str  # "length" (max_tokens reached), "stop" (an EOS id) or "error"
    error: str | None = None  # what went wrong with this request alone (finish_reason "error")


class LLM:
    """A model on the engine for batch use: ``generate(prompts, sampling, max_tokens)``.

    The keywords are ``EngineOptions``' (``serving.options``): the runtime's ``quantize``,
    ``group_size``, ``dtype``, ``compile``, ``tensor_parallel``, ``device``; speculation
    (``speculative_model`` and ``num_speculative_tokens``, or ``prompt_lookup``); ``max_model_len``,
    ``max_batch``, ``num_blocks``, ``block_size`` and ``prefix_cache``. ``close()`` (or ``with``)
    ends a tensor-parallel model's ranks."""

    def __init__(self, model: str | os.PathLike, **options):
        self.options = EngineOptions(str(model), **options)
        self.engine, self.tokenizer = build_engine(self.options)
        self.engine.warmup()
        self.model = self.engine.model

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        sampling: SamplingParams | None = None,
        max_tokens: int = 64,
    ) -> list[Completion]:
        """One completion per prompt (text, or token ids), in the prompts' order; each stops at
        ``max_tokens`` or at the model's EOS. A seeded ``sampling`` gives every request the same
        seed, so equal prompts get equal completions."""
        if isinstance(prompts, str):
            raise ValueError("prompts must be a list of prompts; wrap one prompt in a list")
        ids = [self._encode(p) for p in prompts]
        params = sampling or SamplingParams()
        stop = resolve_eos("config", self.model.config)
        requests = [Request(p, max_tokens, params=params, stop_ids=stop) for p in ids]
        outputs = self.engine.run(requests)
        for out in outputs:  # kept by the engine until taken: this call takes them
            self.engine.outputs.pop(out.request.id, None)
        return [
            Completion(prompt, out.tokens, self._decode(out.tokens), out.finish_reason, out.error)
            for prompt, out in zip(prompts, outputs)
        ]

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: pass prompts as token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _decode(self, tokens: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(tokens)
