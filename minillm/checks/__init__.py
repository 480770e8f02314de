"""Checkers for the exercises: each prints a pass line or raises CheckFailed with a hint.

One module per chapter; this package re-exports them all, so a notebook may write
``from minillm.checks import check_top_p``.
"""

from .base import CheckFailed, close, passed, require
from .generation import check_greedy_generate, check_softmax_with_temperature, check_top_p
from .kv import (
    check_kv_cache_bytes,
    check_kv_update,
    check_quantize_int8,
    check_repeat_kv,
    check_ring_slots,
    check_users_that_fit,
)
from .metrics import check_cost_per_million, check_goodput, check_percentile, check_request_latencies
from .roofline import check_decode_upper_bound, check_matmul_intensity, check_roofline_point

__all__ = [
    "CheckFailed",
    "check_cost_per_million",
    "check_decode_upper_bound",
    "check_goodput",
    "check_greedy_generate",
    "check_kv_cache_bytes",
    "check_kv_update",
    "check_matmul_intensity",
    "check_percentile",
    "check_quantize_int8",
    "check_repeat_kv",
    "check_request_latencies",
    "check_ring_slots",
    "check_roofline_point",
    "check_softmax_with_temperature",
    "check_top_p",
    "check_users_that_fit",
    "close",
    "passed",
    "require",
]
