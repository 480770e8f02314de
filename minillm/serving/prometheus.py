"""``GET /metrics``: the server's figures in Prometheus' text format (prometheus_client).

Latencies are histograms observed in the engine's loop thread, on the engine's clock, for every
request (streamed or not, read to the end or not): time to first token, each inter-token gap, and
end-to-end latency; and, split as vLLM splits them, the time queued (arrival to the first step),
in prefill (first step to first token) and in decode (first to last token), the time per output
token of each request, and its prompt and output lengths. The engine's state is read at scrape
time from the snapshot the loop leaves after each step: requests running and waiting, KV blocks
used and free and the fraction in use, the prefix cache's queried and hit tokens, and counters of
preemptions, steps, prompt and generated tokens, and finished requests by how they ended. The
server counts its HTTP responses by status (``count_response``).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .async_engine import AsyncEngine, RequestStream, TokenDelta

# seconds: from a fast GPU step to a long queue
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
LENGTH_BUCKETS = tuple(2**i for i in range(15))  # tokens: 1 to 16384
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
    "prefix_cache_queries": ("prefix_query_tokens", "Prompt tokens looked up in the prefix cache (at each admission)"),
    "prefix_cache_hits": ("prefix_hit_tokens", "Prompt tokens whose K/V the prefix cache held"),
    "spec_decode_draft_tokens": ("spec_proposed_tokens", "Speculative decoding: tokens proposed and verified"),
    "spec_decode_accepted_tokens": ("spec_accepted_tokens", "Speculative decoding: proposed tokens accepted"),
    "spec_decode_verified_rows": ("spec_verified_rows", "Speculative decoding: decode rows verified"),
}


class EngineCollector(Collector):
    """The engine's state and counters, read from its latest snapshot when Prometheus scrapes."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats
        for name, (key, doc) in GAUGES.items():
            yield GaugeMetricFamily(f"minillm_{name}", doc, value=stats.get(key, 0))
        total = stats.get("kv_blocks_total", 0)
        usage = stats.get("kv_blocks_used", 0) / total if total else 0.0
        yield GaugeMetricFamily(
            "minillm_kv_cache_usage_ratio", "Fraction of the KV-cache blocks in use (0 to 1)", usage
        )
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
        self.queue = self._histogram("request_queue_time_seconds", "Arrival at the engine -> its first step")
        self.prefill = self._histogram("request_prefill_time_seconds", "First step -> first output token")
        self.decode = self._histogram("request_decode_time_seconds", "First output token -> last")
        self.tpot = self._histogram(
            "time_per_output_token_seconds", "A request's decode time over its tokens after the first"
        )
        self.prompt_len = self._histogram(
            "request_prompt_tokens", "Prompt length of each finished request", LENGTH_BUCKETS
        )
        self.output_len = self._histogram(
            "request_generation_tokens", "Output tokens of each finished request", LENGTH_BUCKETS
        )
        self.responses = Counter(
            "minillm_http_responses", "HTTP responses, by status", ["status"], registry=self.registry
        )
        self.registry.register(EngineCollector(engine))
        self._seen: dict[int, list] = {}  # request id -> [queued observed, first token time, latest, tokens]
        engine.observers.append(self.observe)

    def _histogram(self, name: str, doc: str, buckets: tuple = LATENCY_BUCKETS) -> Histogram:
        unit = "" if buckets is LENGTH_BUCKETS else " (s, engine clock)"
        return Histogram(f"minillm_{name}", doc + unit, buckets=buckets, registry=self.registry)

    def count_response(self, status: int) -> None:
        self.responses.labels(str(status)).inc()

    def observe(self, stream: RequestStream, delta: TokenDelta) -> None:
        """Called by the engine's loop with every delta of every request."""
        arrival = stream.request.arrival
        seen = self._seen.pop(stream.id, None) or [False, None, None, 0]
        if not seen[0] and delta.started is not None:
            self.queue.observe(delta.started - arrival)
            seen[0] = True
        for t in delta.times:
            if seen[1] is None:
                self.ttft.observe(t - arrival)
                if delta.started is not None:
                    self.prefill.observe(t - delta.started)
                seen[1] = t
            else:
                self.itl.observe(t - seen[2])
            seen[2], seen[3] = t, seen[3] + 1
        if not delta.finished:
            self._seen[stream.id] = seen
            return
        if seen[2] is not None and delta.finish_reason in ("length", "stop"):
            first, last, n = seen[1], seen[2], seen[3]
            self.e2e.observe(last - arrival)
            self.decode.observe(last - first)
            if n > 1:
                self.tpot.observe((last - first) / (n - 1))
            self.prompt_len.observe(len(stream.request.prompt))
            self.output_len.observe(n)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
