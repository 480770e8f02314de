"""The engine, served: many callers add requests and read their tokens as they are sampled.

    async_engine = AsyncEngine(Engine(model, EngineConfig(num_blocks=256)))
    async_engine.start()                       # the step loop runs in a thread of its own
    stream = async_engine.add_request(Request(prompt_ids, max_tokens=32))
    async for delta in stream:                 # TokenDelta: new ids, when each came out, how it ended
        ...
    async_engine.abort(stream.id)              # from anywhere: its KV blocks are freed at once
    async_engine.shutdown()                    # aborts what is left, stops the loop

The ``Engine`` stays synchronous and untouched by other threads: callers hand their requests and
aborts to the loop thread through a queue, and the loop publishes each step's new tokens into
one stream per request (an ``asyncio.Queue`` fed thread-safely when the caller runs an event
loop, a plain queue otherwise). The engine's clock is the wall clock here: before each step it
is set to the seconds since the loop started, and a request's ``arrival`` is stamped when it is
added, so its metrics (TTFT, ITL) count the wait for the loop as well as queueing and compute.

Nothing a caller sends can stop the loop: a request the engine could never serve is refused in
``add_request`` (ValueError), one that fails while served ends alone with ``finish_reason``
"error", and if a step itself raises, the requests in flight end with the error and the loop
goes on with the next ones. Nor does a caller ever wait for nothing: if anything else in a pass
of the loop fails (a bug), the requests in flight end with "error" and the loop goes on; if the
loop ends, for any reason, every request still open ends; and once it has ended, ``add_request``
refuses (RuntimeError), also when shutdown comes while the request is being added.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from .engine import Engine, RequestOutput
from .logits import TokenLogprob
from .workload import Request

STEP_LOG_KEPT = 4096  # steps of Engine.step_log a long-running server keeps (it would grow forever)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenDelta:
    """What one step added to a request: new token ids, each one's time (s, engine clock), and on
    the last delta how the request ended ("length", "stop", "abort" or "error")."""

    tokens: tuple[int, ...] = ()
    times: tuple[float, ...] = ()
    finish_reason: str | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when the request asked for them
    started: float | None = None  # when the request first ran (engine clock), on every delta once known

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class RequestStream:
    """One request's deltas, in order, for the caller that added it (iterate it once)."""

    request: Request
    loop: asyncio.AbstractEventLoop | None  # the caller's event loop; None: a plain blocking queue
    timeout: float | None = None  # seconds an iteration waits for the next delta at most (None: no bound)
    sent: int = 0  # tokens published so far (the loop thread's count)
    _queue: asyncio.Queue | queue.SimpleQueue = field(init=False)

    def __post_init__(self) -> None:
        self._queue = asyncio.Queue() if self.loop is not None else queue.SimpleQueue()

    @property
    def id(self) -> int:
        return self.request.id

    def publish(self, delta: TokenDelta) -> None:
        """Called by the loop thread."""
        if self.loop is None:
            self._queue.put(delta)
            return
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is reading any more
            self.loop.call_soon_threadsafe(self._queue.put_nowait, delta)

    async def __aiter__(self) -> AsyncIterator[TokenDelta]:
        if self.loop is None:
            raise TypeError("this stream was added outside an event loop: iterate it with a plain for loop")
        while True:
            try:
                delta = await asyncio.wait_for(self._queue.get(), self.timeout)
            except TimeoutError:
                raise TimeoutError(f"request {self.id}: no token within {self.timeout} s") from None
            yield delta
            if delta.finished:
                return

    def __iter__(self) -> Iterator[TokenDelta]:
        if self.loop is not None:
            raise TypeError("this stream was added inside an event loop: iterate it with async for")
        while True:
            try:
                delta = self._queue.get(timeout=self.timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.id}: no token within {self.timeout} s") from None
            yield delta
            if delta.finished:
                return


Observer = Callable[[RequestStream, TokenDelta], None]


