"""The serving engine: requests in, batched forward passes over a paged KV cache, tokens out.

    engine = Engine(model, EngineConfig(num_blocks=256, scheduler=SchedulerConfig("continuous", 16)))
    outputs = engine.run(requests)          # one RequestOutput per request, in the given order
    print(summary([o.metrics for o in outputs if o.finish_reason != "error"]))

A request that fails while being served (``finish_reason == "error"``, the reason in ``error``)
ends alone, its blocks freed; the engine serves the others.

Each ``step`` asks the scheduler for work (which sequences, how many tokens each), runs the real
model over all of it (one forward for the decode rows and one for the prompt chunks, rows
left-padded with position -1: without a variable-length attention kernel, padding a one-token
decode row to a chunk's length would cost more than the second forward), samples a token for
every sequence whose tokens are now all cached, and retires finished requests.

Time. The engine keeps its own clock, ``now`` (seconds), on which request arrivals are given.
Each step advances it by the step's duration: by default the *measured* wall-clock time of the
step (``time.perf_counter``), or, with ``EngineConfig.step_cost``, a *simulated* time from a cost
model (``StepCost``: a fixed cost per forward, plus a cost per decode row and per prompt token),
which makes runs reproducible and fast in tests. Either way, idle gaps between arrivals are
skipped, not slept through. ``fit_step_cost`` fits that model to the steps of a measured run,
and ``SimulatedModel`` stands in for the model when only the schedule and the clock matter
(rate sweeps of thousands of steps in seconds).

Every step is logged in ``Engine.step_log`` (a ``StepRecord``: when, how long, which sequences
with how many tokens, the KV blocks in use), for timelines and for fitting the cost model. The
three of them live in ``step_cost`` and are importable from here too.

``Engine.abort`` ends a request wherever it is and keeps nothing of it: a server (the async
engine) aborts what its clients leave, and pops each finished output, so a long-running engine
holds only the requests in flight.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..core.config import ModelConfig
from ..core.device import synchronize
from ..core.model import Transformer
from ..core.outputs import TimedTokens
from ..core.prompts import check_vocabulary
from ..core.sampling import sample
from ..decoding.common import DecodingStats
from ..kv.paged import BlockManager, KVPool, PagedKVBatch
from ..kv.radix import RadixBlockManager
from ..measure.metrics import RequestMetrics
from .logits import TokenLogprob, ban, token_logprob
from .scheduler import Scheduler, SchedulerConfig, SequenceState, Work
from .speculative import DraftModel, PoolPair, Speculation, accept, check_draft, lookup_proposals, verify_inputs
from .step_cost import StepCost, StepRecord, fit_step_cost  # noqa: F401 (fit_step_cost: importable from here too)
from .workload import Request


class RequestTooLargeError(ValueError):
    """A request that could never run: it needs more blocks than the whole pool, or more than the context."""


class SimulatedModel:
    """Stands in for the model when only the schedule and the clock matter (it needs a ``StepCost``).

    Every forward returns all-zero logits at once (greedy sampling then picks token 0) and stores
    no K/V: its pool holds two numbers per slot. The scheduler, the block tables and the prefix
    cache run exactly as with the real model, so a sweep of thousands of steps takes seconds;
    the times it gives are the cost model's, not measured.
    """

    def __init__(self, config: ModelConfig):
        self.config = config.replace(
            dim=2, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=2, ffn_dim=1, name=f"{config.name} (simulated)"
        )
        self.device, self.dtype = torch.device("cpu"), torch.float32

    @classmethod
    def like(cls, model) -> SimulatedModel:
        return cls(model.config)

    def __call__(self, input_ids: Tensor, positions: Tensor | None = None, cache=None, last_only: bool = False):
        B, T = input_ids.shape
        return torch.zeros(B, 1 if last_only else T, self.config.vocab_size)


BLOCK_MANAGERS = {"hash": BlockManager, "radix": RadixBlockManager}  # EngineConfig.prefix_cache


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 256  # KV pool size, in blocks
    block_size: int = 16  # tokens per block
    prefix_caching: bool = True
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    step_cost: StepCost | None = None  # None: each step takes its measured wall-clock time
    prefix_cache: str = "hash"  # "hash": full blocks by hash chain (kv.paged); "radix": a token radix tree (kv.radix)
    speculation: Speculation | None = None  # speculative decoding of the decode rows (serving.speculative)
    compile: bool = False  # decode steps through torch.compile, batches padded to size buckets (serving.compiled_step)
    max_model_len: int | None = None  # prompt + max_tokens per request at most (None: the model's context)

    def __post_init__(self) -> None:
        if self.prefix_cache not in BLOCK_MANAGERS:
            raise ValueError(f"prefix_cache must be one of {tuple(BLOCK_MANAGERS)}, got {self.prefix_cache!r}")
        if self.max_model_len is not None and (
            isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int) or self.max_model_len < 1
        ):
            raise ValueError(f"max_model_len must be a positive integer or None, got {self.max_model_len!r}")
        if self.speculation is not None and self.scheduler.policy != "continuous":
            raise ValueError(
                f"speculative decoding needs the continuous policy (rows accept different numbers of "
                f"tokens), got {self.scheduler.policy!r}"
            )


@dataclass
class RequestOutput(TimedTokens):
    request: Request
    tokens: list[int]  # the generated ids
    metrics: RequestMetrics  # arrival and each token's time, on the engine's clock
    preemptions: int
    finish_reason: str = "length"  # "length" (max_tokens reached), "stop" (a stop id), "error"
    error: str | None = None  # what went wrong while serving this request (finish_reason "error")
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them
    started: float | None = None  # when it first ran (engine clock; None: it never did)
    speculation: DecodingStats | None = None  # proposals and acceptance, when the engine speculates

    def token_lists(self) -> list[list[int]]:
        return [list(self.tokens)]

    @property
    def total_time(self) -> float:
        """Seconds from the request's arrival to its last token (nan if it made none)."""
        times = self.metrics.token_times
        return times[-1] - self.metrics.arrival if times else float("nan")


