"""The quantized matmul kernels against dequantize-then-F.linear (in Triton's CPU interpreter here).

The buffers come from minillm.compression.quant's own functions. Tolerance, relative to the
largest output: 1e-5 in fp32 (the same products summed in another order); 3e-3 in fp16, where
the reference rounds each dequantized weight to fp16 before its matmul and the kernel (int8,
fp8) applies the fp32 scale once to the fp32 sum instead. bf16 is not tested here: the
interpreter's bf16 tl.dot is wrong (a Triton bug); the GPU check covers it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minillm.compression import cuda_kernels
from minillm.compression.fastpath import check_kernel
from minillm.compression.quant import (
    QuantizedLinear,
    QuantSpec,
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)

pytest.importorskip("triton", reason="triton is not installed: the kernel tests need it (or its CPU interpreter)")

from minillm.kernels.quant_matmul import Tiles, fp8_matmul, int4_matmul, int8_matmul  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]
REL_TOL = {torch.float32: 1e-5, torch.float16: 3e-3}
SCHEMES = ["int8", "int4-g32", "int4-g64", "fp8"]
# (M, N, K): one decode row against a ragged N; five rows, a single output column; two M tiles
SHAPES = [(1, 37, 100), (5, 1, 70), (17, 24, 96)]


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05  # (N, K)


def _run(scheme: str, w: torch.Tensor, x: torch.Tensor, tiles: Tiles | None = None):
    """(kernel output, dequantize-then-F.linear reference) for x (M, K) on weight w (N, K)."""
    w, dtype = w.to(DEVICE), x.dtype
    if scheme == "int8":
        q, s = quantize_int8(w)
        return int8_matmul(x, q, s, tiles=tiles), F.linear(x, dequantize_int8(q, s, dtype))
    if scheme == "fp8":
        q, s = quantize_fp8(w)
        return fp8_matmul(x, q, s, tiles=tiles), F.linear(x, (q.float() * s[:, None]).to(dtype))
    g = int(scheme.removeprefix("int4-g"))
    codes, s, z = quantize_int4(w, g)
    ref = F.linear(x, dequantize_int4(codes, s, z, w.shape[1], dtype))
    return int4_matmul(x, pack_int4(codes), s, z, g, w.shape[1], tiles=tiles), ref


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_dequantize_then_linear(shape, scheme, dtype):
    """K = 100 and 70 are not multiples of the group: the last group is short (padded codes)."""
    m, n, k = shape
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(DEVICE, dtype)  # (M, K)
    out, ref = _run(scheme, _weight(n, k, seed=n), x)
    assert out.shape == (m, n) and out.dtype == dtype
    assert _rel_err(out, ref) < REL_TOL[dtype]


@pytest.mark.parametrize(
    "tiles",
    [Tiles(16, 16, 32, split_k=2), Tiles(32, 16, 64, split_k=3), Tiles(16, 64, 32)],
    ids=["split2", "split3-deep", "wide"],
)
@pytest.mark.parametrize("scheme", ["int8", "int4-g64"])
def test_other_tiles_and_split_k(scheme, tiles):
    """The GPU's decode tiles split K over programs that add into an fp32 output: any split
    (K = 150: the last slice shorter than the others) and tile shape gives the same sums."""
    x = torch.randn(17, 150, generator=torch.Generator().manual_seed(1)).to(DEVICE)  # (M, K)
    out, ref = _run(scheme, _weight(40, 150, seed=2), x, tiles)
    assert _rel_err(out, ref) < REL_TOL[torch.float32]


def test_leading_dims_are_kept():
    q, s = quantize_int8(_weight(8, 64, seed=3).to(DEVICE))
    x = torch.randn(2, 3, 64, device=DEVICE)  # (B, T, K)
    assert torch.allclose(int8_matmul(x, q, s), F.linear(x, dequantize_int8(q, s)), atol=1e-5)
    assert int8_matmul(x[:, :0], q, s).shape == (2, 0, 8)  # no rows: nothing to launch


def test_bad_inputs_are_rejected():
    w = _weight(8, 64, seed=4).to(DEVICE)
    q8, s8 = quantize_int8(w)
    codes, s4, z4 = quantize_int4(w, 32)
    x = torch.zeros(1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="in_features 64"):
        int8_matmul(torch.zeros(1, 63, device=DEVICE), q8, s8)
    with pytest.raises(ValueError, match="int8 qweight"):
        int8_matmul(x, q8.float(), s8)
    with pytest.raises(ValueError, match="fp8 qweight"):
        fp8_matmul(x, q8, s8)
    with pytest.raises(ValueError, match="multiple of 32"):
        int4_matmul(x, pack_int4(codes), s4, z4, 48, 64)
    with pytest.raises(ValueError, match="whole groups"):
        int4_matmul(x, pack_int4(codes), s4, z4, 32, 20)
    with pytest.raises(ValueError, match="block_k 64 must divide"):
        int4_matmul(x, pack_int4(codes), s4, z4, 32, 64, tiles=Tiles(16, 16, 64))
    with pytest.raises(ValueError, match="block_m"):
        Tiles(24, 16, 16)


# ---------------------------------------------------------------------------------------------
# minillm.compression.cuda_kernels: what can be checked without a GPU


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "spec", [QuantSpec.make("int8"), QuantSpec("int4", 32), QuantSpec.make("fp8")], ids=lambda s: s.label
)
def test_the_triton_candidate_passes_the_layers_own_check(spec, dtype):
    """The kernel cuda_kernels builds for a layer (bias and a short last group included) passes
    check_kernel, the check every fast kernel meets before it is used, and adds the bias."""
    linear = torch.nn.Linear(80, 24).to(DEVICE)
    layer = QuantizedLinear.from_linear(linear, spec)
    kernel = check_kernel(cuda_kernels.triton_kernel(layer, dtype), layer, torch.device(DEVICE), dtype)
    assert kernel is not None and kernel.name == f"triton {spec.scheme}"
    layer._fast[(torch.device(DEVICE), dtype)] = kernel  # what forward caches on a GPU
    x = torch.randn(3, 80, device=DEVICE).to(dtype)
    assert _rel_err(layer(x), layer.forward_reference(x)) < REL_TOL[dtype] and layer.path == kernel.name


def _tinygemm_dequant(codes_hi_even: torch.Tensor, scale_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """tinygemm's arithmetic as read from aten/src/ATen/native/cuda/int4mm.cu: byte j of a row holds
    column 2j in its high nibble and 2j + 1 in its low one; w = (q - 8) * scale + zero per group."""
    q = torch.stack([codes_hi_even >> 4, codes_hi_even & 0xF], dim=-1).flatten(1).float()  # (N, K)
    sz = scale_and_zeros.float().repeat_interleave(group, dim=0)  # (K, N, 2)
    return (q - 8) * sz[..., 0].T + sz[..., 1].T


def test_tinygemm_operands_encode_our_weights():
    """Our low-nibble-first bytes and (q - z) * s become tinygemm's high-nibble-first bytes and
    (q - 8) * s + zero; the same weights up to bf16's rounding of scale and zero."""
    layer = QuantizedLinear.from_linear(torch.nn.Linear(96, 16, bias=False), QuantSpec("int4", 32))
    codes, scale_and_zeros = cuda_kernels.tinygemm_operands(layer)
    assert codes.shape == (16, 48) and codes.dtype == torch.uint8
    assert scale_and_zeros.shape == (3, 16, 2) and scale_and_zeros.dtype == torch.bfloat16
    assert torch.equal(unpack_int4(codes).view(16, 48, 2).flip(-1).flatten(1), unpack_int4(layer.qweight))
    w = layer.dequantized_weight()  # (N, K)
    step = layer.scales.float().repeat_interleave(32, dim=1)  # (N, K): one quantization step
    assert ((_tinygemm_dequant(codes, scale_and_zeros, 32) - w).abs() <= 0.05 * step).all()


