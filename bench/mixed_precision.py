"""Mixed precision on the demo model: auto plans (``--scheme AUTO``) at several bit budgets next to
uniform schemes and llama.cpp's own files, all quantized and evaluated in this one run on the
same windows.

1. per-tensor sensitivities measured once (``llmopt.quant.sensitivity``, calibration windows
   from the default calibration text) and cached in ``out/mixed/``;
2. one plan per budget (``llmopt.quant.allocate``), written as ``plan.json`` and applied by
   ``run_quantize(scheme=AUTO, plan=…, method=…)`` — the ``--plan`` path. Budgets in checkpoint
   bits per weight (codes + 16-bit scales: ``--budgets``) and one sized to llama.cpp's own
   Q4_K_M file (``--size-of gguf``: the exported file's block bits, metadata subtracted);
3. llama.cpp (when ``llama_cpp`` imports): an F32 GGUF of the float demo model exported by us,
   quantized by ``llama_cpp.llama_model_quantize`` to Q4_0 / Q4_K_M / Q6_K, each file run by
   llama.cpp on the same windows, its sizes measured from the files; llama.cpp also runs our
   exported mixed GGUF (perplexity against ours);
4. each variant: mean / p99 KLD, top-1 and perplexity against the float demo model on WikiText-2
   and on the held-out Gutenberg text (never used for calibration), bits per weight, GGUF file
   size, and the predicted KLD of the plan next to the measured one.

Rows run in priority order; a row not started by ``--deadline`` (UTC HH:MM) is skipped and listed
as such. Results are saved after every row; a rerun with the same settings keeps finished rows.

    python bench/mixed_precision.py [--windows 2] [--method gptq] [--deadline 08:12]

Written to bench/results/mixed_precision_gptq_priced/mixed_precision.{json,md,png} (``--results``
for another folder). The current results there were made with ``--method awq+gptq --calib self
--windows 8 --sens-gptq`` (the settings are recorded in the JSON); a run with other settings
replaces them. Earlier experiments (other calibration texts, RTN pricing, code descent …) are in
git history, listed in docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "mixed_precision_gptq_priced"
ANCHORS = ROOT.parent / "shared" / "anchors" / "llamacpp_smollm2.json"
OUT = ROOT / "out" / "mixed"
DATASETS = ("wikitext2", "heldout")
SEQ_LEN = 2048
LLAMA_FTYPES = {"Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K",
                "IQ4_NL": "LLAMA_FTYPE_MOSTLY_IQ4_NL"}
Q4_K_M_ANCHOR_BYTES = 105_453_824  # llama.cpp's Q4_K_M file of the demo model (shared/anchors), when llama.cpp is absent
MODEL = "demo"  # --model (a small model for a smoke run)
SENSITIVITY_VERSION = 9  # candidate formats int4 g128/g64/g32, int4 / int5 asym g32, nl4 / nl4x g32, int5/int6/int8 g32,
# int6x g16 (Q6_K), int3x g16 (Q3_K), int8; int4/int4a/nl4/int5/int5a/int6/int8 head
# (v3: a calibrated method's head priced as GPTQ stores it; v4: int5 asym g32; v7: int6x, int4a / int5a head;
# v8: the head's most probable rows on their own KL-weighted Hessians; v9: int3x)
ENGINE_VERSION = 5  # calibration engine: v2 float32 Hessian products, bfloat16 forwards only where native; v3 GPTQ scale
# refit; v5 the head's most probable rows on their own Hessians (llmopt.quant.head_fisher)
# (engine "4" there, 4 rounds of code descent after the refit: bench/results/mixed_precision_descent, in git
# history at 894f7f0; off by default now)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def sensitivity(source: Path, samples: int, seq_len: int, head_gptq: bool, calib: str = "austen", linear_gptq: bool = False):
    """Per-tensor costs (cached) on the first ``samples`` windows of ``calib``, as ``--scheme auto``
    measures them; ``head_gptq``: the head priced as a calibrated method stores it; ``linear_gptq``:
    the Linears likewise."""
    from llmopt.checkpoints.models import load_model
    from llmopt.core.data import calibration_ids
    from llmopt.quant.sensitivity import Sensitivity, measure_sensitivity
    from llmopt.self_calibration import sampler

    slug = "" if calib == "austen" else "-" + re.sub(r"[^A-Za-z0-9]+", "_", calib).strip("_")
    cache = OUT / f"sensitivity-v{SENSITIVITY_VERSION}-{samples}x{seq_len}{'-gptq-head' if head_gptq else ''}{'-gptq-linears' if linear_gptq else ''}{slug}.json"
    if cache.exists():
        data = json.loads(cache.read_text())
        return Sensitivity.from_dict(data), data.get("seconds")
    model, tokenizer = load_model(source)
    ids, _ = calibration_ids(tokenizer, calib, samples, seq_len, 0, sample_self=sampler(source))
    start = time.perf_counter()
    sens = measure_sensitivity(model, ids, head_gptq=head_gptq, linear_gptq=linear_gptq)
    seconds = time.perf_counter() - start
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({**sens.to_dict(), "seconds": seconds}))
    return sens, seconds


def quantize(name: str, **options) -> tuple[Path, float | None]:
    from llmopt.pipeline.stages.quantize import QuantizeConfig, run_quantize

    out = OUT / name.replace(" ", "_")
    if (out / "config.json").exists() and _same_quantization(out, options):
        return out, json.loads((out / "llmopt.json").read_text()).get("quantize_seconds")
    start = time.perf_counter()
    run_quantize(QuantizeConfig(model=MODEL, output=str(out), overwrite=True, **options))
    seconds = time.perf_counter() - start
    log(f"{name}: quantized in {seconds:.0f} s")
    return out, round(seconds, 1)


def _same_quantization(out: Path, options: dict) -> bool:
    """Whether a checkpoint left by an earlier run was made with ``options``: the same method,
    calibration windows and (for a plan) formats; otherwise it is quantized again."""
    from llmopt.quant.gptq import DESCENT_ROUNDS
    from llmopt.quant.head_fisher import FISHER_ROWS

    record = json.loads((out / "llmopt.json").read_text())
    calibration = record.get("calibration") or {}
    if record.get("method") != options.get("method", "rtn") or calibration.get("samples") != options.get("calib_samples"):
        return False
    if calibration and calibration.get("seq_len", 512) != options.get("calib_seq_len", 512):
        return False
    if calibration and calibration.get("name") != options.get("calib", "austen"):
        return False
    made = record.get("options") or {}  # GPTQ's settings (a checkpoint from before the scale refit has none)
    if "gptq" in options.get("method", "rtn") and (made.get("scale_refit") is not True
                                                  or made.get("descent_rounds", 0) != DESCENT_ROUNDS
                                                  or made.get("damp") != options.get("damp", 0.01)
                                                  or made.get("float_targets", False) != options.get("float_targets", False)
                                                  or made.get("head_fisher_rows", 0) != FISHER_ROWS
                                                  or (options.get("method") == "awq+gptq" and made.get("gptq_after_awq") != "sequential")):
        return False
    tuned = record.get("scale_tuning") or {}
    if tuned.get("steps", 0) != options.get("tune_steps", 0) or (tuned and tuned["settings"]["lr"] != options.get("tune_lr")):
        return False
    if "plan" in options:
        return (record.get("plan") or {}).get("formats") == json.loads(Path(options["plan"]).read_text())["formats"]
    return True


def baseline(dataset: str, windows: int):
    """The evaluation windows and the float demo model's cached distributions (filled if missing)."""
    from llmopt.accuracy import BaselineCache, eval_data, fill_baseline
    from llmopt.checkpoints.models import load_model, resolve_model
    from llmopt.checkpoints.provenance import model_fingerprint
    from transformers import AutoTokenizer

    demo = resolve_model(MODEL)
    data = eval_data(AutoTokenizer.from_pretrained(demo), dataset, SEQ_LEN, windows)
    cache = BaselineCache.for_model(model_fingerprint(demo), data)
    if cache.missing(len(data.windows)):
        model, _ = load_model(demo)
        fill_baseline(model, data, cache)
    return data, cache


