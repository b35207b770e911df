"""Memory and time of streamed quantization against model size → bench/results/scaling.{json,md,png}.

Synthetic Llama-architecture checkpoints in bf16 with random weights (0.5B, 1.5B, 3B and 7B
shapes, grouped-query attention; written by this script, layer by layer, into
``$LLMOPT_CACHE``-independent scratch under ``--scratch``) plus the demo model, each through
W4A16 RTN, W4A16 GPTQ (16 × 512 calibration tokens) and W8A16 GPTQ. Every run is a separate
child process (``python bench/scaling.py --child …``) that reports its own wall time, CPU time
and peak RSS (``getrusage``) and the engine's per-phase seconds; the parent writes the results
after every row, so an interrupted run keeps what finished. Rows run smallest first.

Runs too long for the machine are measured in part, and reported as such (a separate table,
never mixed with completed rows): ``--layers N`` builds the size's checkpoint with only its
first N decoder layers (same embedding, head and per-layer shapes, so the same memory bound),
``--time-limit S`` stops a run after S seconds. Either way the child logs each finished layer
(wall and CPU seconds, peak RSS so far) and the row keeps the layers done, the seconds per
layer and the total projected for the full depth (start-up + layers × mean layer time).

    .venv/bin/python bench/scaling.py                    # everything (the 7B GPTQ rows take hours)
    .venv/bin/python bench/scaling.py --sizes demo 0.5B --methods rtn-w4
    .venv/bin/python bench/scaling.py --device cuda        # on a GPU machine → scaling_cuda.{json,md,png}
    .venv/bin/python bench/scaling.py --cost                # Wanda / OWL / SparseGPT / GPTQ phase costs (demo)
    .venv/bin/python bench/scaling.py --sizes 7B --methods gptq-w4 --layers 2   # partial: 2 of 32 layers, projected
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
SHAPES = {  # hidden, intermediate, layers, heads, kv heads (vocabulary 32000)
    "0.5B": (1024, 4096, 24, 16, 8),
    "1.5B": (2048, 8192, 24, 16, 4),
    "3B": (3072, 8192, 28, 24, 8),
    "7B": (4096, 14336, 32, 32, 8),
}
METHODS = {  # name: (scheme, method, group size)
    "rtn-w4": ("W4A16", "rtn", 128),
    "gptq-w4": ("W4A16", "gptq", 128),
    "gptq-w8": ("W8A16", "gptq", None),
}
CALIB = (16, 512)
VOCAB = 32000


def make_checkpoint(size: str, folder: Path, depth: int | None = None) -> Path:
    """A bf16 Llama checkpoint of shape ``size`` with random weights, written layer by layer;
    ``depth``: only the first ``depth`` decoder layers (same shapes; random values drawn anew)."""
    import torch

    from llmopt.checkpoints.writer import ShardedWriter

    hidden, inter, layers, heads, kv = SHAPES[size]
    layers = min(layers, depth or layers)
    path = folder / (f"llama-{size}-bf16" if layers == SHAPES[size][2] else f"llama-{size}-{layers}layers-bf16")
    if (path / "config.json").is_file():
        return path
    head_dim = hidden // heads
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    writer = ShardedWriter(path, 2 * 1024**3)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    writer.add("model.embed_tokens.weight", rand(VOCAB, hidden))
    for i in range(layers):
        p = f"model.layers.{i}."
        writer.add_all({
            f"{p}self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            f"{p}self_attn.k_proj.weight": rand(kv * head_dim, hidden),
            f"{p}self_attn.v_proj.weight": rand(kv * head_dim, hidden),
            f"{p}self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            f"{p}mlp.gate_proj.weight": rand(inter, hidden),
            f"{p}mlp.up_proj.weight": rand(inter, hidden),
            f"{p}mlp.down_proj.weight": rand(hidden, inter),
            f"{p}input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            f"{p}post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        })
    writer.add("model.norm.weight", torch.ones(hidden, dtype=torch.bfloat16))
    writer.add("lm_head.weight", rand(VOCAB, hidden))
    writer.close()
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim, "vocab_size": VOCAB, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "dtype": "bfloat16",
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


DEVICE = "cpu"


def _name() -> str:
    return "scaling" if DEVICE == "cpu" else f"scaling_{DEVICE}"


def peak_rss_mib() -> float:
    """This process's own peak RSS (``VmHWM``). ``getrusage``'s ``ru_maxrss`` is not: Linux carries
    the parent's high-water mark over fork / exec, so a child started after this script built a
    checkpoint would report the parent's peak."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _usage(start: float) -> dict:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"wall_s": round(time.perf_counter() - start, 2), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "peak_rss_mib": peak_rss_mib(), "load": round(os.getloadavg()[0], 1)}


