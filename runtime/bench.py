"""Speed measurements of the engine: single stream (llama-bench style) and a serving workload."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from .engine import LLMEngine
from .metrics import percentiles
from .outputs import RequestFailedError, RequestOutput, raise_if_failed
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


def _run_one(engine: LLMEngine, prompt: list[int], max_tokens: int) -> tuple[float, RequestOutput]:
    """Seconds from adding the request to its end, and its checked final output."""
    start = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    seconds = time.perf_counter() - start
    return seconds, check_measured(final, "benchmark request")


def check_measured(output: RequestOutput | None, what: str = "request") -> RequestOutput:
    """``output`` when its figures can be used: it did not error, produced at least one token and
    has its latencies; otherwise a ``RequestFailedError`` (a broken kernel must not look fast)."""
    output = raise_if_failed(output, what)
    if not output.token_ids:
        raise RequestFailedError(f"{what} produced no token", "report this as a bug (llmopt --debug shows more)")
    m = output.metrics
    if m.ttft is None or m.e2e is None or (len(output.token_ids) > 1 and m.tpot is None):
        raise RequestFailedError(f"{what} finished without its latencies (TTFT {m.ttft}, TPOT {m.tpot}, end-to-end {m.e2e})",
                                 "report this as a bug")
    return output


def time_prompt(engine: LLMEngine, pp: int, rng: random.Random) -> tuple[float, int]:
    """Seconds to process a fresh random ``pp``-token prompt (and emit one token), and the prompt
    tokens actually processed."""
    seconds, out = _run_one(engine, _random_prompt(engine, pp, rng), 1)
    return seconds, len(out.prompt_token_ids)


def time_generation(engine: LLMEngine, tg: int, rng: random.Random) -> tuple[float, int]:
    """Seconds to generate ``tg`` tokens from a one-token prompt, and the tokens actually produced."""
    seconds, out = _run_one(engine, _random_prompt(engine, 1, rng), tg)
    return seconds, len(out.token_ids)


def single_stream(engine: LLMEngine, pp: int = 512, tg: int = 128, repetitions: int = 5, seed: int = 0,
                  advance: Callable[[int], None] | None = None) -> dict:
    """Prompt processing of ``pp`` tokens (one token generated) and generation of ``tg`` tokens
    from a one-token prompt, one request at a time; the median of ``repetitions`` rates (tokens
    actually processed or produced / seconds) after a warm-up. Every prompt is fresh random
    tokens, so the prefix cache never helps. A request that errors raises ``RequestFailedError``."""
    rng = random.Random(seed)
    _run_one(engine, _random_prompt(engine, min(pp, 32), rng), 4)  # warm-up
    engine.reset_metrics()
    pp_s, tg_s, pp_tokens, tg_tokens = [], [], [], []
    for _ in range(repetitions):
        seconds, tokens = time_prompt(engine, pp, rng)
        pp_s.append(seconds)
        pp_tokens.append(tokens)
        seconds, tokens = time_generation(engine, tg, rng)
        tg_s.append(seconds)
        tg_tokens.append(tokens)
        if advance:
            advance(1)
    return {
        f"pp{pp}_tok_s": statistics.median(n / t for n, t in zip(pp_tokens, pp_s)),
        f"tg{tg}_tok_s": statistics.median(n / t for n, t in zip(tg_tokens, tg_s)),
        "pp_seconds": pp_s,
        "tg_seconds": tg_s,
        "pp_tokens": pp_tokens,
        "tg_tokens": tg_tokens,
        "repetitions": repetitions,
        **spec_figures(engine),
    }


SPEC_FIGURES = ("spec_acceptance_rate", "spec_mean_accepted_length", "spec_draft_s", "spec_verify_s")


def spec_figures(engine: LLMEngine) -> dict:
    """Speculative decoding's figures of the measurement window (empty when it is off)."""
    if engine.spec is None:
        return {}
    m = engine.metrics()
    return {k: m[k] for k in m if k.startswith("spec_")}


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
                finished.append(check_measured(out, f"serving request {out.request_id}"))
                if advance:
                    advance(1)
    duration = time.perf_counter() - start
    if len(finished) != len(workload):
        raise RequestFailedError(f"serving finished {len(finished)} of {len(workload)} requests", "report this as a bug")
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
        **{k: run[k] for k in run if k.startswith("spec_")},
    }
