"""``llmopt compare``: accuracy, speed and size of variants side by side, in one run.

Accuracy is measured against the baseline (perplexity, KLD, top-1; the baseline's distributions
are cached); speed is measured in our runtime (single stream like llama-bench, and a seeded
serving workload); size is the weights' bytes on disk. Results: a rich table, ``report.json``,
``report.md`` and a Pareto plot.
"""

from __future__ import annotations

import gc
import hashlib
import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmopt.accuracy import (
    DEFAULT_TOP_K,
    BaselineCache,
    EvalData,
    eval_data,
    evaluate,
    fill_baseline,
)
from llmopt.checkpoints.models import load_model, resolve_model
from llmopt.checkpoints.provenance import model_fingerprint
from llmopt.core.paths import cache_dir
from llmopt.evaluation import compare_tasks
from llmopt.checkpoints.provenance import read_provenance


@dataclass
class CompareSettings:
    dataset: str = "wikitext2"
    seq_len: int = 2048
    max_windows: int = 16
    top_k: int = DEFAULT_TOP_K
    speed: bool = True
    repetitions: int = 3  # single-stream repetitions in all, spread over the rounds
    rounds: int = 3  # interleaved speed rounds over the baseline and every variant
    serving_requests: int = 16
    prompt_len: tuple[int, int] = (32, 256)
    output_len: tuple[int, int] = (32, 128)
    seed: int = 0
    model_impl: str | None = None  # the runtime's model code for the speed figures (None: each checkpoint's saved setting)
    labels: list[str] = field(default_factory=list)
    # lm-evaluation-harness tasks (the ``tasks`` extra), scored for every variant beside KLD and speed
    tasks: list[str] = field(default_factory=list)
    task_num_fewshot: int | None = None
    task_limit: int | None = None
    task_batch_size: int = 8
    task_include_path: list[str] = field(default_factory=list)


def weight_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def _label(spec: str, path: Path) -> str:
    if spec == "demo":
        return "float (demo)"
    data = read_provenance(path)
    if data:
        if data.get("scheme"):
            return f"{data['scheme']} {data.get('method', '')}".strip()
    return Path(spec).name or spec


def accuracy(specs: list[str], baseline: str, settings: CompareSettings, advance=None) -> list[dict]:
    """Perplexity and agreement with the baseline for every spec (the baseline computed once)."""
    base_path = resolve_model(baseline)
    base_model, tokenizer = load_model(base_path)
    data: EvalData = eval_data(tokenizer, settings.dataset, settings.seq_len, settings.max_windows or None)
    cache = BaselineCache.for_model(model_fingerprint(base_path), data, settings.top_k)
    fill_baseline(base_model, data, cache)
    del base_model
    rows = []
    for spec in specs:
        stored = cache_dir("results") / f"{_hash(model_fingerprint(resolve_model(spec)), str(cache.root))}.json"
        if stored.is_file():  # same variant files, same windows, same baseline: same figures
            rows.append(json.loads(stored.read_text()))
        else:
            model, _ = load_model(spec)
            rows.append(evaluate(model, data, cache).to_dict())
            stored.write_text(json.dumps(rows[-1]))
            del model
            gc.collect()
        if advance:
            advance(1)
    return rows


