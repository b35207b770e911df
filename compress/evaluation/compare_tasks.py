"""Task accuracy in ``llmopt compare``: each variant's lm-evaluation-harness scores beside KLD
and speed (the ``tasks`` settings of :class:`~llmopt.evaluation.compare.CompareSettings`).

The baseline is evaluated once; every variant gets its scores and the paired difference from
the baseline with its standard error. Figures are cached by checkpoint contents, like the
perplexity / KLD figures.
"""

from __future__ import annotations

from pathlib import Path

from llmopt.tasks.scores import TaskSettings, check_tasks, differences, evaluate_tasks, summary


def task_settings(settings) -> TaskSettings | None:
    """The task settings carried by a ``CompareSettings`` (None when it asks for no tasks)."""
    tasks = list(getattr(settings, "tasks", None) or [])
    if not tasks:
        return None
    from llmopt.tasks.scores import parse_tasks

    return TaskSettings(tasks=parse_tasks(tasks), num_fewshot=getattr(settings, "task_num_fewshot", None),
                        limit=getattr(settings, "task_limit", None), batch_size=getattr(settings, "task_batch_size", 8),
                        include_path=list(getattr(settings, "task_include_path", None) or []), seed=getattr(settings, "seed", 0))


def prepare(settings):
    """Check the extra is installed and every task name is known, before any measurement;
    returns ``(TaskSettings, task manager)`` or None."""
    ts = task_settings(settings)
    if ts is None:
        return None
    return ts, check_tasks(ts)


def add_task_scores(rows: list[dict], specs: list[str], prepared) -> None:
    """Put ``row["tasks"]`` (per task: metric, value, stderr, n and, for variants, the difference
    from the first spec, the baseline) into every row."""
    if prepared is None:
        return
    ts, manager = prepared
    base = None
    for spec, row in zip(specs, rows):
        result = evaluate_tasks(spec, ts, manager)
        if base is None:
            base = result
        else:
            result["differences"] = differences(result, base)
        row["tasks"] = summary(result)
        row["tasks_generation"] = result.get("generation")


def task_names(rows: list[dict]) -> list[str]:
    names: list[str] = []
    for r in rows:
        for name in r.get("tasks", {}):
            if name not in names:
                names.append(name)
    return names


def markdown_columns(rows: list[dict]) -> tuple[str, str, list[str]]:
    """Extra header, separator and per-row cells for the report table: one column per task,
    the score in percent ± its standard error (and the difference from the baseline)."""
    names = task_names(rows)
    if not names:
        return "", "", [""] * len(rows)
    head = "".join(f" {n} ({rows[0]['tasks'].get(n, {}).get('metric', '')}) |" for n in names)
    sep = "---|" * len(names)
    cells = []
    for r in rows:
        line = ""
        for n in names:
            t = r.get("tasks", {}).get(n)
            if t is None:
                line += " — |"
                continue
            text = f"{100 * t['value']:.1f} ± {100 * (t['stderr'] or 0):.1f}"
            if "difference" in t:
                text += f" ({100 * t['difference']:+.1f} ± {100 * (t['difference_stderr'] or 0):.1f})"
            line += f" {text} |"
        cells.append(line)
    return head, sep, cells


def markdown_note(rows: list[dict]) -> str:
    names = task_names(rows)
    if not names:
        return ""
    counts = ", ".join(f"{n} {rows[0]['tasks'][n]['n']} items, {rows[0]['tasks'][n]['num_fewshot']}-shot"
                       for n in names if n in rows[0].get("tasks", {}))
    return (f"Tasks (lm-evaluation-harness): {counts}; score % ± standard error, and in brackets the "
            f"difference from the baseline ± its paired standard error.")


def plot_tasks(report: dict, path: Path) -> None:
    """Grouped bars: one group per task, one bar per variant, ± one standard error."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    names = task_names(rows)
    width = 0.8 / max(len(rows), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(names) + 2), 4.5), dpi=120)
    for i, r in enumerate(rows):
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(names))]
        ys = [100 * r.get("tasks", {}).get(n, {}).get("value", float("nan")) for n in names]
        errs = [100 * (r.get("tasks", {}).get(n, {}).get("stderr") or 0) for n in names]
        ax.bar(xs, ys, width, yerr=errs, capsize=3, label=r["label"])
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([f"{n}\n({rows[0].get('tasks', {}).get(n, {}).get('metric', '')})" for n in names], fontsize=8)
    ax.set_ylabel("score, % (± one standard error)")
    ax.set_title(f"task accuracy — baseline {report['baseline']}")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
