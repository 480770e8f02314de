"""Which worker serves a request (chapter 14): one load rule, kept by one router, for the
simulated cluster (``serving.cluster``) and the real worker processes (``serving.disagg``) alike.

    router = Router(["prefill", "decode", "decode"])
    place = router.route(request)       # Placement(prefill_worker=0, decode_worker=1, ...)
    router.prefilled(request.id)        # its prefill worker handed its K/V off
    router.finished(request.id)         # its output came back

A worker's load is the tokens it has been given and is not done with: for a prefill worker, the
prompt tokens of its requests whose prefill it has not handed off yet; for a decode worker, the
``max_tokens`` of the requests named for it that have not finished; for a colocated worker (one
that prefills and decodes), both. The router needs nothing but its own bookkeeping for it (what
it sent, and which handoffs and outputs came back), so a router in another process than its
workers keeps it exactly, without asking them how far they are.

An arrival goes to the prefill (or colocated) worker of least load and, at once, names the decode
worker of least load: a prefill worker sends the K/V point to point, so it must know where when
the prefill ends. Ties go to the lowest index.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .workload import Request

ROLES = ("prefill", "decode", "colocated")


def least_loaded(load: Sequence[int], workers: Iterable[int]) -> int:
    """The one of ``workers`` (indices into ``load``) with the least load; ties to the lowest index."""
    return min(workers, key=lambda i: (load[i], i))


@dataclass
class Placement:
    """Where one request runs, and the tokens it counts for there."""

    prefill_worker: int  # the prefill (or colocated) worker's index
    decode_worker: int | None  # None: colocated, one worker does both
    prompt_tokens: int
    max_tokens: int
    prefilled: bool = False  # its prefill worker handed it off


class Router:
    """The load of every worker, from the requests routed and the handoffs and outputs reported;
    ``roles`` give each worker's kind, one of ``ROLES``: all colocated, or prefill and decode."""

    def __init__(self, roles: Sequence[str]):
        self.roles = list(roles)
        kinds = set(self.roles)
        if not kinds or not kinds <= set(ROLES):
            raise ValueError(f"roles must be some of {ROLES}, got {self.roles}")
        if kinds != {"colocated"} and kinds != {"prefill", "decode"}:
            raise ValueError(f"workers are all colocated, or prefill and decode workers; got {sorted(kinds)}")
        self.load = [0] * len(self.roles)  # tokens per worker, as defined above
        self.fronts = [i for i, role in enumerate(self.roles) if role != "decode"]
        self.decoders = [i for i, role in enumerate(self.roles) if role == "decode"]
        self.placed: dict[int, Placement] = {}  # requests routed and not finished, by id

    def route(self, request: Request) -> Placement:
        """Place an arrival on the least-loaded prefill (or colocated) and decode workers."""
        if request.id in self.placed:
            raise ValueError(f"request {request.id} is already placed")
        first = least_loaded(self.load, self.fronts)
        decoder = least_loaded(self.load, self.decoders) if self.decoders else None
        place = Placement(first, decoder, len(request.prompt), request.max_tokens)
        if decoder is None:
            self.load[first] += place.prompt_tokens + place.max_tokens
        else:
            self.load[first] += place.prompt_tokens
            self.load[decoder] += place.max_tokens
        self.placed[request.id] = place
        return place

    def prefilled(self, request_id: int) -> Placement:
        """Its prefill worker handed the request off: its prompt is no longer that worker's load."""
        place = self.placed[request_id]
        if place.decode_worker is None or place.prefilled:
            raise ValueError(f"request {request_id} has no handoff to make")
        place.prefilled = True
        self.load[place.prefill_worker] -= place.prompt_tokens
        return place

    def finished(self, request_id: int) -> Placement:
        """The request's output came back (from whichever worker it ended on): none of it is load now."""
        place = self.placed.pop(request_id)
        if place.decode_worker is None:
            self.load[place.prefill_worker] -= place.prompt_tokens + place.max_tokens
        else:
            if not place.prefilled:  # it ended at its first token, or failed, on the prefill worker
                self.load[place.prefill_worker] -= place.prompt_tokens
            self.load[place.decode_worker] -= place.max_tokens
        return place
