"""Weight-only quantization, as a transformation of a loaded model (the model class is untouched).

Three formats, each a few lines of arithmetic and one module that replaces an ``nn.Linear``:

- ``int8``: symmetric, one fp32 scale per output channel: ``w ~ q * s``, q in [-127, 127].
- ``int4``: asymmetric, one fp16 scale and one 4-bit zero point per group of ``group_size``
  input weights: ``w ~ (q - z) * s``, q and z in [0, 15]; two weights per byte. The range of
  each group always includes 0, so that 0 (and the zero padding of a last, short group) is exact.
- ``fp8``: float8 e4m3 with one fp32 scale per output channel (448 is e4m3's largest value).
- ``w8a8``: the weights as ``int8``, and the activations too, each token (row) with a scale of
  its own computed as it arrives (dynamic, per token): ``x ~ a * t``; the product is then an
  integer one, ``x @ w.T ~ (a @ q.T) * t * s``, int8 times int8 summed in int32. The others
  dequantize the weights and multiply in floating point; this one multiplies in integers.

Each ``QuantizedLinear`` keeps the reference path beside the fast one: ``forward_reference``
dequantizes the whole matrix and calls ``F.linear``; ``forward`` uses the packed kernel PyTorch
ships for this device and dtype where there is one (``path`` names it), and the reference
otherwise. The fast kernels only pay off where they read fewer bytes than the dense matmul:
decode (a matrix-vector product) is bandwidth-bound, prefill is compute-bound (chapter 3).

Calibrated methods (GPTQ, AWQ) decide *which* codes to store; they live in ``gptq.py`` and
``awq.py`` and produce the same ``QuantizedLinear``.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cpu_kernels import decode_kernel as cpu_decode_kernel
from .fastpath import W8A8_TOLERANCE, Kernel, check_kernel, quantize_tokens

SCHEMES = ("int8", "int4", "fp8", "w8a8")
INT4_DEFAULT_GROUP = 128
FP8_MAX = 448.0  # the largest finite float8 e4m3 value


# ---------------------------------------------------------------------------------------------
# The arithmetic of each format


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per output channel: w (N, K) -> q int8 (N, K), scale fp32 (N,);
    w ~ q * scale."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # (N,)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return (q.float() * scale.float()[:, None]).to(dtype)


def w8a8_matmul(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """x (M, K) float, q int8 (N, K), scale (N,) -> (M, N) fp32: the W8A8 product
    in integers, spelled out (the integer sums are exact in fp32 up to 2**24)."""
    a, t = quantize_tokens(x)
    return (a.float() @ q.float().T) * t * scale.float()


def padded_groups(w: Tensor, group_size: int) -> Tensor:
    """(N, K) -> (N, G, group_size), the last group padded with zeros when K % group_size != 0."""
    n, k = w.shape
    pad = -k % group_size
    return F.pad(w, (0, pad)).view(n, (k + pad) // group_size, group_size)


def int4_group_params(groups: Tensor) -> tuple[Tensor, Tensor]:
    """Scale and zero point of each group (..., g) -> (...,), (...,): the group's range
    [min, max], widened to include 0, mapped onto the 16 codes 0..15. The scale is
    stored in fp16, rounded up so that 15 steps still span the range. The zero point is
    a whole code, so the codes cover [-zero * scale, (15 - zero) * scale]: the range
    shifted by less than half a step, and a value at its very end may round with an
    error of up to one step instead of half."""
    lo = groups.amin(dim=-1).clamp(max=0).float()
    hi = groups.amax(dim=-1).clamp(min=0).float()
    exact = ((hi - lo) / 15).clamp(min=1e-8)
    half = exact.half()
    half = torch.where(half.float() < exact, torch.nextafter(half, torch.full_like(half, float("inf"))), half)
    scale = half.float()
    zero = torch.round(-lo / scale).clamp(0, 15)
    return scale, zero


def int4_codes(w: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    """Round w to its codes given the scale and zero point that apply to it (broadcast): 0..15."""
    return (torch.round(w.float() / scale) + zero).clamp(0, 15)


def quantize_int4(w: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Round to nearest: w (N, K) -> codes uint8 (N, G * group_size) in 0..15, scales
    fp16 (N, G), zeros uint8 (N, G); w ~ (codes - zero) * scale, group by group."""
    groups = padded_groups(w.float(), group_size)  # (N, G, g)
    scale, zero = int4_group_params(groups)  # (N, G) each
    codes = int4_codes(groups, scale[..., None], zero[..., None])  # (N, G, g)
    return codes.flatten(1).to(torch.uint8), scale.half(), zero.to(torch.uint8)


