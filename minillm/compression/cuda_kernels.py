"""The CUDA kernels behind ``QuantizedLinear.forward``: which one serves a layer on a GPU, and the
layout each one wants.

``cuda_kernel(layer, dtype)`` tries the candidates of ``candidates(layer, dtype)`` in order and
returns the first that builds and agrees with the reference (``fastpath.check_kernel``); ``None`` sends
the layer to the reference path. The order, per scheme:

- int4, bf16 activations, compute capability >= 8.0: PyTorch's own "tinygemm" kernel
  (``torch._weight_int4pack_mm``, written for gpt-fast), then the Triton kernel
  (``kernels.quant_matmul``). Other dtypes: the Triton kernel only; tinygemm is bf16 only.
- int8: the Triton kernel, then ``torch._weight_int8pack_mm``. PyTorch's CUDA version of the
  latter (aten/src/ATen/native/cuda/int8mm.cu, as read at commit 01f9ef3) runs one thread per
  output element, each reading its weight row serially after casting x to fp32: correct, but
  not written for decode speed (the GPU check times both).
- fp8 (e4m3 weights, activations in 16 bits), compute capability >= 8.9: the Triton kernel.
  ``torch._scaled_mm`` wants fp8 activations too, which is not weight-only quantization.
- w8a8 (int8 weights, activations quantized per token as they arrive): ``torch._int_mm``, the
  integer matmul of cuBLASLt (int8 tensor cores), which wants more than 16 rows and K and N
  multiples of 8: a decode step's few rows are padded with zero rows.

The layout tinygemm wants (read from aten/src/ATen/native/cuda/int4mm.cu): the codes as uint8
(N, K / 2) with column 2j in the *high* nibble and 2j + 1 in the low one (ours is the other way
round), repacked by ``torch._convert_weight_to_int4pack(codes, inner_k_tiles)`` with
inner_k_tiles 2, 4 or 8 and K a multiple of ``inner_k_tiles * 16``; group sizes 32, 64, 128,
256; N a multiple of 8. It dequantizes a code q in 0..15 as ``(q - 8) * scale + zero`` with
``scale`` and ``zero`` bf16 in one (K / group, N, 2) tensor: our ``(q - z) * s`` is that with
``zero = (8 - z) * s``, rounded to bf16 (so it computes with weights a rounding away from the
reference's: well inside the check's tolerance). (PyTorch before 2.5 took the codes unpacked,
int32 (N, K): there the check rejects the kernel and the Triton one serves.)

Each ``layer`` here is a ``quant.QuantizedLinear`` (typed ``nn.Module``: ``quant`` imports this
module, not the other way round). Triton is imported only when a Triton kernel is built: this
module imports without it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .fastpath import W8A8_TOLERANCE, Kernel, check_kernel, quantize_tokens

TINYGEMM_GROUPS = (32, 64, 128, 256)
rejected: dict[str, str] = {}  # candidate name -> why it was last passed over (the GPU check reports it)


class Unsupported(Exception):
    """A candidate kernel does not apply to this layer, device or dtype (the message says why)."""


def capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


# ---------------------------------------------------------------------------------------------
# PyTorch's kernels


def tinygemm_operands(layer: nn.Module) -> tuple[Tensor, Tensor]:
    """Our int4 buffers in the form tinygemm's packer wants: codes uint8 (N, Kp / 2), column 2j
    in the high nibble; scale_and_zeros bf16 (G, N, 2) with zero = (8 - z) * s."""
    q = layer.qweight
    swapped = (q << 4) | (q >> 4)  # (N, Kp / 2): even columns to the high nibble
    s = layer.scales.float()  # (N, G)
    zero = (8 - layer.zeros.float()) * s
    scale_and_zeros = torch.stack([s, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)  # (G, N, 2)
    return swapped.contiguous(), scale_and_zeros


def _inner_k_tiles(k: int) -> int:
    for tiles in (8, 4, 2):
        if k % (tiles * 16) == 0:
            return tiles
    raise Unsupported(f"K = {k} is not a multiple of 32 (tinygemm packs K in tiles of 16, two or more at once)")


def torch_int4(layer: nn.Module, dtype: torch.dtype) -> Kernel:
    g, k, n = layer.spec.group_size, layer.qweight.shape[1] * 2, layer.out_features
    if dtype != torch.bfloat16:
        raise Unsupported(f"tinygemm takes bf16 activations only, not {dtype}")
    if capability(layer.qweight.device) < (8, 0):
        raise Unsupported("tinygemm needs compute capability 8.0 (its bf16 mma)")
    if g not in TINYGEMM_GROUPS or n % 8:
        raise Unsupported(f"tinygemm needs a group size in {TINYGEMM_GROUPS} and N % 8 == 0, got {g}, N = {n}")
    codes, scale_and_zeros = tinygemm_operands(layer)
    packed = torch._convert_weight_to_int4pack(codes, _inner_k_tiles(k))  # (N / 8, K / (tiles * 16), 32, tiles / 2)
    k_in = layer.in_features

    def run(x: Tensor) -> Tensor:  # (M, K) bf16 -> (M, N)
        if k != k_in:  # the padding of a last, short group
            x = F.pad(x, (0, k - k_in))
        return torch._weight_int4pack_mm(x.contiguous(), packed, g, scale_and_zeros)

    return Kernel("torch int4 tinygemm", run)


def torch_int8(layer: nn.Module, dtype: torch.dtype) -> Kernel:
    if not hasattr(torch, "_weight_int8pack_mm"):
        raise Unsupported("this PyTorch has no _weight_int8pack_mm")
    scales = layer.scales.to(dtype)
    return Kernel("torch int8pack", lambda x: torch._weight_int8pack_mm(x.contiguous(), layer.qweight, scales))


def torch_int_mm(layer: nn.Module, dtype: torch.dtype) -> Kernel:
    k, n = layer.in_features, layer.out_features
    if not hasattr(torch, "_int_mm"):
        raise Unsupported("this PyTorch has no _int_mm")
    if k % 8 or n % 8:
        raise Unsupported(f"_int_mm needs K and N multiples of 8, got K = {k}, N = {n}")
    q_t, scales = layer.qweight.T, layer.scales.float()  # (K, N), column-major: what cuBLASLt wants

    def run(x: Tensor) -> Tensor:
        a, t = quantize_tokens(x)
        m = a.shape[0]
        if m <= 16:
            a = F.pad(a, (0, 0, 0, 17 - m))
        return (torch._int_mm(a, q_t)[:m].float() * t * scales).to(x.dtype)

    return Kernel("torch int_mm", run)


# ---------------------------------------------------------------------------------------------
# The Triton kernels (kernels/quant_matmul.py)


def triton_kernel(layer: nn.Module, dtype: torch.dtype) -> Kernel:
    """The Triton kernel of the layer's scheme (also runs in Triton's CPU interpreter)."""
    if not triton_available():
        raise Unsupported("triton is not installed")
    from minillm.kernels import quant_matmul as qm

    scheme = layer.spec.scheme
    if scheme == "int8":
        return Kernel("triton int8", lambda x: qm.int8_matmul(x, layer.qweight, layer.scales))
    if scheme == "fp8":
        if layer.qweight.is_cuda and capability(layer.qweight.device) < (8, 9):
            raise Unsupported("fp8 e4m3 needs compute capability 8.9 (Ada, Hopper)")
        return Kernel("triton fp8", lambda x: qm.fp8_matmul(x, layer.qweight, layer.scales))
    g = layer.spec.group_size
    if g % 32:
        raise Unsupported(f"the Triton int4 kernel needs a group size multiple of 32, got {g}")
    return Kernel(
        "triton int4",
        lambda x: qm.int4_matmul(x, layer.qweight, layer.scales, layer.zeros, g, layer.in_features),
    )


Builder = Callable[[nn.Module, torch.dtype], Kernel]


def candidates(layer: nn.Module, dtype: torch.dtype) -> list[tuple[str, Builder]]:
    """The kernels to try for this layer, best first (see the module docstring for why)."""
    scheme = layer.spec.scheme
    if scheme == "int4":
        return [("torch int4 tinygemm", torch_int4), ("triton int4", triton_kernel)]
    if scheme == "int8":
        return [("triton int8", triton_kernel), ("torch int8pack", torch_int8)]
    if scheme == "w8a8":
        return [("torch int_mm", torch_int_mm)]
    return [("triton fp8", triton_kernel)]


def cuda_kernel(layer: nn.Module, dtype: torch.dtype) -> Kernel | None:
    """The first candidate that applies and matches the reference on a small input, or None."""
    for name, build in candidates(layer, dtype):
        try:
            tol = W8A8_TOLERANCE if layer.spec.scheme == "w8a8" else None
            kernel = check_kernel(build(layer, dtype), layer, layer.qweight.device, dtype, tol)
        except Unsupported as exc:
            rejected[name] = str(exc)
            continue
        except Exception as exc:  # a kernel missing from this build, a Triton compile error, ...
            rejected[name] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        if kernel is not None:
            return kernel
        rejected[name] = "disagreed with the reference (a layout this version packs differently?)"
    return None