def figures(r) -> dict:
    return {"kld_mean": r.kld_mean, "kld_p99": r.kld_p99, "top1": r.top1_agreement, "ppl": r.perplexity, "tokens": r.tokens}


def measure(path: Path, windows: int) -> dict:
    """Our checkpoint: its ``--type auto`` GGUF export and our evaluation on both datasets."""
    from llmopt.accuracy import run_eval
    from llmopt.formats.gguf_export import export_gguf

    weights = list(path.glob("*.safetensors"))
    row: dict = {"checkpoint_bytes": sum(f.stat().st_size for f in weights)}
    gguf = path.parent / f"{path.name}.gguf"
    if not gguf.exists() or gguf.stat().st_mtime < max(f.stat().st_mtime for f in weights):  # never a stale export
        export_gguf(path, gguf, "auto", overwrite=True)
    row["gguf_bytes"] = gguf.stat().st_size
    for dataset in DATASETS:
        row[dataset] = figures(run_eval(str(path), MODEL, dataset, SEQ_LEN, windows))
    return row


def plain_llama_buffers() -> None:
    """Load llama.cpp models without its extra weight buffer types (AMX / repacked Q4_0 and Q8_0):
    on this machine they stop the process with an illegal instruction."""
    from llama_cpp import llama_cpp as c_api

    default = c_api.llama_model_default_params
    if getattr(default, "plain", False):
        return

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    params.plain = True
    c_api.llama_model_default_params = params


