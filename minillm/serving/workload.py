"""Workloads for a serving engine: requests, chat-like traces, and recorded traces replayed.

A trace is a list of ``TraceEntry`` (arrival time, prompt length, output length). The synthetic
one is chat-like: Poisson arrivals (``measure.arrivals.poisson_arrivals``) and lognormal lengths,
many short prompts and answers with a long tail, as in public chat logs. A recorded trace
is a JSON list of objects or a CSV with the columns ``arrival,prompt_len,output_len``.
``requests_from_trace`` turns a trace into ``Request`` objects with random prompt ids (the
engine's speed does not depend on which tokens they are).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..core.prompts import token_id_tuple, token_rows
from ..core.sampling import SamplingParams
from ..measure.arrivals import poisson_arrivals
from .logits import LogitAdjustments

TRACE_FIELDS = ("arrival", "prompt_len", "output_len")
MAX_LOGPROBS = 20  # top log-probabilities per token a request may ask for


@dataclass
class Request:
    """One request to the engine: generate ``max_tokens`` tokens after ``prompt``.

    ``arrival`` is seconds on the engine's clock; generation stops early only at one of
    ``stop_ids`` (none by default, as ``generate(..., eos_token_id=None)``), and not before
    ``min_tokens`` outputs (the stop ids are banned until then). ``adjust`` holds the penalties,
    biases and min_p applied to its logits before sampling (``serving.logits``).
    """

    prompt: list[int]
    max_tokens: int
    arrival: float = 0.0
    params: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: tuple[int, ...] = ()
    id: int | None = None  # the engine numbers requests that come without one
    min_tokens: int = 0
    adjust: LogitAdjustments = field(default_factory=LogitAdjustments)
    logprobs: int | None = None  # each output token's log-probability, with this many top ones (None: none)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (the engine calls this again when the request is added, since fields
        can be changed after construction); prompt and stop ids are normalized to ints."""
        rows = token_rows(self.prompt)
        if len(rows) != 1:
            raise ValueError(f"a request has one prompt, got {len(rows)} rows of token ids")
        self.prompt = rows[0]
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if (
            isinstance(self.arrival, bool)
            or not isinstance(self.arrival, (int, float))
            or not math.isfinite(self.arrival)
        ):
            raise ValueError(f"arrival must be a finite time in seconds, got {self.arrival!r}")
        if self.arrival < 0:
            raise ValueError(f"arrival must be a finite time >= 0, got {self.arrival!r}")
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(self.params).__name__} {self.params!r}")
        self.stop_ids = token_id_tuple(self.stop_ids, "stop_ids")
        if self.id is not None and (isinstance(self.id, bool) or not isinstance(self.id, int) or self.id < 0):
            raise ValueError(f"id must be a non-negative integer or None, got {self.id!r}")
        m = self.min_tokens
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {m!r}")
        n = self.logprobs
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {n!r}")
        if not isinstance(self.adjust, LogitAdjustments):
            raise ValueError(f"adjust must be a LogitAdjustments, got {type(self.adjust).__name__}")


def copy_requests(requests: Sequence[Request]) -> list[Request]:
    """Fresh copies (an engine numbers and consumes its requests), with everything a request says:
    prompt, length, arrival, sampling parameters, stop ids, id, minimum length, adjustments and
    log-probabilities asked for."""
    return [
        Request(list(r.prompt), r.max_tokens, r.arrival, r.params, r.stop_ids, r.id, r.min_tokens, r.adjust, r.logprobs)
        for r in requests
    ]


def number_requests(requests: list[Request]) -> list[Request]:
    """Give each request without an id the next free one, as ``Engine.run`` numbers them (one more
    than the largest id so far); a ValueError for an id given twice. Returns the same list."""
    next_id, seen = 0, set()
    for r in requests:
        if r.id is None:
            r.id = next_id
        if r.id in seen:
            raise ValueError(f"a request with id {r.id} was given twice")
        seen.add(r.id)
        next_id = max(next_id, r.id) + 1
    return requests


@dataclass(frozen=True)
class TraceEntry:
    arrival: float  # seconds
    prompt_len: int
    output_len: int


def lognormal_lengths(n: int, median: float, sigma: float, low: int, high: int, rng: np.random.Generator) -> list[int]:
    """``n`` integer lengths from a lognormal with this median and log-space sigma, clipped to [low, high]."""
    values = rng.lognormal(math.log(median), sigma, size=n)
    return np.clip(np.round(values), low, high).astype(int).tolist()


def chat_trace(
    n: int,
    rate: float,
    prompt_median: float = 96,
    prompt_sigma: float = 0.8,
    output_median: float = 64,
    output_sigma: float = 0.8,
    max_len: int = 1024,
    seed: int = 0,
) -> list[TraceEntry]:
    """A chat-like trace: Poisson arrivals at ``rate`` requests/s, lognormal prompt and output
    lengths; every prompt + output fits in ``max_len`` tokens (prompts take at most half)."""
    if max_len < 2:
        raise ValueError(f"max_len must be at least 2, got {max_len}")
    rng = np.random.default_rng(seed)
    prompts = lognormal_lengths(n, prompt_median, prompt_sigma, 1, max_len // 2, rng)
    outputs = lognormal_lengths(n, output_median, output_sigma, 1, max_len, rng)
    arrivals = poisson_arrivals(n, rate, seed)
    return [TraceEntry(a, p, min(o, max_len - p)) for a, p, o in zip(arrivals, prompts, outputs)]


def save_trace(entries: Sequence[TraceEntry], path: str | Path) -> None:
    """Write a trace as JSON (a list of objects) or CSV, by the file's suffix."""
    path = Path(path)
    rows = [asdict(e) for e in entries]
    if path.suffix == ".csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=TRACE_FIELDS)
            writer.writeheader()
            writer.writerows(rows)
    else:
        path.write_text(json.dumps(rows, indent=1) + "\n")


def load_trace(path: str | Path) -> list[TraceEntry]:
    """Read a recorded trace (JSON or CSV with columns arrival, prompt_len, output_len), by arrival."""
    path = Path(path)
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    else:
        rows = json.loads(path.read_text())
    entries = [_entry(row, i, path) for i, row in enumerate(rows)]
    return sorted(entries, key=lambda e: e.arrival)


def _entry(row: dict, i: int, path: Path) -> TraceEntry:
    missing = [k for k in TRACE_FIELDS if k not in row]
    if missing:
        raise ValueError(f"{path}: entry {i} lacks {missing}; each needs {list(TRACE_FIELDS)}")
    try:
        entry = TraceEntry(float(row["arrival"]), int(row["prompt_len"]), int(row["output_len"]))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: entry {i} is not numeric: {row}") from e
    if entry.arrival < 0 or entry.prompt_len < 1 or entry.output_len < 1:
        raise ValueError(f"{path}: entry {i} needs arrival >= 0 and positive lengths, got {row}")
    return entry


def random_prompt(length: int, vocab_size: int, rng: np.random.Generator) -> list[int]:
    return rng.integers(0, vocab_size, size=length).tolist()


def requests_from_trace(
    entries: Sequence[TraceEntry], vocab_size: int, seed: int = 0, shared_prefix: Sequence[int] = ()
) -> list[Request]:
    """Greedy requests with random prompt ids of the trace's lengths; ``shared_prefix`` (e.g. a
    system prompt) is put before every prompt."""
    rng = np.random.default_rng(seed)
    return [
        Request([*shared_prefix, *random_prompt(e.prompt_len, vocab_size, rng)], e.output_len, e.arrival, id=i)
        for i, e in enumerate(entries)
    ]