def _hash(*parts: str) -> str:
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def speed_plan(settings: CompareSettings):
    """How :mod:`llmopt.evaluation.speed` measures: ``rounds`` rounds, the repetitions spread over them."""
    from llmopt.evaluation.speed import SpeedPlan

    return SpeedPlan(rounds=settings.rounds, repetitions=max(1, -(-settings.repetitions // settings.rounds)),
                     serving_requests=settings.serving_requests, prompt_len=settings.prompt_len,
                     output_len=settings.output_len, seed=settings.seed, model_impl=settings.model_impl)


def speed(spec: str, settings: CompareSettings, advance=None) -> dict:
    """Single-stream pp512 / tg128 and serving figures in our runtime (one model, one pass;
    :func:`compare` measures all models in interleaved rounds instead)."""
    from llmopt.runtime import LLMEngine
    from llmopt.runtime.bench import make_workload, serving, single_stream

    engine = LLMEngine(spec, **({} if settings.model_impl is None else {"model_impl": settings.model_impl}))
    single = single_stream(engine, repetitions=settings.repetitions, seed=settings.seed)
    workload = make_workload(settings.serving_requests, settings.prompt_len, settings.output_len,
                             engine.arch.vocab_size, seed=settings.seed)
    served = serving(engine, workload)
    del engine
    gc.collect()
    if advance:
        advance(1)
    keep = ("output_tok_s", "total_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "requests")
    return {"pp512_tok_s": single["pp512_tok_s"], "tg128_tok_s": single["tg128_tok_s"],
            **{f"serving_{k}": served[k] for k in keep if k in served}}


def compare(baseline: str, variants: list[str], settings: CompareSettings, advance=None) -> dict:
    """Measure the baseline and every variant; returns the report (rows in input order)."""
    specs = [baseline, *variants]
    paths = [resolve_model(s) for s in specs]
    labels = settings.labels or [_label(s, p) for s, p in zip(specs, paths)]
    tasks = compare_tasks.prepare(settings)  # a missing extra or unknown task fails before any measurement
    rows = accuracy(specs, baseline, settings, advance)
    for spec, path, label, row in zip(specs, paths, labels, rows):
        row.update({"label": label, "spec": spec, "weights_bytes": weight_bytes(path)})
    compare_tasks.add_task_scores(rows, specs, tasks)
    measurement = None
    if settings.speed:
        from llmopt.evaluation.speed import measure

        figures, measurement = measure([str(p) for p in paths], labels, speed_plan(settings), advance)
        for row, fig in zip(rows, figures):
            row.update(fig)
    return {
        "baseline": baseline,
        "rows": rows,
        "settings": {k: v for k, v in settings.__dict__.items() if k != "labels"},
        "machine": {"platform": platform.platform(), "processor": platform.machine(), "threads": torch.get_num_threads()},
        "versions": _versions(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "speed_measurement": measurement,
    }


def _versions() -> dict:
    import transformers

    from llmopt import __version__

    return {"llmopt": __version__, "torch": torch.__version__, "transformers": transformers.__version__}


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points not dominated (lower x and higher y are better), sorted by x."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any((x2 <= x and y2 >= y) and (x2 < x or y2 > y) for j, (x2, y2) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def plot_pareto(report: dict, path: Path) -> None:
    """Speed (or size) against KLD, every point labelled, the Pareto front drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    has_speed = all("tg128_tok_s" in r for r in rows)
    y_key, y_label = ("tg128_tok_s", "generation speed, tokens/s (tg128, higher is better)") if has_speed else \
        ("weights_mib", "weights, MiB (lower is better)")
    xs = [max(r["kld_mean"], 1e-6) for r in rows]
    ys = [r[y_key] if has_speed else r["weights_bytes"] / 2**20 for r in rows]
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    ax.scatter(xs, ys, s=40, zorder=3)
    for x, y, r in zip(xs, ys, rows):
        ax.annotate(r["label"], (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
    signed = [(x, y if has_speed else -y) for x, y in zip(xs, ys)]
    front = pareto_front(signed)
    ax.plot([xs[i] for i in front], [ys[i] for i in front], "--", color="tab:red", zorder=2, label="Pareto front")
    ax.set_xscale("log")
    ax.set_xlabel("mean KL divergence vs baseline (log, lower is better)")
    ax.set_ylabel(y_label)
    ax.set_title(f"llmopt compare — baseline {report['baseline']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def markdown(report: dict) -> str:
    s = report["settings"]
    rows = report["rows"]
    speed_cols = all("tg128_tok_s" in r for r in rows)
    head = "| variant | ppl | KLD mean | KLD p99 | top-1 | weights (MiB) |"
    sep = "|---|---|---|---|---|---|"
    if speed_cols:
        head += " pp512 tok/s | tg128 tok/s | tg128 spread | serving tok/s | TTFT p50 (ms) | TPOT p50 (ms) |"
        sep += "---|---|---|---|---|---|"
    task_head, task_sep, task_cells = compare_tasks.markdown_columns(rows)
    head, sep = head + task_head, sep + task_sep
    lines = [
        f"# llmopt compare — baseline `{report['baseline']}`", "",
        f"Accuracy: {s['dataset']}, {rows[0]['windows']} windows of {s['seq_len']} tokens ({rows[0]['tokens']:,} scored tokens); "
        f"speed: our runtime, single stream ({s['repetitions']} repetitions in all), serving {s['serving_requests']} requests "
        f"(prompt {s['prompt_len'][0]}–{s['prompt_len'][1]}, output {s['output_len'][0]}–{s['output_len'][1]} tokens, seed {s['seed']}); "
        f"{report['machine']['processor']}, {report['machine']['threads']} threads; {report['date']}.", "", head, sep,
    ]
    for r, task_cell in zip(rows, task_cells):
        line = (f"| {r['label']} | {r['perplexity']:.3f} | {r['kld_mean']:.4f} | {r['kld_p99']:.3f} | "
                f"{100 * r['top1_agreement']:.1f}% | {r['weights_bytes'] / 2**20:.1f} |")
        if speed_cols:
            spread = r.get("tg128_tok_s_spread")
            line += (f" {r['pp512_tok_s']:.0f} | {r['tg128_tok_s']:.1f} | "
                     f"{'' if spread is None else f'{100 * spread:.0f}%'} | {r['serving_output_tok_s']:.1f} | "
                     f"{1000 * r['serving_ttft_p50_s']:.0f} | {1000 * r['serving_tpot_p50_s']:.0f} |")
        lines.append(line + task_cell)
    lines += speed_notes(report.get("speed_measurement"))
    if compare_tasks.task_names(rows):
        lines += ["", compare_tasks.markdown_note(rows)]
    return "\n".join(lines) + "\n"


def speed_notes(measurement: dict | None) -> list[str]:
    """How speed was measured (rounds, load average before / after) and any warnings, as markdown lines."""
    if not measurement:
        return []
    load = lambda x: "unknown" if not x else f"{x[0]:.2f} / {x[1]:.2f} / {x[2]:.2f}"  # noqa: E731
    lines = ["", (f"Speed: {measurement['rounds']} interleaved rounds over all models ({measurement['repetitions_per_round']} "
                  f"single-stream repetition(s) per round); each figure is the median over rounds, spread = (max − min) / "
                  f"median. Load average (1 / 5 / 15 min) before: {load(measurement['load_average_before'])}, after: "
                  f"{load(measurement['load_average_after'])} ({measurement['cores']} cores, {measurement['threads']} threads).")]
    for warning in measurement["warnings"]:
        lines.append(f"\n**Warning:** {warning}.")
    return lines


def write_report(report: dict, directory: Path, plot: Path | None = None) -> dict[str, Path]:
    """``report.json``, ``report.md`` and the Pareto plot, each written whole or not at all."""
    from llmopt.core.atomic import atomic_file

    directory.mkdir(parents=True, exist_ok=True)
    files = {"json": directory / "report.json", "md": directory / "report.md", "plot": plot or directory / "pareto.png"}
    with atomic_file(files["json"], overwrite=True) as tmp:
        tmp.write_text(json.dumps(report, indent=2) + "\n")
    with atomic_file(files["md"], overwrite=True) as tmp:
        tmp.write_text(markdown(report))
    with atomic_file(files["plot"], overwrite=True) as tmp:
        plot_pareto(report, tmp)
    if compare_tasks.task_names(report["rows"]):
        files["tasks_plot"] = directory / "tasks.png"
        with atomic_file(files["tasks_plot"], overwrite=True) as tmp:
            compare_tasks.plot_tasks(report, tmp)
    return files
