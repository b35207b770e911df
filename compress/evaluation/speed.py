"""Speed of several models in llmopt's runtime, measured in interleaved rounds.

Each round measures every model once (single stream pp512 / tg128 and a seeded serving
workload), model after model, so whatever else runs on the machine falls on all of them alike;
each figure is the median over rounds, with its spread. The machine's load average is recorded
before and after, and warnings say when the spread or the load makes the figures unreliable.
"""

from __future__ import annotations

import gc
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

# A figure whose rounds differ by more than this fraction of its median is flagged.
MAX_SPREAD = 0.15
# Load from other processes (load average minus our own threads) above this fraction of the
# cores is flagged: our threads then share cores with someone else's work.
MAX_OTHER_LOAD = 0.25
SERVING_KEYS = ("output_tok_s", "total_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
CHECKED = ("pp512_tok_s", "tg128_tok_s", "serving_output_tok_s")  # figures the warnings look at


@dataclass
class SpeedPlan:
    rounds: int = 3
    repetitions: int = 1  # single-stream repetitions per round (median)
    serving_requests: int = 16
    prompt_len: tuple[int, int] = (32, 256)
    output_len: tuple[int, int] = (32, 128)
    seed: int = 0
    model_impl: str | None = None  # the engine's model_impl (None: the checkpoint's saved setting, else auto)


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def one_round(path: str, plan: SpeedPlan) -> dict:
    """One model's figures for one round (a fresh engine, freed afterwards)."""
    from llmopt.runtime import LLMEngine
    from llmopt.runtime.bench import SPEC_FIGURES, make_workload, serving, single_stream

    engine = LLMEngine(path, **({} if plan.model_impl is None else {"model_impl": plan.model_impl}))
    try:
        single = single_stream(engine, repetitions=plan.repetitions, seed=plan.seed)
        workload = make_workload(plan.serving_requests, plan.prompt_len, plan.output_len, engine.arch.vocab_size,
                                 seed=plan.seed)
        served = serving(engine, workload)
    finally:
        del engine
        gc.collect()
    spec = {f"tg128_{k}": single[k] for k in SPEC_FIGURES if k in single}  # speculative decoding, when the checkpoint's runtime settings turn it on
    return {"pp512_tok_s": single["pp512_tok_s"], "tg128_tok_s": single["tg128_tok_s"],
            "serving_requests": served["requests"], **{f"serving_{k}": served[k] for k in SERVING_KEYS}, **spec}


def summarize(rounds: list[dict]) -> dict:
    """Median over rounds of every figure, ``<figure>_spread`` = (max − min) / median, and the rounds."""
    out: dict = {}
    for key in rounds[0]:
        values = [r[key] for r in rounds]
        if any(v is None for v in values):
            out[key] = None
            continue
        median = statistics.median(values)
        out[key] = median
        if key != "serving_requests":
            out[f"{key}_spread"] = (max(values) - min(values)) / median if median else 0.0
    out["speed_rounds"] = rounds
    return out


def warnings_for(labels: list[str], rows: list[dict], load_before: list[float] | None,
                 load_after: list[float] | None, threads: int, cores: int) -> list[str]:
    """Sentences saying why the figures may not be trusted (none when they look sound)."""
    notes = []
    for label, row in zip(labels, rows):
        for key in CHECKED:
            spread = row.get(f"{key}_spread")
            if spread is not None and spread > MAX_SPREAD:
                notes.append(f"{label}: {key} varied by {100 * spread:.0f}% between rounds "
                             f"(over {100 * MAX_SPREAD:.0f}%): the machine's speed changed during the run")
    loads = [x[0] for x in (load_before, load_after) if x]
    if loads:
        other = max(loads) - threads
        if other > max(MAX_OTHER_LOAD * cores, 0.5):
            notes.append(f"the machine was busy: 1-minute load average {load_before[0] if load_before else '?'} before, "
                         f"{load_after[0] if load_after else '?'} after, on {cores} cores with {threads} threads of ours; "
                         "speed figures are lower and less even than on a quiet machine")
    if len(rows[0].get("speed_rounds", [])) < 2:
        notes.append("one round only: no spread could be measured (use more rounds)")
    return notes


def measure(paths: list[str], labels: list[str], plan: SpeedPlan,
            advance: Callable[[int], None] | None = None) -> tuple[list[dict], dict]:
    """Figures per model (same order as ``paths``) and a record of how they were measured."""
    threads, cores = torch.get_num_threads(), os.cpu_count() or 1
    before = load_average()
    per_model: list[list[dict]] = [[] for _ in paths]
    for _ in range(plan.rounds):
        for i, path in enumerate(paths):
            per_model[i].append(one_round(path, plan))
            if advance:
                advance(1 / plan.rounds)  # one step per model over all rounds
    after = load_average()
    rows = [summarize(r) for r in per_model]
    record = {"rounds": plan.rounds, "repetitions_per_round": plan.repetitions, "threads": threads, "cores": cores,
              "load_average_before": before, "load_average_after": after, "max_spread": MAX_SPREAD,
              "warnings": warnings_for(labels, rows, before, after, threads, cores)}
    return rows, record
