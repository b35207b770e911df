"""End-to-end scale tuning (``llmopt.quant.scale_tuning``, ``quantize --tune-steps``) measured on a
quantized checkpoint left by bench/mixed_precision.py (default: the demo's 4.85 GGUF-bpw AUTO
awq+gptq plan). Each setting tunes a copy of that checkpoint on its calibration windows
(austen+self, 128 x 512, as it was quantized; ``--tune-samples`` draws more windows of the same
text), then every variant and the untuned checkpoint are evaluated against the float demo model on
WikiText-2 and on the held-out Gutenberg text (never used for calibration or tuning). Written to
bench/results/scale_tuning_gptq_priced/scale_tuning.{json,md} (``--results`` for another folder);
rows of earlier runs on the same checkpoint and calibration are kept there, each with the start
time of its run and the untuned KLD that run measured. The current results there tune the
GPTQ-priced plan of bench/results/mixed_precision_gptq_priced (``--windows 8``); earlier tuning
experiments are in git history, listed in docs/results.md.

    python bench/scale_tuning.py [--checkpoint DIR] [--settings row,1e-3,norms row,1e-3,scales ...]
                                 [--steps 128] [--tune-samples 256]

A tuned checkpoint left in --work by an earlier run with the same settings and source is reused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "scale_tuning_gptq_priced"
DATASETS = ("wikitext2", "heldout")
SEQ_LEN = 2048


def parse_setting(text: str) -> dict:
    """``per,lr,what`` (what: norms = scales and norms, scales = scales only) → TuneSettings fields."""
    per, lr, what = text.split(",")
    if per not in ("row", "group") or what not in ("norms", "scales"):
        raise SystemExit(f"bad setting {text!r}: give per,lr,what with per row|group and what norms|scales")
    return {"per": per, "lr": float(lr), "norms": what == "norms"}


def slug(setting: dict, steps: int, samples: int, calibration_samples: int) -> str:
    """The variant's name: its settings, steps and (when not the checkpoint's own) tuning windows."""
    more = f"-w{samples}" if samples != calibration_samples else ""
    return f"tuned-{setting['per']}-lr{setting['lr']:g}-{'norms' if setting['norms'] else 'scales'}-{steps}{more}"


def tuned(source_ckpt: Path, work: Path, setting: dict, steps: int, calib: str, samples: int,
          name: str) -> tuple[Path, dict]:
    """The tuned copy of ``source_ckpt`` (made now, or reused) and its tuning report."""
    from llmopt.checkpoints.models import resolve_model
    from llmopt.core.data import calibration_ids
    from llmopt.quant.scale_tuning import TuneSettings
    from llmopt.checkpoints.rewrite import rewrite_tensors
from llmopt.quant.tune_checkpoint import tune_checkpoint
    from llmopt.self_calibration import sampler
    from transformers import AutoTokenizer

    out = work / name
    settings = TuneSettings(steps, setting["lr"], norms=setting["norms"], per=setting["per"])
    record = out / "llmopt.json"
    if record.is_file():
        made = json.loads(record.read_text())
        report = made.get("scale_tuning") or {}
        newer = record.stat().st_mtime > (source_ckpt / "llmopt.json").stat().st_mtime
        if report.get("settings") == json.loads(json.dumps(settings.__dict__)) and newer:
            return out, report
    demo = resolve_model("demo")
    ids, _ = calibration_ids(AutoTokenizer.from_pretrained(demo), calib, samples, 512, 0, sample_self=sampler(demo))
    replacements, report = tune_checkpoint(source_ckpt, demo, ids, settings, "cpu")
    rewrite_tensors(source_ckpt, out, replacements, {"scale_tuning": report.to_dict()}, overwrite=True)
    return out, report.to_dict()


def evaluate(path: Path, windows: int) -> dict:
    from llmopt.accuracy import run_eval

    row = {}
    for dataset in DATASETS:
        r = run_eval(str(path), "demo", dataset, SEQ_LEN, windows)
        row[dataset] = {"kld_mean": r.kld_mean, "kld_p99": r.kld_p99, "top1": r.top1_agreement, "ppl": r.perplexity, "tokens": r.tokens}
    return row


def llama_check(path: Path, windows: int) -> dict | None:
    """The tuned checkpoint's ``--type auto`` GGUF run by llama.cpp on WikiText-2 (None without llama-cpp-python)."""
    import importlib.util

    from llmopt.formats.compressed import read_compressed
    from llmopt.formats.gguf_export import export_gguf

    gguf = path.parent / f"{path.name}.gguf"
    export = export_gguf(path, gguf, "auto", overwrite=True)
    carried = sum(t.how == "carried codes" and bool(t.codes_identical) for t in export.tensors)
    row = {"gguf_bytes": gguf.stat().st_size, "tensors_carried_exactly": carried,
           "tensors_quantized": len(read_compressed(path)[0])}
    if importlib.util.find_spec("llama_cpp") is None:
        return row
    from mixed_precision import measure_llama  # bench/mixed_precision.py

    return {**row, **measure_llama(gguf, windows, ("wikitext2",))}


