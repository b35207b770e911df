"""Quantized linear kernels on this CPU: llmopt's C++ kernels against torch, in one run.

Shapes: the demo model's linears (576→576, 576→192, 576→1536, 1536→576, 576→49152) and a 7B
model's (4096→4096, 4096→14336, 14336→4096); rows M in 1, 4, 16, 128. Variants:

    f32         torch ``F.linear`` with the float32 weight (the baseline of every ratio)
    f32 (W^T)   ``x @ W^T`` with the weight stored [in, out], as the runtime's DenseLinear does
    int4 gN     ours, symmetric int4 with groups of N (skipped where N does not divide K)
    int8 / fp8  ours, per-channel weight-only
    w8a8        ours, int8 weights and per-token int8 activations (integer dot products)
    torch int4 gN / torch int8   ``torch._weight_int4pack_mm_for_cpu`` / ``torch._weight_int8pack_mm``
                fed bfloat16 activations (their fast path)

Each measurement: one warm-up call, then calls until ``--min-time`` seconds (at least 3, at most
``--max-reps``), median. GB/s = bytes of the weight as that kernel reads it (packed codes plus
scales for ours) / median time; the memory copy bandwidth is measured in the same run (a
256 MiB tensor copy, counted as read + write, as STREAM does), at the start and at the end.

Results: ``bench/results/kernels.{json,md}``.

    python bench/kernel_speed.py [--threads-list 1,2] [--shapes 576x1536,4096x14336]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DEMO = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]
SEVEN_B = [(4096, 4096), (4096, 14336), (14336, 4096)]
ROWS = [1, 4, 16, 128]
OURS = ["int4 g32", "int4 g64", "int4 g128", "int8", "fp8", "w8a8"]
PRESET = {"int4": "W4A16", "int8": "W8A16", "fp8": "FP8", "w8a8": "W8A8"}
COLUMNS = ["f32", "f32 (W^T)", *OURS, "torch int4 g32", "torch int4 g64", "torch int4 g128", "torch int8"]
COLD_BYTES = 128 * 2**20  # four times the 32 MiB L3 of the machine these results come from
MAX_COPIES = 256


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def timed(fn, min_time: float, max_reps: int) -> float:
    """Median seconds of ``fn()`` after one warm-up call."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < max_reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(min_time: float) -> float:
    """GB/s of a 256 MiB float32 copy, read + write bytes counted."""
    src = torch.ones(64 * 1024 * 1024)
    dst = torch.zeros_like(src)
    seconds = timed(lambda: dst.copy_(src), min_time, 15)
    return 2 * src.nbytes / seconds / 1e9


def our_variant(name: str, w: torch.Tensor):
    """(weights, bytes read, call(x, xb, weights)) for one of ``OURS``, or None when the group does not fit."""
    from llmopt.formats.schemes import compute_qparams, get_scheme, quantize
    from llmopt.runtime.kernels import cpu_linear

    kind, _, group = name.partition(" g")
    gs = int(group) if group else None
    if gs and w.shape[1] % gs:
        return None
    scheme = get_scheme(PRESET[kind], gs or 0)
    scale, zp = compute_qparams(w, scheme, gs)
    packed = cpu_linear.pack(quantize(w, scale, zp, scheme, gs), scale, zp, gs, scheme.activations)
    return (packed,), packed.nbytes(), lambda x, xb, p: cpu_linear.linear(x, p)


