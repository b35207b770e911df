"""Speed measurements of the engine: single stream (llama-bench style) and a serving workload."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from .engine import LLMEngine
from .metrics import percentiles
from .sampling_params import SamplingParams


@dataclass
class WorkItem:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival: float  # seconds after the start


def make_workload(num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab_size: int,
                  seed: int = 0, rate: float | None = None, token_range: tuple[int, int] | None = None) -> list[WorkItem]:
    """Seeded random prompts (token ids) and output lengths; Poisson arrivals at ``rate``
    requests/s, or all at time 0 when ``rate`` is None."""
    rng = random.Random(seed)
    low, high = token_range or (min(100, vocab_size - 1), vocab_size - 1)
    items, t = [], 0.0
    for _ in range(num_requests):
        n = rng.randint(*prompt_range)
        prompt = [rng.randint(low, high) for _ in range(n)]
        items.append(WorkItem(prompt, rng.randint(*output_range), t))
        if rate:
            t += rng.expovariate(rate)
    return items


def _random_prompt(engine: LLMEngine, n: int, rng: random.Random) -> list[int]:
    vocab = engine.arch.vocab_size
    return [rng.randint(min(100, vocab - 1), vocab - 1) for _ in range(n)]


def _run_one(engine: LLMEngine, prompt: list[int], max_tokens: int) -> float:
    """Seconds from adding the request to its end."""
    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def time_prompt(engine: LLMEngine, pp: int, rng: random.Random) -> float:
    """Seconds to process a fresh random ``pp``-token prompt (and emit one token)."""
    return _run_one(engine, _random_prompt(engine, pp, rng), 1)


def time_generation(engine: LLMEngine, tg: int, rng: random.Random) -> float:
    """Seconds to generate ``tg`` tokens from a one-token prompt."""
    return _run_one(engine, _random_prompt(engine, 1, rng), tg)


def single_stream(engine: LLMEngine, pp: int = 512, tg: int = 128, repetitions: int = 5, seed: int = 0,
                  advance: Callable[[int], None] | None = None) -> dict:
    """Prompt processing of ``pp`` tokens (one token generated) and generation of ``tg`` tokens
    from a one-token prompt, one request at a time; the median of ``repetitions`` after a warm-up.
    Every prompt is fresh random tokens, so the prefix cache never helps."""
    rng = random.Random(seed)
    _run_one(engine, _random_prompt(engine, min(pp, 32), rng), 4)  # warm-up
    pp_s, tg_s = [], []
    for _ in range(repetitions):
        pp_s.append(time_prompt(engine, pp, rng))
        tg_s.append(time_generation(engine, tg, rng))
        if advance:
            advance(1)
    return {
        f"pp{pp}_tok_s": pp / statistics.median(pp_s),
        f"tg{tg}_tok_s": tg / statistics.median(tg_s),
        "pp_seconds": pp_s,
        "tg_seconds": tg_s,
        "repetitions": repetitions,
    }


def serving(engine: LLMEngine, workload: list[WorkItem], advance: Callable[[int], None] | None = None) -> dict:
    """Run ``workload`` through the engine, adding each request at its arrival time."""
    pending = sorted(workload, key=lambda w: w.arrival)
    engine.reset_metrics()
    start = time.perf_counter()
    finished = []
    i = 0
    while i < len(pending) or engine.has_unfinished():
        now = time.perf_counter() - start
        while i < len(pending) and pending[i].arrival <= now:
            w = pending[i]
            engine.add_request(w.prompt_token_ids, SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True),
                                     arrival_time=start + w.arrival)
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[i].arrival - (time.perf_counter() - start)))
            continue
        for out in engine.step():
            if out.finished:
                finished.append(out)
                if advance:
                    advance(1)
    duration = time.perf_counter() - start
    out_tokens = sum(len(o.token_ids) for o in finished)
    in_tokens = sum(len(o.prompt_token_ids) for o in finished)
    ttft = [o.metrics.ttft for o in finished]
    tpot = [o.metrics.tpot for o in finished]
    e2e = [o.metrics.e2e for o in finished]
    run = engine.metrics()
    return {
        "requests": len(finished),
        "duration_s": duration,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / duration,
        "total_tok_s": (out_tokens + in_tokens) / duration,
        "requests_per_s": len(finished) / duration,
        **{f"ttft_{k}_s": v for k, v in percentiles(ttft).items()},
        **{f"tpot_{k}_s": v for k, v in percentiles(tpot).items()},
        **{f"e2e_{k}_s": v for k, v in percentiles(e2e).items()},
        "preemptions": run["preemptions"],
        "prefix_cache_hit_rate": run["prefix_cache_hit_rate"],
        "kv_peak_usage": run["kv_peak_usage"],
        "kv_bytes_allocated": run["kv_bytes_allocated"],
        "kv_bytes_peak_in_use": run["kv_bytes_peak_in_use"],
        "steps": run["steps"],
    }