def _log_layers(path: Path, start: float) -> None:
    """Append a JSON line to ``path`` for the memory estimate, the start of layer 0 and each
    finished decoder layer (seconds since ``start``, peak RSS so far): what a run stopped by
    ``--time-limit`` leaves behind."""
    import llmopt.quant.streaming as qs
    from llmopt.checkpoints.streaming import StreamedModel

    def line(**event: object) -> None:
        with path.open("a") as f:
            f.write(json.dumps({**event, **_usage(start)}) + "\n")

    estimate, before, after = qs.quantize_estimate, StreamedModel.before, StreamedModel.after

    def logged_estimate(*args, **kwargs):  # noqa: ANN002, ANN003
        found = estimate(*args, **kwargs)
        line(event="estimate", estimate=found.to_dict())
        return found

    def logged_before(self, index, layer):  # noqa: ANN001
        if index == 0:
            line(event="start", layers=len(self.prefixes))
        before(self, index, layer)

    def logged_after(self, index, layer):  # noqa: ANN001
        after(self, index, layer)
        line(event="layer", index=index, layers=len(self.prefixes))

    qs.quantize_estimate = logged_estimate
    StreamedModel.before, StreamedModel.after = logged_before, logged_after


def child(source: str, method: str, out: str) -> None:
    """One measured run (in its own process): prints one JSON line; logs each layer to
    ``OUT.progress.jsonl``."""
    import torch

    from llmopt.checkpoints.lazy import LazyCheckpoint
    from llmopt.pipeline.stages.quantize import quantize_checkpoint
    from llmopt.quant.request import make_request

    scheme, algo, group = METHODS[method]
    with LazyCheckpoint(source) as ckpt:
        params = sum(int(torch.Size(ckpt.shape(k)).numel()) for k in ckpt.keys())
        stored = ckpt.total_bytes()
    calib = None
    if algo != "rtn":
        gen = torch.Generator().manual_seed(0)
        calib = torch.randint(3, 32000, CALIB, generator=gen)
    load = round(os.getloadavg()[0], 1)
    start = time.perf_counter()
    _log_layers(Path(f"{out}.progress.jsonl"), start)
    request = make_request(scheme, algo, group_size=group, device=DEVICE)
    result = quantize_checkpoint(Path(source), Path(out), request, calib, overwrite=True, progress=False).result
    wall = time.perf_counter() - start
    estimate = json.loads((Path(out) / "llmopt.json").read_text())["memory_estimate"]
    shutil.rmtree(out, ignore_errors=True)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({
        "load": load, "load_end": round(os.getloadavg()[0], 1), "wall_s": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "peak_rss_mib": peak_rss_mib(), "params": params, "stored_bytes": stored,
        "bound_mib": round(estimate["peak"] / 1024**2, 1), "estimate": estimate,
        "phases_s": result.timings.to_dict(), "quantized_modules": len(result.weights),
    }))


