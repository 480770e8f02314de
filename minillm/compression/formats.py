"""How many bits a weight costs in each storage format, scales and zero points included, and
what that makes of a model's size.

Our own formats (``quant.py``) and llama.cpp's GGUF block formats, computed from their layout
(the block structure is documented in ggml's source, ``ggml-common.h``; Gerganov et al.):

- ``Q8_0``: blocks of 32 int8 codes and one fp16 scale: 8 + 16/32 = 8.5 bits.
- ``Q4_0``: blocks of 32 4-bit codes and one fp16 scale: 4 + 16/32 = 4.5 bits.
- ``Q4_1``: as Q4_0 plus an fp16 minimum per block: 5 bits.
- the "K-quants" nest blocks in super-blocks of 256 weights: small blocks carry low-bit scales
  (and minimums), the super-block one fp16 scale for those (and one for the minimums), e.g.
  ``Q4_K``: 8 blocks of 32, each a 6-bit scale and a 6-bit minimum, and two fp16 per super-block:
  (256 x 4 + 8 x 12 + 2 x 16) / 256 = 4.5 bits.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.config import ModelConfig


@dataclass(frozen=True)
class WeightFormat:
    """``code_bits`` per weight, plus ``block_bits`` of metadata per block of ``block`` weights,
    plus ``super_bits`` per super-block of ``super_block`` weights (0 if none)."""

    name: str
    code_bits: int
    block: int
    block_bits: int
    super_block: int = 0
    super_bits: int = 0
    note: str = ""

    @property
    def bits_per_weight(self) -> float:
        extra = self.super_bits / self.super_block if self.super_block else 0.0
        return self.code_bits + self.block_bits / self.block + extra


FORMATS = [
    WeightFormat("fp32", 32, 1, 0, note="PyTorch's default"),
    WeightFormat("bf16", 16, 1, 0, note="training and serving default"),
    WeightFormat("int8 (per channel)", 8, 4096, 32, note="minillm int8: one fp32 scale per row of 4096"),
    WeightFormat("fp8 e4m3 (per channel)", 8, 4096, 32, note="minillm fp8, rows of 4096"),
    WeightFormat("int4 g128", 4, 128, 24, note="minillm int4: fp16 scale + 8-bit zero per 128"),
    WeightFormat("int4 g32", 4, 32, 24, note="minillm int4: fp16 scale + 8-bit zero per 32"),
    WeightFormat("GGUF Q8_0", 8, 32, 16, note="fp16 scale per 32"),
    WeightFormat("GGUF Q4_0", 4, 32, 16, note="fp16 scale per 32"),
    WeightFormat("GGUF Q4_1", 4, 32, 32, note="fp16 scale + fp16 min per 32"),
    WeightFormat("GGUF Q6_K", 6, 16, 8, 256, 16, note="8-bit scale per 16, fp16 per 256"),
    WeightFormat("GGUF Q4_K", 4, 32, 12, 256, 32, note="6-bit scale + 6-bit min per 32, 2 fp16 per 256"),
    WeightFormat("GGUF Q2_K", 2, 16, 8, 256, 32, note="4-bit scale + 4-bit min per 16, 2 fp16 per 256"),
]


def weight_format(name: str) -> WeightFormat:
    for f in FORMATS:
        if f.name == name:
            return f
    raise ValueError(f"unknown weight format {name!r}: choose from {', '.join(f.name for f in FORMATS)}")


def model_size_bytes(config: ModelConfig, bits_per_weight: float) -> float:
    """Every parameter at ``bits_per_weight`` (tied embeddings once). Real checkpoints often keep
    the embedding and the norms wider; at billions of parameters that changes little."""
    return config.num_params() * bits_per_weight / 8
