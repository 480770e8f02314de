"""Chapter 3's checkers accept the right answers and reject plausible wrong ones."""

import pytest

from minillm.book.checks import CheckFailed
from minillm.book.checks.roofline import check_decode_upper_bound, check_matmul_intensity, check_roofline_point
from minillm.measure.roofline import Roofline, decode_upper_bound_tokens_per_s, matmul_cost


def stub(*args):
    raise NotImplementedError


def test_matmul_intensity_checker():
    check_matmul_intensity(lambda m, k, n, b: matmul_cost("", m, k, n, b).intensity)
    with pytest.raises(CheckFailed, match="2mkn"):  # forgot the factor 2
        check_matmul_intensity(lambda m, k, n, b: m * k * n / (b * (m * k + k * n + m * n)))
    with pytest.raises(CheckFailed, match="mk \\+ kn \\+ mn"):  # counted only the weights
        check_matmul_intensity(lambda m, k, n, b: 2 * m * k * n / (b * k * n))
    with pytest.raises(NotImplementedError):
        check_matmul_intensity(stub)


def test_roofline_point_checker():
    def right(i, p, w):
        roof = Roofline(p, w)
        return roof.attainable(i), roof.bound(i)

    check_roofline_point(right)
    with pytest.raises(CheckFailed, match="smaller"):  # max instead of min
        check_roofline_point(lambda i, p, w: (max(p, w * i), right(i, p, w)[1]))
    with pytest.raises(CheckFailed, match="ridge"):  # the roofs swapped
        check_roofline_point(lambda i, p, w: (right(i, p, w)[0], "compute" if i < p / w else "memory"))
    with pytest.raises(CheckFailed, match="pair"):
        check_roofline_point(lambda i, p, w: min(p, w * i))
    with pytest.raises(NotImplementedError):
        check_roofline_point(stub)


def test_decode_upper_bound_checker():
    check_decode_upper_bound(decode_upper_bound_tokens_per_s)
    with pytest.raises(CheckFailed, match="not bits"):  # bits instead of bytes
        check_decode_upper_bound(lambda n, b, w: w / (n * 8 * b))
    with pytest.raises(CheckFailed, match="int8"):  # 2 bytes per parameter assumed
        check_decode_upper_bound(lambda n, b, w: w / (2 * n))
    with pytest.raises(NotImplementedError):
        check_decode_upper_bound(stub)