def measure_llama(path: Path, windows: int, datasets=DATASETS) -> dict:
    """A GGUF file run by llama.cpp on the same windows, against the same float distributions."""
    from gguf_export import LlamaCppModel  # bench/gguf_export.py

    plain_llama_buffers()

    from llmopt.accuracy import evaluate

    model = LlamaCppModel(path, SEQ_LEN)
    row: dict = {"gguf_bytes": path.stat().st_size}
    for dataset in datasets:
        data, cache = baseline(dataset, windows)
        row[dataset] = figures(evaluate(model, data, cache))
    del model
    return row


def llama_files(types: list[str]) -> dict[str, Path]:
    """llama.cpp's own files: our F32 GGUF of the float demo model quantized by llama.cpp."""
    import ctypes

    import llama_cpp
    from llmopt.formats.gguf_export import export_gguf

    f32 = OUT / "demo-f32.gguf"
    if not f32.exists():
        export_gguf(MODEL, f32, "F32")
    files = {"F32": f32}
    for t in types:
        path = OUT / f"llamacpp-{t}.gguf"
        if not path.exists():
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, LLAMA_FTYPES[t])
            params.nthread = os.cpu_count() or 1
            if llama_cpp.llama_model_quantize(str(f32).encode(), str(path).encode(), ctypes.byref(params)) != 0:
                raise RuntimeError(f"llama_model_quantize to {t} failed")
        files[t] = path
    return files


