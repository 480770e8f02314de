"""What moving a prompt's KV cache over a real link costs, beside what computing it costs
(chapter 14): the arithmetic behind disaggregated serving, where one GPU prefills a prompt and
another decodes it (DistServe, Zhong et al. 2024; Splitwise, Patel et al. 2024; Mooncake,
Qin et al. 2025).

A link moves ``nbytes`` in ``latency + nbytes / bandwidth`` seconds. The prompt's K/V are
2 (K and V) x n_layers x n_kv_heads x head_dim x tokens x bytes per element; its prefill does
about 2 FLOPs per weight per token plus causal attention, at some fraction (MFU) of the
accelerator's peak. Their ratio says whether the handoff is a rounding error (NVLink) or a
real share of the time to first token (a 100 Gb/s NIC).

The link figures are vendors' and standards bodies' peaks, one direction, for one transfer
that has the link to itself (see book/references.bib): real copies get less (protocol
overhead, the copy engines, a NIC shared by the GPUs of a node). The latencies are a rough
"a few microseconds" per transfer, not a spec figure; at megabytes they do not matter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.config import ModelConfig, check_field_types, check_positive_int, is_number
from .roofline import layer_costs, matmul_cost

ROUGH_LATENCY_S = 5e-6  # a few microseconds to start and finish one DMA/RDMA transfer (rough)


@dataclass(frozen=True)
class Link:
    """One direction of an interconnect, as one transfer sees it."""

    name: str
    bandwidth: float  # bytes/s, one direction, what one transfer can use
    latency: float  # seconds per transfer, whatever its size
    source: str  # the bibtex key in book/references.bib the bandwidth comes from

    def __post_init__(self) -> None:
        check_field_types(self, ints=(), numbers=("bandwidth",))
        if not is_number(self.latency) or not 0 <= self.latency < math.inf:
            raise ValueError(f"Link.latency must be a non-negative number of seconds, got {self.latency!r}")

    def transfer_time(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` in one transfer: latency + nbytes / bandwidth."""
        if not is_number(nbytes) or not 0 <= nbytes < math.inf:
            raise ValueError(f"nbytes must be a non-negative number, got {nbytes!r}")
        return self.latency + nbytes / self.bandwidth


LINKS: dict[str, Link] = {
    link.name: link
    for link in [
        # 16 GT/s x 16 lanes x 128/130 (encoding) / 8 bits: the spec's data rate before packet overhead
        Link("PCIe 4.0 x16", 31.5e9, ROUGH_LATENCY_S, "pcisig_pcie4"),
        Link("PCIe 5.0 x16", 63.0e9, ROUGH_LATENCY_S, "pcisig_pcie5"),
        # 18 NVLink 4 links, 900 GB/s both directions together
        Link("NVLink 4 (H100)", 450e9, ROUGH_LATENCY_S, "nvidia_nvlink"),
        Link("RDMA 100 Gb/s", 100e9 / 8, ROUGH_LATENCY_S, "ibta_roadmap"),  # EDR InfiniBand / 100 GbE RoCE
        Link("RDMA 400 Gb/s", 400e9 / 8, ROUGH_LATENCY_S, "nvidia_connectx7"),  # NDR InfiniBand, ConnectX-7
    ]
}


def kv_bytes(config: ModelConfig, tokens: int, dtype_bytes: int = 2) -> int:
    """Bytes of K and V for ``tokens`` tokens (``ModelConfig.kv_bytes``), checked: a whole number
    of tokens and of bytes per element, as a handoff or a transfer has."""
    check_positive_int("tokens", tokens)
    check_positive_int("dtype_bytes", dtype_bytes)
    return config.kv_bytes(tokens, dtype_bytes)


def prefill_flops(config: ModelConfig, tokens: int) -> float:
    """FLOPs of one prompt's prefill, counted by ``roofline.layer_costs``: the projections and MLP
    (2 FLOPs per non-embedding weight per token) and attention (2 x 2 x tokens^2 x n_heads x
    head_dim per layer), halved because a causal mask skips the upper triangle; plus the LM head
    on the last position only (the first token). Sliding windows are not modelled."""
    check_positive_int("tokens", tokens)
    if tokens > config.max_seq_len:
        raise ValueError(f"tokens ({tokens}) exceed the model's context, max_seq_len {config.max_seq_len}")
    layer = layer_costs(config, batch=1, new_tokens=tokens, context=tokens)
    per_layer = sum(op.flops / 2 if op.name == "attention" else op.flops for op in layer)
    lm_head = matmul_cost("lm_head", 1, config.dim, config.vocab_size, bytes_per_element=2).flops
    return config.n_layers * per_layer + lm_head


def prefill_seconds(config: ModelConfig, tokens: int, peak_flops: float, mfu: float = 0.5) -> float:
    """A roofline estimate of a prompt's prefill: ``prefill_flops`` over peak_flops x mfu
    (a long prefill is compute-bound, so the FLOPs decide; ``mfu`` is the fraction of peak the
    kernels reach)."""
    if not is_number(peak_flops) or not 0 < peak_flops < math.inf:
        raise ValueError(f"peak_flops must be a positive number of FLOP/s, got {peak_flops!r}")
    if not is_number(mfu) or not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu!r}")
    return prefill_flops(config, tokens) / (peak_flops * mfu)


def kv_transfer_rows(
    configs: Sequence[ModelConfig],
    tokens: int,
    links: Sequence[Link],
    dtype_bytes: int = 2,
    peak_flops: float = 989e12,  # H100 SXM, dense bf16 (nvidia_h100_datasheet)
    mfu: float = 0.5,
) -> list[dict]:
    """One row per (model, link): the K/V of a ``tokens``-token prompt, the time to send them over
    the link, the time to prefill them, and the ratio transfer / prefill."""
    if not configs or not links:
        raise ValueError("kv_transfer_rows needs at least one config and one link")
    rows = []
    for config in configs:
        nbytes = kv_bytes(config, tokens, dtype_bytes)
        prefill = prefill_seconds(config, tokens, peak_flops, mfu)
        for link in links:
            transfer = link.transfer_time(nbytes)
            rows.append(
                {
                    "model": config.name,
                    "tokens": tokens,
                    "kv_bytes": nbytes,
                    "link": link.name,
                    "transfer_ms": transfer * 1e3,
                    "prefill_ms": prefill * 1e3,
                    "transfer_vs_prefill": transfer / prefill,
                }
            )
    return rows
