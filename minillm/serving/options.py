"""What a served model runs with, in one place: the runtime's options (quantization, dtype,
compile, tensor parallelism), speculation (a draft model or prompt lookup), the context served and
the engine's pool and batch. ``serve``, ``LLM`` and the benchmarks build their engine from it:

    options = EngineOptions("minillm-target", quantize="int8", compile=True, prompt_lookup=8)
    engine, tokenizer = build_engine(options)

The names are vLLM's (``--quantization``, ``--tensor-parallel-size``, ``--speculative-config``'s
``model`` and ``num_speculative_tokens``, ``--max-model-len``). Every combination either works
or is refused by ``EngineOptions`` itself, with the reason, before anything is loaded; what can
only be checked against the loaded model (a draft's vocabulary, ``max_model_len`` against the
context) is checked by ``build_engine`` before it returns, so a server refuses it before it
starts listening.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.config import check_field_types
from ..runtime import RuntimeOptions, load_model
from .engine import BLOCK_MANAGERS, Engine, EngineConfig
from .scheduler import SchedulerConfig
from .speculative import Speculation

DEFAULT_SPECULATIVE_TOKENS = 4  # with a draft model and no num_speculative_tokens


@dataclass(frozen=True)
class EngineOptions:
    model: str  # a bundled model's name, a checkpoint directory or a hub id
    # the runtime's (``minillm.runtime.RuntimeOptions``)
    quantize: str | None = None  # weight-only "int8" | "int4" | "fp8"
    group_size: int | None = None  # int4 only
    dtype: torch.dtype | None = None  # None: as the runtime picks (minillm.runtime.compute_dtype)
    compile: bool = False  # decode steps through torch.compile, batches padded to size buckets
    tensor_parallel: int = 1  # ranks the model is sharded over; the engine schedules, every rank steps
    device: str | None = None  # None: the best available
    # speculation (``serving.speculative``): one of the two
    speculative_model: str | None = None  # a draft model sharing the target's tokenizer
    num_speculative_tokens: int | None = None  # proposals per step (draft: default 4)
    prompt_lookup: int | None = None  # K: proposals copied by prompt lookup
    # the context and the engine
    max_model_len: int | None = None  # prompt + output tokens per request at most (default: the model's context)
    max_batch: int = 16  # sequences per engine step at most
    num_blocks: int = 256  # KV pool, in blocks
    block_size: int = 16  # tokens per KV block
    prefix_cache: str = "hash"  # "hash" (full blocks) or "radix" (to the token)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a model name or path, got {self.model!r}")
        check_field_types(self, ints=("max_batch", "num_blocks", "block_size"))
        for name in ("num_speculative_tokens", "prompt_lookup", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if self.prefix_cache not in BLOCK_MANAGERS:
            raise ValueError(f"prefix_cache must be one of {tuple(BLOCK_MANAGERS)}, got {self.prefix_cache!r}")
        if self.speculative_model is not None and self.prompt_lookup is not None:
            raise ValueError("speculative_model and prompt_lookup are two ways to propose tokens: choose one")
        if self.num_speculative_tokens is not None and self.speculative_model is None:
            raise ValueError(
                "num_speculative_tokens needs speculative_model (prompt lookup takes its K as prompt_lookup)"
            )
        if self.tensor_parallel > 1 and self.compile:  # said here in the engine's words, not the runtime's
            raise ValueError("tensor parallelism with compile is not supported: the ranks step eagerly; drop one")
        self.runtime_options()  # the runtime refuses what does not compose
        self.engine_config()

    def runtime_options(self) -> RuntimeOptions:
        return RuntimeOptions(
            quantize=self.quantize,
            group_size=self.group_size,
            dtype=self.dtype,
            compile=self.compile,
            tensor_parallel=self.tensor_parallel,
            device=self.device,
        )

    def speculation(self) -> Speculation | None:
        if self.prompt_lookup is not None:
            return Speculation("lookup", self.prompt_lookup)
        if self.speculative_model is not None:
            return Speculation("draft", self.num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS)
        return None

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            self.num_blocks,
            self.block_size,
            scheduler=SchedulerConfig("continuous", self.max_batch),
            prefix_cache=self.prefix_cache,
            speculation=self.speculation(),
            compile=self.compile,
            max_model_len=self.max_model_len,
        )

    def describe(self) -> str:
        """The techniques on, for the server's first line: e.g. 'int8, compiled, prompt lookup K=8'."""
        parts = []
        if self.quantize:
            parts.append(self.quantize + (f" g{self.group_size}" if self.group_size else ""))
        if self.compile:
            parts.append("compiled")
        if self.tensor_parallel > 1:
            parts.append(f"tensor parallel {self.tensor_parallel}")
        spec = self.speculation()
        if spec is not None:
            how = "prompt lookup" if spec.method == "lookup" else f"draft {self.speculative_model}"
            parts.append(f"{how} K={spec.k}")
        return ", ".join(parts) or "eager"


def build_engine(options: EngineOptions) -> tuple[Engine, object]:
    """The engine ``options`` describe, and the model's tokenizer (None if it has none). With
    tensor parallelism the engine's model is the ranks' stand-in (``serving.tensor_parallel``);
    ``Engine.close`` ends them."""
    runtime = options.runtime_options()
    if options.tensor_parallel > 1:
        from .tensor_parallel import TensorParallelModel

        model, tokenizer = TensorParallelModel.start(options.model, runtime, options.num_blocks, options.block_size)
    else:
        model, tokenizer = load_model(options.model, runtime)
    try:
        draft = None
        if options.speculative_model is not None:
            same = RuntimeOptions(dtype=model.dtype, device=options.device)  # the draft computes as the target
            draft, _ = load_model(options.speculative_model, same)
        return Engine(model, options.engine_config(), draft=draft), tokenizer
    except BaseException:
        if hasattr(model, "close"):
            model.close()
        raise
