"""Where a decoded token's time goes, against the machine's read bandwidth, in one run.

For each checkpoint, single-stream greedy decoding of ``--tokens`` tokens from a one-token
prompt is timed twice per round: plainly (tok/s), and with a timer around every kernel call
(the linears, decode attention, the fused norm / RoPE / activation steps, the argmax), around the
model's forward and around the engine's step. A token's time then splits into the linear
kernels, attention, the other kernels, Python between the kernels inside the forward, and the
engine outside the forward (scheduling, inputs, sampling, outputs). The bytes a token reads
(bandwidth.bytes_per_token: every stored weight once plus the KV) over the linear kernels' time is
the bandwidth the linears reach; the streaming read bandwidth is measured in the same run, once per
round. Checkpoints alternate over ``--rounds`` rounds; medians over rounds are reported.
Results: ``bench/results/decode_profile.{json,md}``.

    .venv/bin/python bench/decode_profile.py --model out/bench-e2e/W4A16_g32 --model out/bench-e2e/W8A16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from bandwidth import bytes_per_token, read_bandwidth
from common import cpu_name, log

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
KERNEL_GROUPS = {"attention": "attention", "add_rms_norm": "other kernels", "rope_and_store": "other kernels",
                 "silu_mul": "other kernels", "gelu_mul": "other kernels", "argmax": "other kernels"}
PARTS = ("linear kernels", "attention", "other kernels", "Python in the forward", "engine outside the forward")


class Clock:
    """Seconds spent in each named part while ``on``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.on = False

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started
        return timed


def instrument(engine, clock: Clock) -> None:
    """Timers around every linear, the backend's kernel steps, the forward and the step."""
    weights = engine.weights
    linears = [weights.lm_head] + [lin for layer in weights.layers for lin in layer.linears()]
    for lin in {id(x): x for x in linears}.values():
        if getattr(lin, "run", None) is not None:
            lin.run = clock.wrap("linear kernels", lin.run)
    for method, group in KERNEL_GROUPS.items():
        if hasattr(engine.backend, method):
            setattr(engine.backend, method, clock.wrap(group, getattr(engine.backend, method)))
    engine.model.forward = clock.wrap("forward", engine.model.forward)
    engine.step = clock.wrap("step", engine.step)


def generate(engine, tokens: int) -> float:
    """Seconds for ``tokens`` greedy tokens from a one-token prompt (prefill included: one step)."""
    from llmopt.runtime import SamplingParams

    engine.add_request([1], SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - started


def split(clock: Clock, tokens: int) -> dict[str, float]:
    """Milliseconds per token of each part."""
    s = clock.seconds
    kernels = s["linear kernels"] + s["attention"] + s["other kernels"]
    parts = {"linear kernels": s["linear kernels"], "attention": s["attention"], "other kernels": s["other kernels"],
             "Python in the forward": s["forward"] - kernels, "engine outside the forward": s["step"] - s["forward"]}
    return {name: 1e3 * value / tokens for name, value in parts.items()}


def main() -> None:
    from llmopt.runtime import LLMEngine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", required=True, help="checkpoint (repeatable)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    load_before = [round(x, 2) for x in os.getloadavg()]
    engines, clocks = {}, {}
    for model in args.model:
        engines[model] = LLMEngine(model, threads=args.threads)
        clocks[model] = Clock()
        instrument(engines[model], clocks[model])
        generate(engines[model], 8)
    bandwidth, plain, parts = [], defaultdict(list), defaultdict(list)
    for r in range(args.rounds):
        bandwidth.append(read_bandwidth(args.threads))
        log(f"round {r + 1}: read bandwidth {bandwidth[-1] / 1e9:.1f} GB/s")
        for model, engine in engines.items():
            plain[model].append(args.tokens / generate(engine, args.tokens))
            clock = clocks[model]
            clock.seconds.clear()
            clock.on = True
            total = generate(engine, args.tokens)
            clock.on = False
            parts[model].append({**split(clock, args.tokens), "timed_total_ms": 1e3 * total / args.tokens})
            log(f"round {r + 1} {model}: {plain[model][-1]:.1f} tok/s; {parts[model][-1]}")
    bw = statistics.median(bandwidth)
    rows = []
    for model in args.model:
        med = {key: statistics.median(p[key] for p in parts[model]) for key in parts[model][0]}
        reads = bytes_per_token(model, context=args.tokens // 2)
        weight_bytes = reads["weights"]
        token_s = 1.0 / statistics.median(plain[model])
        rows.append({"model": model, "tok_s": statistics.median(plain[model]), "tok_s_rounds": plain[model],
                     "ms_per_token": 1e3 * token_s, "parts_ms": med, "parts_rounds": parts[model],
                     "bytes_per_token": reads, "fraction_of_bandwidth": reads["total"] / token_s / bw,
                     "linear_gb_s": weight_bytes / (med["linear kernels"] / 1e3) / 1e9,
                     "linear_fraction_of_bandwidth": weight_bytes / (med["linear kernels"] / 1e3) / bw})
    result = {"threads": args.threads, "rounds": args.rounds, "tokens": args.tokens, "cpu": cpu_name(),
              "read_bandwidth_gb_s": bw / 1e9, "read_bandwidth_rounds_gb_s": [b / 1e9 for b in bandwidth],
              "load_average_before": load_before, "load_average_after": [round(x, 2) for x in os.getloadavg()], "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_profile.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "decode_profile.md").write_text(render(result))
    print(render(result))


def render(r: dict) -> str:
    lines = ["# Where a decoded token's time goes", "",
             f"{r['cpu']}, {r['threads']} threads, {r['tokens']} greedy tokens from a one-token prompt, {r['rounds']} rounds "
             f"(checkpoints alternate), medians over rounds. Read bandwidth (streaming read, same threads, once per round): "
             f"**{r['read_bandwidth_gb_s']:.1f} GB/s** (rounds {', '.join(f'{b:.1f}' for b in r['read_bandwidth_rounds_gb_s'])}). "
             f"Load average {r['load_average_before']} → {r['load_average_after']}. The split comes from a timed run (a timer "
             "around every kernel call); tok/s and ms per token from an untimed one.", "",
             "| checkpoint | tok/s | ms / token | MB read / token | fraction of read bandwidth | "
             + " | ".join(f"{p} (ms)" for p in PARTS) + " | linear kernels alone: GB/s (fraction) |",
             "|---|---|---|---|---|" + "---|" * len(PARTS) + "---|"]
    for row in r["rows"]:
        p = row["parts_ms"]
        lines.append(f"| {row['model']} | {row['tok_s']:.1f} | {row['ms_per_token']:.2f} | {row['bytes_per_token']['total'] / 1e6:.1f} | "
                     f"{100 * row['fraction_of_bandwidth']:.0f}% | " + " | ".join(f"{p[name]:.2f}" for name in PARTS)
                     + f" | {row['linear_gb_s']:.1f} ({100 * row['linear_fraction_of_bandwidth']:.0f}%) |")
    lines.append("")
    for row in r["rows"]:
        p = row["parts_ms"]
        total = sum(p[name] for name in PARTS)
        outside = p["Python in the forward"] + p["engine outside the forward"]
        lines.append(f"- {row['model']}: the linear kernels take {100 * p['linear kernels'] / total:.0f}% of a timed token "
                     f"and stream the weights at {100 * row['linear_fraction_of_bandwidth']:.0f}% of the read bandwidth; "
                     f"attention and the other kernels {100 * (p['attention'] + p['other kernels']) / total:.0f}%; Python and "
                     f"the engine around the kernels {100 * outside / total:.0f}% ({outside:.2f} ms).")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
