"""End-to-end speed of the demo model's variants in llmopt's runtime, in one run.

For float32, W8A16, W4A16 (groups of 32 and 64; g32 also with its output head in bfloat16 or
int8, ``--lm-head bf16|int8``) and FP8 (weights quantized by RTN: the method does not change the speed),
``llmopt bench`` measures single-stream prompt processing (pp512)
and generation (tg128), median of 5, with the C++ kernels (``--kernels auto``: quantized and float
GEMVs, decode attention, fused float32 steps) and with the plain-torch path (``--kernels
reference``) for comparison. Then:

* a serving workload (32 requests, prompts 32–512, outputs 32–256, all at once) for float32
  and W4A16 g32;
* the latency goal of the product brief: W4A16 g32, Poisson arrivals at 1 request/s, prompts
  of 32–64 tokens, 128 output tokens, 64 requests (p50 TTFT ≤ 150 ms, p50 TPOT ≤ 50 ms);
* llama.cpp's F32, Q8_0 and Q4_0 of the same model through ``llama-cpp-python`` when it is
  installed (optional; it compiles from source), generation tokens/s measured the same way.

Results: ``bench/results/e2e_speed.{json,md}``. Every figure comes from this run, so ratios
compare like with like on a shared machine.

    python bench/e2e_speed.py [--threads 2] [--skip-serving]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from common import llmopt, log

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
ANCHORS = ROOT.parent / "shared" / "anchors" / "llamacpp_smollm2.json"

# label: (scheme, group size) — None scheme: the float model itself
VARIANTS: dict[str, tuple[str | None, int | None]] = {
    "float32": (None, None),
    "W8A16": ("W8A16", None),
    "W4A16 g32": ("W4A16", 32),
    "W4A16 g64": ("W4A16", 64),
    "FP8": ("FP8", None),
    "W4A16 g32 + bf16 head": ("W4A16", 32),
    "W4A16 g32 + int8 head": ("W4A16", 32),
}
# variants that run another variant's checkpoint with extra ``llmopt bench`` options
SAME_CHECKPOINT = {"W4A16 g32 + bf16 head": "W4A16 g32", "W4A16 g32 + int8 head": "W4A16 g32"}
BENCH_OPTIONS = {"W4A16 g32 + bf16 head": ["--lm-head", "bf16"], "W4A16 g32 + int8 head": ["--lm-head", "int8"]}
TARGETS = {"w4a16_vs_float32_decode": 2.5, "w4a16_vs_llamacpp_q4_0_decode": 0.8, "ttft_p50_ms": 150, "tpot_p50_ms": 50}


def checkpoint(label: str, workdir: Path) -> str:
    label = SAME_CHECKPOINT.get(label, label)
    scheme, group = VARIANTS[label]
    if scheme is None:
        return "demo"
    path = workdir / label.replace(" ", "_")
    if not (path / "config.json").exists():
        log(f"quantizing {label} (rtn)")
        args = ["quantize", "demo", "--scheme", scheme, "--method", "rtn", "-o", str(path), "--overwrite"]
        llmopt(*(args + (["--group-size", str(group)] if group else [])))
    return str(path)


def single(model: str, threads: int, kernels: str, *extra: str) -> dict:
    r = llmopt("bench", model, "--threads", str(threads), "-n", "0", "--kernels", kernels, *extra)
    return {"pp512_tok_s": r["pp512_tok_s"], "tg128_tok_s": r["tg128_tok_s"]}


def serving(model: str, threads: int, *extra: str) -> dict:
    return llmopt("bench", model, "--threads", str(threads), "--no-single", *extra)["serving"]


def llamacpp_generation(gguf: Path, threads: int, tokens: int = 128, repetitions: int = 5) -> float:
    """llama.cpp generation tokens/s (median) through llama-cpp-python, one-token prompt."""
    from llama_cpp import Llama

    model = Llama(model_path=str(gguf), n_threads=threads, n_ctx=512, verbose=False)
    times = []
    for rep in range(repetitions + 1):
        model.reset()
        start = time.perf_counter()
        model.eval([1])
        for _ in range(tokens - 1):
            token = model.sample(temp=0.0)
            model.eval([token])
        if rep:  # the first is a warm-up
            times.append(time.perf_counter() - start)
    return tokens / statistics.median(times)


def llamacpp_rows(workdir: Path, threads: int) -> dict:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return {}
    rows = {}
    for gguf_type in ("F32", "Q8_0", "Q4_0"):
        path = workdir / f"demo-{gguf_type}.gguf"
        if not path.exists():
            llmopt("export", "demo", "-o", str(path), "--type", gguf_type.lower(), "--overwrite")
        rows[f"llama.cpp {gguf_type}"] = {"tg128_tok_s": llamacpp_generation(path, threads)}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--workdir", default=str(ROOT / "out" / "bench-e2e"))
    args = parser.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict] = {}
    for label in VARIANTS:
        model = checkpoint(label, workdir)
        log(f"{label}: single stream")
        extra = BENCH_OPTIONS.get(label, [])
        rows[label] = {"kernels": single(model, args.threads, "auto", *extra),
                       "reference": single(model, args.threads, "reference", *extra)}
        log(f"  {rows[label]}")
    peers = llamacpp_rows(workdir, args.threads)
    result = {"machine": platform.machine(), "threads": args.threads, "date": time.strftime("%Y-%m-%d"),
              "variants": rows, "llamacpp": peers, "targets": TARGETS}
    if not args.skip_serving:
        for label in ("float32", "W4A16 g32"):
            log(f"{label}: serving 32 requests")
            rows[label]["serving"] = serving(checkpoint(label, workdir), args.threads)
        log("W4A16 g32: latency goal (Poisson 1/s, 64 requests)")
        result["latency_goal"] = serving(checkpoint("W4A16 g32", workdir), args.threads, "-n", "64", "--rate", "1",
                                         "--prompt-len", "32:64", "--output-len", "128:128")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "e2e_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "e2e_speed.md").write_text(render(result))
    print(render(result))


def render(result: dict) -> str:
    rows, peers = result["variants"], result["llamacpp"]
    base = rows["float32"]["kernels"]["tg128_tok_s"]
    lines = [
        "# End-to-end speed of the demo model in llmopt's runtime",
        "",
        (f"Single stream like llama-bench (pp512, tg128, median of 5), {result['threads']} threads, "
         f"{result['machine']}, {result['date']}; every figure from one run on a shared 2-core machine."),
        "",
        "| variant | pp512 tok/s | tg128 tok/s | tg128 vs float32 | tg128, plain-torch path | kernel speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for label, r in rows.items():
        k, ref = r["kernels"], r.get("reference")
        lines.append(
            f"| {label} | {k['pp512_tok_s']:.1f} | {k['tg128_tok_s']:.1f} | {k['tg128_tok_s'] / base:.2f}× | "
            + (f"{ref['tg128_tok_s']:.1f} | {k['tg128_tok_s'] / ref['tg128_tok_s']:.2f}× |" if ref else "| |"))
    for label, r in peers.items():
        lines.append(f"| {label} | | {r['tg128_tok_s']:.1f} | {r['tg128_tok_s'] / base:.2f}× | | |")
    w4 = rows["W4A16 g32"]["kernels"]["tg128_tok_s"]
    lines += ["", f"- W4A16 g32 decode vs float32: **{w4 / base:.2f}×** (target ≥ {TARGETS['w4a16_vs_float32_decode']}×)."]
    for head in ("bf16", "int8"):
        if f"W4A16 g32 + {head} head" in rows:
            w4h = rows[f"W4A16 g32 + {head} head"]["kernels"]["tg128_tok_s"]
            lines.append(f"- W4A16 g32 with the {head} output head (`--lm-head {head}`; accuracy cost in "
                         f"bench/results/lm_head.md): **{w4h / base:.2f}×** float32, {w4h / w4:.2f}× the float32 head.")
    if "llama.cpp Q4_0" in peers:
        q4 = peers["llama.cpp Q4_0"]["tg128_tok_s"]
        lines.append(f"- W4A16 g32 decode vs llama.cpp Q4_0: **{w4 / q4:.2f}×** (target ≥ {TARGETS['w4a16_vs_llamacpp_q4_0_decode']}×).")
    else:
        anchor = _anchor_tg()
        lines.append("- llama-cpp-python is not installed here, so llama.cpp was not measured in this run"
                     + (f"; its recorded Q4_0 tg128 on this machine is {anchor:.0f} tok/s (../shared/anchors), "
                        f"against which W4A16 g32 is {w4 / anchor:.2f}×"
                        + "".join(f", with the {h} head {rows[f'W4A16 g32 + {h} head']['kernels']['tg128_tok_s'] / anchor:.2f}×"
                                  for h in ("bf16", "int8") if f"W4A16 g32 + {h} head" in rows)
                        + f" (not the same run; target ≥ {TARGETS['w4a16_vs_llamacpp_q4_0_decode']}×)." if anchor else "."))
    for label in ("float32", "W4A16 g32"):
        s = rows[label].get("serving")
        if s:
            lines.append(f"- Serving 32 requests ({label}): {s['output_tok_s']:.1f} output tok/s, TTFT p50 "
                         f"{s['ttft_p50_s'] * 1000:.0f} ms, TPOT p50 {s['tpot_p50_s'] * 1000:.0f} ms.")
    goal = result.get("latency_goal")
    if goal:
        lines.append(f"- Latency goal (W4A16 g32, Poisson 1 request/s, prompts 32–64, 128 output tokens, 64 requests): "
                     f"TTFT p50 **{goal['ttft_p50_s'] * 1000:.0f} ms** (p99 {goal['ttft_p99_s'] * 1000:.0f}), TPOT p50 "
                     f"**{goal['tpot_p50_s'] * 1000:.0f} ms** (p99 {goal['tpot_p99_s'] * 1000:.0f}); targets ≤ "
                     f"{TARGETS['ttft_p50_ms']} ms and ≤ {TARGETS['tpot_p50_ms']} ms.")
    return "\n".join(lines) + "\n"


def _anchor_tg() -> float | None:
    try:
        data = json.loads(ANCHORS.read_text())
    except (OSError, ValueError):
        return None
    for key, value in _walk(data):
        if "q4_0" in key.lower() and "tg" in key.lower() and isinstance(value, (int, float)):
            return float(value)
    return None


def _walk(data, prefix: str = ""):
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _walk(v, f"{prefix}.{k}")
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _walk(v, f"{prefix}.{i}")
    else:
        yield prefix, data


if __name__ == "__main__":
    main()
