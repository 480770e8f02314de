"""Checkers for chapter 12: int4 group quantization with zero points, a 2:4 mask, the
distillation loss with its temperature."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...compression.distill import distillation_loss
from ...compression.prune import two_four_mask
from ...compression.quant import dequantize_int4, quantize_int4
from .base import close, passed, require


def check_int4_groups(quantize: Callable, dequantize: Callable) -> None:
    """quantize(w (N, K), group_size) -> (codes (N, K) ints in 0..15, scale (N, G), zero (N, G));
    dequantize(codes, scale, zero, group_size) -> w (N, K) approximately."""
    name = "int4 group quantization"
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(6, 64, generator=gen) * torch.logspace(-1, 1, 64, dtype=torch.float32)  # uneven columns
    w[2, 5] = 12.0  # an outlier: only its own group should suffer
    codes, scale, zero = quantize(w, 16)
    require(tuple(codes.shape) == (6, 64), name, f"codes must be (N, K) = (6, 64), got {tuple(codes.shape)}")
    require(tuple(scale.shape) == (6, 4), name, f"one scale per group of 16: shape (6, 4), got {tuple(scale.shape)}")
    require(tuple(zero.shape) == (6, 4), name, f"one zero point per group: shape (6, 4), got {tuple(zero.shape)}")
    c = codes.float()
    require(bool((c == c.round()).all() and c.min() >= 0 and c.max() <= 15), name, "codes are integers in 0..15")
    z = zero.float()
    require(bool((z == z.round()).all() and z.min() >= 0 and z.max() <= 15), name, "zero points are codes: 0..15")
    back = dequantize(codes, scale, zero, 16).float()
    require(tuple(back.shape) == (6, 64), name, f"dequantize must return (6, 64), got {tuple(back.shape)}")
    steps = scale.float().repeat_interleave(16, dim=1)
    hint = "every weight within half a step (scale / 2) of its original: w ~ (code - zero) * scale"
    require(bool(((back - w).abs() <= steps / 2 + 1e-4).all()), name, hint)
    hint = "use all 16 codes: scale = (max - min) / 15 over each group (the range widened to include 0)"
    require(bool((c.view(6, 4, 16).amax(-1) - c.view(6, 4, 16).amin(-1) >= 14).all()), name, hint)
    ref = dequantize_int4(*quantize_int4(w, 16), 64)
    mine, ours = (back - w).abs().mean().item(), (ref - w).abs().mean().item()
    require(mine <= 1.1 * ours, name, f"mean error {mine:.4f} vs {ours:.4f} for min/max groups: check the rounding")
    worst = (back - w).abs().view(6, 4, 16).amax(-1)  # (N, G): the largest error of each group
    others = torch.cat([worst[:2], worst[3:]])
    hint = "the outlier w[2, 5] should widen only its own group's step: scale each group by its own range"
    require(
        bool(worst[2, 0] > 5 * others[:, 0].max() and worst[2, 1:].le(others[:, 1:].amax(0) * 1.5).all()), name, hint
    )
    require(close(dequantize(codes, scale, zero, 16)[w == 0], torch.zeros(int((w == 0).sum()))), name, "0 stays 0")
    passed(name, "codes 0..15, zero points, within half a step per group; the outlier hurts its group only")


GROUP_BITS = [  # (group size, scale bits, zero-point bits), what a real checkpoint stores
    (32, 16, 8),  # this chapter's int4 g32: an fp16 scale and a whole byte for the zero
    (128, 16, 8),
    (128, 16, 4),  # GPTQ/AWQ checkpoints pack the zero points in 4 bits too
    (128, 16, 0),  # symmetric: no zero point
    (32, 16, 0),  # GGUF's Q4_0
]


def check_bits_per_weight(fn: Callable) -> None:
    """fn(group_size, scale_bits, zero_bits) -> bits per weight of int4 codes with one scale and
    one zero point per group: 4 + (scale_bits + zero_bits) / group_size."""
    name = "int4 bits per weight"
    for g, scale, zero in GROUP_BITS:
        want = 4 + (scale + zero) / g
        got = fn(g, scale, zero)
        hint = f"groups of {g}, a {scale}-bit scale and a {zero}-bit zero point: expected {want}, got {got!r}"
        if isinstance(got, (int, float)) and abs(got - (scale + zero) / g) < 1e-12:
            hint += ": the 4 bits of the code itself count too"
        require(isinstance(got, (int, float)) and abs(got - want) < 1e-12, name, hint)
    passed(name, "4 + (scale + zero bits) / group: 4.75 at g32, 4.1875, 4.15625 and 4.125 at g128")


def check_two_four_mask(fn: Callable) -> None:
    """fn(score (N, K)) -> bool keep-mask (N, K): the 2 highest scores of every 4 consecutive inputs."""
    name = "2:4 mask"
    gen = torch.Generator().manual_seed(5)
    score = torch.rand(8, 32, generator=gen)
    keep = fn(score)
    require(isinstance(keep, torch.Tensor) and keep.dtype == torch.bool, name, "return a bool tensor (True = keep)")
    require(tuple(keep.shape) == (8, 32), name, f"the mask has the score's shape (8, 32), got {tuple(keep.shape)}")
    per_group = keep.view(8, 8, 4).sum(-1)
    require(bool((per_group == 2).all()), name, "exactly 2 kept in every group of 4 consecutive columns")
    require(torch.equal(keep, two_four_mask(score)), name, "keep the two highest scores of each group of 4")
    across = torch.zeros(2, 8)
    across[:, :4] = torch.tensor([9.0, 8.0, 7.0, 6.0])  # the row's 4 largest all in the first group
    hint = "the 2 of 4 are chosen inside each group, not as the largest half of the row"
    require(bool((fn(across).view(2, 2, 4).sum(-1) == 2).all()), name, hint)
    passed(name, "exactly two of every four consecutive weights kept, the two with the highest score")


def check_distillation_loss(fn: Callable) -> None:
    """fn(student_logits, teacher_logits, temperature) -> scalar: T^2 KL(teacher_T || student_T),
    averaged over positions."""
    name = "distillation loss"
    gen = torch.Generator().manual_seed(6)
    student, teacher = torch.randn(3, 5, 11, generator=gen), 2 * torch.randn(3, 5, 11, generator=gen)
    for t in (1.0, 2.0, 4.0):
        got, want = fn(student, teacher, t), distillation_loss(student, teacher, t)
        hint = f"T = {t}: expected {want.item():.6f}, got {float(got):.6f}"
        if abs(float(got) * t**2 - want.item()) < 1e-5 * max(1.0, want.item()):
            hint += ": off by T^2; multiply the KL by T^2"
        elif abs(float(got) - distillation_loss(teacher, student, t).item()) < 1e-5:
            hint += ": that is KL(student || teacher); the teacher's distribution comes first"
        require(close(got, want, atol=1e-5), name, hint)
    same = fn(teacher, teacher, 2.0)
    require(close(same, 0.0, atol=1e-6), name, "a student equal to its teacher has zero loss")
    passed(name, "T^2 KL(teacher_T || student_T), mean over positions, at T = 1, 2 and 4")
