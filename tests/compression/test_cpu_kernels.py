"""minillm's C kernels for a decode step's rows (kernels/quant_matvec.c through
compression.cpu_kernels): each against the reference product, on shapes whose K is and is not a
multiple of the vector width, across thread counts, inside a compiled function and a model's
greedy decode; where they hand over to the matmul path; and the build's fallbacks."""

from __future__ import annotations

import copy

import pytest
import torch

import minillm
from minillm import generate
from minillm.compression import cpu_kernels, quant, quantize
from minillm.compression.quant import QuantizedLinear, QuantSpec, quantized_layers, w8a8_matmul
from minillm.kernels import native

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no C kernels here: {native.library_error()}")

SCHEMES = [("int8", None), ("w8a8", None), ("int4", 32), ("int4", 64), ("int4", 96), ("int4", 128)]


def layer(scheme, group, n, k, seed=0, bias=False):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    return QuantizedLinear.from_linear(lin, QuantSpec.make(scheme, group))


@pytest.mark.parametrize("scheme, group", SCHEMES)
@pytest.mark.parametrize("n, k, m", [(64, 128, 1), (7, 100, 3), (40, 320, 16), (33, 1000, 2)])
def test_each_c_kernel_equals_the_reference_product(scheme, group, n, k, m):
    """int8 and int4 against dequantize-then-matmul (fp32, summed in another order: 1e-5 of the
    output's scale); W8A8 against ``w8a8_matmul`` exactly: the same 8-bit codes of each token
    (the same rounding, half to even) and integer sums, exact in int32 here and in fp32 there
    while below 2**24. int4 with VNNI rounds each block of 32 activations to 24 bits: each
    output is within what that rounding can move it (``int4_rounding_bound``)."""
    q = layer(scheme, group, n, k, seed=n + k)
    kernel = q.kernel(torch.device("cpu"), torch.float32)
    assert q.path.startswith("C ")
    x = torch.randn(m, k) * torch.logspace(-1, 1, m)[:, None]
    got, ref = kernel(x), quant._reference(q)(x)
    assert got.shape == (m, n) and got.dtype == torch.float32
    slack = 1e-5 * ref.abs().max().item()
    if scheme == "w8a8":
        assert torch.equal(got, w8a8_matmul(x, q.qweight, q.scales))
    elif scheme == "int4" and cpu_kernels.int4_rounds_activations():
        assert ((got - ref).abs() <= int4_rounding_bound(x, q.dequantized_weight()) + slack).all()
    else:
        torch.testing.assert_close(got, ref, rtol=0, atol=slack)


