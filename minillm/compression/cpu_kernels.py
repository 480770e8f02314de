"""The CPU's decode kernels for quantized layers: minillm's own C products (``kernels/quant_matvec.c``,
built by ``kernels.native``) wrapped as torch ops, for the few rows of a decode step.

A decode step multiplies one row per sequence by every weight matrix: the weights are read once
and used once, so the step costs the bytes it reads. PyTorch's CPU kernels for weight-only int8
and int4 compute in bf16 (slow on a CPU without bf16 instructions) or dequantize to a float copy
first (reading more bytes than fp32 itself); its quantized engine's W8A8 has a fixed cost per call
and, without VNNI, keeps activations to 7 bits. The C products read each weight once, in its
stored form, and convert it in registers: ``q8_f32`` (int8 x fp32), ``q8_i8`` (W8A8: 8-bit
activations per token, integer dot products exact in int32) and ``q4_f32`` (int4 groups x fp32;
with AVX-512 VNNI the codes stay integers and each block of 32 activations is rounded to 24 bits,
``int4_rounds_activations``: converting every code to a float cost more than reading it).

They serve up to ``MATVEC_ROWS`` rows; a longer input (a prompt) goes to the layer's matmul path,
which reads its weights once for many rows. Each op is opaque to torch.compile (a custom op), so a
compiled step calls it between the graph's fused kernels; its implementation is C++
(``kernels/quant_ops.cpp``, ``implementation()``) where that builds, else Python. It returns its
rows rounded to the activations' dtype itself, so eager and compiled steps see the same values.
``MINILLM_NATIVE=0`` turns them off.

``layer`` is a ``quant.QuantizedLinear`` (typed ``nn.Module``: ``quant`` imports this module).
"""

from __future__ import annotations

import ctypes
import threading

import torch
from torch import Tensor, nn

from ..kernels import native
from .fastpath import Kernel

MATVEC_ROWS = 16  # up to this many rows the C kernels run; more go to the layer's matmul path


ISAS = ("portable C", "AVX2", "AVX-512", "AVX-512 VNNI")  # by kernels.native's minillm_isa()


def isa() -> str:
    """The instructions the C kernels were built for on this CPU (the widest their build found)."""
    lib = native.library()
    return ISAS[lib.minillm_isa()] if lib is not None else "portable C"


def int4_rounds_activations() -> bool:
    """Whether the int4 kernel multiplies integers (AVX-512 VNNI): each block of 32 activations
    rounded to 24 bits (within 2^-24 of the block's largest), the codes never converted to float."""
    return isa() == "AVX-512 VNNI"


def _call(status: int | None, what: str) -> None:
    if status:
        raise MemoryError(f"the C kernel {what} could not allocate its scratch buffers")


# Declared with torch.library.Library, not torch.library.custom_op: the latter's Python wrapper
# costs ~25 us a call here against ~8 us, and a SmolLM2-360M step makes 129 of these calls. The
# implementation is C++ (kernels/quant_ops.cpp, ~6 us a call less again) where it builds, else
# the Python functions below. ``build`` names the build of the C kernels (kernels.native) that
# the layer's kernel was made with: a slot in ``_builds`` (``build_slot``), not an address, so
# that a compiled graph is the same code in every process.
_OPS = torch.library.Library("minillm", "FRAGMENT")
_OPS.define("q8_matvec_cpu(Tensor x, Tensor w, Tensor s, int build, bool integer) -> Tensor")
_OPS.define("q4_matvec_cpu(Tensor x, Tensor w, Tensor s, Tensor z, int group_size, int build) -> Tensor")

BUILDS = 16  # slots, as quant_ops.cpp has them
_builds: list[ctypes.CDLL] = []  # the loaded builds of the C kernels, by slot


def _q8_matvec(x: Tensor, w: Tensor, s: Tensor, build: int, integer: bool) -> Tensor:
    """x (M, K) float, w int8 (N, K), s fp32 (N,) -> (M, N) in x's dtype; ``integer``: W8A8."""
    lib = _builds[build]
    dtype, x = x.dtype, x.float().contiguous()
    (m, k), n = x.shape, w.shape[0]
    y = x.new_empty(m, n)
    args = (x.data_ptr(), m, k, w.data_ptr(), s.data_ptr(), n, y.data_ptr(), torch.get_num_threads())
    if integer:
        _call(lib.q8_i8(*args), "q8_i8")
    else:
        lib.q8_f32(*args)
    return y.to(dtype)