COSTS = {  # calibration-cost runs on the demo model: name → (kind, options)
    "wanda": ("prune", {"method": "wanda", "sparsity": 0.5}),
    "wanda-owl": ("prune", {"method": "wanda", "sparsity": 0.5, "profile": "owl"}),
    "sparsegpt": ("prune", {"method": "sparsegpt", "sparsity": 0.5}),
    "gptq-w4-g32": ("quant", {}),
}


def cost_child(name: str, out: str) -> None:
    """One calibration-cost run on the demo model (own process): prints the engine's phase seconds."""
    import torch

    from llmopt.checkpoints.models import resolve_model

    source = resolve_model("demo")
    calib = torch.randint(3, 49000, CALIB, generator=torch.Generator().manual_seed(0))
    kind, options = COSTS[name]
    load, start = round(os.getloadavg()[0], 1), time.perf_counter()
    if kind == "prune":
        from llmopt.pruning.apply import PruneSettings
        from llmopt.pruning.streaming import prune_streaming

        record = prune_streaming(source, Path(out), PruneSettings(**options), calib, overwrite=True,
                                 show_progress=False, device=DEVICE)
        passes = record["engine_seconds"]
    else:
        from llmopt.pipeline.stages.quantize import quantize_checkpoint
        from llmopt.quant.request import make_request

        request = make_request("W4A16", "gptq", group_size=32, device=DEVICE)
        result = quantize_checkpoint(source, Path(out), request, calib, overwrite=True, progress=False).result
        passes = {"quantize": result.timings.to_dict()}
    shutil.rmtree(out, ignore_errors=True)
    print(json.dumps({"name": name, "passes": passes, **_usage(start), "load": load, "load_end": round(os.getloadavg()[0], 1)}))


