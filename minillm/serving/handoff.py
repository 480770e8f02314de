"""The two halves of a disaggregated engine (chapter 14): a prefill engine that stops after each
request's first token and hands its KV cache over, and a decode engine that takes such handoffs
into its own pool and decodes them to the end.

    prefill = PrefillEngine(model, EngineConfig(num_blocks=64))
    prefill.add_request(request)
    while prefill.unfinished:
        prefill.step()
    (handoff,) = prefill.take_handoffs()  # the prompt's K/V (all layers), its first token
    decode = DecodeEngine(model, EngineConfig(num_blocks=64))
    decode.admit(handoff)                 # blocks allocated, K/V written, first token in place
    while decode.unfinished:
        decode.step()                     # decode.outputs[request.id]: the same tokens as Engine's

Both are the chapter 13 ``Engine`` (its scheduler, paged pool and step loop) with two hooks
changed: when the prefill side is done with a sequence (after one token) and what retiring it
means (copy its K/V out, free its blocks, keep the handoff instead of an output). The K/V of
a request are ``kv_handoff_bytes`` bytes: 2 (K and V) x layers x K/V heads x head dim x prompt
tokens x bytes per element. The real worker processes (``serving.disagg``) and the simulated
cluster (``serving.cluster``) both run these two classes; they differ only in how handoffs
travel (``torch.distributed`` send/recv, or a link model on a simulated clock).

The decode engine admits a handoff only while the blocks its running sequences can still grow
into, plus the new request's prompt + max_tokens, fit in its pool: a full decode pool makes
handoffs wait (backpressure) instead of preempting or dropping anything.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..kv.paged import blocks_for
from ..measure.links import kv_bytes as kv_handoff_bytes  # 2 x layers x kv heads x head dim x tokens x bytes
from .engine import Engine, EngineConfig, RequestOutput, SimulatedModel
from .scheduler import SequenceState
from .workload import Request


@dataclass
class Handoff:
    """A prefilled request on its way from a prefill to a decode engine."""

    request: Request
    first_token: int
    first_time: float  # when the first token came out, on the clock
    kv: Tensor | None  # (2, n_layers, prompt tokens, n_kv_heads, head_dim); None from a SimulatedModel
    nbytes: int  # the K/V's size in bytes (for a SimulatedModel: the size the real model's would have)
    generator_state: bytes | None = None  # a seeded request's sampler state after its first token
    ready: float = 0.0  # when the decode side may take it in (the first token's time + the transfer)

    @property
    def tokens(self) -> int:
        return len(self.request.prompt)

    def without_kv(self) -> Handoff:
        """The same handoff with no tensor: the message that announces it (the K/V travel apart)."""
        return replace(self, kv=None)


class PrefillEngine(Engine):
    """An ``Engine`` that runs each request's prompt, samples its first token, copies its K/V
    out of the pool and frees its blocks. Requests that end at their first token (max_tokens 1
    or a stop id) finish here as usual; the others become ``Handoff``s (``take_handoffs``).

    ``kv_bytes_per_token``: for a ``SimulatedModel``, the bytes one token's K/V would take in
    the model it stands for (the handoff's ``nbytes``); a real model's are measured.
    """

    def __init__(self, model, config=None, kv_bytes_per_token: int | None = None):
        super().__init__(model, config)
        if kv_bytes_per_token is None:
            kv_bytes_per_token = kv_handoff_bytes(model.config, 1, self.pool.k.element_size())
        self.kv_bytes_per_token = kv_bytes_per_token
        self._handoffs: list[Handoff] = []

    def _blocks_needed(self, request: Request) -> int:
        return blocks_for(len(request.prompt) + 1, self.config.block_size)  # the prompt, then one token

    def _done(self, seq: SequenceState) -> bool:
        return True  # every sequence leaves after its first token

    def _retire(self, seq: SequenceState) -> RequestOutput | None:
        if seq.finished:
            return super()._retire(seq)
        r = seq.request
        kv = None if isinstance(self.model, SimulatedModel) else self.read_kv(seq.id, len(r.prompt))
        generator = self._generators.pop(r.id, None)
        state = None if generator is None else generator.get_state().numpy().tobytes()
        nbytes = len(r.prompt) * self.kv_bytes_per_token
        self._handoffs.append(Handoff(r, seq.tokens[-1], self.now, kv, nbytes, state, self.now))
        self.scheduler.finish(seq)
        self._live.discard(r.id)
        return None

    def read_kv(self, seq_id: int, tokens: int) -> Tensor:
        """A copy of the first ``tokens`` positions of a sequence's K/V from the pool:
        (2, n_layers, tokens, n_kv_heads, head_dim)."""
        pool, table = self.pool, self.blocks.table(seq_id)
        L, _, bs, H, D = pool.k.shape
        k = pool.k[:, table].reshape(L, len(table) * bs, H, D)[:, :tokens]
        v = pool.v[:, table].reshape(L, len(table) * bs, H, D)[:, :tokens]
        return torch.stack([k, v])

    def take_handoffs(self) -> list[Handoff]:
        """The handoffs made since the last call."""
        out, self._handoffs = self._handoffs, []
        return out


class DecodeEngine(Engine):
    """An ``Engine`` whose sequences arrive prefilled: ``admit`` writes a handoff's K/V into
    blocks of its own pool and puts the sequence among the running ones, its first token in
    place; the step loop decodes it like any other. No prefix cache (nothing is prefilled here)."""

    def __init__(self, model, config=None):
        super().__init__(model, replace(config or EngineConfig(), prefix_caching=False))
        self.handoffs_admitted = 0

    def reserved_blocks(self) -> int:
        """Blocks the running sequences hold or can still grow into (each up to prompt + max_tokens)."""
        return sum(blocks_for(s.max_len, self.config.block_size) for s in self.scheduler.running)

    def can_admit(self, handoff: Handoff) -> bool:
        """Room for this handoff: a batch slot, and blocks for its whole length beside the running ones'."""
        if len(self.scheduler.running) >= self.config.scheduler.max_batch:
            return False
        need = self._blocks_needed(handoff.request)
        return self.reserved_blocks() + need <= self.config.num_blocks

    def admit(self, handoff: Handoff, kv: Tensor | None = None) -> None:
        """Take a prefilled request in: its K/V (``kv``, else ``handoff.kv``) into new blocks, its first
        token and the sampler's state, then it runs with the others. Check ``can_admit`` first."""
        r = handoff.request
        self.check(r)
        if self._taken(r.id):
            raise ValueError(f"a request with id {r.id} was already added")
        if not self.can_admit(handoff):
            raise ValueError(f"request {r.id}: no room in the decode pool (check can_admit first)")
        kv = handoff.kv if kv is None else kv
        seq, T = SequenceState(r, r.id), len(r.prompt)
        self.blocks.prepare_write(seq.id, 0, T)
        if not isinstance(self.model, SimulatedModel):
            self._write_kv(self.blocks.table(seq.id), kv)
        generator = r.params.generator(self.model.device)
        if generator is not None and handoff.generator_state is not None:
            state = torch.frombuffer(bytearray(handoff.generator_state), dtype=torch.uint8)
            generator.set_state(state)
        self._generators[r.id] = generator
        self._live.add(r.id)
        self._next_id = max(self._next_id, r.id) + 1
        self.now = max(self.now, handoff.ready)  # it cannot be taken in before it is there
        seq.num_computed = T
        seq.tokens.append(handoff.first_token)
        seq.token_times.append(handoff.first_time)
        self.scheduler.running.append(seq)
        self.handoffs_admitted += 1

    def _write_kv(self, table: list[int], kv: Tensor) -> None:
        pool = self.pool
        L, _, bs, H, D = pool.k.shape
        T = kv.shape[2]
        if kv.shape != (2, L, T, H, D):  # (K and V, layers, tokens, K/V heads, head dim)
            raise ValueError(f"handoff K/V {tuple(kv.shape)} does not fit this pool's {(2, L, T, H, D)}")
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(T)], device=pool.k.device)
        pool.k.view(L, -1, H, D)[:, slots] = kv[0].to(pool.k.device, pool.k.dtype)
        pool.v.view(L, -1, H, D)[:, slots] = kv[1].to(pool.v.device, pool.v.dtype)
