"""The collectives the parallel layers use, each one counted.

Every all-reduce, all-gather, send, receive, ring exchange and all-to-all goes through a
``Comm``, which calls ``torch.distributed`` and records, per kind, how many calls and how many
payload bytes this rank put into them (a tensor's ``numel * element_size``: the "size" that
nccl-tests reports). The counts are what a run really did; chapter 15 checks them against the
formulas (``minillm.parallel.predict``, ``minillm.parallel.expert``), and the benchmark turns
them into predicted times on real links.

What the wire carries is larger than the payload for an all-reduce: the ring algorithm
(Patarasuk & Yuan, 2009) moves 2 (p - 1) / p times the payload through each rank's link,
all-gather (p - 1) / p of the gathered result. ``wire_bytes`` applies those factors. An
all-to-all (expert parallelism's dispatch and combine) is counted as the rows it sends to *other*
ranks: the rows a rank keeps cross no link, and which fraction leaves depends on the routing, so
no factor could recover it from the whole buffer.

A ``Comm`` over a world of one rank does nothing and counts nothing: the same model code runs
alone and sharded.

Tensors are moved to the group's device first: gloo moves CPU tensors, nccl CUDA ones.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch import Tensor

KINDS = ("all_reduce", "all_gather", "send", "recv", "ring", "all_to_all", "all_to_all_counts")


def nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def wire_bytes(kind: str, payload: int, world_size: int) -> float:
    """Bytes through each rank's link for one collective of ``payload`` bytes (ring algorithms)."""
    p = world_size
    if p == 1:
        return 0.0
    return {
        "all_reduce": 2 * (p - 1) / p * payload,
        "all_gather": (p - 1) / p * payload,  # payload: the gathered tensor's size
    }.get(kind, float(payload))  # point to point: what was sent


class Comm:
    """Counted collectives over a process group (default: the whole world)."""

    def __init__(self, group=None, ranks: list[int] | None = None):
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.ranks = ranks if ranks is not None else list(range(dist.get_world_size()))
            self.wire = torch.device("cpu") if dist.get_backend(group) == "gloo" else None
        else:  # one process, no group: every collective is the identity
            self.rank, self.world_size, self.ranks, self.wire = 0, 1, [0], None
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def _count(self, kind: str, payload: int) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += payload

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def counts(self) -> dict[str, dict[str, int]]:
        """{kind: {"calls": n, "bytes": b}} for the kinds used so far."""
        return {k: {"calls": self.calls[k], "bytes": self.bytes[k]} for k in KINDS if self.calls[k]}

    def _to_wire(self, t: Tensor) -> Tensor:
        return t if self.wire is None else t.to(self.wire)

    def all_reduce(self, t: Tensor) -> Tensor:
        """The sum over ranks of ``t``, on every rank (returned; ``t`` is not changed)."""
        if self.world_size == 1:
            return t
        self._count("all_reduce", nbytes(t))
        buf = t.to(self.wire or t.device, copy=True).contiguous()  # the caller keeps its partial sum
        dist.all_reduce(buf, group=self.group)
        return buf.to(t.device)

    def all_gather(self, t: Tensor, dim: int = -1) -> Tensor:
        """Every rank's ``t`` concatenated along ``dim`` in rank order, on every rank.

        Counted as the gathered result's size (what each rank ends up holding)."""
        if self.world_size == 1:
            return t
        self._count("all_gather", nbytes(t) * self.world_size)
        local = self._to_wire(t).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=dim).to(t.device)

    def send(self, t: Tensor, dst: int) -> None:
        """Send ``t`` to rank ``dst`` (a global rank)."""
        self._count("send", nbytes(t))
        dist.send(self._to_wire(t).contiguous(), dst, group=self.group)

    def recv(self, shape, dtype: torch.dtype, src: int, device) -> Tensor:
        """Receive a tensor of ``shape`` and ``dtype`` from rank ``src``."""
        buf = torch.empty(shape, dtype=dtype, device=self.wire or device)
        dist.recv(buf, src, group=self.group)
        self._count("recv", nbytes(buf))
        return buf.to(device)

    def ring_exchange(self, tensors: list[Tensor], dst: int, src: int) -> list[Tensor]:
        """Send ``tensors`` to ``dst`` and receive same-shaped ones from ``src`` in one batch
        (``batch_isend_irecv``): one step of a ring. Counted as the bytes sent."""
        if self.world_size == 1:
            return tensors
        out = [torch.empty_like(self._to_wire(t)) for t in tensors]
        ops = [dist.P2POp(dist.isend, self._to_wire(t).contiguous(), dst, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, buf, src, self.group) for buf in out]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        self._count("ring", sum(nbytes(t) for t in tensors))
        return [o.to(t.device) for o, t in zip(out, tensors)]

    def all_to_all(self, t: Tensor, send_splits: list[int], recv_splits: list[int]) -> Tensor:
        """Rows of ``t`` (along dim 0) to every rank: the first ``send_splits[0]`` to rank 0, the
        next ``send_splits[1]`` to rank 1, and so on; returns the rows every rank sent here, in rank
        order (``recv_splits[j]`` from rank j). Counted as the bytes sent to the other ranks.

        ``all_to_all_single`` with split sizes: gloo's list form (``dist.all_to_all``) refuses
        tensors of different sizes (torch 2.13: "ProcessGroupGloo::alltoall: invalid tensor size")."""
        if self.world_size == 1:
            return t
        row = t[0].numel() * t.element_size() if t.shape[0] else 0
        self._count("all_to_all", row * (sum(send_splits) - send_splits[self.rank]))
        out = torch.empty((sum(recv_splits), *t.shape[1:]), dtype=t.dtype, device=self.wire or t.device)
        dist.all_to_all_single(out, self._to_wire(t).contiguous(), recv_splits, send_splits, group=self.group)
        return out.to(t.device)

    def all_to_all_counts(self, counts: Tensor) -> Tensor:
        """Row j of ``counts`` (p, m) to rank j; returns (p, m), row j from rank j: the sizes an
        all-to-all of uneven splits needs known on both sides before it starts. Counted apart
        (its own kind), as the rows sent to the other ranks."""
        if self.world_size == 1:
            return counts
        self._count("all_to_all_counts", nbytes(counts) // self.world_size * (self.world_size - 1))
        out = torch.empty_like(self._to_wire(counts))
        dist.all_to_all_single(out, self._to_wire(counts).contiguous(), group=self.group)
        return out.to(counts.device)
