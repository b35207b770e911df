"""GGUF export accuracy: the demo model as F16 / Q8_0 / Q4_0 and our W4A16 g32 GPTQ checkpoint as
Q4_0, each loaded back through transformers' GGUF loader and evaluated like any checkpoint.

For every variant: perplexity on WikiText-2 (16 windows of 2048 tokens) and KLD / top-1 against
the float demo model (its distributions cached once), next to the same checkpoint's figures in
our own evaluation (the float model for the dense exports, the compressed-tensors checkpoint for
the GPTQ one). With ``--llama-cpp`` (and llama-cpp-python importable) each file is also run by
llama.cpp itself on the same windows (slow on 2 cores: ~30 tokens/s with all logits kept). Results go to ``bench/results/gguf_export.{json,md}``;
finished variants are kept in the JSON and skipped on a rerun unless ``--force``.

    python bench/gguf_export.py [--windows 16] [--method gptq|rtn] [--llama-cpp] [--force]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SEQ_LEN = 2048


def versions() -> dict:
    from importlib.metadata import version

    import gguf  # noqa: F401
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "gguf": version("gguf"),
            "python": platform.python_version()}


def gguf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def gguf_tokens_match(path: Path, tokenizer, text: str) -> bool:
    from transformers import AutoTokenizer

    gg = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return gg(text, add_special_tokens=False)["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]


class LlamaCppModel:
    """A GGUF file run by llama.cpp, called like a transformers model: ``model(input_ids=…).logits``."""

    def __init__(self, path: Path, n_ctx: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, logits_all=True, verbose=False,
                         n_threads=os.cpu_count())

    def __call__(self, input_ids: torch.Tensor):
        from types import SimpleNamespace

        import numpy as np

        ids = input_ids[0].tolist()
        self.llm.reset()
        self.llm.eval(ids)
        return SimpleNamespace(logits=torch.from_numpy(np.array(self.llm.scores[: len(ids)], dtype=np.float32))[None])


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def figures(result) -> dict:
    return {"ppl": result.perplexity, "kld_mean": result.kld_mean, "kld_p99": result.kld_p99,
            "top1": result.top1_agreement, "tokens": result.tokens, "windows": result.windows}


def quantize_gptq(method: str, out: Path) -> dict:
    """Our W4A16 g32 checkpoint (GPTQ, or RTN when asked), made by the CLI in a child process."""
    if (out / "config.json").is_file():
        return json.loads((out / "llmopt.json").read_text())
    command = [sys.executable, "-m", "llmopt", "quantize", "demo", "--scheme", "W4A16", "--group-size", "32",
               "--method", method, "-o", str(out), "--overwrite", "--json"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"quantize failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--method", default="gptq", choices=["gptq", "rtn"])
    parser.add_argument("--llama-cpp", action="store_true", help="also evaluate each GGUF in llama.cpp")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()

    from llmopt.core.data import load_text
    from llmopt.accuracy import (
        BaselineCache,
        eval_data,
        evaluate,
        fill_baseline,
        model_fingerprint,
    )
    from llmopt.formats.gguf_export import export_gguf
    from llmopt.checkpoints.models import load_model, resolve_model
    from llmopt.core.paths import cache_dir

    RESULTS.mkdir(parents=True, exist_ok=True)
    work = cache_dir("bench", "gguf_export")  # checkpoints and GGUF files stay out of the repository
    out_json = RESULTS / "gguf_export.json"
    previous = json.loads(out_json.read_text()) if out_json.is_file() and not args.force else {}
    rows: dict = previous.get("variants", {}) if previous.get("windows") == args.windows else {}

    demo = resolve_model("demo")
    model, tokenizer = load_model(demo)
    data = eval_data(tokenizer, "wikitext2", SEQ_LEN, args.windows)
    cache = BaselineCache.for_model(model_fingerprint(demo), data)
    fill_baseline(model, data, cache)
    del model
    if "float (our eval)" not in rows:  # the float model's own figures are in its cached distributions
        nll = torch.cat([cache.load(i)["nll"] for i in range(len(data.windows))]).double()
        rows["float (our eval)"] = {"source": "demo (float32)", "ppl": float(nll.mean().exp()), "kld_mean": 0.0,
                                    "kld_p99": 0.0, "top1": 1.0, "tokens": nll.numel(), "windows": len(data.windows)}
    sample = load_text("wikitext2").documents[0][:20000]

    def save() -> None:
        payload = {"what": "GGUF exports loaded through transformers' GGUF loader vs our evaluation",
                   "eval": f"WikiText-2 raw test, first {args.windows} windows of {SEQ_LEN} tokens; KLD/top-1 against the float demo",
                   "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
                   "versions": versions(), "windows": args.windows, "variants": rows}
        out_json.write_text(json.dumps(payload, indent=2) + "\n")
        (RESULTS / "gguf_export.md").write_text(markdown(payload))

    def run_gguf(name: str, spec: str, qtype: str, reference: str) -> None:
        if name in rows:
            return
        path = work / f"{name.split(' ')[0]}.gguf"
        report = export_gguf(spec, path, qtype, overwrite=True)
        start = time.perf_counter()
        result = evaluate(gguf_model(path), data, cache)
        rows[name] = {
            "source": spec, "type": qtype, "file_type": report.file_type, "bytes": report.bytes,
            "export_seconds": report.seconds, "eval_seconds": round(time.perf_counter() - start, 1),
            "decisions": report.decisions,
            "max_abs_err_by_type": {k: v["max_abs_err"] for k, v in report.by_type.items()},
            "codes_identical": {k: v["codes_identical"] for k, v in report.by_type.items() if v["codes_identical"] is not None},
            "token_ids_match": gguf_tokens_match(path, tokenizer, sample),
            "reference": reference, **figures(result),
        }
        ref = rows[reference]["ppl"]
        rows[name]["ppl_vs_reference_pct"] = 100 * (rows[name]["ppl"] / ref - 1)
        if args.llama_cpp and llama_cpp_available():
            from llama_cpp import __version__ as llama_cpp_version

            start = time.perf_counter()
            lc = figures(evaluate(LlamaCppModel(path, SEQ_LEN), data, cache))
            lc["eval_seconds"] = round(time.perf_counter() - start, 1)
            lc["version"] = f"llama-cpp-python {llama_cpp_version}"
            lc["ppl_vs_reference_pct"] = 100 * (lc["ppl"] / ref - 1)
            rows[name]["llama_cpp"] = lc
        save()
        path.unlink()

    for qtype in ("F16", "Q8_0", "Q4_0"):
        run_gguf(f"{qtype}.gguf (demo)", "demo", qtype, "float (our eval)")

    ckpt = work / f"w4a16-g32-{args.method}"
    ours = f"W4A16 g32 {args.method} (our eval)"
    if ours not in rows:
        record = quantize_gptq(args.method, ckpt)
        qmodel, _ = load_model(ckpt)
        rows[ours] = {"source": f"llmopt quantize demo --scheme W4A16 --group-size 32 --method {args.method}",
                      "quantize_seconds": record.get("quantize_seconds"), **figures(evaluate(qmodel, data, cache))}
        del qmodel
        save()
    run_gguf(f"W4A16-g32-{args.method}→Q4_0.gguf", str(ckpt), "Q4_0", ours)
    save()
    print((RESULTS / "gguf_export.md").read_text())


def markdown(payload: dict) -> str:
    lines = [
        "# GGUF export: accuracy through transformers' GGUF loader",
        "",
        f"{payload['eval']}. Machine: {payload['machine']}. Versions: "
        + ", ".join(f"{k} {v}" for k, v in payload["versions"].items()) + ".",
        "",
        "| variant | run by | GGUF types | size (MiB) | ppl | Δppl vs reference | KLD mean | KLD p99 | top-1 | reference |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in payload["variants"].items():
        types = ", ".join(sorted(r.get("max_abs_err_by_type", {}))) or "—"
        size = f"{r['bytes'] / 2**20:.1f}" if "bytes" in r else "—"
        runs = [("transformers" if "bytes" in r else "our eval", r)] + ([("llama.cpp", r["llama_cpp"])] if "llama_cpp" in r else [])
        for runner, f in runs:
            delta = f"{f['ppl_vs_reference_pct']:+.2f}%" if "ppl_vs_reference_pct" in f else "—"
            lines.append(f"| {name} | {runner} | {types} | {size} | {f['ppl']:.3f} | {delta} | {f['kld_mean']:.2e} | "
                         f"{f['kld_p99']:.2e} | {100 * f['top1']:.2f}% | {r.get('reference', '—')} |")
    lines += ["", "Per export:", ""]
    for name, r in payload["variants"].items():
        if "decisions" in r:
            codes = f"; codes identical: {r['codes_identical']}" if r["codes_identical"] else ""
            errors = ", ".join(f"{k} {v:.3g}" for k, v in r["max_abs_err_by_type"].items())
            lines.append(f"- **{name}**: {'; '.join(r['decisions'])}; max |error| per type: {errors}{codes}; "
                         f"tokenizer ids match: {r['token_ids_match']}; export {r['export_seconds']:.0f} s, eval {r['eval_seconds']:.0f} s")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