@pytest.mark.parametrize("group", [32, 64, 96])
def test_int4_error_is_bounded_by_the_weights_even_where_the_codes_are_large(group):
    """A group of one negative weight and zeros stores zero point 15 and codes of 15 for every
    zero: the rounding's error must follow the weights (zero), not the codes (large)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(200, 8, bias=False)
    with torch.no_grad():
        lin.weight.zero_()
        lin.weight[:, ::group] = -1.0
    q = QuantizedLinear.from_linear(lin, QuantSpec.make("int4", group))
    kernel = q.kernel(torch.device("cpu"), torch.float32)
    x = torch.randn(16, 200) * 3
    got, ref = kernel(x), quant._reference(q)(x)
    bound = int4_rounding_bound(x, q.dequantized_weight()) if cpu_kernels.int4_rounds_activations() else 0
    assert ((got - ref).abs() <= bound + 1e-5 * ref.abs().max()).all()


@pytest.mark.parametrize("scheme, group", [("w8a8", None), ("int4", 32), ("int8", None)])
def test_a_nan_activation_gives_nan_outputs_as_the_reference_does(scheme, group):
    q = layer(scheme, group, 16, 64)
    kernel = q.kernel(torch.device("cpu"), torch.float32)
    x = torch.randn(2, 64)
    x[0, 5] = float("nan")
    got = kernel(x)
    assert got[0].isnan().all() and not got[1].isnan().any()


def int4_rounding_bound(x, w):
    """How far rounding each block of 32 activations to 24 bits (a step of max|x| / (2^23 - 1) over
    the block) can move x @ w.T: half a step times |w|, summed."""
    k = x.shape[1]
    blocks = torch.nn.functional.pad(x, (0, -k % 32)).view(x.shape[0], -1, 32)
    step = blocks.abs().amax(-1) / (2**23 - 1)  # (M, blocks)
    half_step = (step / 2).repeat_interleave(32, dim=1)[:, :k]  # (M, K)
    return half_step @ w.abs().T


NARROWER = {  # another instruction set's path, built with these flags, where this CPU runs it
    "AVX-512": ("-O3", "-march=native", "-mno-avx512vnni"),
    "AVX2": ("-O3", "-march=native", "-mno-avx512f"),
    "portable C": ("-O3", "-mno-avx", "-mno-avx2"),
}


def use_narrower(monkeypatch, isa: str) -> None:
    """Make the kernels built for ``isa`` the library the layers use (skip where they do not build
    here, or build another instruction set's path on this CPU)."""
    try:
        lib = native.library_built_with(NARROWER[isa])
    except OSError as e:
        pytest.skip(f"no {isa} build here: {e}")
    if cpu_kernels.ISAS[lib.minillm_isa()] != isa:
        pytest.skip(f"these flags build {cpu_kernels.ISAS[lib.minillm_isa()]} here, not {isa}")
    monkeypatch.setitem(native._state, "lib", lib)


@pytest.mark.parametrize("isa", sorted(NARROWER))
@pytest.mark.parametrize("scheme, group", SCHEMES)
def test_the_narrower_paths_equal_the_reference_product(monkeypatch, isa, scheme, group):
    """The AVX-512 (without VNNI), AVX2 and portable paths, built here beside the widest one: the
    same checks (int4 exact to 1e-5, as they keep fp32 activations)."""
    use_narrower(monkeypatch, isa)
    for n, k, m in [(64, 128, 1), (7, 100, 3), (33, 1000, 2)]:
        q = layer(scheme, group, n, k, seed=n + k)
        kernel = q.kernel(torch.device("cpu"), torch.float32)
        assert q.path.startswith("C ") and f"({isa})" in q.path
        x = torch.randn(m, k) * torch.logspace(-1, 1, m)[:, None]
        got, ref = kernel(x), quant._reference(q)(x)
        if scheme == "w8a8":
            assert torch.equal(got, w8a8_matmul(x, q.qweight, q.scales))
        else:
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("isa", ["native", *sorted(NARROWER)])
def test_int4_scales_below_fp16s_normal_range_are_read_exactly(monkeypatch, isa):
    """Weights of about 1e-4 give scales that fp16 holds only as subnormals: each path converts
    them exactly (the portable path by hand, the others by the CPU)."""
    if isa != "native":
        use_narrower(monkeypatch, isa)
    torch.manual_seed(0)
    q = QuantizedLinear.from_linear(torch.nn.Linear(96, 24, bias=False), QuantSpec.make("int4", 32))
    q.scales.copy_(q.scales * 2e-3)  # as a layer of weights 500 times smaller would store
    assert (q.scales.float() < 6.1e-5).all() and (q.scales > 0).all()  # fp16's subnormals
    x = torch.randn(2, 96)
    got, ref = q.kernel(torch.device("cpu"), torch.float32)(x), quant._reference(q)(x)
    assert q.path.startswith("C int4")
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4 * ref.abs().max().item())


