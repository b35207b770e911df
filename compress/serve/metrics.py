"""Server metrics for Prometheus (``prometheus_client``, one private registry per server), with
vLLM's names and meanings and a ``model_name`` label: request counters and latency / size
histograms updated as requests finish; engine gauges and cumulative engine counters (preemptions,
prefix cache, speculative decoding) read from the engine loop's snapshot at scrape time. llmopt's
own series are ``llmopt:http_requests_total`` (endpoint, status), ``llmopt:requests_in_flight`` and
``llmopt:kv_blocks_used``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

CONTENT_TYPE = getattr(prometheus_client, "CONTENT_TYPE_PLAIN_0_0_4", prometheus_client.CONTENT_TYPE_LATEST)
# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                         40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_COUNT_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))  # 1, 2, 5, 10, … 5,000,000

# engine snapshot key -> (vLLM counter name without _total, help); read at scrape time
ENGINE_COUNTERS = (
    ("preemptions", "vllm:num_preemptions", "Cumulative number of preemptions (sequences recomputed for lack of KV blocks)."),
    ("prefix_cache_queried_tokens", "vllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens."),
    ("prefix_cache_hit_tokens", "vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens."),
)
SPEC_COUNTERS = (
    ("spec_num_drafts", "vllm:spec_decode_num_drafts", "Speculative decoding: drafts verified (sequence-steps with proposals)."),
    ("spec_proposed_tokens", "vllm:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens proposed."),
    ("spec_accepted_tokens", "vllm:spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted."),
)


class _EngineCollector:
    """Gauges and cumulative counters of the engine, from the engine loop's latest snapshot."""

    def __init__(self, model_name: str, snapshot: Callable[[], dict], in_flight: Callable[[], int]) -> None:
        self.model_name, self.snapshot, self.in_flight = model_name, snapshot, in_flight

    def describe(self) -> list[Metric]:
        return list(self._families({}, 0, spec=True))

    def collect(self) -> Iterator[Metric]:
        engine = self.snapshot() or {}
        return self._families(engine, self.in_flight(), spec="spec_proposed_tokens" in engine)

    def _families(self, engine: dict, in_flight: int, spec: bool) -> Iterator[Metric]:
        label = [self.model_name]
        gauges = (("vllm:num_requests_running", engine.get("running", 0), "Requests in the engine's running batch."),
                  ("vllm:num_requests_waiting", engine.get("waiting", 0), "Requests waiting to be scheduled by the engine."),
                  ("vllm:kv_cache_usage_perc", engine.get("kv_usage", 0), "KV cache usage (fraction of blocks in use, 0 to 1)."),
                  ("llmopt:requests_in_flight", in_flight, "Sequences admitted by the server and not finished."),
                  ("llmopt:kv_blocks_used", engine.get("kv_blocks_used", 0), "KV cache blocks held by sequences."))
        for name, value, text in gauges:
            family = GaugeMetricFamily(name, text, labels=["model_name"])
            family.add_metric(label, float(value))
            yield family
        for key, name, text in ENGINE_COUNTERS + (SPEC_COUNTERS if spec else ()):
            family = CounterMetricFamily(name, text, labels=["model_name"])
            family.add_metric(label, float(engine.get(key, 0)))
            yield family


class ServerMetrics:
    """The metrics of one server: ``count_request`` per HTTP response, ``record_finished`` per
    sequence the engine finished (or the server gave up on), ``render`` at scrape time."""

    def __init__(self, model_name: str = "", snapshot: Callable[[], dict] = dict,
                 in_flight: Callable[[], int] = lambda: 0) -> None:
        prometheus_client.disable_created_metrics()  # as vLLM: no *_created series
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def counter(name: str, text: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, text, labels + list(extra), registry=self.registry)

        def histogram(name: str, text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, text, labels, buckets=buckets, registry=self.registry)

        self.http_requests = Counter("llmopt:http_requests", "HTTP requests by endpoint and status code.",
                                     ["endpoint", "status"], registry=self.registry)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens of finished requests.")
        self.success = counter("vllm:request_success", "Finished requests by finish reason.", ("finished_reason",))
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token (engine arrival to first token).",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Time between output tokens (each request's gaps counted at its mean).", TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Engine arrival to the last token.", REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Engine arrival to first scheduled (time waiting).",
                               REQUEST_LATENCY_BUCKETS)
        self.prompt_hist = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", TOKEN_COUNT_BUCKETS)
        self.generation_hist = histogram("vllm:request_generation_tokens", "Generated tokens per request.", TOKEN_COUNT_BUCKETS)
        self.registry.register(_EngineCollector(model_name, snapshot, in_flight))

    def count_request(self, endpoint: str, status: int | str) -> None:
        self.http_requests.labels(endpoint, str(status)).inc()

    def record_finished(self, finish_reason: str, prompt_tokens: int, output_tokens: int, timings=None) -> None:
        """One finished sequence; ``timings``: its ``RequestMetrics`` (None when it never ran)."""
        name = self.model_name
        self.success.labels(name, finish_reason).inc()
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(output_tokens)
        self.prompt_hist.labels(name).observe(prompt_tokens)
        self.generation_hist.labels(name).observe(output_tokens)
        if timings is None:
            return
        for hist, value in ((self.ttft, timings.ttft), (self.e2e, timings.e2e), (self.tpot, timings.tpot),
                            (self.queue, getattr(timings, "queue_time", None))):
            if value is not None:
                hist.labels(name).observe(value)
        if timings.tpot is not None:
            itl = self.itl.labels(name)
            for _ in range(max(output_tokens - 1, 0)):
                itl.observe(timings.tpot)

    def render(self) -> bytes:
        """The exposition text (Prometheus text format 0.0.4)."""
        return generate_latest(self.registry)


Sample = tuple[str, dict[str, str], float]


def parse(text: str) -> list[Sample]:
    """``[(sample name, labels, value), …]`` of an exposition text (for tests and the load benchmark)."""
    return [(s.name, dict(s.labels), s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def total(samples: list[Sample], name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels`` (0 when none)."""
    return sum(value for n, have, value in samples if n == name and all(have.get(k) == v for k, v in labels.items()))
