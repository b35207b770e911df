"""What GPTQ's scale refit buys, Linear by Linear, on the demo model.

Decoder layers ``--layers`` (indices) of the demo model are observed on calibration windows
(float32 forwards, the float model's own inputs); each Linear is GPTQ-quantized (act-order,
clipping search, as ``quantize`` does) in every format of ``--formats`` without and with the
scale refit (``llmopt.quant.scale_refit``: least-squares group scales for the chosen codes, a
second GPTQ pass on them, each row's best), and both are scored by the output error
``tr(E H Eᵀ)`` on the same Hessian; the ratio refit / plain and the solve times are reported.

Written to bench/results/scale_refit.{json,md}.

    python bench/scale_refit.py [--layers 0 10 20] [--calib-samples 32]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
FORMATS = ["int4_g128", "int4_g32", "int4a_g32", "nl4_g32", "nl4x_g32", "int5_g32", "int5a_g32", "int6x_g16", "int8_g32"]


def measure(layers: list[int], samples: int, formats: list[str]) -> list[dict]:
    from llmopt.calibration import call_layer, capture_layer_inputs, decoder_layers, linear_modules
    from llmopt.linear_stats import LinearStats
    from llmopt.checkpoints.models import load_model, resolve_model
    from llmopt.core.data import calibration_ids
    from llmopt.quant.gptq import gptq_quantize_weight
    from llmopt.quant.scale_refit import row_errors
    from llmopt.quant.sensitivity import format_scheme

    model, tokenizer = load_model(resolve_model("demo"))
    calib, _ = calibration_ids(tokenizer, "austen", samples, 512, 0)
    inputs = capture_layer_inputs(model, calib, 8)
    hidden = inputs.hidden
    rows = []
    for index, layer in enumerate(decoder_layers(model)[: max(layers) + 1]):
        if index in layers:
            mods = linear_modules(layer, "")
            with torch.no_grad(), LinearStats(mods, hessian=True, channel=False, hessian_dtype=torch.float32,
                                              stop_early=False) as stats:
                for h, kw in zip(hidden, inputs.kwargs):
                    call_layer(layer, h, kw)
            for name, module in mods.items():
                hessian, weight = stats.hessian(name), module.weight.detach().float()
                for fmt in formats:
                    scheme = format_scheme(fmt, weight.shape[1])
                    result = {"layer": index, "linear": name, "format": fmt, "shape": list(weight.shape)}
                    for refit in (False, True):
                        start = time.perf_counter()
                        qw = gptq_quantize_weight(weight, hessian, scheme, scheme.group_size, act_order=True,
                                                  clip=True, refit=refit)
                        result[f"seconds_{'refit' if refit else 'plain'}"] = round(time.perf_counter() - start, 3)
                        result["refit" if refit else "plain"] = float(row_errors(weight, qw, hessian).sum())
                    result["ratio"] = result["refit"] / result["plain"]
                    rows.append(result)
                    print(f"layer {index} {name} {fmt}: {result['ratio']:.3f}", flush=True)
        with torch.no_grad():
            hidden = [call_layer(layer, h, kw) for h, kw in zip(hidden, inputs.kwargs)]
    return rows


def write(rows: list[dict], args: argparse.Namespace) -> None:
    from llmopt.runtime.format_speed import cpu_model

    by_format = {}
    for fmt in args.formats:
        ratios = [r["ratio"] for r in rows if r["format"] == fmt]
        plain = sum(r["seconds_plain"] for r in rows if r["format"] == fmt)
        refit = sum(r["seconds_refit"] for r in rows if r["format"] == fmt)
        by_format[fmt] = {"linears": len(ratios), "median": statistics.median(ratios), "min": min(ratios),
                          "max": max(ratios), "time_ratio": refit / plain}
    payload = {"what": "GPTQ output error tr(E H E^T) with / without the scale refit, per Linear of the demo model",
               "machine": platform.platform(), "cpu": cpu_model(), "cpus": os.cpu_count(),
               "layers": args.layers, "calib_samples": args.calib_samples, "by_format": by_format, "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "scale_refit.json").write_text(json.dumps(payload, indent=1) + "\n")
    lines = [
        "# GPTQ scale refit: output error per Linear on the demo model",
        "",
        f"`bench/scale_refit.py`: layers {', '.join(map(str, args.layers))} of the demo model, observed on "
        f"{args.calib_samples} calibration windows of 512 tokens (float32 forwards, the float model's inputs); "
        "every Linear GPTQ-quantized (act-order, clipping search) without and with the scale refit, both scored by "
        f"`tr(E H Eᵀ)` on the same Hessian. CPU: {cpu_model()}, {os.cpu_count()} cores.",
        "",
        "| format | Linears | refit / plain error: median | min | max | solve time refit / plain |",
        "|---|---|---|---|---|---|",
    ]
    for fmt, f in by_format.items():
        lines.append(f"| {fmt} | {f['linears']} | {f['median']:.3f} | {f['min']:.3f} | {f['max']:.3f} | {f['time_ratio']:.2f}× |")
    (RESULTS / "scale_refit.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[0, 10, 20])
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--formats", nargs="+", default=FORMATS)
    args = parser.parse_args()
    torch.manual_seed(0)
    write(measure(args.layers, args.calib_samples, args.formats), args)


if __name__ == "__main__":
    main()
