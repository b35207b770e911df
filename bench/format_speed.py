"""Each weight format's decode time per weight in the runtime's CPU kernels, as ``quantize
--scheme AUTO --objective speed`` measures it (``llmopt.runtime.format_speed``), written to
bench/results/format_speed.{json,md}. Measured afresh (no cache), formats taking turns.

    python bench/format_speed.py [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    from llmopt.quant.sensitivity import FLOAT, LINEAR_FORMATS, format_scheme
    from llmopt.runtime import format_speed

    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    names = [*LINEAR_FORMATS, FLOAT]
    schemes = [format_scheme(n, format_speed.IN_FEATURES) for n in names]
    load = [round(x, 2) for x in os.getloadavg()]
    started = time.time()
    seconds = format_speed.measure_formats(schemes, args.threads)
    result = {"cpu": format_speed.cpu_model(), "threads": args.threads, "torch": torch.__version__,
              "in_features": format_speed.IN_FEATURES, "min_bytes": format_speed.MIN_BYTES,
              "repeats": format_speed.REPEATS, "load_average_before": load,
              "load_average_after": [round(x, 2) for x in os.getloadavg()], "seconds": round(time.time() - started, 1),
              "formats": {n: {"kernel_format": format_speed.signature(s), "ps_per_weight": round(v * 1e12, 2),
                              "vs_int4_g32": round(v / seconds[names.index("int4_g32")], 3)}
                          for n, s, v in zip(names, schemes, seconds)}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "format_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# Decode time per weight of each format in the runtime's CPU kernels", "",
             f"{result['cpu']}, {args.threads} threads, torch {result['torch']}; one decode row times a matrix of "
             f"{format_speed.IN_FEATURES} columns and at least {format_speed.MIN_BYTES >> 20} MiB, formats taking turns over "
             f"{format_speed.REPEATS} rounds, median; load average {load} → {result['load_average_after']}. "
             "Written by `bench/format_speed.py`; `quantize --scheme AUTO --objective speed` spends these figures.", "",
             "| format | kernel format | ps per weight | vs int4 g32 |", "|---|---|---|---|"]
    for n, f in result["formats"].items():
        lines.append(f"| {n} | {f['kernel_format']} | {f['ps_per_weight']} | {f['vs_int4_g32']}× |")
    (RESULTS / "format_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
