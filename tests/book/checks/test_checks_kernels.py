"""Chapter 10's checkers accept the right answers and reject plausible wrong ones.

tests/conftest.py sets TRITON_INTERPRET=1 when CUDA is unavailable, before triton is imported."""

import math

import pytest
import torch
import triton
import triton.language as tl

from minillm.book.checks import CheckFailed
from minillm.book.checks.kernels import (
    causal_tile_pairs,
    check_causal_tiles,
    check_online_softmax_update,
    check_triton_rms_norm,
)
from minillm.core.model import rms_norm_reference


def stub(*args):
    raise NotImplementedError


def update(m, l, acc, s, v, rescale_l=True, rescale_acc=True):  # noqa: E741
    m_new = torch.maximum(m, s.amax(-1, keepdim=True))
    p, alpha = torch.exp(s - m_new), torch.exp(m - m_new)
    l_new = (l * alpha if rescale_l else l) + p.sum(-1, keepdim=True)
    return m_new, l_new, (acc * alpha if rescale_acc else acc) + p @ v


def test_online_softmax_update_checker():
    check_online_softmax_update(update)
    with pytest.raises(CheckFailed, match="rescale the old l"):
        check_online_softmax_update(lambda *a: update(*a, rescale_l=False))
    with pytest.raises(CheckFailed, match="rescale the old acc"):
        check_online_softmax_update(lambda *a: update(*a, rescale_acc=False))
    with pytest.raises(CheckFailed, match="max of the scores"):
        check_online_softmax_update(
            lambda m, den, acc, s, v: (s.amax(-1, keepdim=True),) + update(m, den, acc, s, v)[1:]
        )
    with pytest.raises(NotImplementedError):
        check_online_softmax_update(stub)


@triton.jit
def _rms_kernel(X, W, Y, D, eps, BLOCK: tl.constexpr, MASKED: tl.constexpr, WEIGHT: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < D if MASKED else cols < BLOCK
    x = tl.load(X + row * D + cols, mask=inside, other=0.0)
    y = x / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    if WEIGHT:
        y = y * tl.load(W + cols, mask=inside, other=0.0)
    tl.store(Y + row * D + cols, y, mask=inside)


def triton_rms(x, w, eps, masked=True, weight=True):
    y = torch.empty_like(x)
    block = max(64, triton.next_power_of_2(x.shape[1])) if masked else 64
    _rms_kernel[(x.shape[0],)](x, w, y, x.shape[1], eps, BLOCK=block, MASKED=masked, WEIGHT=weight)
    return y


def test_triton_rms_norm_checker():
    check_triton_rms_norm(triton_rms)
    check_triton_rms_norm(rms_norm_reference)
    with pytest.raises(CheckFailed, match="multiply by the weight"):
        check_triton_rms_norm(lambda x, w, e: triton_rms(x, w, e, weight=False))
    with pytest.raises(CheckFailed, match="not a power of two"):
        check_triton_rms_norm(lambda x, w, e: triton_rms(x, w, e, masked=False) if x.shape[1] == 64 else x)
    with pytest.raises(CheckFailed, match="divide by D"):
        check_triton_rms_norm(lambda x, w, e: x * w / x.pow(2).sum(-1, keepdim=True).add(e).sqrt())
    with pytest.raises(NotImplementedError):
        check_triton_rms_norm(stub)


def test_causal_tiles_checker():
    check_causal_tiles(causal_tile_pairs)
    with pytest.raises(CheckFailed, match="every tile"):
        check_causal_tiles(lambda T, b: math.ceil(T / b) ** 2)
    with pytest.raises(CheckFailed, match="diagonal"):
        check_causal_tiles(lambda T, b: math.ceil(T / b) * (math.ceil(T / b) - 1) // 2)
    with pytest.raises(CheckFailed, match="round the number of tiles up"):
        check_causal_tiles(lambda T, b: (T // b) * (T // b + 1) // 2)
    with pytest.raises(NotImplementedError):
        check_causal_tiles(stub)
