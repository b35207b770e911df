"""Memory and time of streamed quantization against model size → bench/results/scaling.{json,md,png}.

Synthetic Llama-architecture checkpoints in bf16 with random weights (0.5B, 1.5B, 3B and 7B
shapes, grouped-query attention; written by this script, layer by layer, into
``$LLMOPT_CACHE``-independent scratch under ``--scratch``) plus the demo model, each through
W4A16 RTN, W4A16 GPTQ (16 × 512 calibration tokens) and W8A16 GPTQ. Every run is a separate
child process (``python bench/scaling.py --child …``) that reports its own wall time, CPU time
and peak RSS (``getrusage``) and the engine's per-phase seconds; the parent writes the results
after every row, so an interrupted run keeps what finished. Rows run smallest first.

    .venv/bin/python bench/scaling.py                    # everything (the 7B GPTQ rows take hours)
    .venv/bin/python bench/scaling.py --sizes demo 0.5B --methods rtn-w4
    .venv/bin/python bench/scaling.py --device cuda        # on a GPU machine → scaling_cuda.{json,md,png}
    .venv/bin/python bench/scaling.py --cost                # Wanda / OWL / SparseGPT / GPTQ phase costs (demo)
"""

from __future__ import annotations

import argparse
import json
import resource
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


def make_checkpoint(size: str, folder: Path) -> Path:
    """A bf16 Llama checkpoint of shape ``size`` with random weights, written layer by layer."""
    import torch

    from llmopt.checkpoints.writer import ShardedWriter

    path = folder / f"llama-{size}-bf16"
    if (path / "config.json").is_file():
        return path
    hidden, inter, layers, heads, kv = SHAPES[size]
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