def gguf_overhead(path: Path) -> int:
    """Bytes of a GGUF file outside its tensors' data (metadata, vocabulary, alignment)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return path.stat().st_size - sum(int(t.n_bytes) for t in reader.tensors)


def plan_variant(sens, name: str, method: str, calib_samples: int, damp: float = 0.01, **budget) -> dict:
    from llmopt.quant.allocate import allocate, plan_table, totals

    try:
        plan = allocate(sens, **budget)
    except ValueError as exc:  # below the smallest plan of the candidate formats
        return {"infeasible": str(exc)}
    record = {**plan.to_dict(), "shapes": {t.name: list(t.shape) for t in sens.tensors},
              "kinds": {t.name: t.kind for t in sens.tensors}, "table": plan_table(sens, plan)}
    path = OUT / f"plan-{name.replace(' ', '_')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    options = {"scheme": "AUTO", "plan": str(path), "method": method}
    if method != "rtn":
        options["calib_samples"] = calib_samples
    if "gptq" in method:
        options["damp"] = damp
    counts: dict[str, int] = {}
    for t in sens.tensors:
        f = plan.formats[t.name]
        counts[f] = counts.get(f, 0) + t.numel
    return {"options": options, "bpw": round(totals(sens, plan.formats)[0], 4),
            "planned_gguf_bpw": round(totals(sens, plan.formats, "gguf")[0], 4), "predicted_kld": plan.predicted_kld,
            "size_of": plan.size, "weights_by_format": counts, "plan_table": record["table"]}


def main() -> None:
    global MODEL, RESULTS, OUT
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--method", default="gptq", choices=["rtn", "gptq", "awq+gptq"])
    parser.add_argument("--calib-samples", type=int, default=128)
    parser.add_argument("--calib-seq-len", type=int, default=512, help="tokens per calibration window of the calibrated rows")
    parser.add_argument("--calib", default="austen", help="calibration text of the calibrated rows and of their plans' sensitivity pass")
    parser.add_argument("--float-targets", action="store_true", help="GPTQ rows fit the float model's outputs (GPTAQ)")
    parser.add_argument("--damp", type=float, default=0.01, help="GPTQ dampening")
    parser.add_argument("--tune-steps", type=int, default=0, help="calibrated rows: end-to-end scale tuning steps (quantize --tune-steps; 0: off)")
    parser.add_argument("--tune-lr", type=float, default=1e-3, help="scale tuning's peak Adam step")
    parser.add_argument("--budgets", type=float, nargs="*", default=[4.85, 4.5, 5.5, 4.0])
    parser.add_argument("--llama-types", nargs="*", default=["Q4_K_M", "Q4_0", "Q6_K", "IQ4_NL"])
    parser.add_argument("--sens-samples", type=int, default=4)
    parser.add_argument("--sens-seq-len", type=int, default=512)
    parser.add_argument("--sens-gptq", action="store_true", help="calibrated plans: price the Linears' formats by GPTQ's error, not RTN's")
    parser.add_argument("--deadline", default=None, help="UTC HH:MM after which no new row starts")
    parser.add_argument("--only", nargs="*", default=None, help="variant names to run (default: all)")
    parser.add_argument("--model", default="demo", help="another model for a smoke run (with --results and --work)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--work", type=Path, default=OUT)
    args = parser.parse_args()
    MODEL, RESULTS, OUT = args.model, args.results, args.work
    from llmopt.checkpoints.models import resolve_model

    started = {"utc": datetime.now(timezone.utc).strftime("%H:%M:%S"), "load": load()}
    source = resolve_model(MODEL)
    sens, sens_seconds = sensitivity(source, args.sens_samples, args.sens_seq_len, head_gptq=args.method != "rtn",
                                     calib=args.calib if args.method != "rtn" else "austen",
                                     linear_gptq=args.sens_gptq and args.method != "rtn")
    n_weights = sum(t.numel for t in sens.tensors) + sens.other_params
    log(f"sensitivity: {len(sens.tensors)} tensors, {sens.tokens} tokens, {sens_seconds:.0f} s")
    lc = llama_cpp_available()
    files = llama_files(args.llama_types) if lc else {}
    q4km_bytes = files["Q4_K_M"].stat().st_size if "Q4_K_M" in files else Q4_K_M_ANCHOR_BYTES
    overhead = gguf_overhead(files["F32"]) if files else None
    if overhead is None:  # our own F32 export gives the metadata size
        from llmopt.formats.gguf_export import export_gguf

        export_gguf(MODEL, OUT / "demo-f32.gguf", "F32", overwrite=True)
        overhead = gguf_overhead(OUT / "demo-f32.gguf")
    q4km_bpw = 8 * (q4km_bytes - overhead - 32 * (len(sens.tensors) + 64)) / n_weights  # alignment padding allowance

    m = args.method
    rows: list[tuple[str, dict]] = []  # (name, spec) in priority order
    if "Q4_K_M" in files:
        rows.append(("llama.cpp Q4_K_M", {"llama": "Q4_K_M"}))
    size_row = f"auto {m} at Q4_K_M file size"
    rows.append((size_row, plan_variant(sens, size_row, m, args.calib_samples, args.damp, target_bpw=q4km_bpw, size="gguf")))
    if lc:
        rows.append((f"llama.cpp runs {size_row}", {"llama_on": size_row}))
    for budget in args.budgets[:2]:
        name = f"auto {m} {budget} bpw"
        rows.append((name, plan_variant(sens, name, m, args.calib_samples, args.damp, target_bpw=budget)))
    for i, budget in enumerate(args.budgets[:2]):  # the same budgets counted in the GGUF file's block bits (nl4: IQ4_NL)
        name = f"auto {m} {budget} GGUF bpw"
        rows.append((name, plan_variant(sens, name, m, args.calib_samples, args.damp, target_bpw=budget, size="gguf")))
        if lc and i == 0:
            rows.append((f"llama.cpp runs {name}", {"llama_on": name}))
    if "F32" in files:  # llama.cpp's own arithmetic against ours, on the float model itself
        rows.append(("llama.cpp F32", {"llama": "F32"}))
    llama_rows = {t: (f"llama.cpp {t}", {"llama": t}) for t in args.llama_types if t != "Q4_K_M" and t in files}
    if "Q4_0" in llama_rows:
        rows.append(llama_rows.pop("Q4_0"))
    rows.append((f"W4A16 g32 {m}, int4 embedding/head", {"options": {"scheme": "W4A16", "group_size": 32, "method": m,
                                                                     "head": "int4", "embedding": "int4"}}))
    rows += list(llama_rows.values())
    rows.append((f"IQ4_NL {m}, nl4 embedding/head", {"options": {"scheme": "IQ4_NL", "method": m, "head": "nl4", "embedding": "nl4"}}))
    rows.append(("W8A16 rtn, int8 embedding/head", {"options": {"scheme": "W8A16", "method": "rtn", "head": "int8", "embedding": "int8"}}))
    name = "auto rtn at Q4_K_M file size"
    if m != "rtn":  # the same budget applied by RTN: the method's share of the gap (its own sensitivities, when reached)
        rows.append((name, {"plan": lambda name=name: plan_variant(
            sensitivity(source, args.sens_samples, args.sens_seq_len, head_gptq=False)[0], name, "rtn", 0,
            target_bpw=q4km_bpw, size="gguf")}))
    for budget in args.budgets[2:]:
        name = f"auto {m} {budget} bpw"
        rows.append((name, plan_variant(sens, name, m, args.calib_samples, args.damp, target_bpw=budget)))
    rows.append((f"W4A16 g64 {m}, int4 embedding/head", {"options": {"scheme": "W4A16", "group_size": 64, "method": m,
                                                                     "head": "int4", "embedding": "int4"}}))
    for _, spec in rows:
        opts = spec.get("options")  # uniform rows: the same calibration as the plans
        if opts and opts.get("method", "rtn") != "rtn" and "calib_samples" not in opts:
            opts["calib_samples"] = args.calib_samples
        if opts and opts.get("method", "rtn") != "rtn" and args.calib != "austen":
            opts["calib"] = args.calib
        if opts and opts.get("method", "rtn") != "rtn" and args.calib_seq_len != 512:
            opts["calib_seq_len"] = args.calib_seq_len
        if opts and "gptq" in opts.get("method", "rtn"):
            opts["damp"] = args.damp
            if args.float_targets:
                opts["float_targets"] = True
        if opts and opts.get("method", "rtn") != "rtn" and args.tune_steps:
            opts.update(tune_steps=args.tune_steps, tune_lr=args.tune_lr)
    order = [n for n, _ in rows]  # the tables list every kept row in this order, not only the rows run now
    if args.only:
        rows = [(n, s) for n, s in rows if n in args.only]

    settings = {"method": m, "windows": args.windows, "calib_samples": args.calib_samples, "damp": args.damp, "sensitivity": SENSITIVITY_VERSION,
                "engine": ENGINE_VERSION, **({"calib": args.calib} if args.calib != "austen" else {}),
                **({"calib_seq_len": args.calib_seq_len} if args.calib_seq_len != 512 else {}),
                **({"sens_gptq": True} if args.sens_gptq else {}),
                **({"float_targets": True} if args.float_targets else {}),
                **({"tune_steps": args.tune_steps, "tune_lr": args.tune_lr} if args.tune_steps else {})}
    results: dict = {}
    previous = RESULTS / "mixed_precision.json"
    if previous.exists():
        old = json.loads(previous.read_text())
        if old.get("settings") == settings:
            results.update(old.get("results", {}))
    kept = len(results)
    skipped: list[str] = []
    meta = {"started": started, "sens_seconds": sens_seconds, "n_weights": n_weights, "q4km_bytes": q4km_bytes,
            "q4km_target_gguf_bpw": round(q4km_bpw, 4), "gguf_overhead_bytes": overhead, "llama_cpp": lc,
            "settings": settings, "sens": {"samples": args.sens_samples, "seq_len": args.sens_seq_len}, "rows_kept": kept}
    for name, spec in rows:
        if name in results:
            continue
        if args.deadline and datetime.now(timezone.utc).strftime("%H:%M") >= args.deadline:
            skipped.append(name)
            continue
        start, before = time.perf_counter(), load()
        if "plan" in spec:
            spec = spec["plan"]()
        if "infeasible" in spec:
            results[name] = {"kind": "infeasible", "note": spec["infeasible"]}
            continue
        if "llama" in spec:
            row = measure_llama(files[spec["llama"]], args.windows)
            row["kind"] = "llama.cpp float" if spec["llama"] == "F32" else "llama.cpp"  # (the float one is not plotted)
        elif "llama_on" in spec:
            target = results.get(spec["llama_on"])
            if target is None:
                skipped.append(name)
                continue
            path = OUT / f"{spec['llama_on'].replace(' ', '_')}.gguf"
            row = {"kind": "llama.cpp on ours", "of": spec["llama_on"], **measure_llama(path, args.windows, ("wikitext2",))}
            row["ppl_vs_ours_pct"] = 100 * (row["wikitext2"]["ppl"] / target["wikitext2"]["ppl"] - 1)
        else:
            path, q_seconds = quantize(name, **spec["options"])
            row = measure(path, args.windows)
            row["kind"] = "auto" if spec["options"]["scheme"] == "AUTO" else "uniform"
            row["quantize_seconds"] = q_seconds
            row.update({k: spec[k] for k in ("bpw", "planned_gguf_bpw", "predicted_kld", "size_of", "weights_by_format", "plan_table") if k in spec})
            if "bpw" not in row:
                row["bpw"] = round(8 * _quantized_bits(path) / n_weights, 4)
            row["method"] = spec["options"]["method"]
        row["gguf_bpw"] = round(8 * row["gguf_bytes"] / n_weights, 4)
        row["seconds"] = round(time.perf_counter() - start, 1)
        row["load"] = {"before": before, "after": load()}
        results[name] = row
        log(f"{name}: {json.dumps({d: row[d] for d in DATASETS if d in row})} gguf {row['gguf_bytes']:,} B ({row['seconds']:.0f} s)")
        write(results, meta, skipped, order + [n for n in results if n not in order])
    meta["finished"] = {"utc": datetime.now(timezone.utc).strftime("%H:%M:%S"), "load": load()}
    write(results, meta, skipped, order + [n for n in results if n not in order])


def _quantized_bits(path: Path) -> float:
    """Nominal stored bits of a uniform checkpoint: its safetensors with scales counted at 16 bits."""
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


FLOAT_TARGETS_NOTE = ", fitted to the float model's outputs (`--float-targets`)"
TUNING_NOTE = (", then {tune_steps} steps of end-to-end tuning of the group scales (codes fixed) and norm weights against "
               "the float model's KLD on the same windows, peak learning rate {tune_lr} (`--tune-steps`, `llmopt.quant.scale_tuning`)")


def _cell(row: dict, dataset: str, key: str, fmt: str) -> str:
    return format(row[dataset][key], fmt) if dataset in row else "—"


def write(results: dict, meta: dict, skipped: list[str], order: list[str]) -> None:
    from llmopt.core.hardware import cpu_has_bf16
    from llmopt.quant.gptq import DESCENT_ROUNDS
    from llmopt.quant.head_fisher import FISHER_ROWS
    from llmopt.runtime.format_speed import cpu_model

    anchors = json.loads(ANCHORS.read_text()) if ANCHORS.exists() else {}
    n_weights = meta["n_weights"]
    forwards = "bfloat16" if cpu_has_bf16() else "float32"  # what quantize's compute_dtype="auto" picks here
    payload = {
        "what": "auto mixed-precision plans vs uniform schemes and llama.cpp's own files on the demo model "
                "(SmolLM2-135M-Instruct, float = bundled Q4_1 dequantized), one run, same windows",
        "machine": platform.platform(), "cpu": cpu_model(), "cpus": os.cpu_count(), "calibration_forwards": forwards,
        **meta, "seq_len": SEQ_LEN,
        "skipped_by_deadline": skipped,
        "llama_cpp_reference": anchors.get("accuracy", {}).get("by_type", {}),
        "results": results,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "mixed_precision.json").write_text(json.dumps(payload, indent=1) + "\n")
    s = meta["settings"]
    lines = [
        "# Mixed precision (auto plans) on the demo model, next to llama.cpp's own files",
        "",
        f"One run of `bench/mixed_precision.py` (started {meta['started']['utc']} UTC, load average {meta['started']['load']}"
        + (f"; finished {meta['finished']['utc']} UTC, load {meta['finished']['load']}" if "finished" in meta else "; unfinished")
        + (f"; {meta['rows_kept']} rows kept from earlier runs with the same settings, each with its own load column"
           if meta.get("rows_kept") else "") + "). "
        f"Accuracy on the first {s['windows']} windows of {SEQ_LEN} tokens of WikiText-2 and of the held-out Gutenberg text "
        "(never used for calibration), against the float demo model (transformers, float32); llama.cpp's files are run "
        "by llama.cpp on the same windows against the same float distributions.",
        f"CPU: {cpu_model()}, {os.cpu_count()} cores; calibration forwards in {forwards} (bfloat16 only where the CPU "
        "computes it natively), Hessian products in float32; GPTQ with its scale refit (least-squares group scales for "
        "the chosen codes, a second pass on them, each row's best: `llmopt.quant.scale_refit`"
        f"{f'; then {DESCENT_ROUNDS} rounds of coordinate descent on the codes alternating with least-squares scales: `llmopt.quant.code_descent`' if DESCENT_ROUNDS else ''}). "
        f"Our rows: method {s['method']} ({s['calib_samples']} calibration windows of {s.get('calib_seq_len', 512)} from {s.get('calib', 'austen')}, GPTQ dampening {s.get('damp', 0.01)}{FLOAT_TARGETS_NOTE if s.get('float_targets') else ''}{TUNING_NOTE.format(**s) if s.get('tune_steps') else ''}) unless named rtn; "
        f"sensitivity pass the first {meta['sens']['samples']} windows of {meta['sens']['seq_len']} tokens of that calibration ({meta['sens_seconds']:.0f} s when "
        "it was measured and cached). "
        "bpw = checkpoint bits (codes + 16-bit scales) over all weights; GGUF bpw = the `--type auto` GGUF file (or llama.cpp's "
        f"file) in bits over the {n_weights:,} weights. The Q4_K_M-size plans count GGUF block bits (`--size-of gguf`) with "
        f"a budget of {meta['q4km_target_gguf_bpw']} bits per weight: the {meta['q4km_bytes']:,}-byte Q4_K_M file less "
        f"{meta['gguf_overhead_bytes']:,} bytes of metadata; the `GGUF bpw` plans count the same block bits against their "
        "budget (tensor data only, as a format's nominal bits per weight; nl4 at 4.5 as IQ4_NL, norms at F32). Predicted KLD: the plan's summed per-tensor costs ("
        f"{'the errors GPTQ leaves on the pass’s inputs for the Linears (`--price-by gptq`)' if s.get('sens_gptq') else 'RTN errors for the Linears'}; "
        "for a calibrated method the head's exact KLD as GPTQ quantizes it, the way it is stored, from the cached sensitivity pass).",
        "",
        "| variant | bpw | GGUF MiB | GGUF bpw | predicted KLD | wiki KLD mean | wiki KLD p99 | wiki top-1 | wiki ppl | held-out KLD mean | held-out top-1 | held-out ppl | seconds | load before → after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in [n for n in order if n in results]:
        r = results[name]
        if r["kind"] in ("llama.cpp on ours", "infeasible"):
            continue
        pred = f"{r['predicted_kld']:.4f}" if "predicted_kld" in r else ""
        bpw = f"{r['bpw']:.3f}" if "bpw" in r else "—"
        lines.append(f"| {name} | {bpw} | {r['gguf_bytes'] / 2**20:.1f} | {r['gguf_bpw']:.3f} | {pred} | "
                     f"{_cell(r, 'wikitext2', 'kld_mean', '.4f')} | {_cell(r, 'wikitext2', 'kld_p99', '.3f')} | "
                     f"{_cell(r, 'wikitext2', 'top1', '.3f')} | {_cell(r, 'wikitext2', 'ppl', '.2f')} | "
                     f"{_cell(r, 'heldout', 'kld_mean', '.4f')} | {_cell(r, 'heldout', 'top1', '.3f')} | {_cell(r, 'heldout', 'ppl', '.2f')} | "
                     f"{r['seconds']:.0f} | {r['load']['before'][0]} → {r['load']['after'][0]} |")
    for name, r in results.items():
        if r["kind"] == "infeasible":
            lines += ["", f"{name}: no plan ({r['note']})."]
        if r["kind"] == "llama.cpp on ours":
            ours = results[r["of"]]["wikitext2"]["ppl"]
            lines += ["", f"llama.cpp running our exported `{r['of']}` GGUF: WikiText-2 perplexity {r['wikitext2']['ppl']:.3f} "
                      f"against {ours:.3f} in our evaluation ({r['ppl_vs_ours_pct']:+.2f}%), KLD {r['wikitext2']['kld_mean']:.4f}."]
    plans = [(n, results[n]) for n in order if n in results and "weights_by_format" in results[n]]
    if plans:
        lines += ["", "Weights per format in each plan (millions):", ""]
        for name, r in plans:
            parts = ", ".join(f"{f} {c / 1e6:.1f}" for f, c in sorted(r["weights_by_format"].items(), key=lambda x: -x[1]))
            lines.append(f"- {name}: {parts}")
    if skipped:
        lines += ["", f"Not measured (not started before the run's deadline): {', '.join(skipped)}."]
    if not meta["llama_cpp"]:
        lines += ["", "llama.cpp was not importable: no llama.cpp rows; the Q4_K_M size is the shared/anchors figure."]
    else:
        lines += ["", "llama.cpp (llama-cpp-python) runs with `use_extra_bufts=False`: its AMX / repacked weight buffers stop "
                  "with an illegal instruction on this machine (accuracy is unaffected; its speed is not measured here)."]
    lines += ["", "Decode speed is not measured here (a quiet machine is needed: `bench/e2e_speed.py`)."]
    (RESULTS / "mixed_precision.md").write_text("\n".join(lines) + "\n")
    _plot(results, order)


def _plot(results: dict, order: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    styles = {"auto": ("o", "tab:blue"), "uniform": ("s", "tab:green"), "llama.cpp": ("x", "black")}
    for name in [n for n in order if n in results]:
        r = results[name]
        if r["kind"] not in styles or "wikitext2" not in r:
            continue
        marker, color = styles[r["kind"]]
        ax.scatter(r["gguf_bytes"] / 2**20, r["wikitext2"]["kld_mean"], marker=marker, color=color)
        ax.annotate(name, (r["gguf_bytes"] / 2**20, r["wikitext2"]["kld_mean"]), fontsize=6)
    ax.set_xlabel("GGUF file size (MiB)")
    ax.set_ylabel("mean KLD vs float (WikiText-2)")
    ax.set_yscale("log")
    ax.set_title("demo model: file size vs KLD (one run, same windows)")
    fig.tight_layout()
    fig.savefig(RESULTS / "mixed_precision.png", dpi=120)


if __name__ == "__main__":
    main()