def test_the_int4_bound_holds_for_rounded_activations_and_catches_a_coarser_rounding():
    """The bound the VNNI int4 kernel is held to is tight enough to fail 16-bit rounding."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 256), torch.randn(64, 256)
    blocks = x.view(4, -1, 32)

    def rounded(levels):
        step = blocks.abs().amax(-1, keepdim=True) / levels
        return (torch.round(blocks / step) * step).view(4, 256)

    bound = int4_rounding_bound(x, w)
    assert ((rounded(2**23 - 1) @ w.T - x @ w.T).abs() <= bound + 1e-6).all()
    assert ((rounded(2**15 - 1) @ w.T - x @ w.T).abs() > bound + 1e-6).any()


@pytest.mark.parametrize("scheme, group", SCHEMES)
def test_threads_share_out_rows_and_change_no_result(scheme, group):
    q = layer(scheme, group, 300, 256)
    kernel = q.kernel(torch.device("cpu"), torch.float32)
    x = torch.randn(4, 256)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(x)
        torch.set_num_threads(2)
        two = kernel(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # each output is one row's dot product, whichever thread runs it


@pytest.mark.parametrize("scheme, group", SCHEMES)
def test_a_prompts_rows_go_to_the_matmul_path(scheme, group):
    """More than MATVEC_ROWS rows: the layer's matmul path runs (fp32: the reference; W8A8: the
    quantized engine where this torch has one), up to MATVEC_ROWS the C kernel."""
    cpu = torch.device("cpu")
    q = layer(scheme, group, 48, 96, bias=True)
    matmul = quant.cpu_matmul_kernel(q, cpu, torch.float32) or quant._reference(q)
    assert q.path == "reference" and q.kernel(cpu, torch.float32).name.endswith(f"over 16 rows {matmul.name}")
    x = torch.randn(2, cpu_kernels.MATVEC_ROWS + 1, 96)
    many = matmul(x.view(-1, 96)).view(2, -1, 48) + q.bias
    torch.testing.assert_close(q(x), many, rtol=0, atol=0)
    few = torch.randn(cpu_kernels.MATVEC_ROWS, 96)
    if not (scheme == "w8a8" and matmul.name == "reference"):  # that one C equals bit for bit
        assert not torch.equal(q(few), matmul(few) + q.bias)  # another kernel: sums in another order


def test_bf16_activations_meet_the_kernel_in_fp32_and_leave_in_bf16():
    q = layer("int4", 32, 64, 128).to(torch.bfloat16)
    x = torch.randn(3, 128).to(torch.bfloat16)
    y = q(x)
    assert y.dtype == torch.bfloat16 and q.path.startswith("C int4")
    ref = quant._reference(q)(x.float()).to(torch.bfloat16)  # the kernel rounds once, at the end
    torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_fp8_and_other_groups_keep_their_paths():
    assert cpu_kernels.decode_kernel(layer("fp8", None, 8, 64), None) is None
    assert cpu_kernels.decode_kernel(layer("int4", 16, 8, 64), None) is None


@pytest.mark.slow
@pytest.mark.parametrize("scheme, group", [("int8", None), ("w8a8", None), ("int4", 32)])
def test_compiled_the_op_is_called_between_the_graphs_kernels(scheme, group):
    q = layer(scheme, group, 64, 128, bias=True)
    q.kernel(torch.device("cpu"), torch.float32)
    f = torch.compile(lambda x: torch.relu(q(x)) * 2, fullgraph=True)
    x = torch.randn(1, 1, 128)
    torch.testing.assert_close(f(x), torch.relu(q(x)) * 2, rtol=0, atol=0)


@pytest.fixture(scope="module")
def target():
    model, tokenizer = minillm.load("minillm-target", device="cpu")
    return model, tokenizer


@pytest.mark.parametrize("scheme, group", [("int8", None), ("w8a8", None), ("int4", 32)])
def test_greedy_decode_through_the_c_kernels_equals_the_reference_paths(target, scheme, group):
    """The bundled target quantized: its greedy tokens with the C kernels (every decode step) are
    the tokens the reference products give, token for token."""
    model, tok = target
    q = quantize(copy.deepcopy(model), scheme, group)
    assert all(layer.path.startswith("C ") for layer in quantized_layers(q).values())
    prompt = torch.tensor([tok.encode("Once upon a time there was a little")])
    fast = generate(q, prompt, max_new_tokens=24).tokens
    for layer in quantized_layers(q).values():
        layer._fast[(torch.device("cpu"), torch.float32)] = None  # the reference path from here
    slow = generate(q, prompt, max_new_tokens=24).tokens
    assert {layer.path for layer in quantized_layers(q).values()} == {"reference"}
    assert torch.equal(fast, slow)


def test_without_a_compiler_the_layers_keep_their_other_paths(monkeypatch, tmp_path):
    """A compiler that fails every flag set: no library, the reason names the build, and a
    layer's kernel falls back to the matmul path (fp32: the reference)."""
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    assert native.library() is None
    assert "did not build" in native.library_error() and "-march=native" in native.library_error()
    q = layer("int8", None, 8, 64)
    assert q.kernel(torch.device("cpu"), torch.float32) is None and q.path == "reference"
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("MINILLM_NATIVE", "0")
    assert native.library() is None and "MINILLM_NATIVE=0" in native.library_error()
    monkeypatch.setattr(native, "_state", {})  # the real library again for the tests after this


def operator_args(q: QuantizedLinear, lib) -> tuple:
    """What ``decode_kernel`` passes the layer's operator, after x."""
    build = cpu_kernels.build_slot(lib)
    if q.spec.scheme == "int4":
        return q.qweight, q.scales.half(), q.zeros, q.spec.group_size, build
    return q.qweight, q.scales.float(), build, q.spec.scheme == "w8a8"


