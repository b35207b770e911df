"""Accuracy cost of the runtime's reduced-precision options on the demo model: the smaller output
heads (``lm_head="bf16"`` and ``"int8"``), bfloat16 products in the quantized linears
(``matmul_precision="medium"``) and int8-rounded activations in them (``"low"``).

WikiText-2 test text, ``--windows`` non-overlapping windows of ``--window`` tokens, each run
through the runtime's forward as one prompt chunk with logits at every position: with the
checkpoint's float32 head, with the head rounded to bfloat16 at load, with it quantized to
int8 per output channel, with the quantized linears multiplying in bfloat16 (the panel path
every prompt chunk of more than 16 tokens takes; everything else identical), and with their
activations rounded to int8 per 32 inputs (the integer GEMV every row count takes under ``low``). Per model and head: KL divergence of its
next-token distributions from the float32 head's (nats; mean, p99, max over positions), top-1
agreement, perplexity, and the head's bytes. Models: the float32 demo and, with ``--w4a16
PATH``, a W4A16 checkpoint of it (its layers quantized, its head float as ``llmopt quantize``
leaves it).

Results: ``bench/results/lm_head.{json,md}``.

    python bench/lm_head.py [--w4a16 /tmp/w4g32] [--windows 4] [--window 512]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def all_logits(engine, ids: list[int]) -> torch.Tensor:
    """Next-token logits (float32) at every position of ``ids``, one prefill chunk."""
    from llmopt.runtime.sampling_params import SamplingParams
    from llmopt.runtime.sequence import Sequence

    seq = Sequence("window", ids, SamplingParams())
    assert engine.block_manager.allocate(seq, len(ids))
    batch, _ = engine.runner.prepare([(seq, len(ids))])
    batch.sample_rows = torch.arange(len(ids))
    logits = engine.runner.model.forward(batch, engine.cache)
    engine.block_manager.free(seq)
    return logits


# each compared with the checkpoint's float32 head and float32 products
VARIANTS = {"bf16": {"lm_head": "bf16"}, "int8": {"lm_head": "int8"}, "medium": {"matmul_precision": "medium"},
            "low": {"matmul_precision": "low"}}


def compare(model: str, windows: list[list[int]]) -> dict:
    from llmopt.runtime import LLMEngine

    logits, head_bytes = {}, {}
    for head in ("float", *VARIANTS):
        engine = LLMEngine(model, **VARIANTS.get(head, {}), max_num_seqs=1, max_num_batched_tokens=len(windows[0]))
        logits[head] = [all_logits(engine, w).log_softmax(-1) for w in windows]
        head_bytes[head] = engine.weights.lm_head.nbytes()
        del engine
    targets = [torch.tensor(w[1:]) for w in windows]
    base = logits["float"]
    top2 = torch.cat([b.topk(2, -1).values for b in base])

    def ppl(logp: list[torch.Tensor]) -> float:
        return float(torch.cat([-lp[:-1].gather(1, t[:, None])[:, 0] for lp, t in zip(logp, targets)]).mean().exp())

    rows = {"float": {"perplexity": ppl(base), "head_bytes": head_bytes["float"]}}
    for head in VARIANTS:
        kld = torch.cat([(b.exp() * (b - q)).sum(-1) for b, q in zip(base, logits[head])])
        top1 = torch.cat([b.argmax(-1) == q.argmax(-1) for b, q in zip(base, logits[head])]).float()
        gaps = (top2[:, 0] - top2[:, 1])[top1 == 0]  # the float head's top-2 log-prob gap where the choices differ
        rows[head] = {
            "positions": int(kld.numel()), "kld_mean": float(kld.mean()), "kld_p99": float(kld.quantile(0.99)),
            "kld_max": float(kld.max()), "top1_agreement": float(top1.mean()),
            "top2_gap_at_disagreements_max": float(gaps.max()) if gaps.numel() else 0.0,
            "top2_gap_at_disagreements_median": float(gaps.median()) if gaps.numel() else 0.0,
            "perplexity": ppl(logits[head]), "head_bytes": head_bytes[head],
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--w4a16", help="a W4A16 checkpoint of the demo model (llmopt quantize demo --scheme W4A16 ...)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from llmopt.core.data import load_text, tokenize_documents
    from llmopt.runtime import LLMEngine

    tokenizer = LLMEngine("demo", max_num_seqs=1, kv_cache_gib=0.01).tokenizer
    ids = torch.cat(tokenize_documents(tokenizer, load_text("wikitext2"))).tolist()
    windows = [ids[i * args.window:(i + 1) * args.window] for i in range(args.windows)]
    models = {"float32 demo": "demo"}
    if args.w4a16:
        models["W4A16 demo"] = args.w4a16
    rows = {}
    for label, model in models.items():
        start = time.perf_counter()
        rows[label] = compare(model, windows)
        print(f"{label}: {rows[label]} ({time.perf_counter() - start:.0f} s)", flush=True)
    result = {"machine": platform.machine(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "data": f"WikiText-2 test, {args.windows} windows x {args.window} tokens", "models": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "lm_head.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "lm_head.md").write_text(render(result))
    print(render(result))


def render(result: dict) -> str:
    lines = [
        "# Reduced precision in the runtime (`--lm-head bf16`, `--lm-head int8`, `--matmul-precision medium` / `low`): accuracy cost",
        "",
        (f"{result['data']}, next-token distributions at every position from the runtime's forward, each head "
         "against the checkpoint's float32 head (same model otherwise). Generated by `bench/lm_head.py`, "
         f"{result['date']}, torch {result['torch']}."),
        "",
        "| model | variant | positions | KLD mean (nats) | KLD p99 | KLD max | top-1 agreement | perplexity | head MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, heads in result["models"].items():
        f = heads["float"]
        lines.append(f"| {label} | float32 (as stored) | | | | | | {f['perplexity']:.3f} | {f['head_bytes'] / 1e6:.1f} |")
        for head in VARIANTS:
            r = heads[head]
            lines.append(
                f"| {label} | {head} | {r['positions']} | {r['kld_mean']:.2e} | {r['kld_p99']:.2e} | {r['kld_max']:.2e} | "
                f"{100 * r['top1_agreement']:.2f}% | {r['perplexity']:.3f} | {r['head_bytes'] / 1e6:.1f} |")
    lines += [
        "",
        "bf16: the float32 weights rounded to bfloat16 at load, run by the float GEMV of `runtime/kernels/cpu_dense.py`",
        "(widened to float32 in registers). int8: quantized per output channel (scale = max|w| / 127, round to",
        "nearest), run by the int8 kernel of `runtime/kernels/cpu_linear.py`. With tied embeddings the float table",
        "stays for lookups. medium: `--matmul-precision medium`, the quantized linears' weights and activations rounded",
        "to bfloat16 with float32 sums (`runtime/kernels/csrc/cpu_linear_bf16.h`); float layers (the float32 demo's) are",
        "unaffected, so its row measures nothing but shows that. low: `--matmul-precision low`, the activations of",
        "the int4 linears rounded to int8 per 32 inputs (llama.cpp's Q8_0 activations) and multiplied in integers",
        "(`runtime/kernels/csrc/cpu_linear_simd.h`), the rest as medium. Where the top-1 choices differ, the float head's two best tokens were close "
        "(log-probability gap, median / max): "
        + "; ".join(f"{label} {head} {r[head]['top2_gap_at_disagreements_median']:.3f} / {r[head]['top2_gap_at_disagreements_max']:.3f}"
                    for label, r in result["models"].items() for head in VARIANTS) + ".",
        "For scale: llama.cpp's Q8_0 of the whole model costs a mean KLD of about 4e-3 on this model",
        "(2048-token windows, against its own F32; ../shared/anchors/llamacpp_smollm2.json).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
