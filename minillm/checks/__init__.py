"""Checkers for the exercises: each prints a pass line or raises CheckFailed with a hint.

One module per chapter; this package re-exports them all, so a notebook may write
``from minillm.checks import check_top_p``.
"""

from .base import CheckFailed, close, passed, require
from .generation import check_greedy_generate, check_softmax_with_temperature, check_top_p
from .metrics import check_cost_per_million, check_goodput, check_percentile, check_request_latencies
from .roofline import check_decode_upper_bound, check_matmul_intensity, check_roofline_point

__all__ = [
    "CheckFailed",
    "check_cost_per_million",
    "check_decode_upper_bound",
    "check_goodput",
    "check_greedy_generate",
    "check_matmul_intensity",
    "check_percentile",
    "check_request_latencies",
    "check_roofline_point",
    "check_softmax_with_temperature",
    "check_top_p",
    "close",
    "passed",
    "require",
]