def batch_inputs(work: list[Work], device, padding_rows: int = 0) -> tuple[Tensor, Tensor]:
    """Each sequence's next n tokens, left-padded, then empty rows: ids and positions (B, T), padding -1."""
    T = max(w.n for w in work)
    ids = torch.zeros(len(work) + padding_rows, T, dtype=torch.long)
    positions = torch.full((len(work) + padding_rows, T), -1, dtype=torch.long)
    for i, w in enumerate(work):
        start = w.seq.num_computed
        ids[i, T - w.n :] = torch.as_tensor(w.seq.tokens[start : start + w.n])
        positions[i, T - w.n :] = torch.arange(start, start + w.n)
    return ids.to(device), positions.to(device)


class Engine:
    """``draft``: the draft model of ``EngineConfig.speculation`` with method ``"draft"``."""

    def __init__(self, model: Transformer, config: EngineConfig | None = None, draft: Transformer | None = None):
        self.model, self.config = model, config or EngineConfig()
        c = self.config
        if isinstance(model, SimulatedModel) and c.step_cost is None:
            raise ValueError("a SimulatedModel takes no time of its own: give EngineConfig a step_cost")
        if c.max_model_len is not None and c.max_model_len > model.config.max_seq_len:
            raise ValueError(
                f"max_model_len {c.max_model_len} exceeds the model's context length {model.config.max_seq_len}"
            )
        self.context = c.max_model_len or model.config.max_seq_len  # prompt + max_tokens per request at most
        pool_of = getattr(model, "kv_pool", None) or (lambda n, bs: KVPool.for_model(model, n, bs))
        scratch = 1 if c.compile else 0  # a compiled step's padding rows write into one block past the table's
        self.pool = pool_of(c.num_blocks + scratch, c.block_size)  # a model held by other processes has its pools there
        self.draft = self._draft_model(draft)
        pools = self.pool if self.draft is None else PoolPair(self.pool, self.draft.pool)
        self.blocks = BLOCK_MANAGERS[c.prefix_cache](c.num_blocks, c.block_size, c.prefix_caching, pools)
        self.scheduler = Scheduler(c.scheduler, self.blocks)
        self.scheduler.lookahead = c.speculation.k if c.speculation is not None else 0
        self._speculation: dict[int, DecodingStats] = {}  # per request in flight
        self.decode_step = self._compiled_step() if c.compile else None  # EngineConfig.compile
        self.speculation_total = DecodingStats(c.speculation.k) if c.speculation is not None else None
        self.now = 0.0
        self.steps = self.tokens_fed = 0
        self.kv_slots_held = self.kv_tokens_stored = 0
        self.padding_rows = 0  # rows of finished sequences that static batches carried
        self.peak_blocks = 0  # the most KV blocks referenced at once
        self.step_log: list[StepRecord] = []
        self._pending: list[tuple[float, int, Request]] = []  # heap by arrival
        self._generators: dict[int, torch.Generator | None] = {}
        self._logprobs: dict[int, list[TokenLogprob]] = {}  # of the requests that asked, token by token
        self.outputs: dict[int, RequestOutput] = {}  # finished requests by id
        self._live: set[int] = set()  # ids of the requests added and not finished
        self._next_id = 0

    def _draft_model(self, draft: Transformer | None) -> DraftModel | None:
        """The draft over a pool of its own, or None; refuses a draft that speculation does not use."""
        spec, c = self.config.speculation, self.config
        wants = spec is not None and spec.method == "draft"
        if spec is not None and isinstance(self.model, SimulatedModel):
            raise ValueError("speculative decoding needs a real model: a SimulatedModel makes no proposals to verify")
        if wants and draft is None:
            raise ValueError("speculation method 'draft' needs a draft model: Engine(model, config, draft=...)")
        if draft is not None and not wants:
            raise ValueError("a draft model was given, but EngineConfig.speculation does not use one (method 'draft')")
        if draft is None:
            return None
        check_draft(self.model.config, draft)
        return DraftModel(draft, c.num_blocks, c.block_size)

    def _compiled_step(self):
        """The decode step compiled per batch bucket (``serving.compiled_step``); its padding rows
        write into the pool's last block, which the block manager never hands out."""
        from .compiled_step import PagedDecodeStep  # torch.compile is imported only when asked for

        if isinstance(self.model, SimulatedModel) or getattr(self.model, "remote", False):
            raise ValueError("compile needs the model in this process (not a SimulatedModel or tensor-parallel ranks)")
        c = self.config
        return PagedDecodeStep(
            self.model, self.pool, c.scheduler.max_batch, scratch_block=c.num_blocks, max_len=self.context
        )

    # -- requests in ---------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Raise RequestTooLargeError (or ValueError) for a request the engine could never serve.
        Its fields are validated again: they may have been changed since it was made."""
        request.validate()
        n, context = len(request.prompt) + request.max_tokens, self.context
        if n > context:
            raise RequestTooLargeError(
                f"request {request.id}: prompt {len(request.prompt)} + max_tokens "
                f"{request.max_tokens} exceeds the context length {context}"
            )
        need = self._blocks_needed(request)
        if need > self.config.num_blocks:
            raise RequestTooLargeError(
                f"request {request.id} needs {need} blocks of {self.config.block_size} tokens "
                f"({n} tokens) but the KV pool has only {self.config.num_blocks}"
            )
        try:
            check_vocabulary([request.prompt], self.model.config.vocab_size)
            request.adjust.check_vocabulary(self.model.config.vocab_size)
        except ValueError as e:
            raise ValueError(f"request {request.id}: {e}") from None

    def _blocks_needed(self, request: Request) -> int:
        """The KV blocks a request needs in this engine's pool at most."""
        return self.scheduler.blocks_needed(request)

    def add_request(self, request: Request) -> int:
        """Queue a request (it joins when the clock reaches its arrival); returns its id."""
        self.check(request)
        if request.id is None:
            request.id = self._next_id
        if self._taken(request.id):
            raise ValueError(f"a request with id {request.id} was already added")
        self._live.add(request.id)
        self._next_id = max(self._next_id, request.id) + 1
        heapq.heappush(self._pending, (request.arrival, request.id, request))
        return request.id

    def _taken(self, request_id: int) -> bool:
        """An id is taken while its request is in flight and while its output is kept."""
        return request_id in self._live or request_id in self.outputs

    def abort(self, request_id: int) -> bool:
        """End a request wherever it is (not yet arrived, waiting or running): its blocks return to
        the pool at once and nothing of it is kept, no output either. False if it was not in flight."""
        if request_id not in self._live:
            return False
        self._live.discard(request_id)
        self._pending = [p for p in self._pending if p[1] != request_id]
        heapq.heapify(self._pending)
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.id == request_id:
                self.scheduler.abort(seq)
        self._generators.pop(request_id, None)
        self._logprobs.pop(request_id, None)
        self._speculation.pop(request_id, None)
        if self.draft is not None:
            self.draft.end(request_id)
        return True

    def _admit_arrivals(self) -> list[RequestOutput]:
        """Move arrived requests to the scheduler; those that fail on the way end with an error."""
        failed = []
        while self._pending and self._pending[0][0] <= self.now:
            request = heapq.heappop(self._pending)[2]
            seq = SequenceState(request, request.id)
            try:
                self._generators[request.id] = request.params.generator(self.model.device)
                if self.draft is not None:
                    self.draft.start(request.id, request.params)
            except Exception as e:  # confined to this request: it ends with an error, the rest go on
                failed.append(self._fail(seq, e, scheduled=False))
                continue
            self.scheduler.add(seq)
        return failed

    def logprobs_so_far(self, request_id: int) -> list[TokenLogprob]:
        """The log-probabilities of a running request's tokens so far (empty if it asked for none)."""
        return self._logprobs.get(request_id, [])

    def _fail(self, seq: SequenceState, error: Exception, scheduled: bool = True) -> RequestOutput:
        """End one request with an error (its blocks freed at once); the engine serves the others."""
        if scheduled:
            self.scheduler.abort(seq)
        out = self._output(seq, finish_reason="error")
        out.error = f"{type(error).__name__}: {error}"
        return out

    # -- the step loop -------------------------------------------------------------------------

    @property
    def next_arrival(self) -> float | None:
        """When the earliest request added but not yet arrived arrives (None if there is none)."""
        return self._pending[0][0] if self._pending else None

    @property
    def unfinished(self) -> bool:
        return bool(self._pending or self.scheduler.waiting or self.scheduler.running)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One forward over the scheduled work; returns the requests that finished in it."""
        failed = self._admit_arrivals()
        work = self.scheduler.schedule(self.now, more_coming=bool(self._pending))
        if not work:
            if self.unfinished:
                self._wait()
            return failed
        synchronize(self.model.device)
        t0 = time.perf_counter()
        try:
            tokens, (decode_rows, padding, prefill_tokens, forwards) = self._forward_and_sample(work)
        except Exception as e:  # the batched forward itself failed: end these requests, keep the engine
            return failed + [self._fail(w.seq, e) for w in work]
        synchronize(self.model.device)
        n_fed = sum(w.n + w.proposed for w in work)
        cost = self.config.step_cost
        duration = cost(decode_rows, prefill_tokens, forwards) if cost is not None else time.perf_counter() - t0
        start, self.now = self.now, self.now + duration
        self.steps, self.tokens_fed = self.steps + 1, self.tokens_fed + n_fed
        finished = self._advance(work, tokens)
        self._count_kv_use()
        rows = tuple((w.seq.id, w.n + w.proposed) for w in work)
        used = self.blocks.allocator.num_used
        self.step_log.append(StepRecord(start, duration, decode_rows, padding, prefill_tokens, forwards, rows, used))
        return failed + finished

    def _count_kv_use(self) -> None:
        """Accumulate token slots held in blocks vs tokens stored in them, for the measured waste."""
        self.kv_slots_held += sum(len(t) for t in self.blocks.tables.values()) * self.config.block_size
        self.kv_tokens_stored += sum(s.num_computed for s in self.scheduler.running)
        self.peak_blocks = max(self.peak_blocks, self.blocks.allocator.num_used)

    @property
    def kv_waste(self) -> float:
        """Fraction of the KV slots held by running sequences that stayed empty, averaged over steps."""
        return 1.0 - self.kv_tokens_stored / self.kv_slots_held if self.kv_slots_held else 0.0

    def _forward(self, work: list[Work], padding_rows: int = 0) -> Tensor:
        """The model over the rows of one step (plus empty rows) -> the logits after each row's last token (B, V).
        Decode rows go through the compiled step when there is one."""
        if self.decode_step is not None and not padding_rows and all(w.n == 1 for w in work):
            return self._decode_compiled([w.seq for w in work])
        ids, positions = batch_inputs(work, self.model.device, padding_rows)
        tables = [self.blocks.table(w.seq.id) for w in work] + [[]] * padding_rows
        return self.model(ids, positions, PagedKVBatch(self.pool, tables), last_only=True)[: len(work), -1]

    def _decode_compiled(self, seqs: list[SequenceState]) -> Tensor:
        """One token per sequence (its last, at position num_computed) through the compiled step."""
        positions = [s.num_computed for s in seqs]
        return self.decode_step(
            [s.tokens[p] for s, p in zip(seqs, positions)], positions, [self.blocks.table(s.id) for s in seqs]
        )

    def _fed(self, work: list[Work]) -> tuple[int, int, int, int]:
        """What a step feeds: (decode rows with a static batch's padding rows, padding rows, prompt
        tokens, forwards). Decode rows and prompt chunks run as two forwards (see ``_forward_split``)."""
        decode = sum(w.n == 1 for w in work)
        pad = self.scheduler.padding_rows if decode else 0  # a static batch's finished rows ride with the decodes
        prefill = sum(w.n for w in work if w.n > 1)
        return decode + pad, pad, prefill, (decode > 0) + (prefill > 0)

    def _forward_split(self, work: list[Work]) -> Tensor:
        """Decode rows and prefill rows as two forwards: padding a one-token row to a prompt chunk's
        length would multiply its cost (a variable-length attention kernel would fuse the two)."""
        logits = torch.empty(len(work), self.model.config.vocab_size, device=self.model.device)
        for rows in ([i for i, w in enumerate(work) if w.n == 1], [i for i, w in enumerate(work) if w.n > 1]):
            pad = self.scheduler.padding_rows if rows and work[rows[0]].n == 1 else 0  # a static batch's finished rows
            if rows:
                logits[rows] = self._forward([work[i] for i in rows], pad).to(logits.dtype)
        return logits

    def _forward_and_sample(self, work: list[Work]) -> tuple[list, tuple[int, int, int, int]]:
        """The model on every row; new tokens for each row whose sequence is now fully cached: one
        (an int), or with speculation a decode row's accepted proposals and the token after them (a
        list). A ``SimulatedModel`` runs nothing: each such row gets token 0, what its zero logits
        would give."""
        fed = self._fed(work)
        self.padding_rows += fed[1]
        for w in work:
            if w.seq.started is None:  # its first step: its queueing ends now
                w.seq.started = self.now
        done = [w.seq.num_computed + w.n >= len(w.seq.tokens) for w in work]  # else a prompt chunk, mid-prompt
        if isinstance(self.model, SimulatedModel):
            return [0 if d else None for d in done], fed
        speculating = self.config.speculation is not None
        verified = [i for i, w in enumerate(work) if speculating and w.n == 1]
        rest = [i for i, w in enumerate(work) if not (speculating and w.n == 1)]
        out: list = [None] * len(work)
        if rest:
            sub = [work[i] for i in rest]
            logits = self._forward_split(sub)  # (B, V)
            if self.draft is not None:  # the draft's K/V keep up with the target's
                self.draft.prefill([w.seq for w in sub], [w.n for w in sub], [self.blocks.table(w.seq.id) for w in sub])
            for j, i in enumerate(rest):
                out[i] = self._sample(logits[j], work[i].seq) if done[i] else None
        if verified:
            for i, tokens in zip(verified, self._speculate([work[i] for i in verified])):
                out[i] = tokens
        return out, fed

    def _sample(self, logits: Tensor, seq: SequenceState) -> int | Exception:
        """One token for a row from its logits (V,) (or the exception, confined to this request)."""
        r = seq.request
        try:
            token = int(sample(self._adjusted(logits[None], seq), r.params, self._generators[r.id]))
            if r.logprobs is not None:  # of the model's own logits, before the request's adjustments
                self._logprobs.setdefault(r.id, []).append(token_logprob(logits, token, r.logprobs))
            return token
        except Exception as e:  # confined to this row's request (see _advance)
            return e

    def _speculate(self, work: list[Work]) -> list[list[int] | Exception]:
        """Speculative decoding of the decode rows (``serving.speculative``): propose,
        verify all rows in one forward of (B, K + 1), accept row by row -> each row's
        new tokens."""
        seqs, ks = [w.seq for w in work], [w.lookahead for w in work]
        tables = [self.blocks.table(s.id) for s in seqs]
        if self.draft is not None:
            proposals = self.draft.propose(seqs, ks, tables)
        else:
            proposals = lookup_proposals(seqs, ks, self.config.speculation)
        for w, (draft, _) in zip(work, proposals):
            w.proposed = len(draft)
        if self.decode_step is not None and not any(d for d, _ in proposals):  # nothing to verify: a plain step
            return self._accept(seqs, proposals, self._decode_compiled(seqs)[:, None])  # (B, 1, V)
        ids, positions = verify_inputs(seqs, [d for d, _ in proposals], self.model.device)
        return self._accept(seqs, proposals, self.model(ids, positions, PagedKVBatch(self.pool, tables)))

    def _accept(self, seqs: list[SequenceState], proposals: list, logits: Tensor) -> list[list[int] | Exception]:
        """Chapter 7's rule row by row on the verify forward's logits (B, T, V), each row's last
        k + 1 positions at its k proposals and after them -> each row's new tokens."""
        T = logits.shape[1]
        out: list[list[int] | Exception] = []
        for i, (seq, (draft, q)) in enumerate(zip(seqs, proposals)):
            r = seq.request
            try:
                rows = logits[i, T - len(draft) - 1 :]  # (k + 1, V): at each proposal and after them
                n, token = accept(self._adjusted_along(rows, seq, draft), draft, q, r.params, self._generators[r.id])
                emitted = self._emitted(seq, [*draft[:n], token])
                if r.logprobs is not None:
                    for j, t in enumerate(emitted):
                        self._logprobs.setdefault(r.id, []).append(token_logprob(rows[j], t, r.logprobs))
                for stats in (
                    self._speculation.setdefault(r.id, DecodingStats(self.speculation_total.k)),
                    self.speculation_total,
                ):
                    stats.record(len(draft), n, len(emitted))
                out.append(emitted)
            except Exception as e:  # confined to this row's request (see _advance)
                out.append(e)
        if self.draft is not None:
            self.speculation_total.draft_forwards = self.draft.forwards
        return out

    @staticmethod
    def _emitted(seq: SequenceState, tokens: list[int]) -> list[int]:
        """The accepted tokens up to the request's end: its first stop id (once it may stop), or
        max_tokens."""
        r, kept = seq.request, []
        for t in tokens[: r.max_tokens - len(seq.outputs)]:
            kept.append(t)
            if t in r.stop_ids and len(seq.outputs) + len(kept) > r.min_tokens:
                break
        return kept

    def _adjusted_along(self, logits: Tensor, seq: SequenceState, draft: list[int]) -> Tensor:
        """A row's logits (k + 1, V) each adjusted as if the proposals before it were the request's
        tokens (penalties count them; a stop id stays banned until min_tokens)."""
        r = seq.request
        if not r.adjust.active and not (r.stop_ids and len(seq.outputs) < r.min_tokens):
            return logits
        return torch.cat([self._adjusted(logits[j : j + 1], seq, draft[:j]) for j in range(len(logits))])

    @staticmethod
    def _adjusted(logits: Tensor, seq: SequenceState, ahead: list[int] = ()) -> Tensor:
        """One request's logits (1, V) as it asked: penalties, biases and min_p, and its stop ids
        banned while it has fewer than ``min_tokens`` outputs. ``ahead``: tokens proposed after the
        request's own, counted as its (speculative decoding)."""
        r = seq.request
        tokens = seq.tokens + list(ahead) if ahead else seq.tokens
        if r.adjust.active:
            logits = r.adjust.apply(logits, tokens, len(r.prompt), r.params.temperature)
        if r.stop_ids and len(tokens) - len(r.prompt) < r.min_tokens:
            logits = ban(logits, r.stop_ids)
        return logits

    def _advance(self, work: list[Work], tokens: list) -> list[RequestOutput]:
        finished = []
        for w, new in zip(work, tokens):
            seq = w.seq
            if isinstance(new, Exception):
                finished.append(self._fail(seq, new))
                continue
            new = [] if new is None else [new] if isinstance(new, int) else new
            seq.num_computed += w.n + max(0, len(new) - 1)  # accepted proposals' K/V are in the pool too
            seq.tokens.extend(new)
            seq.token_times.extend([self.now] * len(new))
            seq.draft_computed = min(seq.draft_computed, seq.num_computed)  # the draft's rejected roll back too
            cached = seq.num_computed if self.draft is None else seq.draft_computed
            self.blocks.commit(seq.id, seq.tokens, cached)  # a block is cached once every pool holds it
            if new and self._done(seq):
                out = self._retire(seq)
                if out is not None:
                    finished.append(out)
        return finished

    def _done(self, seq: SequenceState) -> bool:
        """Whether this engine is done with a sequence that just got a token (a disaggregated
        prefill worker is done after the first; ``serving.disagg``)."""
        return seq.finished

    def _retire(self, seq: SequenceState) -> RequestOutput | None:
        """Free a done sequence's blocks and return its output (None: it goes on elsewhere)."""
        self.scheduler.finish(seq)
        return self._output(seq)

    def _output(self, seq: SequenceState, finish_reason: str | None = None) -> RequestOutput:
        r = seq.request
        self._generators.pop(r.id, None)  # a finished request never samples again
        logprobs = self._logprobs.pop(r.id, []) if r.logprobs is not None else None
        self._live.discard(r.id)
        speculation = self._speculation.pop(r.id, None)
        if self.draft is not None:
            self.draft.end(r.id)
        metrics = RequestMetrics(r.arrival, list(seq.token_times), len(r.prompt))
        out = seq.outputs
        reason = finish_reason or ("stop" if out and out[-1] in r.stop_ids else "length")
        self.outputs[r.id] = RequestOutput(
            r, out, metrics, seq.preemptions, reason, logprobs=logprobs, started=seq.started, speculation=speculation
        )
        return self.outputs[r.id]

    def _wait(self) -> None:
        """Nothing to run: jump the clock to the next arrival or batching timeout."""
        events = [t for t in (self.next_arrival, self.scheduler.wake_time()) if t is not None and t > self.now]
        if not events:
            raise RuntimeError("the engine is stuck: requests wait but none can be scheduled")
        self.now = min(events)

    def run(self, requests: Iterable[Request] = (), progress: bool = False) -> list[RequestOutput]:
        """Serve ``requests`` (and any added before) to the end; outputs in the order given.

        Every request is checked before any runs, so a request that can never fit fails at once.
        ``progress`` shows a bar of requests done (tqdm, on stderr).
        """
        requests = list(requests)
        seen: set[int] = set()
        for r in requests:
            self.check(r)
            if r.id is not None and (self._taken(r.id) or r.id in seen):
                raise ValueError(f"a request with id {r.id} was already added")
            seen.add(r.id)
        ids = [self.add_request(r) for r in requests]
        bar = progress_bar(len(self._pending) + len(self.scheduler.waiting) + len(self.scheduler.running), progress)
        while self.unfinished:
            bar.update(len(self.step()))
        bar.close()
        return [self.outputs[i] for i in ids]

    def warmup(self) -> float:
        """Compile what ``EngineConfig.compile`` steps through, before a timer starts (or a client
        waits) -> the seconds it took (0 without compile)."""
        return self.decode_step.warmup() if self.decode_step is not None else 0.0

    def close(self) -> None:
        """End what the model runs on beyond this process (a tensor-parallel model's ranks)."""
        close = getattr(self.model, "close", None)
        if close is not None:
            close()

    def stats(self) -> dict[str, int]:
        """Counters over the engine's life: steps, tokens fed, preemptions, evictions, copy-on-write copies,
        prompt tokens found in the prefix cache, padding rows fed for finished members of static batches."""
        return {
            "steps": self.steps,
            "tokens_fed": self.tokens_fed,
            "preemptions": self.scheduler.preemptions,
            "evictions": self.blocks.allocator.evictions,
            "cow_copies": self.blocks.cow_copies,
            "prefix_hit_tokens": self.scheduler.prefix_hit_tokens,
            "padding_rows": self.padding_rows,
            **self.speculation_counters(),
        }

    def speculation_counters(self) -> dict[str, int]:
        """With speculation: proposals verified, proposals accepted, decode rows verified (each
        request's own are in its output); none without."""
        total = self.speculation_total
        if total is None:
            return {}
        return {
            "spec_proposed_tokens": total.proposed,
            "spec_accepted_tokens": sum(total.accepted),
            "spec_verified_rows": total.target_forwards,
            "spec_draft_forwards": total.draft_forwards,
        }


def progress_bar(total: int, enabled: bool) -> tqdm:
    """A bar of requests done (on stderr); a silent one unless ``enabled``."""
    return tqdm(total=total, unit="req", desc="serving", disable=not enabled)