def test_candidates_prefer_pytorchs_int4_kernel_and_the_triton_int8_one():
    spec_names = {
        s: [name for name, _ in cuda_kernels.candidates(QuantizedLinear(64, 8, QuantSpec.make(s)), torch.bfloat16)]
        for s in ("int4", "int8", "fp8")
    }
    assert spec_names == {
        "int4": ["torch int4 tinygemm", "triton int4"],
        "int8": ["triton int8", "torch int8pack"],
        "fp8": ["triton fp8"],
    }
    layer = QuantizedLinear(64, 8, QuantSpec("int4", 32))
    with pytest.raises(cuda_kernels.Unsupported, match="bf16"):
        cuda_kernels.torch_int4(layer, torch.float16)


def test_cuda_kernel_passes_over_candidates_that_do_not_apply_or_disagree(monkeypatch):
    """The first candidate does not apply, the second computes the wrong product: the Triton
    kernel serves, and why the others did not is recorded."""

    def unsupported(layer, dtype):
        raise cuda_kernels.Unsupported("not on this GPU")

    def wrong(layer, dtype):
        return cuda_kernels.Kernel("wrong", lambda x: 2 * layer.forward_reference(x))

    trio = [("unsupported", unsupported), ("wrong", wrong), ("triton int8", cuda_kernels.triton_kernel)]
    monkeypatch.setattr(cuda_kernels, "candidates", lambda layer, dtype: trio)
    monkeypatch.setattr(cuda_kernels, "rejected", {})
    layer = QuantizedLinear.from_linear(torch.nn.Linear(64, 16).to(DEVICE), QuantSpec.make("int8"))
    kernel = cuda_kernels.cuda_kernel(layer, torch.float32)
    assert kernel is not None and kernel.name == "triton int8"
    assert cuda_kernels.rejected["unsupported"] == "not on this GPU"
    assert cuda_kernels.rejected["wrong"].startswith("disagreed") and len(cuda_kernels.rejected) == 2
