"""``llmopt compare``: variants side by side (accuracy, speed, size) with a Pareto plot."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from llmopt.cli.common import emit_json, hub_options, user_errors
from llmopt.runtime.config import MODEL_IMPL_CHOICES


def compare_table(report: dict) -> Table:
    rows = report["rows"]
    speed = all("tg128_tok_s" in r for r in rows)
    table = Table(title=f"compare vs {report['baseline']} ({rows[0]['windows']}×{rows[0]['seq_len']} tokens)", title_justify="left")
    columns = ["variant", "ppl", "KLD mean", "KLD p99", "top-1", "MiB"] + (["pp512 t/s", "tg128 t/s", "serve t/s", "TTFT p50", "TPOT p50"] if speed else [])
    for c in columns:
        table.add_column(c, justify="left" if c == "variant" else "right")
    for r in rows:
        cells = [r["label"], f"{r['perplexity']:.3f}", f"{r['kld_mean']:.4f}", f"{r['kld_p99']:.3f}",
                 f"{100 * r['top1_agreement']:.1f}%", f"{r['weights_bytes'] / 2**20:.1f}"]
        if speed:
            cells += [f"{r['pp512_tok_s']:.0f}", f"{r['tg128_tok_s']:.1f}", f"{r['serving_output_tok_s']:.1f}",
                      f"{1000 * r['serving_ttft_p50_s']:.0f} ms", f"{1000 * r['serving_tpot_p50_s']:.0f} ms"]
        table.add_row(*cells)
    return table


@click.command("compare")
@click.argument("baseline")
@click.argument("variants", nargs=-1, required=True)
@click.option("--label", "labels", multiple=True, help="Row labels, one per model (baseline first); default from each checkpoint's llmopt.json.")
@click.option("--dataset", default="wikitext2", show_default=True)
@click.option("--seq-len", default=2048, show_default=True, type=click.IntRange(2))
@click.option("--max-windows", default=16, show_default=True, type=click.IntRange(0))
@click.option("--speed/--no-speed", default=True, show_default=True, help="Also measure speed in our runtime.")
@click.option("--repetitions", default=3, show_default=True, type=click.IntRange(1), help="Single-stream repetitions in all (median), spread over the rounds.")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1), help="Interleaved speed rounds over the baseline and every variant (median and spread per model).")
@click.option("--serving-requests", default=16, show_default=True, type=click.IntRange(1))
@click.option("--model-impl", type=click.Choice(list(MODEL_IMPL_CHOICES)), help="--speed: the runtime's model code for every "
              "model: auto (native when there is one, else transformers' code on the runtime's attention and linears), "
              "native or transformers [default: each checkpoint's saved runtime setting, else auto].")
@click.option("--tasks", metavar="T1,T2", help="Also score lm-evaluation-harness tasks for every model (needs the tasks extra).")
@click.option("--num-fewshot", type=click.IntRange(0), help="--tasks: few-shot examples (default: each task's own).")
@click.option("--limit", type=click.IntRange(1), help="--tasks: score the first N items of each task.")
@click.option("--include-path", multiple=True, type=click.Path(exists=True, file_okay=False), help="--tasks: a folder of task YAMLs (repeatable).")
@click.option("-o", "--output", default="out/compare", show_default=True, type=click.Path(file_okay=False), help="Directory for report.md, report.json and pareto.png.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Pareto plot path (default OUTPUT/pareto.png).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@user_errors
@hub_options(None)
def compare_command(baseline, variants, labels, dataset, seq_len, max_windows, speed, repetitions, rounds, serving_requests,
                    model_impl, tasks, num_fewshot, limit, include_path, output, plot, as_json):
    """Accuracy (perplexity, KLD, top-1 vs BASELINE), speed (our runtime) and size of every VARIANT."""
    from llmopt.evaluation.compare import CompareSettings, compare, write_report
    from llmopt.core.console import out, progress_task
    from llmopt.core.errors import LlmoptError

    if labels and len(labels) != len(variants) + 1:
        raise LlmoptError(f"{len(labels)} labels for {len(variants) + 1} models", "give one --label per model, baseline first")
    if not tasks and (num_fewshot is not None or limit is not None or include_path):
        raise LlmoptError("--num-fewshot, --limit and --include-path apply to --tasks only", "add --tasks or drop them")
    if model_impl is not None and not speed:
        raise LlmoptError("--model-impl applies to the speed figures, not to --no-speed", "drop --model-impl or --no-speed")
    settings = CompareSettings(dataset=dataset, seq_len=seq_len, max_windows=max_windows, speed=speed,
                               repetitions=repetitions, rounds=rounds, serving_requests=serving_requests, model_impl=model_impl,
                               labels=list(labels),
                               tasks=[t.strip() for t in (tasks or "").split(",") if t.strip()], task_num_fewshot=num_fewshot,
                               task_limit=limit, task_include_path=list(include_path))
    steps = (len(variants) + 1) * (2 if speed else 1)
    with progress_task("comparing", steps) as advance:
        report = compare(baseline, list(variants), settings, advance)
    files = write_report(report, Path(output), Path(plot) if plot else None)
    if as_json:
        emit_json(report)
        return
    out.print(compare_table(report))
    out.print(f"wrote {files['md']}, {files['json']}, {files['plot']}")


@click.command("demo")
@click.option("--model", default="demo", show_default=True, help="Model to build the variants from.")
@click.option("-o", "--output", default="out/demo", show_default=True, type=click.Path(file_okay=False), help="Where variants and the report go.")
@click.option("--max-windows", default=4, show_default=True, type=click.IntRange(1), help="WikiText-2 windows of 2048 tokens for accuracy.")
@click.option("--speed/--no-speed", default=True, show_default=True, help="Also measure speed in our runtime.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@user_errors
def demo_command(model, output, max_windows, speed, as_json):
    """Build the standard variants of the demo model and compare them.

    \b
    Variants: float, W8A16, FP8, W4A16 g32 GPTQ, 2:4 SparseGPT, and a student with 6
    fewer layers recovered by distillation. Each is a recipe run (a second run reuses
    finished variants); then `compare` writes report.md, report.json and pareto.png.
    """
    from llmopt.evaluation.compare import CompareSettings
    from llmopt.core.console import out, progress_task
    from llmopt.evaluation.demo import VARIANTS, run_demo

    settings = CompareSettings(max_windows=max_windows, repetitions=3, serving_requests=8, speed=speed)
    with progress_task("llmopt demo", len(VARIANTS) + 1) as advance:
        seen = []

        def on_step(label, reused):
            if seen:
                advance(1)
            seen.append(label)
            out.print(f"[bold]{label}[/bold]" + (" [dim](reused)[/dim]" if reused else ""))

        report = run_demo(Path(output), model, settings, on_step)
        advance(1)
    if as_json:
        emit_json(report)
        return
    out.print(compare_table(report))
    out.print(f"{report['wall_seconds']:.0f} s in all; wrote {report['files']['md']}, {report['files']['json']}, {report['files']['plot']}")
