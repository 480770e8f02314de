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
goes on with the next ones.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from .engine import Engine, RequestOutput
from .workload import Request

STEP_LOG_KEPT = 4096  # steps of Engine.step_log a long-running server keeps (it would grow forever)


@dataclass(frozen=True)
class TokenDelta:
    """What one step added to a request: new token ids, each one's time (s, engine clock), and on
    the last delta how the request ended ("length", "stop", "abort" or "error")."""

    tokens: tuple[int, ...] = ()
    times: tuple[float, ...] = ()
    finish_reason: str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class RequestStream:
    """One request's deltas, in order, for the caller that added it (iterate it once)."""

    request: Request
    loop: asyncio.AbstractEventLoop | None  # the caller's event loop; None: a plain blocking queue
    timeout: float | None = None  # seconds a blocking iteration waits for the next delta at most
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
            delta = await self._queue.get()
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
        self.stream_timeout = stream_timeout  # for blocking iteration of streams
        engine.step_log = collections.deque(engine.step_log, maxlen=STEP_LOG_KEPT)
        self._commands: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._streams: dict[int, RequestStream] = {}  # live requests, the loop thread's own
        self._ids = itertools.count(1 + max(engine.outputs, default=-1))
        self._t0 = 0.0
        self.observers: list[Observer] = []  # called in the loop thread with every delta (metrics)
        self.counters = collections.Counter()  # tokens generated, prompt tokens, requests by how they ended
        self.stats = self._snapshot()

    # -- the callers' side (any thread) ---------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

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
        self._send("add", stream)
        return stream

    def abort(self, request_id: int) -> None:
        """End a request wherever it is; its blocks return to the pool before the next step. Its
        stream gets a last delta with finish_reason "abort" (a finished request is left alone)."""
        self._send("abort", request_id)

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
        while not self._stopping.is_set():
            self._wake.clear()
            self._take_commands()
            if not self.engine.unfinished:
                self._wake.wait(self.idle_wait)
                continue
            self.engine.now = max(self.engine.now, self.clock())
            try:
                finished = self.engine.step()
            except Exception as e:  # the step itself failed: end what is in flight, keep serving
                self._end_all("error", f"{type(e).__name__}: {e}")
                continue
            self._publish(finished)
        self._take_commands()
        self._end_all("abort", "the server is shutting down")

    def _take_commands(self) -> None:
        """Add and abort what the callers sent. A request aborted before it was added never is; any
        other is in the scheduler by now (each step admits every request that has arrived)."""
        commands = []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        aborted = {arg for command, arg in commands if command == "abort"}
        ended = []
        for command, arg in commands:
            if command == "add" and arg.id in aborted:
                ended.append((arg, TokenDelta(finish_reason="abort")))
            elif command == "add":
                ended += self._add(arg)
            else:
                ended += self._abort(arg)
        if commands:
            self._deliver(ended)

    def _add(self, stream: RequestStream) -> list[tuple[RequestStream, TokenDelta]]:
        try:
            self.engine.add_request(stream.request)
        except Exception as e:  # checked in add_request already; a change since then ends it here
            return [(stream, TokenDelta(finish_reason="error", error=f"{type(e).__name__}: {e}"))]
        self._streams[stream.id] = stream
        self.counters["prompt_tokens"] += len(stream.request.prompt)
        return []

    def _abort(self, request_id: int, reason: str = "abort", error: str | None = None):
        """Drop a live request from the scheduler (its blocks freed); the delta that tells its caller."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return []  # finished already, or never added
        self.engine.abort(request_id)
        return [(stream, TokenDelta(finish_reason=reason, error=error))]

    def _end_all(self, reason: str, error: str) -> None:
        error = error if reason == "error" else None
        self._deliver([pair for request_id in list(self._streams) for pair in self._abort(request_id, reason, error)])

    def _publish(self, finished: list[RequestOutput]) -> None:
        """Each running request's new tokens, then the finished ones' last tokens and how they ended."""
        deltas = []
        for seq in self.engine.scheduler.running:
            stream = self._streams.get(seq.id)
            if stream is not None and len(seq.outputs) > stream.sent:
                deltas.append((stream, self._delta(stream, seq.outputs, seq.token_times)))
        for out in finished:
            stream = self._streams.pop(out.request.id, None)
            self.engine.outputs.pop(out.request.id, None)  # a server's engine keeps no history
            if stream is not None:
                deltas.append(
                    (stream, self._delta(stream, out.tokens, out.metrics.token_times, out.finish_reason, out.error))
                )
        self._deliver(deltas)

    @staticmethod
    def _delta(stream: RequestStream, tokens, times, reason: str | None = None, error: str | None = None):
        return TokenDelta(tuple(tokens[stream.sent :]), tuple(times[stream.sent :]), reason, error)

    def _deliver(self, deltas: list[tuple[RequestStream, TokenDelta]]) -> None:
        """Count, snapshot the engine, then publish: a caller who sees its request end sees its
        blocks freed in ``stats`` too."""
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

    def _snapshot(self) -> dict[str, int]:
        """The engine's state after a step, for /metrics (read by other threads, replaced whole)."""
        e, s, allocator = self.engine, self.engine.scheduler, self.engine.blocks.allocator
        return {
            "running": len(s.running),
            "waiting": len(s.waiting),
            "kv_blocks_used": allocator.num_used,
            "kv_blocks_free": allocator.num_available,
            "kv_blocks_total": allocator.num_blocks,
            "preemptions": s.preemptions,
            "steps": e.steps,
            **self.counters,
        }
