"""The scheduler: which sequences run in the next step, and how many of their tokens.

Every step is a list of ``Work`` items, (sequence, n): feed the next n of the sequence's tokens
whose K/V are not cached yet. A prefill is n = the prompt (or a chunk of it), a decode is n = 1;
a step may mix both. The policies (chapter 13):

- ``static``: wait until ``max_batch`` requests have arrived (or no more will), run them until
  the last one finishes, only then take the next batch.
- ``dynamic``: the same, but a batch also leaves when its oldest request has waited ``timeout`` s.
- ``continuous`` (iteration-level, Orca; Yu et al., 2022): every step, finished sequences leave
  and waiting ones join while the batch has room and the pool has blocks for them. When a
  running sequence needs a block and none is left, the most recently admitted one is preempted:
  its blocks are freed and it is recomputed later (vLLM's recompute preemption).
- chunked prefill (Sarathi; Agrawal et al., 2023), with ``token_budget``: each step feeds at most
  that many tokens. Running sequences go first, oldest first, and a prompt only enters with the
  budget they leave, so decodes are never stalled behind a long prompt: it enters in chunks.

Static and dynamic batches reserve blocks for prompt + max_tokens up front (as a contiguous cache
would), so they never preempt; continuous batching claims blocks as tokens arrive. A static batch
is one tensor: a sequence that finishes early keeps its row, as padding, until the whole batch is
done (``padding_rows``), as in ``minillm.generate``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..kv.paged import BlockManager, blocks_for
from .workload import Request

POLICIES = ("static", "dynamic", "continuous")


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "continuous"
    max_batch: int = 8  # sequences in one step at most
    timeout: float = 0.05  # dynamic: seconds the oldest request waits before a partial batch leaves
    token_budget: int | None = None  # chunked prefill: tokens per step at most; None = whole prompts

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be positive, got {self.max_batch}")
        if self.timeout < 0:
            raise ValueError(f"timeout must be >= 0, got {self.timeout}")
        if self.token_budget is not None and (self.token_budget < 1 or self.policy != "continuous"):
            raise ValueError(
                f"token_budget (chunked prefill) must be positive and needs the continuous policy, "
                f"got {self.token_budget} with {self.policy!r}"
            )
        if self.token_budget is not None and self.token_budget < self.max_batch:
            raise ValueError(
                f"token_budget {self.token_budget} < max_batch {self.max_batch}: "
                "a full batch of decodes would not fit in one step"
            )


@dataclass(eq=False)
class SequenceState:
    """A request in flight: its tokens so far (prompt, then outputs) and how many are cached."""

    request: Request
    id: int
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the pool
    token_times: list[float] = field(default_factory=list)  # when each output token came out
    preemptions: int = 0
    started: float | None = None  # when it first ran (engine clock): its queueing ends there
    draft_computed: int = 0  # speculative decoding with a draft model: tokens whose draft K/V are in its pool

    def __post_init__(self) -> None:
        self.tokens = list(self.request.prompt)

    @property
    def outputs(self) -> list[int]:
        return self.tokens[len(self.request.prompt) :]

    @property
    def finished(self) -> bool:
        out = self.outputs
        return len(out) >= self.request.max_tokens or bool(out and out[-1] in self.request.stop_ids)

    @property
    def max_len(self) -> int:
        return len(self.request.prompt) + self.request.max_tokens


@dataclass
class Work:
    seq: SequenceState
    n: int  # tokens to feed this step: seq.tokens[num_computed : num_computed + n]
    lookahead: int = 0  # speculative decoding: slots reserved after them for this many proposals
    proposed: int = 0  # the proposals the engine then verified (at most lookahead)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config, self.blocks = config, blocks
        self.waiting: deque[SequenceState] = deque()  # arrived, not running; preempted ones go first
        self.running: list[SequenceState] = []  # in admission order
        self.preemptions = 0
        self.prefix_hit_tokens = 0  # prompt tokens whose K/V came from the prefix cache
        self.prefix_query_tokens = 0  # prompt tokens looked up in it
        self.batch_rows = 0  # static/dynamic: rows of the current batch, finished ones included
        self.lookahead = 0  # speculative decoding: proposals per decode row (slots reserved for them)

    def add(self, seq: SequenceState) -> None:
        self.waiting.append(seq)

    def finish(self, seq: SequenceState) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.id)

    def abort(self, seq: SequenceState) -> None:
        """Drop a sequence wherever it is (running or waiting) and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.id)

    @property
    def padding_rows(self) -> int:
        """Static/dynamic: rows of finished sequences the current batch still carries."""
        static = self.config.policy != "continuous"
        return self.batch_rows - len(self.running) if static and self.running else 0

    def wake_time(self) -> float | None:
        """When an idle dynamic batcher must send a partial batch (its oldest request times out)."""
        if self.config.policy != "dynamic" or not self.waiting or self.running:
            return None
        return self.waiting[0].request.arrival + self.config.timeout

    def schedule(self, now: float, more_coming: bool) -> list[Work]:
        """The next step's work. ``more_coming``: requests are still due to arrive (static
        batching waits)."""
        if self.config.policy == "continuous":
            work = self._continue_running()
            return work + self._admit_continuous(self._budget_left(work))
        if not self.running:
            self._admit_batch(now, more_coming)
        return self._continue_running()

    def _budget_left(self, work: list[Work]) -> float:
        budget = self.config.token_budget
        return float("inf") if budget is None else budget - sum(w.n for w in work)

    def _continue_running(self) -> list[Work]:
        """Work for the running sequences, oldest first, preempting the newest when blocks
        run out."""
        work: list[Work] = []
        budget = self._budget_left([])
        for seq in list(self.running):
            if seq not in self.running or budget <= 0:
                continue  # preempted in this loop, or the step is full
            n = int(min(len(seq.tokens) - seq.num_computed, budget))
            extra = self._lookahead(seq, n, budget)
            if self._make_room(seq, n + extra):
                work.append(Work(seq, n, extra))
                budget -= n + extra
        return work

    def _lookahead(self, seq: SequenceState, n: int, budget: float) -> int:
        """Slots for a decode row's proposals: at most ``lookahead``, one fewer than the
        tokens it may still make (the verify forward always makes one more), and what
        the step's budget leaves."""
        if n != 1 or not self.lookahead:
            return 0
        left = seq.request.max_tokens - len(seq.outputs) - 1
        return int(max(0, min(self.lookahead, left, budget - n)))

    def _make_room(self, seq: SequenceState, n: int) -> bool:
        """Blocks for the next n tokens of seq, preempting newer sequences (then seq itself)
        if needed."""
        start = seq.num_computed
        while not self.blocks.can_write(seq.id, start, start + n):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self.blocks.prepare_write(seq.id, start, start + n)
        return True

    def _preempt(self, seq: SequenceState) -> None:
        """Recompute preemption: drop the sequence's K/V; it re-enters first in line,
        outputs kept."""
        self.running.remove(seq)
        self.blocks.free(seq.id)
        seq.num_computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _admit_continuous(self, budget: float) -> list[Work]:
        work = []
        while self.waiting and len(self.running) < self.config.max_batch and budget > 0:
            seq = self.waiting[0]
            n = self._start(seq)
            n = int(min(n, budget))
            if not self.blocks.can_write(seq.id, seq.num_computed, seq.num_computed + n):
                self._unstart(seq)
                break
            self._admit(seq, seq.num_computed + n)
            work.append(Work(seq, n))
            budget -= n
        return work

    def _start(self, seq: SequenceState) -> int:
        """Reuse cached prefix blocks; return how many tokens are left to compute (at least the last)."""
        cached = self.blocks.match_prefix(seq.id, seq.tokens)
        seq.num_computed = min(cached, len(seq.tokens) - 1)  # the last token's logits are needed
        seq.draft_computed = seq.num_computed  # a draft's K/V of cached blocks came with them
        return len(seq.tokens) - seq.num_computed

    def _admit(self, seq: SequenceState, end: int) -> None:
        self.blocks.prepare_write(seq.id, seq.num_computed, end)
        self.prefix_hit_tokens += seq.num_computed
        self.prefix_query_tokens += len(seq.tokens)
        self.running.append(self.waiting.popleft())

    def _unstart(self, seq: SequenceState) -> None:
        self.blocks.free(seq.id)
        seq.num_computed = 0

    def _admit_batch(self, now: float, more_coming: bool) -> None:
        """Static/dynamic: take a whole batch, each sequence with blocks for all its tokens."""
        full = len(self.waiting) >= self.config.max_batch
        timed_out = self.config.policy == "dynamic" and self.waiting and self.wake_time() <= now
        if not (full or timed_out or (self.waiting and not more_coming)):
            return
        while self.waiting and len(self.running) < self.config.max_batch:
            seq = self.waiting[0]
            self._start(seq)
            if not self.blocks.can_write(seq.id, seq.num_computed, seq.max_len):
                self._unstart(seq)
                break
            self._admit(seq, seq.max_len)
        self.batch_rows = len(self.running)

    def blocks_needed(self, request: Request) -> int:
        return blocks_for(len(request.prompt) + request.max_tokens, self.blocks.block_size)