@pytest.mark.skipif(native.cxx_compiler() is None, reason="no C++ compiler here: the operators stay Python")
@pytest.mark.parametrize("scheme, group", SCHEMES)
def test_the_operators_are_cpp_and_equal_their_python_implementation(scheme, group):
    """Where a C++ compiler is, the operators are implemented in C++ (quant_ops.cpp, built against
    this torch); they call the same C functions as the Python ones, so the outputs are equal, bit
    for bit, in fp32 and bf16, for one row and several."""
    assert cpu_kernels.implementation() == "C++", native.operators_error()
    q, lib = layer(scheme, group, 40, 320, seed=3), native.library()
    op, python = (
        (cpu_kernels.q4_matvec, cpu_kernels._q4_matvec)
        if scheme == "int4"
        else (cpu_kernels.q8_matvec, cpu_kernels._q8_matvec)
    )
    for dtype in (torch.float32, torch.bfloat16):
        for m in (1, 5):
            x = torch.randn(m, 320).to(dtype)
            got = op(x, *operator_args(q, lib))
            assert got.dtype == dtype and torch.equal(got, python(x, *operator_args(q, lib)))


@pytest.mark.skipif(native.cxx_compiler() is None, reason="no C++ compiler here: the operators stay Python")
def test_an_operator_names_a_tensor_it_cannot_take():
    assert cpu_kernels.implementation() == "C++", native.operators_error()
    q, lib = layer("w8a8", None, 8, 64), native.library()
    w, s, build, integer = operator_args(q, lib)
    with pytest.raises(RuntimeError, match="w must be a contiguous int8 tensor, got Float"):
        cpu_kernels.q8_matvec(torch.randn(1, 64), w.float(), s, build, integer)
    with pytest.raises(RuntimeError, match="do not match"):
        cpu_kernels.q8_matvec(torch.randn(1, 63), w, s, build, integer)
    w, s, z, g, build = operator_args(layer("int4", 32, 8, 64), lib)
    with pytest.raises(RuntimeError, match="s must be a contiguous fp16 tensor, got Float"):
        cpu_kernels.q4_matvec(torch.randn(1, 64), w, s.float(), z, g, build)
    with pytest.raises(RuntimeError, match="int4 groups of 16"):  # the C kernels take multiples of 32
        cpu_kernels.q4_matvec(
            torch.randn(1, 64), w, torch.ones(8, 4).half(), torch.zeros(8, 4, dtype=torch.uint8), 16, build
        )
    with pytest.raises(ValueError, match="int4 groups of 16"):
        cpu_kernels._q4_matvec(
            torch.randn(1, 64), w, torch.ones(8, 4).half(), torch.zeros(8, 4, dtype=torch.uint8), 16, build
        )
    with pytest.raises(RuntimeError, match="no build in slot 15"):
        cpu_kernels.q4_matvec(torch.randn(1, 64), w, s, z, g, 15)


def test_without_a_cpp_compiler_the_operators_say_why(monkeypatch, tmp_path):
    """The C++ operators' build: a compiler that fails names the build's error, and
    ``MINILLM_CPP_OPS=0`` turns it off (the operators then keep their Python implementation)."""
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    assert native.operators() is None and "did not build" in native.operators_error()
    monkeypatch.setattr(native, "_state", {})  # remembered: not built again by the next process
    monkeypatch.setattr(native, "_compile", lambda cmd, target: pytest.fail("built again"))
    assert native.operators() is None and "an earlier build" in native.operators_error()
    assert len(list((tmp_path / "kernels").glob("quant_ops-*.failed"))) == 1
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("MINILLM_CPP_OPS", "0")
    assert native.operators() is None and "MINILLM_CPP_OPS=0" in native.operators_error()
    monkeypatch.setattr(native, "_state", {})


def test_the_build_is_cached_per_source_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    assert native.library() is not None
    built = list((tmp_path / "kernels").glob("quant_matvec-*.so"))
    assert len(built) == 1
    monkeypatch.setattr(native, "_state", {})
    stamp = built[0].stat().st_mtime_ns
    assert native.library() is not None and built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    monkeypatch.setattr(native, "cpu_flags", lambda: "flags: another cpu")
    monkeypatch.setattr(native, "_state", {})
    assert native.library() is not None
    assert len(list((tmp_path / "kernels").glob("quant_matvec-*.so"))) == 2
    monkeypatch.setattr(native, "_state", {})
