"""Task accuracy (lm-evaluation-harness) of the demo model and its quantized variants.

    .venv/bin/python bench/tasks.py [--out DIR] [--tasks llmopt_tiny_mc,llmopt_tiny_gen] [--limit N]

Builds (or reuses) W8A16 RTN and W4A16 g32 GPTQ (32 calibration windows, to keep it quick) of
the demo model under ``--out``, evaluates the float model and both variants on the tasks
available offline (the bundled ones by default), and writes ``bench/results/tasks.json`` and
``tasks.md``: each task's score with its standard error and item count, and each variant's
difference from the float model with its paired standard error. Needs the ``tasks`` extra.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STANDARD = ("hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "gsm8k")
RESULTS = ROOT / "bench" / "results"
VARIANTS = {  # label → quantize arguments
    "W8A16 rtn": ["--scheme", "W8A16"],
    "W4A16 g32 gptq (32 calib windows)": ["--scheme", "W4A16", "--method", "gptq", "--group-size", "32", "--calib-samples", "32"],
}
FOLDERS = {"W8A16 rtn": "w8a16-rtn", "W4A16 g32 gptq (32 calib windows)": "w4a16-g32-gptq-c32"}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def build(label: str, out: Path) -> tuple[Path, list[str], float | None]:
    folder = out / FOLDERS[label]
    command = ["llmopt", "quantize", "demo", *VARIANTS[label], "-o", str(folder)]
    if (folder / "config.json").is_file():
        return folder, command, None
    log(f"building {label}: {' '.join(command)}")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "llmopt", *command[1:]], check=True)
    return folder, command, round(time.perf_counter() - start, 1)


def main() -> None:
    from llmopt.tasks.scores import BUNDLED_TASKS, differences, evaluate_tasks, parse_tasks
    from llmopt.tasks.scores import TaskSettings, check_tasks, task_rows, tasks_markdown

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/llmopt-bench-tasks", help="where the variants are built")
    parser.add_argument("--tasks", default=",".join(BUNDLED_TASKS))
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    settings = TaskSettings(tasks=parse_tasks(args.tasks), limit=args.limit, batch_size=args.batch_size)
    manager = check_tasks(settings)
    out = Path(args.out)
    models = {"float (demo)": ("demo", ["(the bundled demo model)"], None)}
    for label in VARIANTS:
        models[label] = build(label, out)
    results, records = {}, {}
    base = None
    for label, (spec, command, built_s) in models.items():
        log(f"evaluating {label}")
        start = time.perf_counter()
        result = evaluate_tasks(spec, settings, manager, use_cache=False)
        seconds = round(time.perf_counter() - start, 1)
        if base is None:
            base = result
        else:
            result["baseline"] = base
            result["differences"] = differences(result, base)
        results[label] = result
        records[label] = {"spec": str(spec), "build_command": " ".join(command), "build_seconds": built_s,
                          "eval_seconds": seconds, "generation": result["generation"], "rows": task_rows(result),
                          "harness_results": result["harness"]["results"]}
    report = {
        "tasks": settings.tasks, "limit": settings.limit, "batch_size": settings.batch_size,
        "machine": {"platform": platform.platform(), "processor": platform.machine()},
        "date": time.strftime("%Y-%m-%d %H:%M"), "variants": records,
        "standard_set_command": standard_command(STANDARD),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "tasks.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "tasks.md").write_text(markdown(report, results, tasks_markdown))
    log(f"wrote {RESULTS / 'tasks.md'}")


def standard_command(tasks) -> str:
    """The command that evaluates the standard set (works now, from Python)."""
    return ("HF_HUB_OFFLINE=0 .venv/bin/python -c \"from llmopt.tasks.scores import run_tasks, tasks_markdown; "
            f"print(tasks_markdown(run_tasks('MODEL', '{','.join(tasks)}', baseline='demo')))\"")


def markdown(report: dict, results: dict, table) -> str:
    lines = [
        "# Task accuracy (lm-evaluation-harness) — demo model and quantized variants", "",
        f"`bench/tasks.py`, {report['date']}, {report['machine']['processor']}; tasks: {', '.join(report['tasks'])} "
        f"(bundled with llmopt, offline; scores in % ± one standard error; differences from the float model ± their "
        f"paired standard error, over the same items). Log-likelihood through llmopt's loader, generation in llmopt's runtime.", "",
    ]
    for label, record in report["variants"].items():
        lines += [f"## {label}", "", f"Built with `{record['build_command']}`"
                  + (f" ({record['build_seconds']} s)" if record["build_seconds"] else "")
                  + f"; evaluated in {record['eval_seconds']} s (generation: {record['generation']}).", "",
                  table(results[label]), ""]
    lines += [
        "## The standard set (needs the Hugging Face Hub)", "",
        "hellaswag, arc_easy, arc_challenge, piqa, winogrande and gsm8k download their data from the Hub, which this "
        "workspace cannot reach; where it can, this reproduces them for any variant against the float model:", "",
        "```bash", report["standard_set_command"], "```", "",
        f"(the same through the CLI once `llmopt eval` has `--tasks`: `llmopt eval MODEL --baseline demo --tasks "
        f"{','.join(STANDARD)} --json`).", "",
        "With few items a difference of a few points is within noise: read the standard errors.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
