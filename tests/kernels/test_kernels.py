"""The Triton kernels against their PyTorch references (in Triton's CPU interpreter without a GPU).

tests/conftest.py sets TRITON_INTERPRET=1 when CUDA is unavailable, before triton is imported.
The interpreter's bf16 tl.dot is wrong (a Triton bug), so the CPU tests use fp32 and fp16.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from minillm import generate
from minillm.core.attention import attention_reference
from minillm.core.model import rms_norm_reference
from minillm.kv.paged import paged_attention_decode
from tests.conftest import tiny_model

pytest.importorskip("triton", reason="triton is not installed: the kernel tests need it (or its CPU interpreter)")

from minillm.core import attention as dispatch  # noqa: E402
from minillm.core.attention import attention_tiled
from minillm.kernels.flash_attention import check_interpreter, flash_attention  # noqa: E402
from minillm.kernels.paged_attention import paged_attention_decode_triton  # noqa: E402
from minillm.kernels.rmsnorm import rms_norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 2e-3}


def _qkv(B, H, Hkv, T, S, hd, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, hd, generator=g)  # (B, H, T, hd)
    k = torch.randn(B, Hkv, S, hd, generator=g)  # (B, Hkv, S, hd)
    v = torch.randn(B, Hkv, S, hd, generator=g)
    return (t.to(DEVICE, dtype) for t in (q, k, v))


def _assert_close(out, ref, dtype):
    err = (out.float() - ref.float()).abs().max().item()
    assert err < TOL[dtype], f"max error {err:.2e} > {TOL[dtype]:.0e}"


# (B, H, Hkv, T, S, hd): lengths off the 16-multiple tiles, kv_len > q_len, GQA ratios 1, 4, 8
ATTENTION_SHAPES = [
    (1, 2, 2, 37, 37, 64),
    (2, 4, 1, 19, 45, 64),
    (1, 8, 1, 7, 50, 128),
    (1, 4, 4, 33, 33, 128),
    (1, 8, 2, 1, 29, 64),
    (2, 2, 2, 16, 16, 32),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_flash_attention_matches_reference(shape, causal, dtype):
    B, H, Hkv, T, S, hd = shape
    q, k, v = _qkv(B, H, Hkv, T, S, hd, dtype, seed=T * S)
    ref = attention_reference(q.float(), k.float(), v.float(), None, causal)
    _assert_close(flash_attention(q, k, v, causal), ref, dtype)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block", [1, 16, 64])
def test_attention_tiled_matches_reference(causal, block):
    q, k, v = _qkv(2, 8, 2, 21, 40, 64, torch.float32)
    _assert_close(attention_tiled(q, k, v, causal, block), attention_reference(q, k, v, None, causal), torch.float32)


def test_flash_attention_non_contiguous_views():
    """Views straight out of a stacked qkv projection, as the model passes them."""
    qkv = torch.randn(1, 23, 6, 64).to(DEVICE).transpose(1, 2)  # (B, 6 heads, T, hd), non-contiguous
    q, k, v = qkv[:, :4], qkv[:, 4:5], qkv[:, 5:]
    ref = attention_reference(q, k, v, None, causal=True)
    _assert_close(flash_attention(q, k, v, True), ref, torch.float32)


@pytest.mark.parametrize("block_m, block_n", [(32, 16), (16, 32), (64, 32)])
def test_flash_attention_other_tile_shapes(block_m, block_n):
    """The GPU's tiles are 128 x 64: the diagonal and ragged tiles must be right for any pair."""
    q, k, v = _qkv(1, 2, 1, 45, 70, 64, torch.float32, seed=block_m + block_n)
    for causal in (True, False):
        ref = attention_reference(q, k, v, None, causal)
        _assert_close(flash_attention(q, k, v, causal, block_m=block_m, block_n=block_n), ref, torch.float32)


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((1, 2, 4, 48), (1, 2, 4, 48)), "head dim 48"),
        (((1, 3, 4, 64), (1, 2, 4, 64)), "not a multiple"),
        (((1, 2, 9, 64), (1, 2, 4, 64)), "q_len 9 > kv_len 4"),
        (((1, 2, 4), (1, 2, 4, 64)), "need q"),
    ],
)
def test_flash_attention_rejects_unsupported_input(shapes, match):
    q, k = torch.zeros(shapes[0], device=DEVICE), torch.zeros(shapes[1], device=DEVICE)
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, k)


def test_flash_attention_rejects_integer_dtype():
    q = torch.zeros(1, 2, 4, 64, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="dtypes"):
        flash_attention(q, q, q)