def write_results(rows: list[dict], costs: list[dict] | None = None) -> None:
    RESULTS.mkdir(exist_ok=True)
    partial = [r for r in rows if "partial" in r]
    complete = [r for r in rows if "partial" not in r]
    fit = _linear_fit(complete)
    old = json.loads((RESULTS / f"{_name()}.json").read_text()) if (RESULTS / f"{_name()}.json").is_file() else {}
    costs = costs if costs is not None else old.get("calibration_cost", [])
    data = {"calibration_tokens": list(CALIB), "rows": rows, "time_fit": fit, "calibration_cost": costs,
            "machine": {"cpus": __import__("os").cpu_count()}}
    (RESULTS / f"{_name()}.json").write_text(json.dumps(data, indent=2) + "\n")
    lines = [
        "# Streamed quantization: memory and time against model size",
        "",
        f"bf16 checkpoints (synthetic Llama shapes with random weights, GQA) and the demo model; calibration "
        f"{CALIB[0]}×{CALIB[1]} random tokens; each run a separate process (peak RSS: its own `VmHWM`). "
        "Measured by `bench/scaling.py`.",
        "`bound` is the peak the streaming path computes from the shapes before it starts "
        "(`llmopt.checkpoints.estimate`: the largest of the capture, observe, solve and write phases of one "
        "layer — its float32 weights, the Hessian accumulators or the solver's working memory, the "
        "activations, the output buffer — plus the process baseline).",
        "",
        "The machine is 2 cores shared with other jobs: `load` is the 1-minute load average when the "
        "run started; wall times under load are inflated, CPU times less so.",
        "Phases: `forward` re-runs each compressed layer to make the next layer's inputs (one calibration "
        "forward pass); `calibrate` is the observation pass (forward + statistics hooks); `solve` is the rest "
        "of each layer's work (GPTQ / SparseGPT solves, RTN); `load/write` reads layers from the mmap and writes shards.",
        "",
        "| model | params | method | load (start → end) | wall s | CPU s | CPU s / B params | peak RSS MiB | bound MiB | RSS / bound | RSS / checkpoint size | forward s | calibrate s | solve s | load/write s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in complete:
        ph = r["phases_s"]
        solve = round(ph["observe"] - ph.get("calibrate", 0.0), 2) if ph["layers"] else "–"
        load = f"{r.get('load', '–')} → {r['load_end']}" if "load_end" in r else r.get("load", "–")
        lines.append(
            f"| {r['model']} | {r['params'] / 1e9:.2f}B | {r['method']} | {load} | {r['wall_s']} | {r['cpu_s']} | "
            f"{r['cpu_s'] / (r['params'] / 1e9):.1f} | {r['peak_rss_mib']} | {r['bound_mib']} | "
            f"{r['peak_rss_mib'] / r['bound_mib']:.2f} | {r['peak_rss_mib'] * 1024**2 / r['stored_bytes']:.2f} | "
            f"{ph['forward']} | {ph.get('calibrate', '–')} | {solve} | {ph['load']} |")
    lines += ["", "Linear fits of time against parameters (synthetic sizes; per method, wall and CPU time):", ""]
    for method, f in fit.items():
        sign = "+" if f["intercept_s"] >= 0 else "−"
        lines.append(f"- {method}: {f['slope_s_per_b']:.1f} s per billion parameters {sign} {abs(f['intercept_s']):.1f} s "
                     f"(R² {f['r2']:.3f}, {f['points']} sizes)")
    for r in complete:
        same = [p["partial"] for p in partial if p["model"] == r["model"] and p["method"] == r["method"]]
        layers = r.get("phases_s", {}).get("layers")
        if r["method"] == "gptq-w4" and same and layers and same[0].get("layer_wall_s"):
            first = ", ".join(f"{w:.0f}" for w in same[0]["layer_wall_s"])
            lines.append(f"- {r['model']} {r['method']}: {r['wall_s'] / layers:.0f} s per layer over all {layers} layers, as over "
                         f"the first layers of its partial run ({first} s): no step grows with the number of layers; GPTQ's "
                         "seconds per billion parameters rise with the width instead (each solve is cubic in a matrix's input width)")
    if partial:
        lines += ["", "## Partial runs (not completed): per-layer time and the projected full-depth total", "",
                  "Runs too long for this machine, measured over their first layers only (`--layers N`: a checkpoint "
                  "of the size's first N decoder layers; `--time-limit`: stopped after that many seconds). Peak RSS "
                  "follows one layer, so it is the full run's, except that the output-shard buffer (up to 512 MiB, "
                  "counted by the bound) is nearly empty in the first layers; peak RSS of a stopped run is its "
                  "`VmHWM` sampled every 2 s. The totals are projections (start-up + layers × mean "
                  "seconds per layer, the final embedding / head copy not included), not measurements.", "",
                  "| model | method | layers done / total | load (start → end) | start-up wall s | wall s per layer | "
                  "CPU s per layer | projected wall s | projected CPU s | peak RSS MiB | bound MiB | RSS / bound |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in partial:
            p = r["partial"]
            walls = ", ".join(f"{w:.0f}" for w in p.get("layer_wall_s", [])) or "–"
            cpus = ", ".join(f"{c:.0f}" for c in p.get("layer_cpu_s", [])) or "–"
            bound = p["bound_mib"]
            ratio = f"{p['peak_rss_mib'] / bound:.2f}" if bound else "–"
            fmt = lambda key: f"{p[key]:.0f}" if p.get(key) is not None else "–"  # noqa: E731
            lines.append(f"| {r['model']} | {r['method']} | {p['layers_done']} / {p['layers_total']} | {p['load']} → {p['load_end']} | "
                         f"{fmt('startup_wall_s')} | {walls} | {cpus} | {fmt('projected_wall_s')} | {fmt('projected_cpu_s')} | "
                         f"{p['peak_rss_mib']} | {bound} | {ratio} |")
    if costs:
        lines += ["", f"## Calibration cost on the demo model ({CALIB[0]}×{CALIB[1]} tokens)", "",
                  "Per engine pass: `calibrate` is the observation pass (forward through the observed Linears + "
                  "statistics hooks), `forward` re-runs each compressed layer (one calibration forward pass), `solve` "
                  "the rest of the layer work. `statistics / forward`: all the observation a method needs "
                  "(its `calibrate` seconds, plus the whole profiling pass of OWL, which runs before pruning) "
                  "against the one calibration forward pass of its final pass.", "",
                  "| run | load (start → end) | pass | calibrate s | forward s | calibrate / forward | solve s |",
                  "|---|---|---|---|---|---|---|"]
        for c in costs:
            for pname, ph in c["passes"].items():
                ratio = f"{ph['calibrate'] / ph['forward']:.2f}" if ph["forward"] else "one pass"
                lines.append(f"| {c['name']} | {c.get('load', '–')} → {c.get('load_end', '–')} | {pname} | {ph['calibrate']} | "
                             f"{ph['forward']} | {ratio} | {round(ph['observe'] - ph['calibrate'], 2)} |")
        lines.append("")
        for c in costs:
            final = "prune" if "prune" in c["passes"] else "quantize"
            last = c["passes"][final]
            profiles = [ph for pname, ph in c["passes"].items() if pname != final]
            if not last["forward"]:  # one pass per layer: statistics, solves and the next inputs together
                lines.append(f"- {c['name']}: one pass per layer, {last['calibrate']:.1f} s in all (statistics, solves and "
                             "the forward that makes the next layer's inputs)")
                continue
            stats = sum(ph["calibrate"] + ph["forward"] for ph in profiles) + last["calibrate"]
            profile = "".join(f", of which the {pname} profile {ph['calibrate'] + ph['forward']:.1f} s = "
                              f"{(ph['calibrate'] + ph['forward']) / last['forward']:.2f} ×" for pname, ph in c["passes"].items() if pname != final)
            lines.append(f"- {c['name']}: statistics {stats:.1f} s = {stats / last['forward']:.2f} × one calibration "
                         f"forward pass ({last['forward']:.1f} s){profile}")
    (RESULTS / f"{_name()}.md").write_text("\n".join(lines) + "\n")
    _plot(complete, [r for r in partial if r.get("params_full")])


def _linear_fit(rows: list[dict]) -> dict:
    out = {}
    for method in METHODS:
        for key in ("wall_s", "cpu_s"):
            fit = _fit([(r["params"] / 1e9, r[key]) for r in rows if r["method"] == method and r["model"] != "demo"])
            if fit:
                out[f"{method} {key[:-2]}"] = fit
    return out


def _fit(pts: list[tuple[float, float]]) -> dict | None:
    """Least-squares line through ``(billions of parameters, seconds)`` points."""
    if len(pts) < 2:
        return None
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    icpt = my - slope * mx
    ss = sum((y - my) ** 2 for _, y in pts)
    res = sum((y - (icpt + slope * x)) ** 2 for x, y in pts)
    return {"slope_s_per_b": slope, "intercept_s": icpt, "r2": 1 - res / ss if ss else 1.0, "points": n}


def _plot(rows: list[dict], partial: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in METHODS:
        pts = sorted((r["params"] / 1e9, r["peak_rss_mib"] / 1024, r["bound_mib"] / 1024) for r in rows if r["method"] == method)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{method} peak RSS")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], "x:", label=f"{method} bound")
        part = [(r["params_full"] / 1e9, r["partial"]["peak_rss_mib"] / 1024) for r in partial if r["method"] == method]
        if part:
            ax.plot([p[0] for p in part], [p[1] for p in part], "s", fillstyle="none",
                    label=f"{method} peak RSS (partial run)")
    ax.set_xlabel("parameters (billions)")
    ax.set_ylabel("GiB")
    ax.set_title("Streamed quantization: peak memory vs model size")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{_name()}.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="*", default=["demo", *SHAPES])
    parser.add_argument("--methods", nargs="*", default=list(METHODS))
    parser.add_argument("--scratch", default="/tmp/llmopt-scaling")
    parser.add_argument("--child", nargs=3, metavar=("SOURCE", "METHOD", "OUT"))
    parser.add_argument("--cost", nargs="*", help="calibration-cost runs on the demo model instead (default: all)")
    parser.add_argument("--cost-child", nargs=2, metavar=("NAME", "OUT"))
    parser.add_argument("--report", action="store_true", help="only rewrite the report from the JSON")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (each layer calibrated there)")
    parser.add_argument("--layers", type=int, help="synthetic checkpoints with only their first N decoder layers "
                        "(a partial row: seconds per layer and the projected full-depth total)")
    parser.add_argument("--time-limit", type=float, help="stop each run after this many seconds (a partial row "
                        "from the layers finished by then)")
    args = parser.parse_args()
    if args.layers is not None and args.layers < 1:
        parser.error("--layers takes a positive number of decoder layers")
    if args.time_limit is not None and args.time_limit <= 0:
        parser.error("--time-limit takes a positive number of seconds")
    global DEVICE
    DEVICE = args.device
    if args.child:
        child(*args.child)
        return
    if args.cost_child:
        cost_child(*args.cost_child)
        return
    if args.report:  # rewrite the .md and plot from the .json only
        data = json.loads((RESULTS / f"{_name()}.json").read_text())
        write_results(data["rows"], data.get("calibration_cost", []))
        return
    scratch = Path(args.scratch)
    if args.cost is not None:
        costs = []
        for name in args.cost or list(COSTS):
            proc = subprocess.run([sys.executable, __file__, "--device", DEVICE, "--cost-child", name, str(scratch / "cost-out")],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr[-2000:], file=sys.stderr)
                continue
            costs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(json.dumps(costs[-1]), file=sys.stderr, flush=True)
        old = json.loads((RESULTS / f"{_name()}.json").read_text()) if (RESULTS / f"{_name()}.json").is_file() else {}
        kept = [c for c in old.get("calibration_cost", []) if c["name"] not in {n["name"] for n in costs}]
        write_results(old.get("rows", []), kept + costs)
        return
    for method in args.methods:  # all sizes of the cheap method first, smallest first
        for size in args.sizes:
            if size == "demo":
                from llmopt.checkpoints.models import resolve_model

                source = resolve_model("demo")
            else:
                source = make_checkpoint(size, scratch, args.layers)
            print(f"{size} {method} …", file=sys.stderr, flush=True)
            row = measure(size, method, source, scratch, args.time_limit)
            if row is None:
                continue
            print(json.dumps(row), file=sys.stderr, flush=True)
            _save_row(row)


def measure(size: str, method: str, source: Path, scratch: Path, time_limit: float | None) -> dict | None:
    """Run one child; a run stopped by ``time_limit`` or on a truncated checkpoint gives a row
    with ``partial`` (layers done, seconds per layer, projected total), never a completed one."""
    out = scratch / f"out-{size}-{method}"
    progress = Path(f"{out}.progress.jsonl")
    progress.unlink(missing_ok=True)
    try:
        proc, sampled = _run_sampled([sys.executable, __file__, "--device", DEVICE, "--child", str(source), method, str(out)],
                                     time_limit)
    finally:
        for leftover in scratch.glob(f".{out.name}.tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)
    if proc is not None and proc.returncode != 0:
        print(proc.stderr[-2000:], file=sys.stderr)
        return None
    events = [json.loads(line) for line in progress.read_text().splitlines()] if progress.is_file() else []
    progress.unlink(missing_ok=True)
    row = {"model": size, "method": method}
    if proc is not None:
        row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    total = SHAPES[size][2] if size in SHAPES else None
    done = sum(e["event"] == "layer" for e in events)
    if proc is None or (total is not None and done < total):
        row["partial"] = _partial(events, total, time_limit if proc is None else None, sampled)
        row["params_full"] = shape_params(size) if size in SHAPES else row.get("params")
        if proc is None and row["partial"] is None:
            print(f"{size} {method}: stopped after {time_limit} s before its first layer finished", file=sys.stderr)
            return None
    return row


def shape_params(size: str) -> int:
    """Parameters of the full-depth synthetic checkpoint of ``size``."""
    hidden, inter, layers, heads, kv = SHAPES[size]
    kv_width = kv * (hidden // heads)
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_width + 3 * hidden * inter + 2 * hidden
    return 2 * VOCAB * hidden + hidden + layers * per_layer


def _run_sampled(command: list[str], time_limit: float | None) -> tuple[subprocess.CompletedProcess | None, float]:
    """Run ``command`` (stopped after ``time_limit`` s: None returned) while sampling its ``VmHWM``
    every 2 s, so that a stopped run still has its peak RSS (MiB)."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, stdout=out, stderr=err, text=True)
        began, peak = time.monotonic(), 0.0
        while child.poll() is None:
            try:
                status = Path(f"/proc/{child.pid}/status").read_text()
                peak = max(peak, int(next(x for x in status.splitlines() if x.startswith("VmHWM:")).split()[1]) / 1024)
            except (OSError, StopIteration, ValueError):
                pass
            if time_limit is not None and time.monotonic() - began > time_limit:
                child.kill()
                child.wait()
                return None, round(peak, 1)
            time.sleep(2)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command, child.returncode, out.read(), err.read()), round(peak, 1)


def _partial(events: list[dict], total: int | None, stopped_at: float | None, sampled: float = 0.0) -> dict | None:
    """What the per-layer log of an unfinished (or truncated) run shows, and the full-depth projection
    (none when no layer finished: then only the peak RSS sampled while it ran)."""
    starts = [e for e in events if e["event"] == "start"]
    layers = [e for e in events if e["event"] == "layer"]
    estimate = next((e["estimate"] for e in events if e["event"] == "estimate"), None)
    if not layers:
        if not sampled:
            return None
        return {"layers_done": 0, "layers_total": total, "stopped_at_s": stopped_at, "peak_rss_mib": sampled,
                "load": starts[0]["load"] if starts else None, "load_end": round(os.getloadavg()[0], 1),
                "bound_mib": round(estimate["peak"] / 1024**2, 1) if estimate else None, "estimate": estimate}
    start, last = (starts or events)[0], layers[-1]
    total = total or layers[-1]["layers"]
    walls = [b["wall_s"] - a["wall_s"] for a, b in zip([start, *layers], layers)]
    cpus = [b["cpu_s"] - a["cpu_s"] for a, b in zip([start, *layers], layers)]
    mean_wall, mean_cpu = sum(walls) / len(walls), sum(cpus) / len(cpus)
    return {
        "layers_done": len(layers), "layers_total": total, "stopped_at_s": stopped_at,
        "startup_wall_s": start["wall_s"], "startup_cpu_s": start["cpu_s"],
        "layer_wall_s": [round(w, 2) for w in walls], "layer_cpu_s": [round(c, 1) for c in cpus],
        "projected_wall_s": round(start["wall_s"] + mean_wall * total, 1),
        "projected_cpu_s": round(start["cpu_s"] + mean_cpu * total, 1),
        "peak_rss_mib": max(last["peak_rss_mib"], sampled), "load": start["load"], "load_end": last["load"],
        "bound_mib": round(estimate["peak"] / 1024**2, 1) if estimate else None, "estimate": estimate,
    }


def _save_row(row: dict) -> None:
    """Merge ``row`` into the results on disk (read afresh: several runs may share the file)."""
    path = RESULTS / f"{_name()}.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    key = (row["model"], row["method"], "partial" in row)
    rows = [r for r in old.get("rows", []) if (r["model"], r["method"], "partial" in r) != key]
    write_results([*rows, row], old.get("calibration_cost", []))


if __name__ == "__main__":
    main()
