"""Decode speed against the smallest GEMV task of the C++ quantized linears, in one process.

A quantized linear's output tiles are split into tasks of at least ``min_task_bytes`` weight bytes
(and a minimum of multiply-adds); a linear smaller than one task runs on one thread. Each round
generates ``--tokens`` greedy tokens from a one-token prompt at every setting in turn
(``cpu_linear.set_min_task_bytes``), so the settings share the machine's state; the median over
rounds is reported. Results: ``bench/results/gemv_task_size.{json,md}``.

    .venv/bin/python bench/gemv_task_size.py --model out/bench-e2e/W4A16_g32,_int4_head_in_checkpoint
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SETTINGS = (1 << 20, 1 << 18, 1 << 16, 1 << 14)


def main() -> None:
    from llmopt.runtime import LLMEngine, SamplingParams
    from llmopt.runtime.kernels import cpu_linear

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a quantized checkpoint")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    engine = LLMEngine(args.model, threads=args.threads)
    module = cpu_linear._module()
    if module is None:
        raise SystemExit("the C++ quantized linear kernels are not available on this machine")

    def generate(n: int) -> float:
        engine.add_request([1], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        started = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return n / (time.perf_counter() - started)

    generate(8)
    load_before = [round(x, 2) for x in os.getloadavg()]
    rates: dict[int, list[float]] = {s: [] for s in SETTINGS}
    for _ in range(args.rounds):
        for setting in SETTINGS:
            module.set_min_task_bytes(setting)
            rates[setting].append(generate(args.tokens))
    module.set_min_task_bytes(SETTINGS[2])
    medians = {s: statistics.median(v) for s, v in rates.items()}
    result = {"model": args.model, "threads": args.threads, "rounds": args.rounds, "tokens": args.tokens,
              "load_average_before": load_before, "load_average_after": [round(x, 2) for x in os.getloadavg()],
              "rows": [{"min_task_bytes": s, "tok_s_median": medians[s], "tok_s": rates[s],
                        "vs_largest": medians[s] / medians[SETTINGS[0]]} for s in SETTINGS]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemv_task_size.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# Decode speed against the smallest GEMV task", "",
             f"`{args.model}`, {args.threads} threads, {args.tokens} greedy tokens from a one-token prompt, "
             f"{args.rounds} rounds with every setting in turn in one process, median over rounds. "
             f"Load average {result['load_average_before']} → {result['load_average_after']}.", "",
             "| smallest task (weight bytes) | decode tok/s | vs 1 MiB | per round |", "|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['min_task_bytes']:,} | {row['tok_s_median']:.1f} | {row['vs_largest']:.3f}× | "
                     f"{', '.join(f'{x:.1f}' for x in row['tok_s'])} |")
    (args.out / "gemv_task_size.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
