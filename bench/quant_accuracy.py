"""Quantization accuracy on the demo model: every scheme × method against the float model.

Each variant is quantized by ``llmopt quantize`` in its own process (so its time and peak RSS
are its own), then evaluated by ``llmopt eval VARIANT --baseline demo`` on WikiText-2 windows of
2048 tokens; the float model's distributions are computed once and cached. Results go to
``bench/results/quant_accuracy.{json,md}``; a rerun skips variants already measured with the
same settings (``--force`` redoes them).

    python bench/quant_accuracy.py [--windows 16] [--only NAME ...] [--force]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from common import cpu_name, llmopt, run_variants

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
ANCHORS = ROOT.parent / "shared" / "anchors"

QUIET_LOAD = 2.5  # 1-minute load average at a row's start that still means nothing else ran

# name: (scheme, method, group size, extra quantize flags)
VARIANTS: dict[str, tuple[str, str, int | None, list[str]]] = {
    "W8A16 rtn": ("W8A16", "rtn", None, []),
    "W8A16 gptq": ("W8A16", "gptq", None, []),
    "FP8 rtn": ("FP8", "rtn", None, []),
    "FP8_DYNAMIC rtn": ("FP8_DYNAMIC", "rtn", None, []),
    "W8A8 rtn": ("W8A8", "rtn", None, []),
    "W8A8 smoothquant": ("W8A8", "smoothquant", None, []),
    "W4A16 g64 rtn": ("W4A16", "rtn", 64, []),
    "W4A16 g64 gptq": ("W4A16", "gptq", 64, []),
    "W4A16 g64 awq": ("W4A16", "awq", 64, []),
    "W4A16 g32 rtn": ("W4A16", "rtn", 32, []),
    "W4A16 g32 gptq": ("W4A16", "gptq", 32, []),
    "W4A16 g32 awq+gptq": ("W4A16", "awq+gptq", 32, []),
    "W4A16 g32 gptq, int4 head": ("W4A16", "gptq", 32, ["--head", "int4"]),
    "W4A16 g32 awq+gptq, int4 head": ("W4A16", "awq+gptq", 32, ["--head", "int4"]),
    "W4A16 g32 awq+gptq, float targets": ("W4A16", "awq+gptq", 32, ["--float-targets"]),
    "W4A16 g128 (mixed 64/128) rtn": ("W4A16", "rtn", 128, []),
    "NF4 (bitsandbytes)": ("NF4", "rtn", None, []),
    "W4A16_ASYM g32 rtn (demo weights' own grid)": ("W4A16_ASYM", "rtn", 32, []),
    "W4A16 g32 awq": ("W4A16", "awq", 32, []),
    "W4A16 g128 (mixed 64/128) gptq": ("W4A16", "gptq", 128, []),
    "W8A8 smoothquant+gptq": ("W8A8", "smoothquant+gptq", None, []),
    "W4A16 g64 hqq": ("W4A16", "hqq", 64, []),
    "W4A16_ASYM g128 (mixed 64/128) rtn": ("W4A16_ASYM", "rtn", 128, []),
    "W4A16_ASYM g128 (mixed 64/128) hqq": ("W4A16_ASYM", "hqq", 128, []),
    "W4A16_ASYM g128 (mixed 64/128) gptq": ("W4A16_ASYM", "gptq", 128, []),
}


def measure(name: str, spec, windows: int, workdir: Path) -> dict:
    scheme, method, group, extra = spec
    out = workdir / name.split(" (")[0].replace(" ", "_").replace("+", "-")
    args = ["quantize", "demo", "--scheme", scheme, "--method", method, "-o", str(out), "--overwrite", *extra]
    if group:
        args += ["--group-size", str(group)]
    load = os.getloadavg()[0]  # the quantize time depends on what else runs
    record = llmopt(*args)
    figures = llmopt("eval", str(out), "--baseline", "demo", "--max-windows", str(windows))
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    return {
        "scheme": scheme, "method": method, "group_size_asked": group, "group_sizes": record.get("group_sizes"),
        "ppl": figures["perplexity"], "kld_mean": figures["kld_mean"], "kld_median": figures["kld_median"],
        "kld_p99": figures["kld_p99"], "top1": figures["top1_agreement"], "tokens": figures["tokens"],
        "windows": figures["windows"], "weights_bytes": size,
        "quantize_seconds": record.get("quantize_seconds", record.get("total_seconds")),
        "total_seconds": record.get("total_seconds"), "cpu_seconds": record.get("cpu_seconds"),
        "peak_rss_mib": record.get("peak_rss_mib"),
        "calibration": record.get("calibration"),
        "date": time.strftime("%Y-%m-%d"), "load_average_at_start": round(load, 2), "cpu": cpu_name(),
    }



def anchor_rows() -> list[str]:
    rows = []
    try:
        llama = json.loads((ANCHORS / "llamacpp_smollm2.json").read_text())["accuracy"]["by_type"]
        for name in ("Q8_0", "Q6_K", "Q4_K_M", "Q4_0"):
            r = llama[name]
            rows.append(f"| llama.cpp {name} (6 windows) | {r['ppl']:.3f} | {r['kld_mean']:.4f} | {r['kld_p99']:.3f} | {100 * r['top1']:.1f}% | | | |")
        comp = json.loads((ANCHORS / "llmcompressor_smollm2.json").read_text())["variants"]
        for name, r in comp.items():
            rows.append(f"| llm-compressor {name} (6 windows) | {r['ppl']:.3f} | {r['kld_mean']:.4f} | {r['kld_p99']:.3f} | {100 * r['top1']:.1f}% | | {r.get('quantize_wall_s', '')} s | |")
    except (OSError, KeyError, ValueError):
        pass
    return rows


def target_lines(results: dict) -> list[str]:
    """Each target of the issue, with the figures that decide it."""
    def kld(name: str) -> float | None:
        return results[name]["kld_mean"] if name in results else None

    def verdict(ok: bool | None) -> str:
        return "not measured" if ok is None else ("**met**" if ok else "**missed**")

    lines = []
    w8 = [n for n in results if n.startswith("W8A16")]
    best_w8 = min(w8, key=kld) if w8 else None
    if best_w8:
        r = results[best_w8]
        lines.append(f"- W8A16 mean KLD ≤ 0.002 and top-1 ≥ 97%: {best_w8} {r['kld_mean']:.4f} / {100 * r['top1']:.1f}% — "
                     + verdict(r["kld_mean"] <= 0.002 and r["top1"] >= 0.97))
    if kld("FP8 rtn") is not None:
        lines.append(f"- FP8 (weight-only) mean KLD ≤ 0.02: {kld('FP8 rtn'):.4f} — {verdict(kld('FP8 rtn') <= 0.02)}")
    rtn64 = kld("W4A16 g64 rtn")
    for method in ("gptq", "awq"):
        other = kld(f"W4A16 g64 {method}")
        if rtn64 is not None and other is not None:
            lines.append(f"- W4A16 g64 {method.upper()} ≥ 25% below RTN: {other:.4f} vs {rtn64:.4f} "
                         f"({100 * (1 - other / rtn64):.0f}% lower) — {verdict(other <= 0.75 * rtn64)}")
    for fmt in ("W4A16 g64", "W4A16_ASYM g128 (mixed 64/128)"):
        rtn, hqq, gptq_k = kld(f"{fmt} rtn"), kld(f"{fmt} hqq"), kld(f"{fmt} gptq")
        if rtn is not None and hqq is not None:
            against = f", GPTQ (calibrated) {gptq_k:.4f}" if gptq_k is not None else ""
            lines.append(f"- HQQ (calibration-free, issue 43) below RTN at {fmt}: {hqq:.4f} vs RTN {rtn:.4f}{against} — "
                         + verdict(hqq < rtn))
    g32 = {n: r for n, r in results.items() if n.startswith("W4A16 g32")}
    if g32:
        best = min(g32, key=lambda n: g32[n]["kld_mean"])
        value = g32[best]["kld_mean"]
        lines.append(f"- W4A16 g32 symmetric, best method, mean KLD ≤ 0.155 (half of llama.cpp Q4_0's 0.31): {best} "
                     f"{value:.4f} — {verdict(value <= 0.155)}; Q4_K_M's 0.061 is the aim beyond")
    gptq = results.get("W4A16 g32 gptq")
    if gptq and "load_average_at_start" in gptq:
        quiet = gptq["load_average_at_start"] <= QUIET_LOAD
        lines.append(f"- GPTQ W4A16 g32 ≤ 120 s on a quiet machine (issue 16): {gptq['quantize_seconds']:.0f} s at load "
                     f"average {gptq['load_average_at_start']:.1f} (≤ {QUIET_LOAD} counts as quiet: the previous row's "
                     "own two threads leave about 2) — "
                     + (verdict(gptq["quantize_seconds"] <= 120) if quiet else "not measured quietly"))
    for name in ("W4A16 g32 gptq, int4 head", "W4A16 g32 awq+gptq, int4 head"):
        if name in results:
            lines.append(f"- {name} (the format bench/e2e_speed.py times against llama.cpp Q4_0) mean KLD "
                         f"{kld(name):.4f} vs llama.cpp Q4_0's 0.31 — {verdict(kld(name) < 0.31)}")
    if gptq:
        lines.append(f"- GPTQ W4A16 under 5 minutes and 4 GB peak RSS: {gptq['quantize_seconds']:.0f} s, "
                     f"{gptq['peak_rss_mib']:.0f} MiB — {verdict(gptq['quantize_seconds'] < 300 and gptq['peak_rss_mib'] < 4096)}"
                     " (GPTQ is deterministic for a seed and calibration set: tests/test_quant_algorithms.py)")
    return lines


def write_markdown(results: dict, meta: dict) -> None:
    base = meta["baseline"]
    lines = [
        "# Quantization accuracy on the demo model (SmolLM2-135M-Instruct)",
        "",
        f"WikiText-2 raw test, first {meta['windows']} windows of 2048 tokens ({base['tokens']:,} scored tokens); "
        f"KLD and top-1 against the float model (ppl {base['perplexity']:.4f}). Calibration: {meta['calibration']}. "
        f"Machine: {meta['machine']}; {meta['date']}.",
        "",
        "| variant | ppl | KLD mean | KLD p99 | top-1 | weights (MiB) | quantize time | peak RSS (MiB) | measured (load average at start) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        when = f"{r['date']} ({r['load_average_at_start']:.1f})" if "date" in r else "2026-11-30 or before"
        lines.append(
            f"| {name} | {r['ppl']:.3f} | {r['kld_mean']:.4f} | {r['kld_p99']:.3f} | {100 * r['top1']:.1f}% | "
            f"{r['weights_bytes'] / 2**20:.1f} | {r['quantize_seconds']:.1f} s | {r['peak_rss_mib']:.0f} | {when} |"
        )
    cpus = sorted({r["cpu"] for r in results.values() if "cpu" in r})
    lines += ["", "Targets (issue 3; HQQ: issue 43):", "", *target_lines(results), "",
              "Quantize times are wall times on a 2-core machine, so they depend on the load beside them (last "
              "column; rows measured before 2026-12-01 have no record of it: those ran on an Intel machine, the "
              f"dated ones on {', '.join(cpus) or 'the machine named above'}). The results themselves do not: GPTQ "
              "is deterministic. GPTQ-only rows measured from 2026-12-01 on ran the one-pass (true-sequential) GPTQ "
              "of llmopt.quant.apply._one_pass; AWQ+GPTQ keeps the observe-then-re-run passes.",
              "",
              "W4A16_ASYM g32 is reported but excluded from the method comparisons above: the demo model was "
              "shipped as llama.cpp Q4_1 (asymmetric groups of 32 with a float offset), a grid close to this "
              "scheme's, so its figure says more about the source file than about a method. (Integer zero points "
              "cannot hold Q4_1's float offsets exactly, which is why it does not reproduce the weights.)"]
    lines += ["", "Peers, measured on this machine on the first 6 windows (../shared/anchors):", "",
              "| peer | ppl | KLD mean | KLD p99 | top-1 | | time | |", "|---|---|---|---|---|---|---|---|", *anchor_rows()]
    (RESULTS / "quant_accuracy.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--only", nargs="*", help="variant names (substring match)")
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--workdir", default=str(ROOT / "out" / "bench-quant"))
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "quant_accuracy.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    results = saved.get("variants", {}) if saved.get("windows") == args.windows else {}
    baseline = llmopt("eval", "demo", "--baseline", "demo", "--max-windows", str(args.windows))
    def save() -> None:
        if path.is_file():  # keep rows another run wrote meanwhile
            on_disk = json.loads(path.read_text())
            if on_disk.get("windows") == args.windows:
                results.update({k: v for k, v in on_disk.get("variants", {}).items() if k not in results})
        ordered = {k: results[k] for k in VARIANTS if k in results}
        calib = next((r["calibration"] for r in ordered.values() if r.get("calibration")), None)
        meta = {
            "windows": args.windows, "baseline": baseline, "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "calibration": "none" if not calib else f"{calib['name']} {calib['samples']}×{calib['seq_len']} tokens, seed {calib['seed']}",
        }
        path.write_text(json.dumps({**meta, "variants": ordered}, indent=2) + "\n")
        write_markdown(ordered, meta)

    run_variants(
        list(VARIANTS), results, lambda name: measure(name, VARIANTS[name], args.windows, Path(args.workdir)),
        lambda r: (f"ppl {r['ppl']:.3f}  KLD {r['kld_mean']:.4f}  top-1 {100 * r['top1']:.1f}%  "
                   f"quantize {r['quantize_seconds']:.0f}s  RSS {r['peak_rss_mib']:.0f} MiB"),
        save, args.only, args.force,
    )
    if results:
        save()


if __name__ == "__main__":
    main()