def fingerprint(checkpoint: Path) -> str:
    """The checkpoint's identity: the SHA-256 of its provenance record (a re-made checkpoint at the
    same path gets a new one)."""
    return hashlib.sha256((checkpoint / "llmopt.json").read_bytes()).hexdigest()


def earlier_rows(path: Path, checkpoint: Path, calib: str, samples: int, windows: int, now: dict) -> dict:
    """Tuned rows of an earlier results file on the same checkpoint (by content), calibration and
    evaluation windows that this run did not measure again, each given its run (start time,
    untuned KLD) and steps."""
    if not path.is_file():
        return {}
    old = json.loads(path.read_text())
    same = (old.get("checkpoint") == _shown(checkpoint) and old.get("checkpoint_sha256") == fingerprint(checkpoint)
            and old.get("calibration") == {"name": calib, "samples": samples} and old.get("windows") == windows)
    if not same:
        return {}
    untuned = old["rows"].get("untuned", {})
    run = untuned.get("run") or {"started": old["started"]["utc"], "untuned_wiki_kld": untuned["wikitext2"]["kld_mean"],
                                 "untuned_heldout_kld": untuned["heldout"]["kld_mean"]}
    kept = {}
    for name, row in old["rows"].items():
        if name != "untuned" and name not in now:
            kept[name] = {"steps": old["steps"], "tune_samples": samples, "run": run, **row}
    return kept


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", type=Path, default=ROOT / "out" / "mixed" / "auto_awq+gptq_4.85_GGUF_bpw")
    parser.add_argument("--settings", nargs="+", default=["row,1e-3,scales"])
    parser.add_argument("--steps", type=int, default=128, help="one window per step (124 windows are not held out)")
    parser.add_argument("--tune-samples", type=int, default=None,
                        help="calibration windows to tune on (default: the checkpoint's own calibration count)")
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--work", type=Path, default=ROOT / "out" / "scale_tuning")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    record = json.loads((args.checkpoint / "llmopt.json").read_text())
    calibration = record.get("calibration") or {}
    calib, samples = calibration.get("name", "austen"), calibration.get("samples", 128)
    tune_samples = args.tune_samples or samples
    started = {"utc": datetime.now(timezone.utc).strftime("%H:%M:%S"), "load": [round(x, 2) for x in os.getloadavg()]}
    untuned = evaluate(args.checkpoint, args.windows)
    run = {"started": started["utc"], "untuned_wiki_kld": untuned["wikitext2"]["kld_mean"],
           "untuned_heldout_kld": untuned["heldout"]["kld_mean"]}
    rows = {"untuned": {"report": None, "run": run, **untuned}}
    for text in args.settings:
        setting = parse_setting(text)
        name = slug(setting, args.steps, tune_samples, samples)
        start = time.perf_counter()
        path, report = tuned(args.checkpoint, args.work, setting, args.steps, calib, tune_samples, name)
        rows[name] = {"setting": setting, "steps": args.steps, "tune_samples": tune_samples, "report": report, "run": run,
                      "seconds": round(time.perf_counter() - start, 1), **evaluate(path, args.windows),
                      "llama_cpp": llama_check(path, args.windows)}
        print(name, json.dumps({d: rows[name][d]["kld_mean"] for d in DATASETS}), flush=True)
    earlier = earlier_rows(args.results / "scale_tuning.json", args.checkpoint, calib, samples, args.windows, rows)
    rows = {"untuned": rows.pop("untuned"), **earlier, **rows}
    meta = {"checkpoint": _shown(args.checkpoint), "checkpoint_sha256": fingerprint(args.checkpoint),
            "plan": (record.get("plan") or {}).get("target"), "calibration": {"name": calib, "samples": samples},
            "steps": args.steps, "windows": args.windows, "seq_len": SEQ_LEN, "started": started,
            "finished": {"utc": datetime.now(timezone.utc).strftime("%H:%M:%S"), "load": [round(x, 2) for x in os.getloadavg()]}}
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "scale_tuning.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    (args.results / "scale_tuning.md").write_text(markdown(meta, rows))


