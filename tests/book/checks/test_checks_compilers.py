"""Chapter 11's checkers accept the right answers and reject plausible wrong ones."""

import pytest

from minillm.book.checks import CheckFailed
from minillm.book.checks.compilers import check_launch_overhead, check_mbu, check_pool_offset


def stub(*args):
    raise NotImplementedError


def test_launch_overhead_checker():
    check_launch_overhead(lambda s, k, us: s * k * us * 1e-6)
    with pytest.raises(CheckFailed, match="microseconds"):
        check_launch_overhead(lambda s, k, us: s * k * us)
    with pytest.raises(CheckFailed, match="every step"):
        check_launch_overhead(lambda s, k, us: k * us * 1e-6)
    with pytest.raises(NotImplementedError):
        check_launch_overhead(stub)


def test_mbu_checker():
    check_mbu(lambda w, kv, t, p: (w + kv) * t / p)
    with pytest.raises(CheckFailed, match="percentage"):
        check_mbu(lambda w, kv, t, p: 100 * (w + kv) * t / p)
    with pytest.raises(CheckFailed, match="KV cache too"):
        check_mbu(lambda w, kv, t, p: w * t / p)
    with pytest.raises(NotImplementedError):
        check_mbu(stub)


def test_pool_offset_checker():
    check_pool_offset(lambda t, p, h, bs, hkv, hd: ((t[p // bs] * bs + p % bs) * hkv + h) * hd)
    with pytest.raises(CheckFailed, match="physical block"):
        check_pool_offset(lambda t, p, h, bs, hkv, hd: (p * hkv + h) * hd)
    with pytest.raises(CheckFailed, match="elements per slot"):
        check_pool_offset(lambda t, p, h, bs, hkv, hd: t[p // bs] * bs + p % bs)
    with pytest.raises(NotImplementedError):
        check_pool_offset(stub)
