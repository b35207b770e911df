"""What GPTQ's scale refit and code descent buy, Linear by Linear, on the demo model.

Decoder layers ``--layers`` (indices) of the demo model are observed on calibration windows
(float32 forwards, the float model's own inputs); each Linear is GPTQ-quantized (act-order,
clipping search, as ``quantize`` does) in every format of ``--formats`` three ways: plain; with
the scale refit alone (``llmopt.quant.scale_refit``: least-squares group scales for the chosen
codes, a second GPTQ pass on them, each row's best); and with the refit followed by its rounds
of coordinate descent on the codes (``llmopt.quant.code_descent``), as ``quantize`` runs it. All
are scored by the output error ``tr(E H Eᵀ)`` on the same Hessian and on a Hessian of other
calibration windows (``--test-samples``, seed 1: the gain is not an overfit to the windows
solved on); ratios to plain and the solve times are reported.

Written to bench/results/scale_refit.{json,md}.

    python bench/scale_refit.py [--layers 0 10 20] [--calib-samples 32] [--test-samples 16]
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


VARIANTS = ("plain", "refit", "descent")  # GPTQ; + scale refit; + refit and code descent (the default)


def _layer_hessians(layer, hidden: list, kwargs: list) -> dict:
    """Each Linear of ``layer``'s input Hessian over the given batches."""
    from llmopt.calibration import LinearStats, _call_layer, linear_modules

    mods = linear_modules(layer, "")
    with torch.no_grad(), LinearStats(mods, hessian=True, channel=False, hessian_dtype=torch.float32,
                                      stop_early=False) as stats:
        for h, kw in zip(hidden, kwargs):
            _call_layer(layer, h, kw)
    return {name: stats.hessian(name) for name in mods}


def _solve(weight, hessian, scheme, variant: str):
    from llmopt.quant import gptq

    rounds = gptq.DESCENT_ROUNDS
    gptq.DESCENT_ROUNDS = 0 if variant == "refit" else rounds
    try:
        return gptq.gptq_quantize_weight(weight, hessian, scheme, scheme.group_size, act_order=True, clip=True,
                                         refit=variant != "plain")
    finally:
        gptq.DESCENT_ROUNDS = rounds


def measure(layers: list[int], samples: int, test_samples: int, formats: list[str]) -> list[dict]:
    from llmopt.calibration import _call_layer, capture_layer_inputs, decoder_layers, linear_modules
    from llmopt.checkpoints.models import load_model, resolve_model
    from llmopt.core.data import calibration_ids
    from llmopt.quant.scale_refit import row_errors
    from llmopt.quant.sensitivity import format_scheme

    model, tokenizer = load_model(resolve_model("demo"))
    sets = {}
    for key, count, seed in (("calib", samples, 0), ("test", test_samples, 1)):
        ids, _ = calibration_ids(tokenizer, "austen", count, 512, seed)
        captured = capture_layer_inputs(model, ids, 8)
        sets[key] = [captured.hidden, captured.kwargs]
    rows = []
    for index, layer in enumerate(decoder_layers(model)[: max(layers) + 1]):
        if index in layers:
            hessians = {key: _layer_hessians(layer, *sets[key]) for key in sets}
            for name, module in linear_modules(layer, "").items():
                hessian, test, weight = hessians["calib"][name], hessians["test"][name], module.weight.detach().float()
                for fmt in formats:
                    scheme = format_scheme(fmt, weight.shape[1])
                    result = {"layer": index, "linear": name, "format": fmt, "shape": list(weight.shape)}
                    for variant in VARIANTS:
                        start = time.perf_counter()
                        qw = _solve(weight, hessian, scheme, variant)
                        result[f"seconds_{variant}"] = round(time.perf_counter() - start, 3)
                        result[variant] = float(row_errors(weight, qw, hessian).sum())
                        result[f"{variant}_test"] = float(row_errors(weight, qw, test).sum())
                    for variant in VARIANTS[1:]:
                        result[f"ratio_{variant}"] = result[variant] / result["plain"]
                        result[f"ratio_{variant}_test"] = result[f"{variant}_test"] / result["plain_test"]
                    rows.append(result)
                    print(f"layer {index} {name} {fmt}: refit {result['ratio_refit']:.3f}, "
                          f"descent {result['ratio_descent']:.3f} (other windows {result['ratio_descent_test']:.3f})", flush=True)
        with torch.no_grad():
            for key in sets:
                sets[key][0] = [_call_layer(layer, h, kw) for h, kw in zip(*sets[key])]
    return rows


def write(rows: list[dict], args: argparse.Namespace) -> None:
    from llmopt.quant.gptq import DESCENT_ROUNDS
    from llmopt.runtime.format_speed import cpu_model

    by_format = {}
    for fmt in args.formats:
        mine = [r for r in rows if r["format"] == fmt]
        plain = sum(r["seconds_plain"] for r in mine)
        entry = {"linears": len(mine)}
        for variant in VARIANTS[1:]:
            for suffix in ("", "_test"):
                ratios = [r[f"ratio_{variant}{suffix}"] for r in mine]
                entry[f"{variant}{suffix}"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
            entry[f"{variant}_time_ratio"] = sum(r[f"seconds_{variant}"] for r in mine) / plain
        by_format[fmt] = entry
    payload = {"what": "GPTQ output error tr(E H E^T): plain, with the scale refit, with the refit and code descent, "
                       "per Linear of the demo model",
               "machine": platform.platform(), "cpu": cpu_model(), "cpus": os.cpu_count(), "descent_rounds": DESCENT_ROUNDS,
               "layers": args.layers, "calib_samples": args.calib_samples, "test_samples": args.test_samples,
               "by_format": by_format, "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "scale_refit.json").write_text(json.dumps(payload, indent=1) + "\n")
    lines = [
        "# GPTQ scale refit and code descent: output error per Linear on the demo model",
        "",
        f"`bench/scale_refit.py`: layers {', '.join(map(str, args.layers))} of the demo model, observed on "
        f"{args.calib_samples} calibration windows of 512 tokens (float32 forwards, the float model's inputs); "
        "every Linear GPTQ-quantized (act-order, clipping search) plain, with the scale refit alone, and with the refit "
        f"and {DESCENT_ROUNDS} rounds of code descent + least-squares scales (the default), scored by `tr(E H Eᵀ)` on the "
        f"Hessian solved on and on one of {args.test_samples} other windows (seed 1). Error ratios to plain GPTQ, median "
        f"(min–max) over the Linears. CPU: {cpu_model()}, {os.cpu_count()} cores.",
        "",
        "| format | Linears | refit / plain | refit + descent / plain | same, other windows | solve time refit / plain | refit + descent / plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for fmt, f in by_format.items():
        cell = lambda d: f"{d['median']:.3f} ({d['min']:.3f}–{d['max']:.3f})"  # noqa: E731
        lines.append(f"| {fmt} | {f['linears']} | {cell(f['refit'])} | {cell(f['descent'])} | {cell(f['descent_test'])} | "
                     f"{f['refit_time_ratio']:.2f}× | {f['descent_time_ratio']:.2f}× |")
    (RESULTS / "scale_refit.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[0, 10, 20])
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--test-samples", type=int, default=16)
    parser.add_argument("--formats", nargs="+", default=FORMATS)
    args = parser.parse_args()
    torch.manual_seed(0)
    write(measure(args.layers, args.calib_samples, args.test_samples, args.formats), args)


if __name__ == "__main__":
    main()
