"""Pruning accuracy on the demo model: every method against the float model.

Each variant is pruned by ``llmopt prune`` in its own process (so its time and peak RSS are its
own), then evaluated by ``llmopt eval VARIANT --baseline demo`` on WikiText-2 windows of 2048
tokens; the float model's distributions are computed once and cached. Results go to
``bench/results/prune_accuracy.{json,md}``; a rerun skips variants already measured with the
same settings (``--force`` redoes them). Checkpoints are deleted after evaluation unless
``--keep``.

    python bench/prune_accuracy.py [--windows 16] [--calib-samples 64] [--only NAME ...] [--force]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import time
from pathlib import Path

from common import llmopt, run_variants

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DEPTH_CALIB = ["--calib-samples", "8", "--calib-seq-len", "512"]  # one ranking per method, cached across counts

# name: extra ``llmopt prune`` arguments ("{calib}" is replaced by the calibration arguments)
VARIANTS: dict[str, list[str]] = {
    "magnitude 50%": ["--method", "magnitude", "--sparsity", "0.5"],
    "wanda 50%": ["--method", "wanda", "--sparsity", "0.5", "{calib}"],
    "sparsegpt 50%": ["--method", "sparsegpt", "--sparsity", "0.5", "{calib}"],
    "wanda 2:4": ["--method", "wanda", "--pattern", "2:4", "{calib}"],
    "sparsegpt 2:4": ["--method", "sparsegpt", "--pattern", "2:4", "{calib}"],
    "drop 2 layers (block influence)": ["--method", "drop-layers", "--num", "2", "--ranking", "block-influence", *DEPTH_CALIB],
    "drop 4 layers (block influence)": ["--method", "drop-layers", "--num", "4", "--ranking", "block-influence", *DEPTH_CALIB],
    "drop 8 layers (block influence)": ["--method", "drop-layers", "--num", "8", "--ranking", "block-influence", *DEPTH_CALIB],
    "drop 2 layers (perplexity)": ["--method", "drop-layers", "--num", "2", "--ranking", "perplexity", *DEPTH_CALIB],
    "drop 4 layers (perplexity)": ["--method", "drop-layers", "--num", "4", "--ranking", "perplexity", *DEPTH_CALIB],
    "drop 8 layers (perplexity)": ["--method", "drop-layers", "--num", "8", "--ranking", "perplexity", *DEPTH_CALIB],
    "width: 25% of FFN channels": ["--method", "width", "--ffn-ratio", "0.25", "{calib}"],
    "magnitude 2:4": ["--method", "magnitude", "--pattern", "2:4"],
}


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def measure(name: str, args: list[str], calib: list[str], windows: int, workdir: Path, keep: bool) -> dict:
    out = workdir / _slug(name)
    expanded = [a for arg in args for a in (calib if arg == "{calib}" else [arg])]
    record = llmopt("prune", "demo", *expanded, "-o", str(out), "--overwrite")
    figures = llmopt("eval", str(out), "--baseline", "demo", "--max-windows", str(windows))
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    sparsity = record.get("sparsity") or {}
    return {
        "args": expanded, "ppl": figures["perplexity"], "kld_mean": figures["kld_mean"], "kld_median": figures["kld_median"],
        "kld_p99": figures["kld_p99"], "top1": figures["top1_agreement"], "tokens": figures["tokens"],
        "windows": figures["windows"], "seq_len": figures["seq_len"],
        "parameters": record["parameters"]["after"], "parameters_before": record["parameters"]["before"],
        "weights_bytes": record["weights_bytes"], "sparsity": sparsity.get("overall"),
        "pattern_valid": sparsity.get("pattern_valid"), "layers": (record.get("depth") or {}).get("layers"),
        "dropped": (record.get("depth") or {}).get("dropped"), "width": record.get("width"),
        "prune_seconds": record["prune_seconds"], "total_seconds": record["total_seconds"],
        "ranking_seconds": record.get("ranking_seconds"), "ranking_cached": record.get("ranking_cached"),
        "peak_rss_mib": record["peak_rss_mib"], "calibration": record.get("calibration"),
    }


def _shape_checks(results: dict) -> list[str]:
    """The papers' expected ordering, checked on the measured figures."""
    lines = []

    def ppl(name: str) -> float | None:
        return results.get(name, {}).get("ppl")

    mag, wanda, sgpt = ppl("magnitude 50%"), ppl("wanda 50%"), ppl("sparsegpt 50%")
    if None not in (mag, wanda, sgpt):
        holds = wanda < mag and sgpt < mag
        lines.append(f"- 50% unstructured: magnitude {mag:.2f}, Wanda {wanda:.2f}, SparseGPT {sgpt:.2f} — "
                     f"{'holds' if holds else 'does NOT hold'} (Wanda and SparseGPT below magnitude, by "
                     f"{mag / wanda:.1f}× and {mag / sgpt:.1f}×).")
    w24, s24 = ppl("wanda 2:4"), ppl("sparsegpt 2:4")
    if None not in (w24, s24):
        lines.append(f"- 2:4: Wanda {w24:.2f}, SparseGPT {s24:.2f} — {'holds' if s24 < w24 else 'does NOT hold'} "
                     "(SparseGPT 2:4 below Wanda 2:4).")
    return lines


