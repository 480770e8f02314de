"""Chapters 4 and 5's checkers accept the right answers and reject plausible wrong ones."""

import pytest
import torch

from minillm.book.checks import CheckFailed
from minillm.book.checks.kv import (
    check_kv_cache_bytes,
    check_kv_update,
    check_quantize_int8,
    check_repeat_kv,
    check_ring_slots,
    check_users_that_fit,
)
from minillm.kv.compressed import dequantize_int8, quantize_int8
from minillm.kv.memory import users_that_fit


def stub(*args):
    raise NotImplementedError


def test_kv_cache_bytes_checker():
    check_kv_cache_bytes(lambda L, h, d, s, b, e: 2 * L * h * d * s * b * e)
    with pytest.raises(CheckFailed, match="did you count K and V"):
        check_kv_cache_bytes(lambda L, h, d, s, b, e: L * h * d * s * b * e)
    with pytest.raises(CheckFailed, match="expected"):
        check_kv_cache_bytes(lambda L, h, d, s, b, e: 2 * L * h * d * s * e)  # forgot the batch
    with pytest.raises(NotImplementedError):
        check_kv_cache_bytes(stub)


def test_kv_update_checker():
    def right(kc, vc, k, v, pos):
        kc[:, :, pos : pos + 1], vc[:, :, pos : pos + 1] = k, v
        return kc[:, :, : pos + 1], vc[:, :, : pos + 1]

    def not_in_place(kc, vc, k, v, pos):
        kc, vc = kc.clone(), vc.clone()
        return right(kc, vc, k, v, pos)

    check_kv_update(right)
    with pytest.raises(CheckFailed, match="in place"):
        check_kv_update(not_in_place)
    with pytest.raises(CheckFailed, match="filled part"):
        check_kv_update(lambda kc, vc, k, v, pos: (right(kc, vc, k, v, pos), (kc, vc))[1])  # the whole buffer
    with pytest.raises(NotImplementedError):
        check_kv_update(stub)


def test_users_that_fit_checker():
    check_users_that_fit(lambda c, s, m, e: users_that_fit(c, s, m, "fp16"))
    with pytest.raises(CheckFailed, match="whole users"):  # forgot the weights
        check_users_that_fit(lambda c, s, m, e: int(m // (2 * c.n_layers * c.n_kv_heads * c.head_dim * e * s)))
    with pytest.raises(NotImplementedError):
        check_users_that_fit(stub)


def test_repeat_kv_checker():
    check_repeat_kv(lambda k, n: k.repeat_interleave(n, dim=1))
    with pytest.raises(CheckFailed, match="tiled"):
        check_repeat_kv(lambda k, n: k.repeat(1, n, 1, 1))
    with pytest.raises(CheckFailed, match="shape"):
        check_repeat_kv(lambda k, n: k)
    with pytest.raises(NotImplementedError):
        check_repeat_kv(stub)


def test_ring_slots_checker():
    check_ring_slots(lambda n, t, c: [(n + i) % c for i in range(t)])
    with pytest.raises(CheckFailed, match="mod capacity"):
        check_ring_slots(lambda n, t, c: [n + i for i in range(t)])
    with pytest.raises(CheckFailed, match="mod capacity"):
        check_ring_slots(lambda n, t, c: [(n + i) % (c - 1) for i in range(t)])
    with pytest.raises(NotImplementedError):
        check_ring_slots(stub)


def test_quantize_int8_checker():
    check_quantize_int8(quantize_int8, lambda q, s: dequantize_int8(q, s, torch.float32))

    def per_tensor(x):
        scale = x.abs().max() / 127
        return (x / scale).round().to(torch.int8), scale.expand(*x.shape[:-1], 1)

    with pytest.raises(CheckFailed, match="half a step|whole int8 range"):
        check_quantize_int8(per_tensor, lambda q, s: q.float() * s)

    def truncating(x):
        q, s = quantize_int8(x)
        return (x / s).trunc().to(torch.int8), s

    with pytest.raises(CheckFailed, match="half a step"):
        check_quantize_int8(truncating, lambda q, s: q.float() * s)
    with pytest.raises(CheckFailed, match="int8"):
        check_quantize_int8(lambda x: (x, x.abs().amax(-1, keepdim=True)), lambda q, s: q)
    with pytest.raises(NotImplementedError):
        check_quantize_int8(stub, stub)
