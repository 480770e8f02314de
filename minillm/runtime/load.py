"""Loading a model with the techniques a user asked for, composed in one order: read the
checkpoint in the compute dtype, then quantize its linears; compiling happens where it decodes
(``generate(..., compile=options.compile)``), over whatever this returned.

Refused here, with the reason, before anything is loaded:
- ``group_size`` without ``quantize="int4"`` (only int4 has groups);
- ``quantize`` of a directory minillm saved quantized (it already is);
- ``tensor_parallel > 1`` with ``quantize`` (the ranks shard dense weights by rows and columns;
  packed int4/int8 weights are not sharded yet) or with ``compile`` (the ranks decode eagerly).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..core.checkpoints import load as load_checkpoint
from ..core.config import check_positive_int
from ..core.device import best_device
from ..core.model import Transformer
from ..core.tokenizer import Tokenizer


@dataclass(frozen=True)
class RuntimeOptions:
    quantize: str | None = None  # "int8" | "int4" | "fp8" weight-only, "w8a8"; None: the checkpoint's weights
    group_size: int | None = None  # int4 only: weights per scale (None: 128)
    dtype: torch.dtype | None = None  # compute dtype; None: see compute_dtype
    compile: bool = False  # decode through torch.compile over a static cache (same greedy tokens)
    tensor_parallel: int = 1  # ranks the model is sharded over (minillm.parallel)
    device: str | torch.device | None = None  # None: cuda, then mps, then the cpu

    def __post_init__(self) -> None:
        if self.quantize is not None:
            from ..compression.quant import SCHEMES  # only when quantizing: import minillm stays light

            if self.quantize not in SCHEMES:
                raise ValueError(f"quantize must be one of {', '.join(SCHEMES)}, got {self.quantize!r}")
        if self.group_size is not None:
            if self.quantize != "int4":
                raise ValueError("group_size (--group-size) applies to int4 quantization only")
            check_positive_int("group_size", self.group_size)
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating-point torch.dtype, got {self.dtype!r}")
        check_positive_int("tensor_parallel", self.tensor_parallel)
        if self.tensor_parallel > 1 and self.quantize is not None:
            raise ValueError(
                "tensor parallelism with quantized weights is not supported: the ranks shard dense "
                "weights by rows and columns, and packed int8/int4/fp8 weights are not sharded yet; "
                "drop the quantization or the tensor parallelism"
            )
        if self.tensor_parallel > 1 and self.compile:
            raise ValueError("tensor parallelism with compile is not supported: the ranks decode eagerly; drop one")

    @property
    def target(self) -> torch.device:
        return torch.device(self.device) if self.device is not None else best_device()


def compute_dtype(options: RuntimeOptions) -> torch.dtype | None:
    """What the model computes in: ``options.dtype`` when given; bf16 for a quantized model on a
        CPU (PyTorch's packed int8/int4 CPU kernels are fast in bf16 only; w8a8 multiplies in integers
    and stays in the loader's dtype); else None, the loader's
        default (fp32 on a CPU, the checkpoint's own dtype on a GPU)."""
    if options.dtype is not None:
        return options.dtype
    if options.quantize not in (None, "w8a8") and options.target.type == "cpu":
        return torch.bfloat16
    return None


def load_model(
    name_or_path: str | os.PathLike, options: RuntimeOptions | None = None
) -> tuple[Transformer, Tokenizer | None]:
    """``(model, tokenizer)`` with ``options`` applied (tensor parallelism excepted: its ranks each
    load their shard, ``minillm.parallel.tensor.load_tensor_parallel``)."""
    from ..compression.saving import is_quantized_checkpoint, load_quantized

    options = options or RuntimeOptions()
    if is_quantized_checkpoint(name_or_path):
        if options.quantize is not None:
            raise ValueError(f"{name_or_path} is already quantized: drop quantize ({options.quantize})")
        return load_quantized(name_or_path, device=options.device, dtype=options.dtype)
    model, tokenizer = load_checkpoint(name_or_path, device=options.device, dtype=compute_dtype(options))
    if options.quantize is not None:
        from ..compression import quantize

        quantize(model, options.quantize, options.group_size)
    return model, tokenizer


def load(
    name_or_path: str | os.PathLike,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    *,
    quantize: str | None = None,
    group_size: int | None = None,
) -> tuple[Transformer, Tokenizer | None]:
    """``minillm.load``: a local Hugging Face directory, a bundled model's name, a hub id, or a
    directory minillm saved quantized; ``quantize="int4"`` (``"int8"``, ``"fp8"``) quantizes the
    loaded weights."""
    options = RuntimeOptions(quantize=quantize, group_size=group_size, dtype=dtype, device=device)
    return load_model(name_or_path, options)