class AsyncEngine:
    """Runs ``engine``'s step loop in a background thread for many concurrent callers."""

    def __init__(self, engine: Engine, idle_wait: float = 0.5, stream_timeout: float | None = None):
        if engine.config.scheduler.policy != "continuous":
            raise ValueError(
                "the async engine admits requests as they arrive: it needs the continuous policy, "
                f"got {engine.config.scheduler.policy!r}"
            )
        if engine.unfinished:
            raise ValueError("the engine has requests in flight: wrap an idle engine")
        self.engine = engine
        self.idle_wait = idle_wait  # seconds the idle loop sleeps between checks (a new request wakes it)
        self.stream_timeout = stream_timeout  # for iterating streams (RequestStream.timeout)
        engine.step_log = collections.deque(engine.step_log, maxlen=STEP_LOG_KEPT)
        self._commands: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # a request is sent, or the loop closes: never both at once
        self._closed = False  # the loop has ended (set under the lock): nothing is taken any more
        self._streams: dict[int, RequestStream] = {}  # live requests, the loop thread's own
        self._ids = itertools.count(1 + max(engine.outputs, default=-1))
        self._t0 = 0.0
        self.observers: list[Observer] = []  # called in the loop thread with every delta (metrics)
        self.counters = collections.Counter()  # tokens generated, prompt tokens, requests by how they ended
        self.stats = self._snapshot()

    # -- the callers' side (any thread) ---------------------------------------------------------

    @property
    def running(self) -> bool:
        alive = self._thread is not None and self._thread.is_alive()
        return alive and not self._stopping.is_set() and not self._closed

    def clock(self) -> float:
        """Seconds on the engine's clock: since the loop started (plus what the engine had run before)."""
        return time.perf_counter() - self._t0

    def start(self) -> AsyncEngine:
        if self._thread is not None:
            raise RuntimeError("the async engine was already started")
        self._t0 = time.perf_counter() - self.engine.now
        self._thread = threading.Thread(target=self._loop, name="minillm-engine", daemon=True)
        self._thread.start()
        return self

    def add_request(self, request: Request) -> RequestStream:
        """Queue ``request`` (numbered here, arriving now); raises ValueError (RequestTooLargeError)
        for a request the engine could never serve, RuntimeError once shutting down."""
        if not self.running:
            raise RuntimeError("the engine is not running (not started, or shutting down)")
        request.id = next(self._ids)
        self.engine.check(request)
        request.arrival = self.clock()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        stream = RequestStream(request, loop, self.stream_timeout)
        with self._lock:  # the loop's last drain either takes this request, or comes before it and refuses it
            if self._closed:
                raise RuntimeError("the engine is not running (it shut down while this request was added)")
            self._send("add", stream)
        return stream

    def abort(self, request_id: int, reason: str = "abort") -> None:
        """End a request wherever it is; its blocks return to the pool before the next step. Its
        stream gets a last delta with finish_reason ``reason`` (a finished request is left alone):
        "abort", or "stop" when the caller found a stop of its own (a stop string), which counts
        as a normal ending."""
        if reason not in ("abort", "stop"):
            raise ValueError(f"reason must be 'abort' or 'stop', got {reason!r}")
        self._send("abort", (request_id, reason))

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Abort every request in flight and stop the loop; True when it stopped within ``timeout`` s."""
        self._stopping.set()
        self._wake.set()
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _send(self, command: str, arg: object) -> None:
        self._commands.put((command, arg))
        self._wake.set()

    # -- the loop thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                self._wake.clear()
                try:
                    self._step_once()
                except Exception as e:  # a bug outside the step: end what is in flight, keep serving
                    log.exception("the engine loop failed; the requests in flight end with an error")
                    self._end_all("error", f"the engine loop failed: {describe(e)}")
                    self._wake.wait(self.idle_wait)  # no busy loop if it fails again at once
        finally:  # shut down, or died: either way no caller is left waiting
            died = not self._stopping.is_set()
            self._close("error" if died else "abort", "the engine loop stopped" if died else None)

    def _step_once(self) -> None:
        self._take_commands()
        if not self.engine.unfinished:
            self._wake.wait(self.idle_wait)
            return
        self.engine.now = max(self.engine.now, self.clock())
        try:
            finished = self.engine.step()
        except Exception as e:  # the step itself failed: end what is in flight, keep serving
            self._end_all("error", describe(e))
            return
        self._publish(finished)

    def _close(self, reason: str, error: str | None) -> None:
        """The loop's last act: from here on ``add_request`` refuses; the requests still queued and
        those in flight end with ``reason``."""
        with self._lock:
            self._closed = True
            commands = self._drain()
        for command, arg in commands:
            if command == "add":
                self._streams[arg.id] = arg
        self._end_all(reason, error)

    def _drain(self) -> list[tuple[str, object]]:
        commands = []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _take_commands(self) -> None:
        """Add and abort what the callers sent. A request aborted before it was added never is; any
        other is in the scheduler by now (each step admits every request that has arrived)."""
        commands = self._drain()
        if not commands:
            return
        added = [arg for command, arg in commands if command == "add"]
        aborted: dict[int, str] = {}
        for command, arg in commands:
            if command == "abort":
                aborted.setdefault(*arg)  # (request id, reason): the first abort of a request says why
        for stream in added:
            self._streams[stream.id] = stream  # first: whatever fails from here on, its caller hears of it
        ended = []
        for stream in added:
            if stream.id not in aborted:
                ended += self._add(stream)
        for request_id, reason in aborted.items():
            ended += self._abort(request_id, reason)
        self._deliver(ended)

    def _add(self, stream: RequestStream) -> list[tuple[RequestStream, TokenDelta]]:
        try:
            self.engine.add_request(stream.request)
        except Exception as e:  # checked in add_request already; a change since then ends it here
            return [(stream, TokenDelta(finish_reason="error", error=describe(e)))]
        self.counters["prompt_tokens"] += len(stream.request.prompt)
        return []

    def _abort(self, request_id: int, reason: str = "abort") -> list[tuple[RequestStream, TokenDelta]]:
        """Drop a live request from the engine (its blocks freed); the delta that tells its caller."""
        stream = self._streams.get(request_id)
        if stream is None:
            return []  # finished already, or never added
        self.engine.abort(request_id)
        return [(stream, TokenDelta(finish_reason=reason))]

    def _end_all(self, reason: str, error: str | None = None) -> None:
        """End every live request with ``reason``, in the engine as far as it still can, and tell
        its caller; if even telling fails (counting, a snapshot), each stream still gets its end."""
        ended = [(stream, TokenDelta(finish_reason=reason, error=error)) for stream in self._streams.values()]
        for stream, _ in ended:
            with contextlib.suppress(Exception):  # an engine in a bad state frees what it can
                self.engine.abort(stream.id)
        try:
            self._deliver(ended)
        except Exception:
            log.exception("delivering the last deltas failed; published without counting")
            for stream, delta in ended:
                stream.publish(delta)
        self._streams.clear()

    def _publish(self, finished: list[RequestOutput]) -> None:
        """Each running request's new tokens, then the finished ones' last tokens and how they ended."""
        deltas = []
        for seq in self.engine.scheduler.running:
            stream = self._streams.get(seq.id)
            if stream is not None and len(seq.outputs) > stream.sent:
                logprobs = self.engine.logprobs_so_far(seq.id)
                delta = self._delta(stream, seq.outputs, seq.token_times, logprobs=logprobs, started=seq.started)
                deltas.append((stream, delta))
        for out in finished:
            stream = self._streams.get(out.request.id)
            self.engine.outputs.pop(out.request.id, None)  # a server's engine keeps no history
            if stream is not None:
                times, logprobs = out.metrics.token_times, out.logprobs or ()
                delta = self._delta(stream, out.tokens, times, out.finish_reason, out.error, logprobs, out.started)
                deltas.append((stream, delta))
        self._deliver(deltas)

    @staticmethod
    def _delta(stream: RequestStream, tokens, times, reason=None, error=None, logprobs=(), started=None) -> TokenDelta:
        n = stream.sent
        return TokenDelta(tuple(tokens[n:]), tuple(times[n:]), reason, error, tuple(logprobs[n:]), started)

    def _deliver(self, deltas: list[tuple[RequestStream, TokenDelta]]) -> None:
        """Count, snapshot the engine, then publish: a caller who sees its request end sees its
        blocks freed in ``stats`` too. A request leaves the live ones only here, once its caller
        has its last delta."""
        for stream, delta in deltas:
            stream.sent += len(delta.tokens)
            self.counters["generated_tokens"] += len(delta.tokens)
            if delta.finished:
                self.counters[f"finished_{delta.finish_reason}"] += 1
        self.stats = self._snapshot()
        for stream, delta in deltas:
            for observe in self.observers:
                with contextlib.suppress(Exception):  # a broken observer must not stop the engine
                    observe(stream, delta)
            stream.publish(delta)
            if delta.finished:
                self._streams.pop(stream.id, None)

    def _snapshot(self) -> dict[str, int]:
        """The engine's state after a step, for /metrics (read by other threads, replaced whole)."""
        e, s, allocator = self.engine, self.engine.scheduler, self.engine.blocks.allocator
        return {
            "running": len(s.running),
            "waiting": len(s.waiting),
            "kv_blocks_used": allocator.num_used,
            "kv_blocks_free": allocator.num_available,
            "kv_blocks_total": allocator.num_blocks,
            "prefix_query_tokens": s.prefix_query_tokens,
            "prefix_hit_tokens": s.prefix_hit_tokens,
            "preemptions": s.preemptions,
            "steps": e.steps,
            **e.speculation_counters(),
            **self.counters,
        }


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