def _paged_case(B, H, Hkv, hd, block_size, lens, dtype, seed=0):
    """A pool with each sequence's blocks scattered at random over it; lens ragged."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens) + 1  # one spare table column, never read
    num_blocks = B * width + 3
    k_pool = torch.randn(num_blocks, block_size, Hkv, hd, generator=g)  # (num_blocks, bs, Hkv, hd)
    v_pool = torch.randn(num_blocks, block_size, Hkv, hd, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[: B * width].view(B, width)  # (B, M)
    q = torch.randn(B, H, hd, generator=g)  # (B, H, hd)
    lens_t = torch.tensor(lens)
    return (t.to(DEVICE) for t in (q.to(dtype), k_pool.to(dtype), v_pool.to(dtype), tables, lens_t))


# (B, H, Hkv, hd, block_size, context lengths)
PAGED_CASES = [
    (3, 4, 4, 64, 16, [1, 50, 17]),
    (2, 8, 2, 64, 8, [33, 9]),
    (2, 8, 1, 128, 16, [40, 2]),
    (1, 4, 1, 64, 5, [23]),
]


@pytest.mark.parametrize("splits", [1, 3], ids=["whole", "split3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", PAGED_CASES, ids=lambda c: f"B{c[0]}H{c[1]}kv{c[2]}hd{c[3]}bs{c[4]}")
def test_paged_decode_matches_gather_reference(case, dtype, splits):
    """One program per (sequence, K/V head), or the context split in 3 chunks (some of them empty)."""
    q, k_pool, v_pool, tables, lens = _paged_case(*case, dtype=dtype, seed=case[4])
    ref = paged_attention_decode(q.float(), k_pool.float(), v_pool.float(), tables, lens)
    _assert_close(paged_attention_decode_triton(q, k_pool, v_pool, tables, lens, splits=splits), ref, dtype)


def test_paged_decode_rejects_mismatched_tables():
    q, k_pool, v_pool, tables, lens = _paged_case(2, 4, 2, 64, 16, [3, 4], torch.float32)
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention_decode_triton(q, k_pool, v_pool, tables[:1], lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dim", [64, 100])
def test_rms_norm_matches_reference(dim, with_residual, dtype):
    g = torch.Generator().manual_seed(dim)
    x, res = (torch.randn(2, 5, dim, generator=g).to(DEVICE, dtype) for _ in range(2))  # (B, T, D)
    weight = (1 + 0.1 * torch.randn(dim, generator=g)).to(DEVICE, dtype)
    if not with_residual:
        _assert_close(rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5), dtype)
        return
    y, new_res = rms_norm(x, weight, 1e-5, residual=res)
    _assert_close(new_res, x + res, dtype)
    _assert_close(y, rms_norm_reference(x + res, weight, 1e-5), dtype)


def test_rms_norm_rejects_mismatched_weight():
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.zeros(2, 8, device=DEVICE), torch.ones(4, device=DEVICE), 1e-5)


def test_triton_backend_runs_the_model(monkeypatch):
    """Prefill (causal, no mask) goes through the kernel and gives the same logits as sdpa."""
    model = tiny_model(dim=128, n_heads=2, n_kv_heads=1).to(DEVICE)  # head dim 64
    ids = torch.randint(0, model.config.vocab_size, (2, 19), device=DEVICE)
    ref = model(ids)
    monkeypatch.setattr(dispatch, "warn_once", lambda reason: pytest.fail(f"fell back: {reason}"))
    out = model.set_attention_backend("triton")(ids)
    assert torch.allclose(out, ref, atol=1e-4)


def test_triton_backend_generates_the_same_tokens(monkeypatch):
    """Prefill (causal) and every decode step (one query, no mask) run through the kernel."""
    model = tiny_model(dim=128, n_heads=2, n_kv_heads=1).to(DEVICE)  # head dim 64
    prompt = [5, 17, 3, 88, 41, 2, 9]
    expected = generate(model, prompt, max_new_tokens=6, eos_token_id=None).tokens
    monkeypatch.setattr(dispatch, "warn_once", lambda reason: pytest.fail(f"fell back: {reason}"))
    model.set_attention_backend("triton")
    assert torch.equal(generate(model, prompt, max_new_tokens=6, eos_token_id=None).tokens, expected)


def test_dispatch_uses_the_kernel_when_supported(monkeypatch):
    calls = []
    monkeypatch.setattr("minillm.kernels.flash_attention.flash_attention", lambda *a: calls.append(a) or a[0])
    q, k, v = _qkv(1, 2, 2, 4, 4, 64, torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dispatch.attention_triton(q, k, v, None, True)
    assert len(calls) == 1


@pytest.mark.parametrize(
    "case, reason",
    [
        ("mask", "explicit attention mask"),
        ("head_dim", "head dim 48"),
        ("bf16", "bf16"),
        ("no_interpreter", "needs CUDA"),
        ("no_triton", "triton is not installed"),
    ],
)
def test_dispatch_falls_back_to_sdpa_with_one_warning(case, reason, monkeypatch):
    if DEVICE == "cuda" and case in ("bf16", "no_interpreter"):
        pytest.skip("a CPU-only fallback")
    monkeypatch.setattr(dispatch, "_warned", set())
    hd = 48 if case == "head_dim" else 64
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    q, k, v = _qkv(1, 4, 2, 5, 5, hd, dtype)
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril() if case == "mask" else None
    if case == "no_interpreter":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    if case == "no_triton":
        monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    with pytest.warns(UserWarning, match=reason):
        out = dispatch.attention_triton(q, k, v, mask, mask is None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call is silent: once per reason
        dispatch.attention_triton(q, k, v, mask, mask is None)
    ref = attention_reference(q.float(), k.float(), v.float(), mask, mask is None)
    assert torch.allclose(out.float(), ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_unknown_backend_is_rejected(model):
    with pytest.raises(ValueError, match="triton"):
        model.set_attention_backend("flash")


def test_an_interpreter_that_cannot_run_the_kernels_says_why(monkeypatch):
    """Triton <= 3.6 with numpy >= 2.4 fails deep in the interpreter; the kernels say so first."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match=r"Triton 3\.6\.0's CPU interpreter .* numpy 2\.4\.1.*numpy<2\.4"):
        check_interpreter("3.6.0", "2.4.1")
    for ok in [("3.6.0", "2.0.2"), ("3.7.0", "2.4.1"), ("3.9.0", "2.5.0")]:
        check_interpreter(*ok)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a GPU: nothing interpreted
    check_interpreter("3.6.0", "2.4.1")
