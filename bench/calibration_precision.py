"""The calibration engine's arithmetic on this machine: what bfloat16 costs and what it buys.

1. speed: the Hessian product ``xᵀx`` (``llmopt.calibration.gram``) of one calibration batch
   (8 × 512 tokens) at the demo model's input widths, in float32 and in bfloat16, as a ratio in
   the same run (a CPU without native bfloat16 emulates it);
2. accuracy: the first ``--layers`` decoder layers of the demo model, observed on calibration
   windows under float32 forwards; each Linear GPTQ-quantized (W4A16 g32, act-order, clipping
   search, as ``quantize`` does) from its Hessian built with float32 products and with
   bfloat16 products, and both scored by the output error ``tr(E H Eᵀ)`` on the exact
   (float32-product) Hessian.

Written to bench/results/calibration_precision.{json,md}.

    python bench/calibration_precision.py [--layers 3] [--calib-samples 64]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
BATCH_TOKENS = 8 * 512


def gram_seconds(width: int, dtype: torch.dtype, repeats: int) -> float:
    """Best-of-``repeats`` seconds of one batch's ``xᵀx`` at ``width`` input features."""
    from llmopt.linear_stats import gram

    x = torch.randn(BATCH_TOKENS, width, generator=torch.Generator().manual_seed(width)).to(dtype).contiguous()
    gram(x)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        gram(x)
        best = min(best, time.perf_counter() - start)
    return best


def output_errors(layers: int, samples: int) -> list[dict]:
    """Per Linear of the first ``layers`` layers: GPTQ's output error from float32- and
    bfloat16-product Hessians, both measured on the float32 one."""
    from llmopt.calibration import call_layer, capture_layer_inputs, decoder_layers, linear_modules
    from llmopt.linear_stats import LinearStats
    from llmopt.checkpoints.models import load_model, resolve_model
    from llmopt.core.data import calibration_ids
    from llmopt.quant.gptq import gptq_quantize_weight
    from llmopt.quant.registry import build_method
    from llmopt.quant.request import resolve_scheme

    model, tokenizer = load_model(resolve_model("demo"))
    calib, _ = calibration_ids(tokenizer, "austen", samples, 512, 0)
    scheme = build_method("gptq", {"act_order": True}).check(resolve_scheme("W4A16", 32), True)
    inputs = capture_layer_inputs(model, calib, 8)
    hidden = inputs.hidden
    rows = []
    for index, layer in enumerate(decoder_layers(model)[:layers]):
        mods = linear_modules(layer, "")
        hessians = {}
        for dtype in (torch.float32, torch.bfloat16):
            with torch.no_grad(), LinearStats(mods, hessian=True, channel=False, hessian_dtype=dtype, stop_early=False) as stats:
                for h, kw in zip(hidden, inputs.kwargs):
                    call_layer(layer, h, kw)
            hessians[dtype] = {n: stats.hessian(n) for n in mods}
        for name, module in mods.items():
            exact = hessians[torch.float32][name]
            error = {}
            for dtype, label in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
                qw = gptq_quantize_weight(module.weight.detach(), hessians[dtype][name], scheme, 32, act_order=True, clip=True)
                e = (module.weight.detach() - qw.dequantize(torch.float32)).double()
                error[label] = float(torch.einsum("oi,ij,oj->", e, exact, e))
            rows.append({"layer": index, "linear": name, **error, "ratio": error["bfloat16"] / error["float32"]})
            print(f"layer {index} {name}: bf16 / fp32 products {rows[-1]['ratio']:.3f}", flush=True)
        with torch.no_grad():
            hidden = [call_layer(layer, h, kw) for h, kw in zip(hidden, inputs.kwargs)]
    return rows


def main() -> None:
    from llmopt.core.hardware import cpu_has_bf16

    from common import cpu_name

    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    load = [round(x, 2) for x in os.getloadavg()]
    speed = []
    for width in (576, 1536):
        f32, bf16 = (gram_seconds(width, d, args.repeats) for d in (torch.float32, torch.bfloat16))
        speed.append({"width": width, "float32_s": f32, "bfloat16_s": bf16, "bf16_over_fp32": bf16 / f32})
    errors = output_errors(args.layers, args.calib_samples)
    result = {"what": "calibration arithmetic: Hessian-product speed and GPTQ output error, float32 vs bfloat16 products",
              "cpu": cpu_name(), "native_bf16": cpu_has_bf16(), "threads": torch.get_num_threads(), "load_before": load,
              "load_after": [round(x, 2) for x in os.getloadavg()], "batch_tokens": BATCH_TOKENS,
              "calib_samples": args.calib_samples, "speed": speed, "gptq_output_error": errors}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "calibration_precision.json").write_text(json.dumps(result, indent=1))
    lines = ["# Calibration arithmetic: float32 against bfloat16", "",
             f"CPU {result['cpu']} (native bfloat16: {'yes' if result['native_bf16'] else 'no'}), "
             f"{result['threads']} threads, load {load}. Written by `bench/calibration_precision.py`.", "",
             f"## One batch's Hessian product xᵀx ({BATCH_TOKENS} tokens), best of {args.repeats}", "",
             "| input features | float32 s | bfloat16 s | bfloat16 / float32 |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['width']} | {r['float32_s']:.4f} | {r['bfloat16_s']:.4f} | {r['bf16_over_fp32']:.2f} |" for r in speed]
    lines += ["", f"## GPTQ output error tr(E H Eᵀ), W4A16 g32, demo model, {args.calib_samples} calibration windows", "",
              "Each Linear quantized from a Hessian with float32 or bfloat16 `xᵀx` products, both errors measured",
              "on the float32-product Hessian.", "",
              "| layer | Linear | float32 products | bfloat16 products | ratio |", "|---:|---|---:|---:|---:|"]
    lines += [f"| {r['layer']} | {r['linear']} | {r['float32']:.4g} | {r['bfloat16']:.4g} | {r['ratio']:.3f} |" for r in errors]
    (RESULTS / "calibration_precision.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
