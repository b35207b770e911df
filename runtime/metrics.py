"""Latency per request (TTFT, TPOT, end-to-end) and figures per run (throughput, KV usage,
prefix-cache hit rate, preemptions)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class RequestMetrics:
    """Seconds. ``tpot`` is the mean time per output token after the first (None with one token);
    ``queue_time`` is arrival to first scheduled (None if never scheduled)."""

    ttft: float | None
    tpot: float | None
    e2e: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    queue_time: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def request_metrics(seq) -> RequestMetrics:
    t = seq.times
    ttft = None if t.first_token is None else t.first_token - t.arrival
    e2e = None if t.finished is None else t.finished - t.arrival
    tpot = None
    if t.first_token is not None and t.finished is not None and seq.num_output_tokens > 1:
        tpot = (t.finished - t.first_token) / (seq.num_output_tokens - 1)
    queue = None if t.first_scheduled is None else t.first_scheduled - t.arrival
    return RequestMetrics(ttft, tpot, e2e, seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens, queue)


class RunStats:
    """Counters of one engine since creation (or the last ``reset``)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.started = time.perf_counter()
        self.steps = 0
        self.computed_tokens = 0  # every token run through the model (prompts, chunks, recomputation)
        self.generated_tokens = 0
        self.finished_requests = 0
        self.busy_seconds = 0.0

    def snapshot(self, scheduler, block_manager, bytes_per_block: int) -> dict:
        """A plain dict of the run so far."""
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        queried = scheduler.prefix_queried_tokens
        return {
            "elapsed_s": elapsed,
            "busy_s": self.busy_seconds,
            "steps": self.steps,
            "finished_requests": self.finished_requests,
            "computed_tokens": self.computed_tokens,
            "generated_tokens": self.generated_tokens,
            "generation_tok_s": self.generated_tokens / elapsed,
            "computed_tok_s": self.computed_tokens / elapsed,
            "preemptions": scheduler.num_preemptions,
            "prefix_cache_hit_rate": scheduler.prefix_hit_tokens / queried if queried else 0.0,
            "prefix_cache_hit_tokens": scheduler.prefix_hit_tokens,
            "prefix_cache_queried_tokens": queried,
            "kv_blocks_total": block_manager.num_blocks,
            "kv_blocks_used": block_manager.num_used_blocks,
            "kv_blocks_peak": block_manager.peak_used,
            "kv_usage": block_manager.num_used_blocks / block_manager.num_blocks,
            "kv_peak_usage": block_manager.peak_used / block_manager.num_blocks,
            "kv_bytes_allocated": block_manager.num_blocks * bytes_per_block,
            "kv_bytes_peak_in_use": block_manager.peak_used * bytes_per_block,
        }


def percentiles(values: list[float], qs=(50, 99)) -> dict[str, float | None]:
    """``{"p50": …, "p99": …}`` of ``values`` (None when empty)."""
    clean = [v for v in values if v is not None]
    return {f"p{q}": (float(np.percentile(clean, q)) if clean else None) for q in qs}
