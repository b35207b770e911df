"""Server metrics in the Prometheus text exposition format (version 0.0.4), without a client
library: request counters by endpoint and status, latency histograms, engine gauges."""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PREFIX = "llmopt"


class Histogram:
    """Cumulative buckets, sum and count, as Prometheus expects them."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip([*map(_num, self.buckets), "+Inf"], self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        out += [f"{name}_sum {_num(self.sum)}", f"{name}_count {self.count}"]
        return out


class ServerMetrics:
    """Counters and histograms updated by request handlers; engine gauges read at scrape time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = defaultdict(int)  # (endpoint, status) -> count
        self.finish_reasons: dict[str, int] = defaultdict(int)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram()
        self.tpot = Histogram()
        self.e2e = Histogram()

    def count_request(self, endpoint: str, status: int | str) -> None:
        with self._lock:
            self.requests[(endpoint, str(status))] += 1

    def record_finished(self, finish_reason: str, prompt_tokens: int, output_tokens: int,
                        ttft: float | None, tpot: float | None, e2e: float | None) -> None:
        with self._lock:
            self.finish_reasons[finish_reason] += 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += output_tokens
            for hist, value in ((self.ttft, ttft), (self.tpot, tpot), (self.e2e, e2e)):
                if value is not None:
                    hist.observe(value)

    def render(self, engine: dict, in_flight: int) -> str:
        """The exposition text; ``engine`` is the engine loop's latest snapshot."""
        p = PREFIX
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str, samples: list[str]) -> None:
            lines.extend([f"# HELP {p}_{name} {help_text}", f"# TYPE {p}_{name} {kind}", *samples])

        with self._lock:
            family("requests_total", "counter", "HTTP requests by endpoint and status code.",
                   [f'{p}_requests_total{{endpoint="{e}",status="{s}"}} {n}' for (e, s), n in sorted(self.requests.items())])
            family("request_finished_total", "counter", "Generated sequences by finish reason.",
                   [f'{p}_request_finished_total{{finish_reason="{r}"}} {n}' for r, n in sorted(self.finish_reasons.items())])
            family("prompt_tokens_total", "counter", "Prompt tokens of finished sequences.", [f"{p}_prompt_tokens_total {self.prompt_tokens}"])
            family("generation_tokens_total", "counter", "Generated tokens of finished sequences.",
                   [f"{p}_generation_tokens_total {self.generation_tokens}"])
            for name, hist, text in (("time_to_first_token_seconds", self.ttft, "Time to first token (engine arrival to first token)."),
                                     ("time_per_output_token_seconds", self.tpot, "Mean time per output token after the first."),
                                     ("e2e_request_latency_seconds", self.e2e, "Engine arrival to the last token.")):
                family(name, "histogram", text, hist.lines(f"{p}_{name}"))
        gauges = [
            ("requests_in_flight", in_flight, "Sequences admitted by the server and not finished."),
            ("num_requests_running", engine.get("running", 0), "Sequences in the engine's running batch."),
            ("num_requests_waiting", engine.get("waiting", 0), "Sequences queued in the engine."),
            ("kv_blocks_used", engine.get("kv_blocks_used", 0), "KV cache blocks held by sequences."),
            ("kv_blocks_total", engine.get("kv_blocks_total", 0), "KV cache blocks allocated."),
            ("kv_cache_usage_ratio", engine.get("kv_usage", 0.0), "Fraction of KV blocks in use."),
            ("prefix_cache_hit_rate", engine.get("prefix_cache_hit_rate", 0.0), "Prompt tokens found in the prefix cache / prompt tokens scheduled."),
            ("preemptions_total", engine.get("preemptions", 0), "Sequences preempted (recomputed) for lack of KV blocks."),
        ]
        if "spec_acceptance_rate" in engine:  # only when the engine decodes speculatively
            gauges.append(("spec_decode_acceptance_rate", engine["spec_acceptance_rate"], "Accepted / proposed draft tokens."))
        for name, value, text in gauges:
            kind = "counter" if name.endswith("_total") else "gauge"
            family(name, kind, text, [f"{p}_{name} {_num(value)}"])
        return "\n".join(lines) + "\n"


def _num(value: float | int) -> str:
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


def parse(text: str) -> dict[str, float]:
    """``{"name{labels}": value}`` of an exposition text (for tests and the load benchmark)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values
