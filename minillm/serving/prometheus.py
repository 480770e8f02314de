"""``GET /metrics``: the server's figures in Prometheus' text format (prometheus_client).

Latencies are histograms observed in the engine's loop thread, on the engine's clock, for every
request (streamed or not, read to the end or not): time to first token, each inter-token gap, and
end-to-end latency. The engine's state is read at scrape time from the snapshot the loop leaves
after each step: requests running and waiting, KV blocks used and free, and counters of
preemptions, steps, prompt and generated tokens, and finished requests by how they ended.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .async_engine import AsyncEngine, RequestStream, TokenDelta

# seconds: from a fast GPU step to a long queue
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
# metric name: (key of AsyncEngine.stats, help text)
GAUGES = {
    "requests_running": ("running", "Requests in the running batch"),
    "requests_waiting": ("waiting", "Requests admitted to the scheduler but not running (queued or preempted)"),
    "kv_blocks_used": ("kv_blocks_used", "KV-cache blocks referenced by requests"),
    "kv_blocks_free": ("kv_blocks_free", "KV-cache blocks free (or cached but evictable)"),
}
COUNTERS = {
    "preemptions": ("preemptions", "Requests preempted (their KV dropped, recomputed later)"),
    "engine_steps": ("steps", "Engine steps run"),
    "prompt_tokens": ("prompt_tokens", "Prompt tokens of the requests added"),
    "generation_tokens": ("generated_tokens", "Output tokens generated"),
}


class EngineCollector(Collector):
    """The engine's state and counters, read from its latest snapshot when Prometheus scrapes."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats
        for name, (key, doc) in GAUGES.items():
            yield GaugeMetricFamily(f"minillm_{name}", doc, value=stats.get(key, 0))
        for name, (key, doc) in COUNTERS.items():
            yield CounterMetricFamily(f"minillm_{name}", doc, value=stats.get(key, 0))
        finished = CounterMetricFamily("minillm_requests_finished", "Requests finished, by reason", labels=["reason"])
        for key, value in stats.items():
            if key.startswith("finished_"):
                finished.add_metric([key.removeprefix("finished_")], value)
        yield finished


class ServerMetrics:
    """The registry behind /metrics (one per server, so that several can live in one process)."""

    def __init__(self, engine: AsyncEngine):
        self.registry = CollectorRegistry()
        self.ttft = self._histogram("time_to_first_token_seconds", "Arrival at the engine -> first output token")
        self.itl = self._histogram("inter_token_latency_seconds", "Gap between consecutive output tokens")
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival at the engine -> last output token")
        self.registry.register(EngineCollector(engine))
        self._last: dict[int, float] = {}  # request id -> its latest token's time
        engine.observers.append(self.observe)

    def _histogram(self, name: str, doc: str) -> Histogram:
        return Histogram(f"minillm_{name}", f"{doc} (s, engine clock)", buckets=LATENCY_BUCKETS, registry=self.registry)

    def observe(self, stream: RequestStream, delta: TokenDelta) -> None:
        """Called by the engine's loop with every delta of every request."""
        previous = self._last.pop(stream.id, None)
        for t in delta.times:
            if previous is None:
                self.ttft.observe(t - stream.request.arrival)
            else:
                self.itl.observe(t - previous)
            previous = t
        if delta.finished:
            if previous is not None and delta.finish_reason in ("length", "stop"):
                self.e2e.observe(previous - stream.request.arrival)
        elif previous is not None:
            self._last[stream.id] = previous

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
