"""Checkers for the exercises: each prints a pass line or raises CheckFailed with a hint.

One module per chapter; this package re-exports them all, so a notebook may write
``from minillm.book.checks import check_top_p``.
"""

from .base import CheckFailed, close, passed, require
from .capstone import check_pick_technique, check_predict_stacked, check_row_costs
from .compilers import check_launch_overhead, check_mbu, check_pool_offset
from .compression import check_distillation_loss, check_int4_groups, check_two_four_mask
from .generation import check_greedy_generate, check_softmax_with_temperature, check_top_p
from .kernels import check_causal_tiles, check_online_softmax_update, check_triton_rms_norm
from .kv import (
    check_kv_cache_bytes,
    check_kv_update,
    check_quantize_int8,
    check_repeat_kv,
    check_ring_slots,
    check_users_that_fit,
)
from .metrics import check_cost_per_million, check_goodput, check_percentile, check_request_latencies
from .parallel_decoding import check_candidate_tokens, check_jacobi_step, check_tree_mask, check_window_update
from .roofline import check_decode_upper_bound, check_matmul_intensity, check_roofline_point
from .serving import (
    check_admission,
    check_allocator,
    check_batch_steps,
    check_run_goodput,
    check_shared_prefix_blocks,
    check_token_slot,
)
from .speculative import (
    check_accept_step,
    check_copyable_fraction,
    check_expected_tokens,
    check_greedy_accept,
    check_ngram_lookup,
    check_prompt_lookup_loop,
    check_speedup_with_costs,
)

__all__ = [
    "CheckFailed",
    "check_accept_step",
    "check_admission",
    "check_allocator",
    "check_batch_steps",
    "check_candidate_tokens",
    "check_causal_tiles",
    "check_copyable_fraction",
    "check_cost_per_million",
    "check_decode_upper_bound",
    "check_distillation_loss",
    "check_expected_tokens",
    "check_goodput",
    "check_greedy_accept",
    "check_greedy_generate",
    "check_int4_groups",
    "check_jacobi_step",
    "check_kv_cache_bytes",
    "check_kv_update",
    "check_launch_overhead",
    "check_matmul_intensity",
    "check_mbu",
    "check_ngram_lookup",
    "check_online_softmax_update",
    "check_percentile",
    "check_pick_technique",
    "check_pool_offset",
    "check_predict_stacked",
    "check_prompt_lookup_loop",
    "check_quantize_int8",
    "check_repeat_kv",
    "check_request_latencies",
    "check_ring_slots",
    "check_roofline_point",
    "check_row_costs",
    "check_run_goodput",
    "check_shared_prefix_blocks",
    "check_softmax_with_temperature",
    "check_speedup_with_costs",
    "check_token_slot",
    "check_top_p",
    "check_tree_mask",
    "check_two_four_mask",
    "check_triton_rms_norm",
    "check_users_that_fit",
    "check_window_update",
    "close",
    "passed",
    "require",
]