def markdown(meta: dict, rows: dict) -> str:
    lines = [
        "# End-to-end scale tuning on the demo model's 4.85 GGUF-bpw plan", "",
        f"`bench/scale_tuning.py` (last run started {meta['started']['utc']} UTC, load {meta['started']['load']}; finished "
        f"{meta['finished']['utc']} UTC, load {meta['finished']['load']}). Checkpoint `{meta['checkpoint']}` (made by "
        f"bench/mixed_precision.py), each variant tuned for its `steps` of one 512-token window on calibration windows "
        f"of the checkpoint's own text ({meta['calibration']['name']}; {meta['calibration']['samples']} windows as it was "
        "quantized, or the `windows` column's count of the same text; the first 4 held out of the tuning and used for the "
        "`calibration KLD` columns), Adam with a 10% warm-up then a cosine; codes unchanged. "
        f"Evaluation on the first {meta['windows']} windows of {meta['seq_len']} tokens of WikiText-2 and of the held-out "
        "Gutenberg text, against the float demo model. `run`: the start of the run that measured the row, and the "
        "untuned checkpoint's WikiText-2 / held-out KLD in that run (rows of earlier runs are kept).", "",
        "| variant | multipliers | lr | norms | steps | windows | calibration KLD before → after | wiki KLD | wiki top-1 "
        "| wiki ppl | held-out KLD | held-out top-1 | held-out ppl | tuning s | run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        s, r, run = row.get("setting"), row.get("report"), row["run"]
        cal = f"{r['kld_before']:.4f} → {r['kld_after']:.4f}" if r else ""
        w, h = row["wikitext2"], row["heldout"]
        lines.append(f"| {name} | {s['per']} | {s['lr']:g} | {'yes' if s['norms'] else 'no'} | {row['steps']} | "
                     f"{row['tune_samples']} | {cal} | " if s else f"| {name} | | | | | | | ")
        lines[-1] += (f"{w['kld_mean']:.4f} | {w['top1']:.3f} | {w['ppl']:.2f} | {h['kld_mean']:.4f} | {h['top1']:.3f} | "
                      f"{h['ppl']:.2f} | {r['seconds'] if r else ''} | {run['started']} "
                      f"({run['untuned_wiki_kld']:.4f} / {run['untuned_heldout_kld']:.4f}) |")
    for name, row in rows.items():
        lc = row.get("llama_cpp")
        if lc and "wikitext2" in lc:
            ours = row["wikitext2"]["ppl"]
            lines.append(f"\n`{name}` exported with `--type auto` ({lc['gguf_bytes']:,} bytes, codes of "
                         f"{lc['tensors_carried_exactly']} of its {lc['tensors_quantized']} quantized tensors carried unchanged) and run by llama.cpp: WikiText-2 perplexity "
                         f"{lc['wikitext2']['ppl']:.3f} against {ours:.3f} in our evaluation "
                         f"({100 * (lc['wikitext2']['ppl'] / ours - 1):+.2f}%), KLD {lc['wikitext2']['kld_mean']:.4f}.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
