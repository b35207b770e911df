"""The demo model's tied embedding / output head quantized alone (everything else float): RTN with
the clipping search (uncalibrated) against GPTQ on the Hessian of the head's inputs (calibrated,
what ``quantize`` does when it has calibration data), at int5 and int4 (groups of 32). KLD against
the float model on held-out text, written to bench/results/head_gptq.{json,md}.

    python bench/head_gptq.py [--windows 2] [--calib-samples 16]
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
    from llmopt.checkpoints.models import load_model, resolve_model
    from llmopt.core.data import calibration_ids, load_text
    from llmopt.quant.outer import gptq_matrix, outer_scheme, quantize_matrix

    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--calib-samples", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = [round(x, 2) for x in os.getloadavg()]
    model, tok = load_model(resolve_model("demo"))
    model.eval()
    embed = model.get_input_embeddings()
    assert model.get_output_embeddings().weight is embed.weight, "the demo model's head is tied"
    calib, calib_record = calibration_ids(tok, "austen", args.calib_samples, 512, 0)
    hidden = embed.weight.shape[1]
    hessian = torch.zeros(hidden, hidden, dtype=torch.float64)
    tokens = 0
    with torch.no_grad():
        for batch in torch.split(calib, 4):
            x = model.model(batch).last_hidden_state.reshape(-1, hidden).double()  # after the final norm
            hessian += x.T @ x
            tokens += x.shape[0]
    hessian *= 2.0 / tokens
    text = "\n\n".join(load_text("heldout").documents)
    ids = tok(text, return_tensors="pt").input_ids[0, : args.windows * args.seq_len].reshape(args.windows, args.seq_len)
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits.float(), -1)
    weight = embed.weight.data.clone()

    def kld(w: torch.Tensor) -> float:
        embed.weight.data = w
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits.float(), -1)
        embed.weight.data = weight
        return float((ref.exp() * (ref - logp)).sum(-1).mean())

    rows = []
    for fmt in ("int5", "int4"):
        scheme = outer_scheme(fmt)
        for method, quantize in (("rtn + clipping search", lambda: quantize_matrix(weight, scheme)),
                                 ("gptq on the head's inputs", lambda: gptq_matrix(weight, scheme, hessian))):
            start = time.perf_counter()
            qw = quantize()
            rows.append({"format": fmt, "method": method, "seconds": round(time.perf_counter() - start, 1),
                         "kld_mean": kld(qw.dequantize())})
            print(rows[-1], flush=True)
    result = {"model": "demo", "windows": args.windows, "seq_len": args.seq_len, "eval_text": "heldout",
              "calibration": calib_record, "calibration_tokens": tokens, "threads": args.threads,
              "load_average_before": load, "load_average_after": [round(x, 2) for x in os.getloadavg()], "rows": rows}
    (RESULTS / "head_gptq.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# The tied embedding / head quantized alone: uncalibrated RTN against GPTQ", "",
             f"Demo model, everything but the tied embedding/head in float; mean KLD against the float model on "
             f"{args.windows} windows of {args.seq_len} tokens of the held-out Gutenberg text; GPTQ's Hessian from "
             f"{tokens} calibration tokens (austen). Load average {load} → {result['load_average_after']}. "
             "Written by `bench/head_gptq.py`.", "", "| format | method | KLD mean | seconds |", "|---|---|---|---|"]
    lines += [f"| {r['format']} | {r['method']} | {r['kld_mean']:.4f} | {r['seconds']} |" for r in rows]
    (RESULTS / "head_gptq.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