def dequantize_int4(
    codes: Tensor, scales: Tensor, zeros: Tensor, in_features: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """codes (N, G * g), scales and zeros (N, G) -> w (N, in_features)."""
    n, g = scales.shape
    groups = codes.view(n, g, -1).float()  # (N, G, group_size)
    w = (groups - zeros.float()[..., None]) * scales.float()[..., None]
    return w.flatten(1)[:, :in_features].to(dtype)


def pack_int4(codes: Tensor) -> Tensor:
    """Two 4-bit codes per byte: (N, 2M) uint8 in 0..15 -> (N, M) uint8, even columns in
    the low nibble and odd columns in the high one."""
    if codes.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of columns, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """The inverse of pack_int4: (N, M) uint8 -> (N, 2M) uint8 codes."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def quantize_fp8(w: Tensor) -> tuple[Tensor, Tensor]:
    """float8 e4m3 per output channel: w (N, K) -> w8 (N, K), scale fp32 (N,), w ~ w8 * scale."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def bits_per_weight(scheme: str, group_size: int | None = None, in_features: int | None = None) -> float:
    """Stored bits per weight, scales and zero points included (per-channel scales spread over
    ``in_features`` weights when given, else ignored)."""
    if scheme == "int4":
        g = group_size or INT4_DEFAULT_GROUP
        return 4 + (16 + 8) / g  # a 4-bit code, plus an fp16 scale and an 8-bit zero per group
    per_row = 32 / in_features if in_features else 0.0  # one fp32 scale per output channel
    return 8 + per_row


# ---------------------------------------------------------------------------------------------
# The module


@dataclass(frozen=True)
class QuantSpec:
    """What a quantized linear stores: the scheme and, for int4, the group size."""

    scheme: str
    group_size: int | None = None

    @property
    def storage(self) -> str:
        """The scheme whose buffers and rounding the weights use (w8a8 stores its weights as int8)."""
        return "int8" if self.scheme == "w8a8" else self.scheme

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown quantization scheme {self.scheme!r}: choose one of {SCHEMES}")
        g = self.group_size
        if self.scheme != "int4" and g is not None:
            raise ValueError(
                f"group_size applies to int4 only ({self.scheme} has one scale per output channel), got {g!r}"
            )
        if self.scheme == "int4" and (isinstance(g, bool) or not isinstance(g, int) or g < 2 or g % 2):
            raise ValueError(f"int4 group_size must be a positive even integer (two 4-bit codes per byte), got {g!r}")

    @classmethod
    def make(cls, scheme: str, group_size: int | None = None) -> QuantSpec:
        if scheme == "int4" and group_size is None:
            group_size = INT4_DEFAULT_GROUP
        return cls(scheme, group_size)

    @property
    def label(self) -> str:
        return f"int4-g{self.group_size}" if self.scheme == "int4" else self.scheme


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is stored quantized (see the module docstring for the formats).

    Buffers: int8 (and w8a8) ``qweight`` int8 (N, K) + ``scales`` fp32 (N,); int4 ``qweight`` uint8
    (N, G * g / 2) + ``scales`` fp16 (N, G) + ``zeros`` uint8 (N, G); fp8 ``qweight`` float8
    (N, K) + ``scales`` fp32 (N,). ``bias`` (N,) when the original had one.
    """

    def __init__(self, in_features: int, out_features: int, spec: QuantSpec, bias: bool = False, device=None):
        super().__init__()
        self.in_features, self.out_features, self.spec = in_features, out_features, spec
        n, k = out_features, in_features
        if spec.scheme == "int4":
            groups = -(-k // spec.group_size)
            self.register_buffer(
                "qweight", torch.zeros(n, groups * spec.group_size // 2, dtype=torch.uint8, device=device)
            )
            self.register_buffer("scales", torch.ones(n, groups, dtype=torch.float16, device=device))
            self.register_buffer("zeros", torch.zeros(n, groups, dtype=torch.uint8, device=device))
        else:
            dtype = torch.int8 if spec.storage == "int8" else torch.float8_e4m3fn
            self.register_buffer("qweight", torch.zeros(n, k, dtype=dtype, device=device))
            self.register_buffer("scales", torch.ones(n, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(n, device=device) if bias else None)
        self._fast: dict = {}  # derived per (device, dtype): the layouts the packed kernels want
        self.path = "reference"

    # -- building ---------------------------------------------------------------------------

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: QuantSpec, weight: Tensor | None = None) -> QuantizedLinear:
        """Round ``weight`` (default: the linear's own) to nearest in ``spec``'s format."""
        w = (linear.weight if weight is None else weight).detach()
        q = cls(linear.in_features, linear.out_features, spec, linear.bias is not None, w.device)
        if spec.storage == "int8":
            q.set_int8(*quantize_int8(w))
        elif spec.scheme == "int4":
            q.set_int4(*quantize_int4(w, spec.group_size))
        else:
            q.set_fp8(*quantize_fp8(w))
        if linear.bias is not None:
            q.bias = linear.bias.detach().clone()
        return q

    def set_int8(self, q: Tensor, scale: Tensor) -> None:
        self.qweight.copy_(q)
        self.scales.copy_(scale)
        self._fast.clear()

    def set_int4(self, codes: Tensor, scales: Tensor, zeros: Tensor) -> None:
        """codes (N, G * g) in 0..15, scales (N, G), zeros (N, G) in 0..15."""
        self.qweight.copy_(pack_int4(codes))
        self.scales.copy_(scales)
        self.zeros.copy_(zeros)
        self._fast.clear()

    def set_fp8(self, w8: Tensor, scale: Tensor) -> None:
        self.qweight.copy_(w8)
        self.scales.copy_(scale)
        self._fast.clear()

    def __getstate__(self):
        """A copy (``copy.deepcopy``, pickling) packs its kernels afresh: a kernel may hold a packed
        weight by a key that lives only as long as the original's kernel."""
        state = super().__getstate__()
        return {**state, "_fast": {}, "path": "reference"}

    def _apply(self, fn, recurse=True):
        """``.to(device)`` moves the stored tensors; ``.to(dtype)`` (or ``.half()``) changes the
        compute dtype only: the codes, scales and zero points keep their stored dtypes."""
        stored = {n: getattr(self, n) for n in ("qweight", "scales", "zeros") if hasattr(self, n)}
        super()._apply(fn, recurse)
        for name, before in stored.items():
            after = getattr(self, name)
            if after.dtype != before.dtype:
                setattr(self, name, before.to(after.device))
        self._fast = {}
        return self

    # -- the reference path -----------------------------------------------------------------

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The (N, K) weight this layer computes with."""
        s = self.spec.storage
        if s == "int8":
            return dequantize_int8(self.qweight, self.scales, dtype)
        if s == "int4":
            return dequantize_int4(unpack_int4(self.qweight), self.scales, self.zeros, self.in_features, dtype)
        return (self.qweight.float() * self.scales[:, None]).to(dtype)

    def forward_reference(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.spec.scheme == "w8a8":
            y = w8a8_matmul(x.reshape(-1, self.in_features), self.qweight, self.scales).to(x.dtype)
            y = y.view(*x.shape[:-1], self.out_features)
            return y if bias is None else y + bias
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    # -- the fast path ----------------------------------------------------------------------

    def kernel(self, device: torch.device, dtype: torch.dtype) -> Kernel | None:
        """The fast kernel for ``dtype`` activations on ``device`` (chosen and packed once, then
        remembered), or None for the reference path; ``path`` names what runs."""
        key = (device, dtype)
        if key not in self._fast:
            self._fast[key] = fast_kernel(self, device, dtype)
        kernel = self._fast[key]
        self.path = kernel.name if kernel is not None else "reference"
        return kernel

    def forward(self, x: Tensor) -> Tensor:
        kernel = self.kernel(x.device, x.dtype)
        if kernel is None:
            return self.forward_reference(x)
        y = kernel(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.spec.label}"


# ---------------------------------------------------------------------------------------------
# Fast kernels: each returns a function x (M, K) -> (M, N), or None where it does not apply


def _cpu_int8(layer: QuantizedLinear, dtype: torch.dtype) -> Kernel | None:
    """torch's int8 kernel reads K in steps of 8: other K give wrong sums (and can crash)."""
    if not hasattr(torch, "_weight_int8pack_mm") or layer.in_features % 8:
        return None
    scales = layer.scales.to(dtype)
    return Kernel("torch int8pack", lambda x: torch._weight_int8pack_mm(x, layer.qweight, scales))


def _cpu_int4(layer: QuantizedLinear, dtype: torch.dtype) -> Kernel | None:
    """torch's CPU int4 kernel computes (q - 8) * s + m per group: our (q - z) * s is that with
    m = (8 - z) * s. It wants the codes as int32 (N, K) and [scale, m] as (G, N, 2)."""
    g, k = layer.spec.group_size, layer.qweight.shape[1] * 2
    if not hasattr(torch, "_weight_int4pack_mm_for_cpu") or g not in (32, 64, 128, 256) or k % g:
        return None
    n, k_in = layer.out_features, layer.in_features
    rows = -n % 16  # the kernel packs 16 output rows at a time: pad with rows of zeros, cut back after
    codes = F.pad(unpack_int4(layer.qweight).to(torch.int32), (0, 0, 0, rows))
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
    s = F.pad(layer.scales.float(), (0, 0, 0, rows))
    m = (8 - F.pad(layer.zeros.float(), (0, 0, 0, rows))) * s
    sz = torch.stack([s, m], dim=-1).transpose(0, 1).contiguous().to(dtype)  # (G, N + rows, 2)

    def run(x: Tensor) -> Tensor:
        if k != k_in:  # the padding of a last, short group: zero inputs meet its codes
            x = F.pad(x, (0, k - k_in))
        y = torch._weight_int4pack_mm_for_cpu(x.contiguous(), packed, g, sz)
        return y[:, :n] if rows else y

    return Kernel("torch int4pack", run)


# The CPU's integer product: PyTorch's quantized engine (FBGEMM or oneDNN, chosen by
# ``torch.backends.quantized.engine``) multiplies uint8 activations by int8 weights in int32 with
# the CPU's integer dot products (AVX2 ``vpmaddubsw``, AVX-512 VNNI, AMX). Its dynamic linear
# quantizes a whole input with one scale; dividing each row by its largest magnitude first (and
# multiplying the output back) makes that one scale fit every row: quantization per token.
# Without VNNI, u8 x s8 pairs summed in int16 can saturate: ``reduce_range`` keeps the
# activations to 7 bits there. The packed weight is an object torch.compile cannot trace, so the
# op is opaque to it and finds its weight by a key.
_PACKED: dict[int, object] = {}


def cpu_has_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_vnni", "avx_vnni", "amx_int8"))


@torch.library.custom_op("minillm::w8a8_linear_cpu", mutates_args=())
def w8a8_linear_cpu(x: Tensor, key: int, out_features: int, reduce_range: bool) -> Tensor:
    x = x.float()
    peak = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    return torch.ops.quantized.linear_dynamic(x / peak, _PACKED[key], reduce_range) * peak


@w8a8_linear_cpu.register_fake
def _(x: Tensor, key: int, out_features: int, reduce_range: bool) -> Tensor:
    return x.new_empty(x.shape[0], out_features, dtype=torch.float32)


def saturates(layer: QuantizedLinear, key: int) -> bool:
    """Whether 8-bit activations go wrong on this CPU: the input most likely to saturate is one
    aligned with a weight row (every product of a pair large and of one sign)."""
    x = layer.qweight[:1].float()
    ref = x @ layer.dequantized_weight().T
    got = w8a8_linear_cpu(x, key, layer.out_features, False)
    return bool((got - ref).norm() > 0.02 * ref.norm())


def _cpu_w8a8(layer: QuantizedLinear, dtype: torch.dtype) -> Kernel | None:
    if not hasattr(torch.ops.quantized, "linear_dynamic") or not torch.backends.quantized.engine:
        return None
    n = layer.out_features
    with warnings.catch_warnings():  # quantized tensors are deprecated; the engine's kernels are not replaced yet
        warnings.simplefilter("ignore")
        w = torch._make_per_channel_quantized_tensor(
            layer.qweight, layer.scales.double(), torch.zeros(n, dtype=torch.long), 0
        )
        packed = torch.ops.quantized.linear_prepack(w, None)
    key = id(packed)
    _PACKED[key] = packed
    reduce_range = not cpu_has_vnni() or saturates(layer, key)
    name = f"{torch.backends.quantized.engine} int8 x int8" + (" (7-bit activations)" if reduce_range else "")
    kernel = Kernel(name, lambda x: w8a8_linear_cpu(x, key, n, reduce_range).to(x.dtype))
    kernel.key = key
    weakref.finalize(kernel, _PACKED.pop, key, None)  # the packed weight lives as long as its kernel
    return kernel


def fast_kernel(layer: QuantizedLinear, device: torch.device, dtype: torch.dtype) -> Kernel | None:
    """The fastest packed kernel for this layer on ``device`` with ``dtype`` activations, or None.

    On the CPU a decode step's few rows go to minillm's C kernels (``cpu_kernels``) where they
    build, a prompt's many rows to the matmul path: PyTorch's int8 and int4 weight-only kernels in
    bf16 (and fp16), its quantized engine for W8A8, dequantize-then-matmul for fp32 (PyTorch's
    packed kernels are slower than that with fp32 activations)."""
    if device.type == "cpu":
        matmul = cpu_matmul_kernel(layer, device, dtype)
        tol = W8A8_TOLERANCE if layer.spec.scheme == "w8a8" else None
        rows = check_kernel(cpu_decode_kernel(layer, matmul or _reference(layer)), layer, device, dtype, tol)
        return rows or matmul
    try:
        if device.type == "cuda":
            from .cuda_kernels import cuda_kernel

            return cuda_kernel(layer, dtype)  # checks each candidate it tries
    except (RuntimeError, NotImplementedError, ImportError):
        return None  # this build of torch lacks the kernel for this shape or dtype
    return None


def cpu_matmul_kernel(layer: QuantizedLinear, device: torch.device, dtype: torch.dtype) -> Kernel | None:
    """PyTorch's packed CPU kernel for many rows, checked, or None for the reference."""
    scheme = layer.spec.scheme
    try:
        if scheme == "w8a8":  # computes in integers: any activation dtype
            return check_kernel(_cpu_w8a8(layer, dtype), layer, device, dtype, W8A8_TOLERANCE)
        if dtype in (torch.bfloat16, torch.float16):
            if scheme == "int8":
                return check_kernel(_cpu_int8(layer, dtype), layer, device, dtype)
            if scheme == "int4":
                return check_kernel(_cpu_int4(layer, dtype), layer, device, dtype)
    except (RuntimeError, NotImplementedError):
        return None  # this build of torch lacks the kernel for this shape or dtype
    return None


def _reference(layer: QuantizedLinear) -> Kernel:
    """The reference product without the bias (a kernel's output; ``forward`` adds the bias)."""
    if layer.spec.scheme == "w8a8":
        return Kernel("reference", lambda x: w8a8_matmul(x, layer.qweight, layer.scales).to(x.dtype))
    return Kernel("reference", lambda x: F.linear(x, layer.dequantized_weight(x.dtype)))


# ---------------------------------------------------------------------------------------------
# The transformation


def quantized_layers(model: nn.Module) -> dict[str, QuantizedLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def linear_layers(model: nn.Module, skip: Iterable[str] = ()) -> dict[str, nn.Linear]:
    """Every nn.Linear of the model by qualified name, except those whose name contains a ``skip``
    entry (e.g. "lm_head")."""
    skip = tuple(skip)
    return {
        name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and not any(s in name for s in skip)
    }


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def prepare_kernels(model: nn.Module, dtype: torch.dtype | None = None) -> None:
    """Pack every quantized layer for its fast kernel now (device of its weights, ``dtype`` of the
    activations, by default the model's), so that the first forward is not slowed by it."""
    if dtype is None:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    for layer in quantized_layers(model).values():
        layer.kernel(layer.qweight.device, dtype)


def model_bytes(model: nn.Module) -> int:
    """Bytes of the model's stored tensors (parameters and persistent buffers, shared ones once):
    what its checkpoint holds and what a decode step reads."""
    seen, total = set(), 0
    tensors = list(model.parameters()) + [b for _, b in _persistent_buffers(model)]
    for t in tensors:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def _persistent_buffers(model: nn.Module):
    for mod_name, mod in model.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in mod._non_persistent_buffers_set:
                yield f"{mod_name}.{name}", buf