def torch_int4(w: torch.Tensor, gs: int):
    """torch's CPU int4 weight (packed uint8, bf16 scales and zeros), or None when the group does not fit."""
    n, k = w.shape
    if k % gs:
        return None
    wg = w.reshape(n, k // gs, gs)
    scale = (wg.abs().amax(-1) / 7.5).clamp(min=1e-8)
    q = (torch.round(wg / scale.unsqueeze(-1)) + 8).clamp(0, 15).to(torch.int32).reshape(n, k)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_zeros = torch.stack([scale.T, torch.zeros_like(scale.T)], -1).to(torch.bfloat16).contiguous()
    return ((packed, scales_zeros), packed.nbytes + scales_zeros.nbytes,
            lambda x, xb, p, z: torch._weight_int4pack_mm_for_cpu(xb, p, gs, z))


def variants(w: torch.Tensor) -> dict[str, tuple]:
    """name → (weights, bytes the kernel reads, call(x, x_bf16, *weights))."""
    w8 = torch.round(w / (w.abs().amax(1, keepdim=True) / 127)).to(torch.int8)
    s8 = (w.abs().amax(1) / 127).to(torch.bfloat16)
    out = {"f32": ((w,), w.nbytes, lambda x, xb, w: F.linear(x, w)),
           "f32 (W^T)": ((w.t().contiguous(),), w.nbytes, lambda x, xb, w_t: torch.mm(x, w_t))}
    out.update({name: v for name in OURS if (v := our_variant(name, w)) is not None})
    out.update({f"torch int4 g{gs}": v for gs in (32, 64, 128) if (v := torch_int4(w, gs)) is not None})
    out["torch int8"] = ((w8, s8), w8.nbytes + s8.nbytes, lambda x, xb, w, s: torch._weight_int8pack_mm(xb, w, s))
    return out


def copies_of(weights: tuple) -> tuple:
    """An independent copy (fresh memory) of one variant's weights."""
    from dataclasses import replace

    from llmopt.runtime.kernels.cpu_linear import PackedLinear

    def clone(t):
        if isinstance(t, PackedLinear):
            return replace(t, data=t.data.clone(), scale=t.scale.clone(), handle=None,
                           offset=None if t.offset is None else t.offset.clone(),
                           wsum=None if t.wsum is None else t.wsum.clone())
        return t.clone()

    return tuple(clone(t) for t in weights)


def cycling(call, x: torch.Tensor, xb: torch.Tensor, sets: list[tuple]):
    """A no-argument call of ``call`` on the next weight copy of ``sets`` each time."""
    turn = iter(range(10**12))
    return lambda: call(x, xb, *sets[next(turn) % len(sets)])


def measure_shape(k: int, n: int, args) -> list[dict]:
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.05
    rows = []
    table = variants(w)
    # Cold: calls cycle through copies of the weight totalling COLD_BYTES (or MAX_COPIES), so each
    # call reads it from memory as a model's forward pass does (its other layers evict it from cache).
    cold = {name: [weights] + [copies_of(weights) for _ in range(min(MAX_COPIES, -(-COLD_BYTES // nbytes)) - 1)]
            for name, (weights, nbytes, _) in table.items()}
    for m in ROWS:
        x = torch.randn(m, k)
        xb = x.to(torch.bfloat16)
        for mode in ("cold", "warm") if m == 1 else ("cold",):
            base = None
            for name, (weights, nbytes, call) in table.items():
                fn = cycling(call, x, xb, cold[name] if mode == "cold" else [weights])
                seconds = timed(fn, args.min_time, args.max_reps)
                base = base or seconds
                rows.append({"k": k, "n": n, "m": m, "mode": mode, "variant": name, "seconds": seconds,
                             "weight_bytes": nbytes, "gbps": nbytes / seconds / 1e9, "speedup_vs_f32": base / seconds})
            log(f"  {k}→{n} M={m} {mode}: " + ", ".join(f"{r['variant']} {r['speedup_vs_f32']:.2f}x"
                                                      for r in rows if (r["m"], r["mode"]) == (m, mode)))
    return rows


def machine() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            name = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{name}, {len(os.sched_getaffinity(0))} CPUs"


def run(threads: int, args) -> dict:
    from llmopt.runtime.kernels import cpu_linear

    torch.set_num_threads(threads)
    load_start = os.getloadavg()[0]
    copy_start = copy_bandwidth(args.min_time)
    log(f"threads {threads}: copy bandwidth {copy_start:.1f} GB/s")
    rows = []
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else DEMO + SEVEN_B
    for k, n in shapes:
        rows += measure_shape(k, n, args)
    copy_end = copy_bandwidth(args.min_time)
    log(f"threads {threads}: copy bandwidth at the end {copy_end:.1f} GB/s")
    isa = cpu_linear.supported_isas()[-1]
    return {"threads": threads, "isa": isa, "copy_gbps_start": copy_start, "copy_gbps_end": copy_end,
            "load_average_start": load_start, "load_average_end": os.getloadavg()[0], "rows": rows}


def fmt_us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f}" if seconds < 1e-2 else f"{seconds * 1e3:.1f} ms"


def report(result: dict) -> str:
    lines = ["# Quantized linear kernels on this CPU", "",
             (f"{result['machine']}, torch {result['torch']}. Generated by `bench/kernel_speed.py`; "
              "median of repetitions (at least 3, until "
              f"{result['min_time']} s). The machine is shared with other tenants, so absolute times are noisy; "
              "variants are measured one after another on the same shape, so ratios are fairer than absolute "
              "times.") + (f" {result['note']}" if result.get("note") else ""), "",
             ("Speed-up = f32 `F.linear` time / variant time (higher is better); GB/s = weight bytes as the kernel "
              "reads them / time. *From memory*: calls cycle through copies of the weight totalling 128 MiB (at most "
              "256 copies), as in a model's forward pass where the other layers evict each weight from the 32 MiB L3; "
              "*warm*: one copy called repeatedly. Ours: `runtime/kernels/cpu_linear.py` (C++, instruction set "
              "chosen at run time). torch int4/int8: `_weight_int4pack_mm_for_cpu` / `_weight_int8pack_mm` with "
              "bfloat16 activations."), ""]
    for run_ in result["runs"]:
        lines += run_report(run_)
    return "\n".join(lines)


def run_report(run_: dict) -> list[str]:
    rows = run_["rows"]
    copy = (run_["copy_gbps_start"] + run_["copy_gbps_end"]) / 2
    present = {r["variant"] for r in rows}
    variants = [v for v in COLUMNS if v in present]
    pick = {(r["k"], r["n"], r["m"], r["mode"], r["variant"]): r for r in rows}
    shapes = list(dict.fromkeys((r["k"], r["n"]) for r in rows))
    load = (f" Load average (1 min): {run_['load_average_start']:.1f} at the start, {run_['load_average_end']:.1f} at the end."
            if "load_average_start" in run_ else "")
    lines = [f"## {run_['threads']} thread(s), {run_['isa']} kernels", "",
             (f"Memory copy bandwidth (read + write, STREAM's count): {run_['copy_gbps_start']:.1f} GB/s at the start, "
             f"{run_['copy_gbps_end']:.1f} GB/s at the end; the % below are of their mean ({copy:.1f} GB/s). "
             "A kernel that only reads can exceed it (a copy also reads the destination before writing it)." + load), "",
             "### Speed-up over float32 F.linear, weights from memory (f32 column: its time in µs)", "",
             "| K→N | M | " + " | ".join(variants) + " |", "|" + "---|" * (len(variants) + 2)]
    for k, n in shapes:
        for m in ROWS:
            cells = [pick.get((k, n, m, "cold", v)) for v in variants]
            if cells[0] is None:
                continue
            out = [fmt_us(c["seconds"]) if v == "f32" else (f"{c['speedup_vs_f32']:.2f}" if c else "—")
                   for v, c in zip(variants, cells)]
            lines.append(f"| {k}→{n} | {m} | " + " | ".join(out) + " |")
    for mode, title in (("cold", "weights from memory"), ("warm", "weights warm in cache (one copy, called repeatedly)")):
        lines += ["", f"### M = 1, {title}: GB/s (% of copy bandwidth) and speed-up", "",
                  "| K→N | " + " | ".join(variants) + " |", "|" + "---|" * (len(variants) + 1)]
        for k, n in shapes:
            cells = [pick.get((k, n, 1, mode, v)) for v in variants]
            out = [f"{c['gbps']:.1f} ({100 * c['gbps'] / copy:.0f}%) {c['speedup_vs_f32']:.2f}×" if c else "—" for c in cells]
            lines.append(f"| {k}→{n} | " + " | ".join(out) + " |")
    lines += ["", "### Targets", ""]
    for k, n in [(576, 1536), (4096, 14336)]:
        for g in ("int4 g32", "int4 g64", "int4 g128"):
            for mode in ("cold", "warm"):
                cell = pick.get((k, n, 1, mode, g))
                if cell:
                    ok = "met" if cell["speedup_vs_f32"] >= 3 else "MISSED"
                    lines.append(f"- {g} GEMV, M = 1, {k}→{n}, {mode}: {cell['speedup_vs_f32']:.2f}× f32 (target ≥ 3×: {ok})")
    for k, n in SEVEN_B:
        for g in ("int4 g32", "int4 g128"):
            cell = pick.get((k, n, 1, "cold", g))
            if cell:
                share = cell["gbps"] / copy
                ok = "met" if share >= 0.6 else "MISSED"
                lines.append(f"- {g} GEMV, M = 1, {k}→{n}, from memory: {cell['gbps']:.1f} GB/s = {100 * share:.0f}% "
                             f"of copy bandwidth (target ≥ 60%: {ok})")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads-list", default="1,2", help="comma-separated thread counts, measured in turn")
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds of calls per measurement (at least 3 calls)")
    parser.add_argument("--max-reps", type=int, default=25)
    parser.add_argument("--shapes", help="KxN,... instead of the demo and 7B shapes (a quick look)")
    parser.add_argument("--note", help="a remark printed under the title (stored in the JSON)")
    parser.add_argument("--report-only", action="store_true", help="rewrite kernels.md from kernels.json (with --note)")
    args = parser.parse_args()
    if args.report_only:
        result = json.loads((RESULTS / "kernels.json").read_text())
        if args.note:
            result["note"] = args.note
        (RESULTS / "kernels.json").write_text(json.dumps(result, indent=1))
        (RESULTS / "kernels.md").write_text(report(result))
        return
    from llmopt.runtime.kernels import cpu_linear

    if not cpu_linear.available():
        raise SystemExit("the C++ kernels are not available here (no compiler?)")
    result = {"machine": machine(),
              "torch": torch.__version__, "min_time": args.min_time, "max_reps": args.max_reps, "note": args.note,
              "runs": []}
    for threads in (int(t) for t in args.threads_list.split(",")):
        result["runs"].append(run(threads, args))
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "kernels.json").write_text(json.dumps(result, indent=1))
        (RESULTS / "kernels.md").write_text(report(result))
    log(f"wrote {RESULTS / 'kernels.md'}")


if __name__ == "__main__":
    main()
