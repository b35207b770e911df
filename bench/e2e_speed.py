"""End-to-end speed of the demo model's variants in llmopt's runtime, in one run.

For float32, W8A16, W4A16 (groups of 32 and 64; g32 also with its output head in bfloat16 or
int8, ``--lm-head bf16|int8``) and FP8 (weights quantized by RTN: the method does not change the
speed), ``llmopt bench`` measures single-stream prompt processing (pp512) and generation (tg128)
with the C++ kernels (``--kernels auto``: quantized and float GEMVs, decode attention, fused
float32 steps), in ``--rounds`` interleaved rounds over all variants (and llama.cpp), each a
median of 5; the median over rounds is reported. The plain-torch path (``--kernels reference``)
runs once per checkpoint for comparison. Then:

* a serving workload (32 requests, prompts 32–512, outputs 32–256, all at once) for float32
  and W4A16 g32;
* the latency goal of the product brief: W4A16 g32, Poisson arrivals at 1 request/s, prompts
  of 32–64 tokens, 128 output tokens, 64 requests (p50 TTFT ≤ 150 ms, p50 TPOT ≤ 50 ms);
* llama.cpp's F32, Q8_0 and Q4_0 of the same model through ``llama-cpp-python`` when it is
  importable (optional; it compiles from source), generation tokens/s measured the same way;
* the bandwidth roofline (``bandwidth.py``): the read bandwidth of a streaming read over a 1 GiB
  buffer with the same threads, once per round, and per variant the bytes one decoded token
  reads (from the checkpoint) and the fraction of that bandwidth its tg128 achieves.

Results: ``bench/results/e2e_speed.{json,md}``. Every figure comes from this run, so ratios
compare like with like on a shared machine.

    python bench/e2e_speed.py [--threads 2] [--rounds 3] [--skip-serving]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from bandwidth import bytes_per_token, read_bandwidth
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
    "W4A16 g32, int8 head in checkpoint": ("W4A16", 32),
    "W4A16 g32, int4 head in checkpoint": ("W4A16", 32),
    "IQ4_NL, nl4 embedding/head in checkpoint": ("IQ4_NL", 32),
}
# variants whose checkpoint stores a quantized output head (``llmopt quantize --head``)
QUANTIZE_OPTIONS = {"W4A16 g32, int8 head in checkpoint": ["--head", "int8"],
                    "W4A16 g32, int4 head in checkpoint": ["--head", "int4"],
                    "IQ4_NL, nl4 embedding/head in checkpoint": ["--head", "nl4", "--embedding", "nl4"]}
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
        llmopt(*(args + (["--group-size", str(group)] if group else []) + QUANTIZE_OPTIONS.get(label, [])))
    return str(path)


def single(model: str, threads: int, kernels: str, *extra: str, repetitions: int = 5) -> dict:
    r = llmopt("bench", model, "--threads", str(threads), "-n", "0", "--kernels", kernels, "-r", str(repetitions), *extra)
    return {"pp512_tok_s": r["pp512_tok_s"], "tg128_tok_s": r["tg128_tok_s"]}


def serving(model: str, threads: int, *extra: str) -> dict:
    return llmopt("bench", model, "--threads", str(threads), "--no-single", *extra)["serving"]


def llamacpp_generation(gguf: Path, threads: int, tokens: int = 128, repetitions: int = 5) -> float:
    """llama.cpp generation tokens/s (median) through llama-cpp-python, as ``llmopt bench``'s
    tg128 runs: a one-token prompt, then greedy decoding (argmax of the last logits, read in
    place) until ``tokens`` tokens were evaluated. llama-cpp-python's own ``sample`` is not
    used: its per-call sampler set-up costs more than the model step on this small model."""
    import numpy as np
    from llama_cpp import Llama

    model = Llama(model_path=str(gguf), n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    vocab = model.n_vocab()
    times = []
    for rep in range(repetitions + 1):
        model.reset()
        start = time.perf_counter()
        token = 1
        for _ in range(tokens):
            model.eval([token])
            token = int(np.ctypeslib.as_array(model._ctx.get_logits(), shape=(vocab,)).argmax())
        if rep:  # the first is a warm-up
            times.append(time.perf_counter() - start)
    return tokens / statistics.median(times)


def llamacpp_models(workdir: Path) -> dict[str, Path]:
    """llama.cpp's F32, Q8_0 and Q4_0 GGUF files of the demo model (written by ``llmopt export``),
    or nothing when ``llama-cpp-python`` is not installed."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return {}
    paths = {}
    for gguf_type in ("F32", "Q8_0", "Q4_0"):
        path = workdir / f"demo-{gguf_type}.gguf"
        if not path.exists():
            llmopt("export", "demo", "-o", str(path), "--type", gguf_type.lower(), "--overwrite")
        paths[f"llama.cpp {gguf_type}"] = path
    return paths