def _q4_matvec(x: Tensor, w: Tensor, s: Tensor, z: Tensor, group_size: int, build: int) -> Tensor:
    """x (M, K) float, w uint8 (N, G * g / 2) packed codes, s fp16 scales and z uint8 zero points
    (N, G), as the layer stores them -> (M, N) in x's dtype."""
    if group_size <= 0 or group_size % 32 or (w.shape[1] * 2) % group_size or x.shape[-1] > w.shape[1] * 2:
        raise ValueError(f"minillm's C kernels: int4 groups of {group_size} do not fit w {tuple(w.shape)} and x")
    dtype, x = x.dtype, x.float().contiguous()
    (m, k), n = x.shape, w.shape[0]
    y = x.new_empty(m, n)
    status = _builds[build].q4_f32(
        x.data_ptr(), m, k, w.data_ptr(), s.data_ptr(), z.data_ptr(), n, w.shape[1] * 2, group_size,
        y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    _call(status, "q4_f32")
    return y.to(dtype)


_state: dict = {}
_registering = threading.RLock()


def implementation() -> str:
    """The operators' implementation, registered on first use: "C++" (``kernels/quant_ops.cpp``,
    built against this torch) or "Python (why not C++)"."""
    with _registering:  # once, even when two threads make their first kernels together
        if "impl" not in _state:
            _state["impl"] = _register()
    return _state["impl"]


def build_slot(lib: ctypes.CDLL) -> int:
    """The slot of the loaded C kernels ``lib`` (the operators' ``build``), given one on first sight:
    the machine's own build is slot 0 in every process; tests add the narrower ones."""
    implementation()
    with _registering:
        paths = [b._name for b in _builds]
        if lib._name in paths:
            return paths.index(lib._name)
        if len(_builds) == BUILDS:
            raise RuntimeError(f"more than {BUILDS} builds of the C kernels in one process")
        if _state["impl"] == "C++":
            names = ("q8_f32", "q8_i8", "q4_f32")
            addresses = [ctypes.cast(getattr(lib, name), ctypes.c_void_p) for name in names]
            if _state["ops"].minillm_set_build(ctypes.c_int64(len(_builds)), *addresses):
                raise RuntimeError("quant_ops.cpp refused a build of the C kernels")
        _builds.append(lib)
        return len(_builds) - 1


def _register() -> str:
    path = native.operators()
    if path is not None:
        try:
            torch.ops.load_library(str(path))
            # the same library through ctypes (a second dlopen of a path returns the same handle),
            # for its C entry point minillm_set_build
            _state["ops"] = ctypes.CDLL(str(path))
            _state["ops"].minillm_set_build.restype = ctypes.c_int
            return "C++"
        except Exception as e:  # noqa: BLE001 - a library that does not load: the Python ones serve
            why = f"{type(e).__name__}: {e}"
    else:
        why = native.operators_error()
    _OPS.impl("q8_matvec_cpu", _q8_matvec, "CPU")
    _OPS.impl("q4_matvec_cpu", _q4_matvec, "CPU")
    return f"Python ({why})"


@torch.library.register_fake("minillm::q8_matvec_cpu", lib=_OPS)
def _(x: Tensor, w: Tensor, s: Tensor, build: int, integer: bool) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.register_fake("minillm::q4_matvec_cpu", lib=_OPS)
def _(x: Tensor, w: Tensor, s: Tensor, z: Tensor, group_size: int, build: int) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


q8_matvec = torch.ops.minillm.q8_matvec_cpu.default
q4_matvec = torch.ops.minillm.q4_matvec_cpu.default


def decode_kernel(layer: nn.Module, matmul: Kernel) -> Kernel | None:
    """The C kernel for ``layer``'s scheme, handing inputs of more than ``MATVEC_ROWS`` rows to
    ``matmul``; None where the C kernels do not apply (no compiler, fp8, int4 groups that are not
    a multiple of 32)."""
    lib = native.library()
    scheme = layer.spec.scheme
    if lib is None or not (scheme in ("int8", "w8a8") or scheme == "int4" and layer.spec.group_size % 32 == 0):
        return None
    build = build_slot(lib)  # the operators registered, and this build of the kernels given a slot
    if scheme in ("int8", "w8a8"):
        integer = scheme == "w8a8"
        w, s = layer.qweight, layer.scales.float()

        def rows(x: Tensor) -> Tensor:
            return q8_matvec(x, w, s, build, integer)

        what = "int8 x int8" if integer else "int8 x fp32"
    else:  # int4, in groups of a multiple of 32
        w, g = layer.qweight, layer.spec.group_size
        s, z = layer.scales.to(torch.float16).contiguous(), layer.zeros.contiguous()
        if not torch.equal(s.float(), layer.scales.float()):
            return None  # scales that fp16 cannot hold exactly (a layer cast to another dtype)

        def rows(x: Tensor) -> Tensor:
            return q4_matvec(x, w, s, z, g, build)

        what = "int4 x 24-bit blocks" if int4_rounds_activations() else "int4 x fp32"

    def run(x: Tensor) -> Tensor:
        return rows(x) if x.shape[0] <= MATVEC_ROWS else matmul(x)

    return Kernel(f"C {what} ({isa()}); over {MATVEC_ROWS} rows {matmul.name}", run)
