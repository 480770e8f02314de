"""A fast kernel of a quantized linear layer, the check it passes before it is used, and the
rounding of activations that W8A8 kernels share.

Shared by ``quant`` (PyTorch's CPU kernels) and ``cuda_kernels`` (the GPU's), which imports this
rather than ``quant``: ``quant`` imports ``cuda_kernels`` when a layer first runs on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

W8A8_TOLERANCE = 0.03  # a W8A8 kernel's error's norm vs its output's, against the reference


def quantize_tokens(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per token (row), from the activations themselves: x (M, K) -> a int8
    (M, K), t fp32 (M, 1); x ~ a * t. An outlier token leaves the others' steps fine."""
    x = x.float()
    t = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(x / t).clamp(-127, 127).to(torch.int8), t


class Kernel:
    """A named function x (M, K) -> (M, N) computing the layer's product in its packed form."""

    def __init__(self, name: str, fn: Callable[[Tensor], Tensor]):
        self.name, self.fn = name, fn

    def __call__(self, x: Tensor) -> Tensor:
        return self.fn(x)


def check_kernel(
    kernel: Kernel | None, layer: nn.Module, device, dtype, norm_tol: float | None = None
) -> Kernel | None:
    """Try the kernel once on a small input against the layer's ``forward_reference``: a kernel
    that fails or disagrees (a layout this torch version packs differently) is not used. It agrees
    when no output is off by more than 2% of the largest; or, given ``norm_tol`` (a kernel that
    rounds its activations its own way), when the error's norm is within that fraction of the
    output's."""
    if kernel is None:
        return None
    gen = torch.Generator(device=device).manual_seed(0)  # not the global RNG: sampling stays seeded
    x = torch.randn(3, layer.in_features, device=device, generator=gen).to(dtype)
    bias = layer.bias
    layer.bias = None
    try:
        ref = layer.forward_reference(x).float()
        got = kernel(x).float()
    finally:
        layer.bias = bias
    if got.shape != ref.shape:
        return None
    if norm_tol is not None:
        return kernel if (got - ref).norm().item() <= norm_tol * ref.norm().item() + 1e-3 else None
    tol = 2e-2 * ref.abs().max().item() + 1e-3
    return kernel if (got - ref).abs().max().item() <= tol else None
