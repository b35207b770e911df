"""Quantization-aware distillation on the demo model: how much of the KLD gap to the float model
that post-training quantization leaves, ``llmopt distill --quantized`` recovers.

The starting point is the issue's: W4A16 g32 with an int4 head, AWQ then GPTQ (``llmopt
quantize``, austen calibration). Each QAD variant trains that checkpoint's codes and scales
against the float demo model's logits on the bundled Gutenberg training text (``--data
gutenberg``; neither evaluation text is trained on) and is saved in the same format. KLD (mean,
p99) and top-1 against the float model on WikiText-2 and on the held-out Gutenberg text,
``--windows`` windows of 2048 tokens each. Target: recover at least 50% of the starting
checkpoint's mean KLD (QAD KLD ≤ 0.5× the AWQ+GPTQ KLD). Results: bench/results/qad.{json,md}.

    python bench/qad.py [--windows 4] [--force] [--only NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import llmopt, log, run_variants  # noqa: E402
from rotations import TEXTS, kld_summary, reference, scores  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
WORK = ROOT / "out" / "qad"
W4 = "W4A16 g32 awq+gptq, int4 head"
Q3 = "Q3_K_M gptq"
# name → (folder, quantize options, what its llmopt.json must say)
BASES = {
    W4: ("w4g32", ["--scheme", "W4A16", "--group-size", "32", "--method", "awq+gptq", "--head", "int4"],
         {"scheme": "W4A16", "method": "awq+gptq", "head": "int4"}),
    Q3: ("q3km", ["--scheme", "Q3_K_M", "--method", "gptq"], {"scheme": "Q3_K_M", "method": "gptq"}),
}
# name → (starting checkpoint, distill options on top of --teacher demo --student BASE --quantized --data gutenberg)
QAD = {
    f"{W4} + QAD (end to end, 150 steps)": (W4, ["--steps", "150", "--lr", "1e-3", "--code-lr", "1e-2"]),
    f"{W4} + QAD (end to end, 150 steps, codes started at the teacher)": (W4, ["--steps", "150", "--lr", "1e-3", "--code-lr", "1e-2",
                                                                             "--code-start", "teacher"]),
    f"{W4} + QAD (end to end, 150 steps, codes started at the teacher, code step 1e-3)": (
        W4, ["--steps", "150", "--lr", "1e-3", "--code-lr", "1e-3", "--code-start", "teacher"]),
    f"{W4} + QAD (block 40 + end to end 150 steps)": (W4, ["--block-steps", "40", "--steps", "150", "--lr", "2e-3", "--code-lr", "2e-2"]),
    f"{Q3} + QAD (block 40 + end to end 150 steps)": (Q3, ["--block-steps", "40", "--steps", "150", "--lr", "2e-3", "--code-lr", "2e-2"]),
}
RENAMED = {"QAD 150 steps": f"{W4} + QAD (end to end, 150 steps)"}  # rows of earlier runs, by their current names
TARGETS = {W4: 0.5, Q3: 0.4}  # the share of the gap to float that QAD must recover


def main() -> None:
    from llmopt.checkpoints.models import load_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--remake-base", action="store_true", help="quantize the starting checkpoint again even if out/qad/base holds it")
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--report-only", action="store_true", help="rewrite qad.md from qad.json")
    args = parser.parse_args()
    if args.report_only:
        write_md(json.loads((RESULTS / "qad.json").read_text()))
        return
    torch.set_num_threads(2)
    path = RESULTS / "qad.json"
    data = json.loads(path.read_text()) if path.is_file() else {"meta": {}, "variants": {}}
    data["variants"] = {RENAMED.get(k, k): v for k, v in data["variants"].items()}
    ids, ref = reference(args.windows)
    data["meta"] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "windows": args.windows,
                    "seq_len": 2048, "load": [round(x, 2) for x in os.getloadavg()]}

    def base_checkpoint(name: str) -> tuple[Path, dict]:
        folder, options, expected = BASES[name]
        out = WORK / folder
        if args.remake_base or not (out / "llmopt.json").is_file():
            shutil.rmtree(out, ignore_errors=True)
            llmopt("quantize", "demo", *options, "-o", str(out))
        made = json.loads((out / "llmopt.json").read_text())
        if any(made.get(k) != v for k, v in expected.items()):
            raise SystemExit(f"{out} was not made by `quantize demo {' '.join(options)}`: pass --remake-base")
        return out, made

    def measure(name: str) -> dict:
        start = time.perf_counter()
        if name in BASES:
            out, made = base_checkpoint(name)
            seconds, base = made["total_seconds"], name
        else:
            base, options = QAD[name]
            student, _ = base_checkpoint(base)
            out = WORK / name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
            shutil.rmtree(out, ignore_errors=True)
            log(f"distill --quantized {' '.join(options)}")
            llmopt("distill", "--teacher", "demo", "--student", str(student), "--quantized", "--data", "gutenberg",
                   "--validation", "none", *options, "-o", str(out))
            seconds = time.perf_counter() - start
        variant, _ = load_model(out)
        result = scores(variant, ids, ref)
        result["base"] = base
        result["seconds"] = round(seconds, 1)
        result["bytes"] = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        if name not in BASES:
            qad = json.loads((out / "llmopt.json").read_text())["quantization_aware_distillation"]
            result["options"] = options
            result["training"] = {k: qad[k] for k in ("steps", "tokens", "train_seconds", "codes_changed", "codes", "seq_len")}
            result["training"]["batch_size"] = qad["settings"]["batch_size"]
            if qad["student"].get("code_start") == "teacher":  # how many weights the teacher's values could start
                result["training"]["started_near_teacher"] = f"{qad['student']['weights_started_near_teacher']} of {qad['student']['quantized_weights']}"
            result["training"]["final_loss"] = qad["loss_curve"][-1]["loss"] if qad["loss_curve"] else None
            if "block_phase" in qad:
                result["training"]["block_seconds"] = qad["block_phase"].get("seconds")
        return result

    def save() -> None:
        path.write_text(json.dumps(data, indent=1) + "\n")
        write_md(data)

    run_variants([*BASES, *QAD], data["variants"], measure, kld_summary, save, args.only, args.force)
    save()


def write_md(data: dict) -> None:
    meta, rows = data["meta"], data["variants"]
    lines = ["# Quantization-aware distillation (`llmopt distill --quantized`) on the demo model", "",
             f"Written by bench/qad.py (last run {meta['date']}, load {meta['load']}): KLD against the float demo model on "
             f"WikiText-2 and a held-out Gutenberg text, {meta['windows']} × {meta['seq_len']} tokens each. Starting "
             "checkpoints: " + "; ".join(f"{name}: `llmopt quantize demo {' '.join(options)}`" for name, (_, options, _) in BASES.items())
             + " (austen calibration). QAD trains a starting checkpoint's codes and scales on the bundled Gutenberg training "
             "text against the float model's logits and saves it in the same format; neither evaluation text is trained on.", "",
             "| variant | KLD wiki (mean / p99) | top-1 wiki | KLD held-out (mean / p99) | top-1 held-out | gap recovered (wiki / held-out) | codes changed | tokens trained | seconds | safetensors bytes |",
             "|---|---|---:|---|---:|---|---:|---:|---:|---:|"]
    verdicts = []
    for name, r in rows.items():
        w, h = r["wiki"], r["heldout"]
        base = rows.get(r.get("base", W4))
        recovered = {t: 1 - r[t]["kld_mean"] / base[t]["kld_mean"] for t in TEXTS} if base is not None and name not in BASES else {}
        train = r.get("training") or {}
        changed = f"{train['codes_changed']:,} of {train['codes']:,}" if train else ""
        tokens = f"{train['tokens']:,}" if train else ""
        lines.append(f"| {name} | {w['kld_mean']:.4f} / {w['kld_p99']:.3f} | {100 * w['top1']:.1f}% | "
                     f"{h['kld_mean']:.4f} / {h['kld_p99']:.3f} | {100 * h['top1']:.1f}% | "
                     f"{' / '.join(f'{100 * v:.0f}%' for v in recovered.values())} | {changed} | {tokens} | {r['seconds']:.0f} | {r['bytes']:,} |")
        if recovered:
            target = TARGETS[r.get("base", W4)]
            met = all(v >= target for v in recovered.values())
            verdicts.append(f"- {name}: gap recovered {' / '.join(f'{100 * v:.0f}%' for v in recovered.values())} "
                            f"(target ≥ {100 * target:.0f}% on both texts): **{'met' if met else 'missed'}**")
    lines.append("")
    for name, r in rows.items():
        if r.get("options"):
            lines.append(f"- {name}: `llmopt distill --teacher demo --student <{r.get('base', W4)}> --quantized --data gutenberg "
                         f"--validation none {' '.join(r['options'])}`")
    budgets = sorted({(r["training"]["tokens"], r["training"]["seq_len"], r["training"]["batch_size"])
                      for r in rows.values() if r.get("training")})
    for tokens, seq_len, batch in budgets:
        runs = [r for r in rows.values() if r.get("training") and r["training"]["tokens"] == tokens]
        share = max(r["training"]["codes_changed"] / r["training"]["codes"] for r in runs)
        lines.append(f"\nTraining budget of these runs: {tokens:,} tokens ({batch} × {seq_len} per step), "
                     f"{min(r['training']['train_seconds'] for r in runs):.0f}–{max(r['training']['train_seconds'] for r in runs):.0f} s "
                     f"of end-to-end training on this machine; at most {100 * share:.2f}% of the codes moved.")
    lines += ["", "Targets:", *verdicts]
    (RESULTS / "qad.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