def _time(r: dict) -> str:
    """Prune time; for drop-layers the block ranking's (computed once per ranking, then cached)."""
    if r.get("ranking_seconds") is not None:
        return f"{r['ranking_seconds']:.0f} s ranking" + (" (cached)" if r.get("ranking_cached") else "")
    return f"{r['prune_seconds']:.0f} s"


def write_markdown(results: dict, meta: dict) -> None:
    base = meta["baseline"]
    lines = [
        "# Pruning accuracy on the demo model (SmolLM2-135M-Instruct)",
        "",
        (f"WikiText-2 raw test, first {meta['windows']} windows of 2048 tokens ({base['tokens']:,} scored tokens); "
         f"KLD and top-1 against the float model (ppl {base['perplexity']:.4f}, {meta['parameters']:,} parameters). "
         f"Calibration: {meta['calibration']}. Machine: {meta['machine']}; {meta['date']}."),
        "",
        "| variant | parameters | weights (MiB) | zeros in decoder Linears | ppl | KLD mean | KLD p99 | top-1 | prune time | peak RSS (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
        (f"| float (baseline) | {meta['parameters']:,} | {meta['weights_bytes'] / 2**20:.1f} | 0% | "
         f"{base['perplexity']:.3f} | 0 | 0 | 100% | | |"),
    ]
    for name, r in results.items():
        zeros = "" if r["sparsity"] is None else f"{100 * r['sparsity']:.1f}%" + (" (2:4 valid)" if r.get("pattern_valid") else "")
        lines.append(
            f"| {name} | {r['parameters']:,} | {r['weights_bytes'] / 2**20:.1f} | {zeros or '—'} | {r['ppl']:.3f} | "
            f"{r['kld_mean']:.4f} | {r['kld_p99']:.3f} | {100 * r['top1']:.1f}% | {_time(r)} | {r['peak_rss_mib']:.0f} |"
        )
    dropped = {n: r["dropped"] for n, r in results.items() if r.get("dropped")}
    if dropped:
        lines += ["", "Dropped layers (of 0–29):", ""] + [f"- {n}: {', '.join(map(str, d))}" for n, d in dropped.items()]
    checks = _shape_checks(results)
    if checks:
        lines += ["", "Expected shape (SparseGPT / Wanda papers, Llama models):", "", *checks]
    lines += ["", ("Prune time includes calibration (sequential engine) but not loading or saving; unstructured and 2:4 "
                   "checkpoints are dense safetensors, so their size equals the float model's.")]
    (RESULTS / "prune_accuracy.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--calib-seq-len", type=int, default=512)
    parser.add_argument("--only", nargs="*", help="variant names (substring match)")
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the pruned checkpoints")
    parser.add_argument("--workdir", default=str(ROOT / "out" / "bench-prune"))
    args = parser.parse_args()
    calib = ["--calib-samples", str(args.calib_samples), "--calib-seq-len", str(args.calib_seq_len)]
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "prune_accuracy.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    same = saved.get("windows") == args.windows and saved.get("calib_args") == calib
    results = saved.get("variants", {}) if same else {}
    baseline = saved.get("baseline") if same else None
    baseline = baseline or llmopt("eval", "demo", "--baseline", "demo", "--max-windows", str(args.windows))
    info = llmopt("inspect", "demo", "--no-sparsity")
    meta = {
        "windows": args.windows, "calib_args": calib, "baseline": baseline, "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
        "parameters": info["parameters"], "weights_bytes": info["bytes_in_memory"],
        "calibration": f"austen, seed 0: {args.calib_samples}×{args.calib_seq_len} tokens for Wanda, SparseGPT and width; "
                       f"{DEPTH_CALIB[1]}×{DEPTH_CALIB[3]} for the layer rankings (computed once per ranking, cached)",
    }

    def save() -> None:
        ordered = {k: results[k] for k in VARIANTS if k in results}
        path.write_text(json.dumps({**meta, "variants": ordered}, indent=2) + "\n")
        write_markdown(ordered, meta)

    run_variants(
        list(VARIANTS), results, lambda name: measure(name, VARIANTS[name], calib, args.windows, Path(args.workdir), args.keep),
        lambda r: (f"ppl {r['ppl']:.3f}  KLD {r['kld_mean']:.4f}  top-1 {100 * r['top1']:.1f}%  params {r['parameters']:,}  "
                   f"prune {r['prune_seconds']:.0f}s"),
        save, args.only, args.force,
    )
    save()

if __name__ == "__main__":
    main()
