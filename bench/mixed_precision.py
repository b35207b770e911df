"""Mixed precision on the demo model: auto plans (``--scheme AUTO``) at several bit budgets next to
uniform schemes, all quantized and evaluated in this one run on the same windows.

1. per-tensor sensitivities measured once (``llmopt.quant.sensitivity``, calibration windows
   from the default calibration text) and cached in ``out/mixed/sensitivity.json``;
2. one plan per budget (``llmopt.quant.allocate``), written as ``plan.json`` and applied by
   ``run_quantize(scheme=AUTO, plan=…)`` — the ``--plan`` path;
3. each variant: mean / p99 KLD, top-1 and perplexity against the float demo model on WikiText-2
   and on the held-out Gutenberg text (never used for calibration), bits per weight (nominal:
   codes + 16-bit scales), checkpoint and ``--type auto`` GGUF file sizes, and the predicted
   KLD of the plan next to the measured one.

llama.cpp's own files need ``llama-quantize``; when it is not importable here, its figures are the
external reference values of ``shared/anchors/llamacpp_smollm2.json`` (6 windows, measured
earlier on this machine type), labelled as such in the results.

    python bench/mixed_precision.py [--windows 4] [--method rtn] [--budgets 4.5 4.85 5.5 6.0]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
ANCHORS = ROOT.parent / "shared" / "anchors" / "llamacpp_smollm2.json"
OUT = ROOT / "out" / "mixed"
DATASETS = ("wikitext2", "heldout")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def sensitivity(source: Path, samples: int, seq_len: int):
    from llmopt.checkpoints.models import load_model
    from llmopt.core.data import calibration_ids
    from llmopt.quant.sensitivity import Sensitivity, measure_sensitivity

    cache = OUT / f"sensitivity-{samples}x{seq_len}.json"
    if cache.exists():
        return Sensitivity.from_dict(json.loads(cache.read_text())), json.loads(cache.read_text()).get("seconds")
    model, tokenizer = load_model(source)
    ids, _ = calibration_ids(tokenizer, "austen", samples, seq_len, 0)
    start = time.perf_counter()
    sens = measure_sensitivity(model, ids)
    seconds = time.perf_counter() - start
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({**sens.to_dict(), "seconds": seconds}))
    return sens, seconds


def quantize(name: str, **options) -> Path:
    from llmopt.pipeline.stages.quantize import QuantizeConfig, run_quantize

    out = OUT / name.replace(" ", "_")
    if not (out / "config.json").exists():
        start = time.perf_counter()
        run_quantize(QuantizeConfig(model="demo", output=str(out), overwrite=True, **options))
        log(f"{name}: quantized in {time.perf_counter() - start:.0f} s")
    return out


def measure(path: Path, windows: int) -> dict:
    from llmopt.accuracy import run_eval
    from llmopt.formats.gguf_export import export_gguf

    row: dict = {"checkpoint_bytes": sum(f.stat().st_size for f in path.glob("*.safetensors"))}
    gguf = path.parent / f"{path.name}.gguf"
    if not gguf.exists():
        export_gguf(path, gguf, "auto")
    row["gguf_bytes"] = gguf.stat().st_size
    for dataset in DATASETS:
        r = run_eval(str(path), "demo", dataset, 2048, windows)
        row[dataset] = {"kld_mean": r.kld_mean, "kld_p99": r.kld_p99, "top1": r.top1_agreement,
                        "ppl": r.perplexity, "tokens": r.tokens}
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--method", default="rtn")
    parser.add_argument("--budgets", type=float, nargs="*", default=[4.5, 4.85, 5.5, 6.0])
    parser.add_argument("--sens-samples", type=int, default=4)
    parser.add_argument("--sens-seq-len", type=int, default=512)
    parser.add_argument("--only", nargs="*", default=None, help="variant names to run (default: all)")
    args = parser.parse_args()
    from llmopt.checkpoints.models import resolve_model
    from llmopt.quant.allocate import allocate, plan_table, totals

    source = resolve_model("demo")
    sens, sens_seconds = sensitivity(source, args.sens_samples, args.sens_seq_len)
    n_weights = sum(t.numel for t in sens.tensors) + sens.other_params
    log(f"sensitivity: {len(sens.tensors)} tensors, {sens.tokens} tokens, {sens_seconds:.0f} s")
    variants: dict[str, dict] = {}
    uniform = {
        "W4A16 g32": dict(scheme="W4A16", group_size=32),
        "W4A16 g64": dict(scheme="W4A16", group_size=64),
        "W4A16 g32 + int8 embedding/head": dict(scheme="W4A16", group_size=32, head="int8", embedding="int8"),
        "W8A16": dict(scheme="W8A16"),
    }
    for budget in args.budgets:
        plan = allocate(sens, target_bpw=budget)
        record = {**plan.to_dict(), "shapes": {t.name: list(t.shape) for t in sens.tensors},
                  "kinds": {t.name: t.kind for t in sens.tensors}, "table": plan_table(sens, plan)}
        plan_path = OUT / f"plan-{budget}.json"
        plan_path.parent.mkdir(parents=True, exist_ok=True)
        plan_path.write_text(json.dumps(record, indent=1))
        variants[f"auto {budget} bpw {args.method}"] = {
            "options": {"scheme": "AUTO", "plan": str(plan_path), "method": args.method},
            "bpw": round(totals(sens, plan.formats)[0], 4), "predicted_kld": plan.predicted_kld,
            "plan_table": record["table"],
        }
    for name, opts in uniform.items():
        variants[f"{name} {args.method}"] = {"options": {**opts, "method": args.method}}
    if args.method != "rtn":
        for v in variants.values():
            v["options"].update(calib_samples=32)
    results = {}
    if args.only:
        variants = {k: v for k, v in variants.items() if k in args.only}
    previous = RESULTS / "mixed_precision.json"
    if previous.exists():  # keep variants measured by an earlier bounded run with the same settings
        old = json.loads(previous.read_text())
        if (old.get("method"), old.get("windows")) == (args.method, args.windows):
            results.update({k: v for k, v in old.get("results", {}).items() if k not in variants})
    for name, v in variants.items():
        path = quantize(name, **v["options"])
        start = time.perf_counter()
        row = measure(path, args.windows)
        row.update({k: v[k] for k in ("bpw", "predicted_kld", "plan_table") if k in v})
        if "bpw" not in row:
            row["bpw"] = round(8 * _quantized_bits(path) / n_weights, 4)
        row["file_bpw_gguf"] = round(8 * row["gguf_bytes"] / n_weights, 3)
        results[name] = row
        log(f"{name}: {json.dumps({d: row[d] for d in DATASETS})} gguf {row['gguf_bytes']:,} B ({time.perf_counter() - start:.0f} s)")
        write(results, args, sens_seconds, n_weights)


def _quantized_bits(path: Path) -> float:
    """Nominal stored bytes of a uniform checkpoint: its safetensors with scales counted at 16 bits."""
    from safetensors import safe_open

    total = 0.0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for key in h.keys():
                t = h.get_slice(key)
                n = 1
                for d in t.get_shape():
                    n *= d
                size = {"F32": 4, "BF16": 2, "F16": 2, "I32": 4, "I64": 8, "I8": 1, "U8": 1}.get(t.get_dtype(), 4)
                if key.endswith("weight_scale"):
                    size = 2
                total += n * size
    return total


def write(results: dict, args, sens_seconds: float, n_weights: int) -> None:
    anchors = json.loads(ANCHORS.read_text()) if ANCHORS.exists() else {}
    try:
        import llama_cpp  # noqa: F401
        llamacpp = "importable (own files not produced by this script yet)"
    except ImportError:
        llamacpp = "not importable here: llama.cpp figures are external reference values"
    payload = {
        "what": "auto mixed-precision plans vs uniform schemes on the demo model (SmolLM2-135M-Instruct, float = bundled Q4_1 dequantized)",
        "machine": platform.platform(), "method": args.method, "windows": args.windows, "seq_len": 2048,
        "sensitivity": {"samples": args.sens_samples, "seq_len": args.sens_seq_len, "seconds": sens_seconds},
        "weights_counted": n_weights,
        "llama_cpp": llamacpp,
        "llama_cpp_reference": {
            "source": "shared/anchors/llamacpp_smollm2.json (external reference: 6 windows of 2048 of WikiText-2, llama.cpp's own F32 as baseline, not this run)",
            "by_type": {k: {**anchors.get("accuracy", {}).get("by_type", {}).get(k, {}),
                            "file_bytes": anchors.get("file_bytes", {}).get(k)} for k in ("Q4_0", "Q4_K_M", "Q6_K", "Q5_K_M")},
        },
        "results": results,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "mixed_precision.json").write_text(json.dumps(payload, indent=1) + "\n")
    lines = [
        "# Mixed precision (auto plans) on the demo model",
        "",
        f"Method {args.method}; accuracy on the first {args.windows} windows of 2048 tokens against the float demo model; "
        "bpw = nominal stored bits per weight (codes + 16-bit scales) over all weights; GGUF = `llmopt export --type auto` file.",
        f"Sensitivity pass: {args.sens_samples} windows of {args.sens_seq_len} tokens, {sens_seconds:.0f} s. llama.cpp: {llamacpp}.",
        "",
        "| variant | bpw | GGUF MiB | GGUF bpw | predicted KLD | wiki KLD mean | wiki KLD p99 | wiki top-1 | wiki ppl | held-out KLD mean | held-out ppl |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        w, h = r["wikitext2"], r["heldout"]
        pred = f"{r['predicted_kld']:.4f}" if "predicted_kld" in r else ""
        lines.append(f"| {name} | {r['bpw']:.3f} | {r['gguf_bytes'] / 2**20:.1f} | {r['file_bpw_gguf']:.2f} | {pred} | "
                     f"{w['kld_mean']:.4f} | {w['kld_p99']:.3f} | {w['top1']:.3f} | {w['ppl']:.2f} | {h['kld_mean']:.4f} | {h['ppl']:.2f} |")
    lines += ["", "llama.cpp's own files (external reference values from shared/anchors/llamacpp_smollm2.json, "
              "6 windows, against llama.cpp's F32 run — not measured in this run):", "",
              "| type | file MiB | file bpw | KLD mean | KLD p99 | top-1 | ppl |", "|---|---|---|---|---|---|---|"]
    for k, v in payload["llama_cpp_reference"]["by_type"].items():
        size = v.get("file_bytes")
        mib = f"{size / 2**20:.1f}" if size else "n/a"
        bpw = f"{8 * size / n_weights:.2f}" if size else "n/a"
        if "kld_mean" in v:
            lines.append(f"| {k} | {mib} | {bpw} | {v['kld_mean']:.4f} | {v['kld_p99']:.3f} | {v['top1']:.3f} | {v['ppl']:.2f} |")
    (RESULTS / "mixed_precision.md").write_text("\n".join(lines) + "\n")
    _plot(results, payload, n_weights)


def _plot(results: dict, payload: dict, n_weights: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        marker = "o" if name.startswith("auto") else "s"
        ax.scatter(r["gguf_bytes"] / 2**20, r["wikitext2"]["kld_mean"], marker=marker)
        ax.annotate(name, (r["gguf_bytes"] / 2**20, r["wikitext2"]["kld_mean"]), fontsize=7)
    for k, v in payload["llama_cpp_reference"]["by_type"].items():
        if v.get("file_bytes") and "kld_mean" in v:
            ax.scatter(v["file_bytes"] / 2**20, v["kld_mean"], marker="x", color="black")
            ax.annotate(f"llama.cpp {k} (ref.)", (v["file_bytes"] / 2**20, v["kld_mean"]), fontsize=7)
    ax.set_xlabel("GGUF file size (MiB)")
    ax.set_ylabel("mean KLD vs float (WikiText-2)")
    ax.set_yscale("log")
    ax.set_title("demo model: size vs KLD")
    fig.tight_layout()
    fig.savefig(RESULTS / "mixed_precision.png", dpi=120)


if __name__ == "__main__":
    main()