def median_rounds(rounds: list[dict]) -> dict:
    """Per figure, the median over rounds (each round's figure is itself a median of 5)."""
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over all variants")
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--skip-reference", action="store_true", help="skip the (slow) plain-torch path")
    parser.add_argument("--variants", help="semicolon-separated labels to measure (default: all; float32 and W4A16 g32 always)")
    parser.add_argument("--workdir", default=str(ROOT / "out" / "bench-e2e"))
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    wanted = set(VARIANTS) if not args.variants else {v.strip() for v in args.variants.split(";")} | {"float32", "W4A16 g32"}
    unknown = wanted - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    models = {label: checkpoint(label, workdir) for label in VARIANTS if label in wanted}
    gguf = llamacpp_models(workdir)
    # The machine is shared: every variant is measured once per round, rounds interleaved, so a
    # slow spell hits all variants alike; each figure is the median over rounds.
    kernels: dict[str, list[dict]] = {label: [] for label in models}
    peer_rounds: dict[str, list[dict]] = {label: [] for label in gguf}
    bandwidth: list[float] = []  # the roofline: streaming read bandwidth, same threads, every round
    for r in range(args.rounds):
        bandwidth.append(read_bandwidth(args.threads))
        log(f"round {r + 1}/{args.rounds} read bandwidth {bandwidth[-1] / 1e9:.1f} GB/s")
        for label, model in models.items():
            kernels[label].append(single(model, args.threads, "auto", *BENCH_OPTIONS.get(label, [])))
            log(f"round {r + 1}/{args.rounds} {label}: {kernels[label][-1]}")
        for label, path in gguf.items():
            peer_rounds[label].append({"tg128_tok_s": llamacpp_generation(path, args.threads)})
            log(f"round {r + 1}/{args.rounds} {label}: {peer_rounds[label][-1]}")
    rows: dict[str, dict] = {}
    for label, model in models.items():
        rows[label] = {"kernels": median_rounds(kernels[label]), "rounds": kernels[label]}
        if label not in SAME_CHECKPOINT and not args.skip_reference:  # the plain-torch path once, for the kernels' speed-up
            rows[label]["reference"] = single(model, args.threads, "reference", repetitions=2)
            log(f"{label} reference path: {rows[label]['reference']}")
    peers = {label: {**median_rounds(v), "rounds": v} for label, v in peer_rounds.items()}
    bw = statistics.median(bandwidth)
    for label, model in models.items():
        head = dict(zip(BENCH_OPTIONS.get(label, [])[::2], BENCH_OPTIONS.get(label, [])[1::2])).get("--lm-head", "auto")
        per_token = bytes_per_token(model, context=64, head=head)  # tg128 from a one-token prompt: 64 tokens of context on average
        tg = rows[label]["kernels"]["tg128_tok_s"]
        rows[label]["roofline"] = {"bytes_per_token": per_token, "achieved_gb_s": tg * per_token["total"] / 1e9,
                                   "fraction_of_read_bandwidth": tg * per_token["total"] / bw}
    result = {"machine": platform.machine(), "threads": args.threads, "date": time.strftime("%Y-%m-%d"),
              "rounds": args.rounds, "variants": rows, "llamacpp": peers, "targets": TARGETS,
              "read_bandwidth_gb_s": bw / 1e9, "read_bandwidth_rounds_gb_s": [b / 1e9 for b in bandwidth]}
    if not args.skip_serving:
        for label in ("float32", "W4A16 g32"):
            log(f"{label}: serving 32 requests")
            rows[label]["serving"] = serving(models[label], args.threads)
        log("W4A16 g32: latency goal (Poisson 1/s, 64 requests)")
        result["latency_goal"] = serving(models["W4A16 g32"], args.threads, "-n", "64", "--rate", "1",
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
        (f"Single stream like llama-bench (pp512, tg128), {result['threads']} threads, {result['machine']}, "
         f"{result['date']}; every figure from one run on a shared 2-core machine: {result.get('rounds', 1)} "
         "interleaved rounds over all variants (llama.cpp included), each a median of 5 repetitions, and the "
         "median over rounds reported. The plain-torch path ran once per checkpoint (median of 2: it is slow)."),
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
        lines.append(f"- W4A16 g32 decode vs llama.cpp Q4_0: **{w4 / q4:.2f}×** (target ≥ {TARGETS['w4a16_vs_llamacpp_q4_0_decode']}×)"
                     + "".join(f"; with the {h} head **{rows[f'W4A16 g32 + {h} head']['kernels']['tg128_tok_s'] / q4:.2f}×**"
                               for h in ("bf16", "int8") if f"W4A16 g32 + {h} head" in rows)
                     + ". llama.cpp's Q4_0 file (`llmopt export --type q4_0`, as llama-quantize does) holds the tied "
                       "output matrix at Q6_K, so the int8 head is the like-for-like configuration.")
        for label in QUANTIZE_OPTIONS:
            if label in rows:
                ratio = rows[label]["kernels"]["tg128_tok_s"] / q4
                target = f" (issue target ≥ 1.2×: {'met' if ratio >= 1.2 else 'missed'})" if label.startswith("W4A16") else ""
                lines.append(f"- {label} (`llmopt quantize {' '.join(QUANTIZE_OPTIONS[label])}`: the evaluated weights are the "
                             f"ones run) vs llama.cpp Q4_0: **{ratio:.2f}×**{target}.")
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
    if "read_bandwidth_gb_s" in result:
        bw = result["read_bandwidth_gb_s"]
        lines += ["", f"Bandwidth roofline: streaming read of a 1 GiB buffer with the same {result['threads']} threads, once per "
                  f"round in this run: **{bw:.1f} GB/s** (rounds {', '.join(f'{b:.1f}' for b in result['read_bandwidth_rounds_gb_s'])}). "
                  "Bytes per decoded token from the checkpoint (every weight once, a tied embedding once as the head, "
                  "an untied one a row) plus the float32 KV of 64 tokens of context (tg128's mean).", "",
                  "| variant | MB per token (weights + KV) | achieved GB/s | fraction of read bandwidth |", "|---|---|---|---|"]
        for label, r in rows.items():
            roof = r.get("roofline")
            if roof:
                lines.append(f"| {label} | {roof['bytes_per_token']['total'] / 1e6:.1f} | {roof['achieved_gb_s']:.1f} | "
                             f"{100 * roof['fraction_of_read_bandwidth']:.0f}% |")
        lines.append("")
        for label in ("W4A16 g32", "W8A16"):
            roof = rows.get(label, {}).get("roofline")
            if roof:
                frac = roof["fraction_of_read_bandwidth"]
                lines.append(f"- {label}: {100 * frac:.0f}% of the measured read bandwidth (target ≥ 60%: "
                             f"{'met' if frac >= 0.6 else 'missed'}).")
        lines.append("")
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