def child(source: str, method: str, out: str) -> None:
    """One measured run (in its own process): prints one JSON line."""
    import shutil

    import torch

    from llmopt.checkpoints.lazy import LazyCheckpoint
    from llmopt.quant.streaming import quantize_streaming

    scheme, algo, group = METHODS[method]
    with LazyCheckpoint(source) as ckpt:
        params = sum(int(torch.Size(ckpt.shape(k)).numel()) for k in ckpt.keys())
        stored = ckpt.total_bytes()
    calib = None
    if algo != "rtn":
        gen = torch.Generator().manual_seed(0)
        calib = torch.randint(3, 32000, CALIB, generator=gen)
    load = round(__import__("os").getloadavg()[0], 1)
    start = time.perf_counter()
    result = quantize_streaming(Path(source), Path(out), scheme, algo, group, calib, show_progress=False,
                                overwrite=True, device=DEVICE, provenance=lambda r, e: {"estimate": e.to_dict()})
    wall = time.perf_counter() - start
    record = json.loads((Path(out) / "llmopt.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({
        "load": load, "wall_s": round(wall, 2), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1), "params": params, "stored_bytes": stored,
        "bound_mib": round(record["estimate"]["peak"] / 1024**2, 1), "estimate": record["estimate"],
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
    import shutil

    import torch

    from llmopt.checkpoints.models import resolve_model

    source = resolve_model("demo")
    calib = torch.randint(3, 49000, CALIB, generator=torch.Generator().manual_seed(0))
    kind, options = COSTS[name]
    if kind == "prune":
        from llmopt.prune.apply import PruneSettings
        from llmopt.prune.streaming import prune_streaming

        record = prune_streaming(source, Path(out), PruneSettings(**options), calib, overwrite=True,
                                 show_progress=False, device=DEVICE)
        passes = record["engine_seconds"]
    else:
        from llmopt.quant.streaming import quantize_streaming

        result = quantize_streaming(source, Path(out), "W4A16", "gptq", 32, calib, overwrite=True, show_progress=False,
                                    device=DEVICE)
        passes = {"quantize": result.timings.to_dict()}
    shutil.rmtree(out, ignore_errors=True)
    print(json.dumps({"name": name, "passes": passes}))


def write_results(rows: list[dict], costs: list[dict] | None = None) -> None:
    RESULTS.mkdir(exist_ok=True)
    fit = _linear_fit(rows)
    old = json.loads((RESULTS / f"{_name()}.json").read_text()) if (RESULTS / f"{_name()}.json").is_file() else {}
    costs = costs if costs is not None else old.get("calibration_cost", [])
    data = {"calibration_tokens": list(CALIB), "rows": rows, "time_fit": fit, "calibration_cost": costs,
            "machine": {"cpus": __import__("os").cpu_count()}}
    (RESULTS / f"{_name()}.json").write_text(json.dumps(data, indent=2) + "\n")
    lines = [
        "# Streamed quantization: memory and time against model size",
        "",
        f"bf16 checkpoints (synthetic Llama shapes with random weights, GQA) and the demo model; calibration "
        f"{CALIB[0]}×{CALIB[1]} random tokens; each run a separate process. Measured by `bench/scaling.py`.",
        "`bound` is the peak the streaming path computes from the shapes before it starts "
        "(largest layer + Hessians + activations + embedding + output buffer + process baseline).",
        "",
        "The machine is 2 cores shared with other jobs: `load` is the 1-minute load average when the "
        "run started; wall times under load are inflated, CPU times less so.",
        "Phases: `forward` re-runs each compressed layer to make the next layer's inputs (one calibration "
        "forward pass); `calibrate` is the observation pass (forward + statistics hooks); `solve` is the rest "
        "of each layer's work (GPTQ / SparseGPT solves, RTN); `load/write` reads layers from the mmap and writes shards.",
        "",
        "| model | params | method | load | wall s | CPU s | CPU s / B params | peak RSS MiB | bound MiB | RSS / bound | RSS / checkpoint size | forward s | calibrate s | solve s | load/write s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ph = r["phases_s"]
        solve = round(ph["observe"] - ph.get("calibrate", 0.0), 2) if ph["layers"] else "–"
        lines.append(
            f"| {r['model']} | {r['params'] / 1e9:.2f}B | {r['method']} | {r.get('load', '–')} | {r['wall_s']} | {r['cpu_s']} | "
            f"{r['cpu_s'] / (r['params'] / 1e9):.1f} | {r['peak_rss_mib']} | {r['bound_mib']} | "
            f"{r['peak_rss_mib'] / r['bound_mib']:.2f} | {r['peak_rss_mib'] * 1024**2 / r['stored_bytes']:.2f} | "
            f"{ph['forward']} | {ph.get('calibrate', '–')} | {solve} | {ph['load']} |")
    lines += ["", "Linear fits of time against parameters (synthetic sizes; per method, wall and CPU time):", ""]
    for method, f in fit.items():
        lines.append(f"- {method}: {f['slope_s_per_b']:.1f} s per billion parameters + {f['intercept_s']:.1f} s "
                     f"(R² {f['r2']:.3f}, {f['points']} sizes)")
    if costs:
        lines += ["", f"## Calibration cost on the demo model ({CALIB[0]}×{CALIB[1]} tokens)", "",
                  "`calibrate / forward`: the observation pass against one calibration forward pass of the same layers.", "",
                  "| run | pass | calibrate s | forward s | calibrate / forward | solve s |", "|---|---|---|---|---|---|"]
        for c in costs:
            for pname, ph in c["passes"].items():
                lines.append(f"| {c['name']} | {pname} | {ph['calibrate']} | {ph['forward']} | "
                             f"{ph['calibrate'] / ph['forward']:.2f} | {round(ph['observe'] - ph['calibrate'], 2)} |")
    (RESULTS / f"{_name()}.md").write_text("\n".join(lines) + "\n")
    _plot(rows)


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


def _plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in METHODS:
        pts = sorted((r["params"] / 1e9, r["peak_rss_mib"] / 1024, r["bound_mib"] / 1024) for r in rows if r["method"] == method)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{method} peak RSS")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], "x:", label=f"{method} bound")
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
    args = parser.parse_args()
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
        write_results(old.get("rows", []), costs)
        return
    old = json.loads((RESULTS / f"{_name()}.json").read_text())["rows"] if (RESULTS / f"{_name()}.json").is_file() else []
    rows = [r for r in old if not (r["model"] in args.sizes and r["method"] in args.methods)]
    for method in args.methods:  # all sizes of the cheap method first, smallest first
        for size in args.sizes:
            if size == "demo":
                from llmopt.checkpoints.models import resolve_model

                source = resolve_model("demo")
            else:
                source = make_checkpoint(size, scratch)
            print(f"{size} {method} …", file=sys.stderr, flush=True)
            proc = subprocess.run([sys.executable, __file__, "--device", DEVICE, "--child", str(source), method, str(scratch / "out")],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr[-2000:], file=sys.stderr)
                continue
            row = {"model": size, "method": method, **json.loads(proc.stdout.strip().splitlines()[-1])}
            rows = [r for r in rows if not (r["model"] == size and r["method"] == method)]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            write_results(rows)


if __name__ == "__main__":
    main()
