"""Fused RMSNorm in Triton (Zhang & Sennrich, 2019), optionally fused with the residual add.

In a pre-norm block the residual stream is updated, ``h = x + residual``, and immediately
normalized. Unfused, that is three passes over memory (the add, the mean of squares, the scale);
fused, one program per row reads x (and the residual) once and writes the normed row (and the
new residual) once. The statistics are computed in fp32 and the result rounded as in the
reference, ``minillm.core.model.rms_norm_reference``: ``weight * (h * rsqrt(mean(h^2) + eps)).to(dtype)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .flash_attention import DTYPES, interpreting

MAX_DIM = 65536


@triton.jit
def _rmsnorm_kernel(X, R, W, Y, R_OUT, D, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One program: one row of D features (rows are contiguous, D <= BLOCK)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < D
    x = tl.load(X + row * D + cols, mask=inside, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(R + row * D + cols, mask=inside, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(R_OUT + row * D + cols, x, mask=inside)  # the new residual, rounded like an unfused add
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
    w = tl.load(W + cols, mask=inside, other=0.0)
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(Y + row * D + cols, y.to(Y.dtype.element_ty), mask=inside)


def _check(x: Tensor, weight: Tensor, residual: Tensor | None) -> None:
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"weight {tuple(weight.shape)} does not match the last dim of x {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    if x.dtype not in DTYPES or x.shape[-1] > MAX_DIM:
        raise ValueError(f"need dtype in {DTYPES} and dim <= {MAX_DIM}; got {x.dtype}, {x.shape[-1]}")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"tensors on {x.device}: the kernel needs CUDA (or TRITON_INTERPRET=1 on the CPU)")


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm over the last dim of x (..., D). With ``residual``: (rms_norm(x + residual), x + residual)."""
    _check(x, weight, residual)
    D = x.shape[-1]
    x2 = x.reshape(-1, D).contiguous()  # (rows, D)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)  # as in the reference's weight * x
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    r2 = residual.reshape(-1, D).contiguous() if residual is not None else x2
    r_out = torch.empty_like(x2) if residual is not None else x2
    block = triton.next_power_of_2(D)
    warps = 1 if interpreting() else min(16, max(1, block // 256))
    _rmsnorm_kernel[(x2.shape[0],)](
        x2, r2, weight, y, r_out, D, eps, HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=warps
    )
    y = y.view(x.shape)
    return (y, r_out.view(x.shape)) if residual is not None else y
