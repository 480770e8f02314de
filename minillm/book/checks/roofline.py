"""Checkers for chapter 3's exercises: arithmetic intensity, the roofline, a decode ceiling."""

from __future__ import annotations

from collections.abc import Callable

from ...measure.roofline import Roofline, decode_upper_bound_tokens_per_s, matmul_cost
from .base import passed, require


def _rel_close(got, want: float, rel: float = 1e-3) -> bool:
    try:
        return abs(float(got) - want) <= rel * abs(want)
    except (TypeError, ValueError):
        return False


def check_matmul_intensity(fn: Callable) -> None:
    """fn(m, k, n, bytes_per_element) -> FLOPs per byte of an (m x k) @ (k x n) matmul."""
    name = "matmul arithmetic intensity"
    cases = [(1, 4096, 4096, 2), (1, 4096, 14336, 2), (16, 4096, 4096, 2), (4096, 4096, 4096, 2), (512, 256, 704, 4)]
    for m, k, n, bpe in cases:
        want = matmul_cost("", m, k, n, bpe).intensity
        got = fn(m, k, n, bpe)
        hint = (
            f"for m={m}, k={k}, n={n} at {bpe} bytes per element expected {want:.4g} FLOP/byte, got {got!r}: "
            "FLOPs = 2mkn (a multiply and an add per term); bytes = bytes_per_element x (mk + kn + mn), "
            "both inputs read once and the output written once"
        )
        require(_rel_close(got, want), name, hint)
    passed(name, "2mkn FLOPs over (mk + kn + mn) elements moved, from decode (m=1) to a large prefill")


def check_roofline_point(fn: Callable) -> None:
    """fn(intensity, peak_flops, peak_bandwidth) -> (attainable FLOP/s, "memory" or "compute")."""
    name = "roofline point"
    for peak_flops, peak_bandwidth in [(989e12, 3.35e12), (65e12, 0.32e12), (2e11, 2e10)]:
        roof = Roofline(peak_flops, peak_bandwidth)
        for intensity in (0.5, 1.0, 0.5 * roof.ridge, roof.ridge, 4 * roof.ridge, 2000.0):
            got = fn(intensity, peak_flops, peak_bandwidth)
            require(isinstance(got, tuple) and len(got) == 2, name, f"return a pair (FLOP/s, bound), got {got!r}")
            want = (roof.attainable(intensity), roof.bound(intensity))
            where = (
                f"at intensity {intensity:.4g} FLOP/byte on a roof of {peak_flops:.3g} FLOP/s and "
                f"{peak_bandwidth:.3g} bytes/s (ridge {roof.ridge:.4g})"
            )
            require(
                _rel_close(got[0], want[0]),
                name,
                f"{where} expected {want[0]:.4g} FLOP/s, got {got[0]!r}: "
                "an operation can go no faster than the compute peak nor than bandwidth x intensity, "
                "so take the smaller of the two",
            )
            require(
                got[1] == want[1],
                name,
                f"{where} expected {want[1]!r}, got {got[1]!r}: below the ridge "
                "(peak FLOP/s / bandwidth) the bandwidth roof is the lower one ('memory'); at or above it, "
                "'compute'",
            )
    passed(name, "min(peak, bandwidth x intensity), and the right roof on both sides of the ridge on three devices")


def check_decode_upper_bound(fn: Callable) -> None:
    """fn(n_params, bytes_per_param, bandwidth in bytes/s) -> batch-1 decode tokens/s ceiling."""
    name = "decode tokens/s ceiling"
    cases = [
        (8.03e9, 2, 3.35e12, "an 8B model in bf16 on an H100"),
        (8.03e9, 1, 3.35e12, "the same in int8"),
        (70.6e9, 2, 4.8e12, "a 70B model in bf16 on an H200"),
        (5.87e6, 4, 2e10, "minillm-target in fp32 on a CPU"),
    ]
    for n_params, bpp, bandwidth, what in cases:
        want = decode_upper_bound_tokens_per_s(n_params, bpp, bandwidth)
        got = fn(n_params, bpp, bandwidth)
        require(
            _rel_close(got, want, rel=1e-2),
            name,
            f"for {what} expected about {want:.4g} tokens/s, got {got!r}: "
            "at batch 1 each new token reads every weight once, so the ceiling is bandwidth (bytes/s) over "
            "the weights' size in bytes (parameters x bytes per parameter, not bits)",
        )
    passed(name, f"bandwidth / weight bytes; an 8B model in bf16 on an H100: <= {cases[0][2] / 16.06e9:.0f} tokens/s")
