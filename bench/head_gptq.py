"""The demo model's tied embedding / output head quantized alone (everything else float): RTN with
the clipping search (uncalibrated) against GPTQ on the Hessian of the head's inputs, and GPTQ with
the most probable rows solved again on their own KL-weighted Hessians (``llmopt.quant.head_fisher``;
what ``quantize`` does when it has calibration data), at int5, nl4 and int4 (groups of 32). KLD
against the float model on WikiText-2 and on held-out text, written to bench/results/head_gptq.{json,md}.

    python bench/head_gptq.py [--windows 2] [--calib-samples 128] [--results DIR]

(The same with 16 calibration windows, ``--calib-samples 16``: bench/results/head_gptq_calib16, in git
history at f284b0d.)
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
    from llmopt.accuracy import eval_data
    from llmopt.core.data import calibration_ids
    from llmopt.quant.head_fisher import HeadFisher
    from llmopt.quant.outer import gptq_matrix, input_hessian, outer_scheme, quantize_matrix

    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--calib-samples", type=int, default=128, help="calibration windows of 512 tokens (quantize's default)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of head_gptq.{json,md}")
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
    with torch.no_grad():  # the head's inputs: after the final norm
        inputs = torch.cat([model.model(batch).last_hidden_state.reshape(-1, hidden).float() for batch in torch.split(calib, 4)])
    tokens = inputs.shape[0]
    hessian = input_hessian(inputs)
    weight = embed.weight.data.clone()
    start = time.perf_counter()
    fisher = HeadFisher.measure(inputs, weight)
    fisher_seconds = time.perf_counter() - start
    texts = {"wiki": "wikitext2", "heldout": "heldout"}
    ids = {name: eval_data(tok, text, args.seq_len, args.windows).windows for name, text in texts.items()}
    with torch.no_grad():
        ref = {name: torch.log_softmax(model(x).logits.float(), -1) for name, x in ids.items()}

    def kld(w: torch.Tensor, name: str) -> float:
        embed.weight.data = w
        with torch.no_grad():
            logp = torch.log_softmax(model(ids[name]).logits.float(), -1)
        embed.weight.data = weight
        return float((ref[name].exp() * (ref[name] - logp)).sum(-1).mean())

    rows = []
    for fmt in ("int5", "nl4", "int4"):
        scheme = outer_scheme(fmt)
        for method, quantize, extra in (
                ("rtn + clipping search", lambda: quantize_matrix(weight, scheme), 0.0),
                ("gptq on the head's inputs", lambda: gptq_matrix(weight, scheme, hessian), 0.0),
                ("gptq, likely rows on their own Hessians", lambda: gptq_matrix(weight, scheme, hessian, fisher=fisher),
                 fisher_seconds)):
            start = time.perf_counter()
            qw = quantize()
            seconds = time.perf_counter() - start + extra
            rows.append({"format": fmt, "method": method, "seconds": round(seconds, 1),
                         **{f"kld_{name}": kld(qw.dequantize(), name) for name in texts}})
            print(rows[-1], flush=True)
    result = {"model": "demo", "windows": args.windows, "seq_len": args.seq_len, "eval_texts": list(texts.values()),
              "fisher_rows": int(fisher.rows.numel()),
              "calibration": calib_record, "calibration_tokens": tokens, "threads": args.threads,
              "load_average_before": load, "load_average_after": [round(x, 2) for x in os.getloadavg()], "rows": rows}
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "head_gptq.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# The tied embedding / head quantized alone: uncalibrated RTN, GPTQ, GPTQ with per-row Hessians", "",
             f"Demo model, everything but the tied embedding/head in float; mean KLD against the float model on "
             f"{args.windows} windows of {args.seq_len} tokens of WikiText-2 and of the held-out Gutenberg text; "
             f"GPTQ's Hessian from {tokens} calibration tokens (austen); the {result['fisher_rows']} most probable rows "
             "solved again on their own Hessians `E[p(1-p) h hᵀ]` in the last method (its seconds include measuring "
             f"them). Load average {load} → {result['load_average_after']}. Written by `bench/head_gptq.py`.", "",
             "| format | method | KLD WikiText-2 | KLD held-out | seconds |", "|---|---|---|---|---|"]
    lines += [f"| {r['format']} | {r['method']} | {r['kld_wiki']:.4f} | {r['kld_heldout']:.4f} | {r['seconds']} |" for r in rows]
    (args.results / "head_gptq.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
