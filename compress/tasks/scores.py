"""Task accuracy through EleutherAI's lm-evaluation-harness (the optional ``tasks`` extra).

``run_tasks("out/w4-gptq", ["arc_easy", "hellaswag"], baseline="demo")`` evaluates a model (any
spec llmopt loads) with the harness's own task definitions and metrics, through the adapter in
:mod:`llmopt.tasks.harness_model`, and returns every task's scores with standard errors and,
against a baseline, the paired differences with their standard errors.

Two tiny tasks ship with llmopt and need no download: ``llmopt_tiny_mc`` (multiple choice, 40
items) and ``llmopt_tiny_gen`` (generation, exact match, 40 items). Any folder of harness task
YAMLs can be added with ``include_path`` (the harness's ``--include_path``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from llmopt.core.errors import LlmoptError

TASK_DATA = Path(__file__).resolve().parent / "data"
BUNDLED_TASKS = ("llmopt_tiny_mc", "llmopt_tiny_gen")
STANDARD_TASKS = ("hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "gsm8k")
INSTALL = "pip install 'llmopt[tasks]'"


@dataclass
class TaskSettings:
    """What to evaluate and how: task names, few-shot count (None: each task's default), items
    per task (None: all), rows per forward / sequences per generation batch, extra YAML folders."""

    tasks: list[str] = field(default_factory=list)
    num_fewshot: int | None = None
    limit: int | None = None
    batch_size: int = 8
    include_path: list[str] = field(default_factory=list)
    generation: str = "auto"
    seed: int = 0

    def key(self) -> str:
        return json.dumps({**self.__dict__, "include_path": [str(Path(p).resolve()) for p in self.include_path]}, sort_keys=True)


def require_lm_eval() -> None:
    """One clear line when the optional harness is missing."""
    try:
        missing = importlib.util.find_spec("lm_eval") is None
    except (ImportError, ValueError):
        missing = True
    if missing:
        raise LlmoptError("task evaluation needs lm-evaluation-harness (lm-eval), which is not installed", f"run: {INSTALL}")


def parse_tasks(tasks: str | Sequence[str]) -> list[str]:
    """``"a,b"`` or ``["a", "b,c"]`` → ``["a", "b", "c"]`` (order kept, duplicates dropped)."""
    items = [tasks] if isinstance(tasks, str) else list(tasks)
    names = [n.strip() for item in items for n in str(item).split(",") if n.strip()]
    if not names:
        raise LlmoptError("no task names given", f"pass --tasks NAME[,NAME…], e.g. {','.join(BUNDLED_TASKS)}")
    return list(dict.fromkeys(names))


def task_manager(include_path: Sequence[str | os.PathLike] = (), tasks: Sequence[str] | None = None):
    """The harness's task index: its own tasks, llmopt's bundled ones and ``include_path``
    (only the last two when they hold every one of ``tasks``: indexing the harness's thousands
    of YAMLs takes seconds)."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    paths = [TASK_DATA]
    for p in include_path:
        path = Path(p).expanduser()
        if not path.is_dir():
            raise LlmoptError(f"task folder not found: {p}", "pass --include-path DIR holding lm-evaluation-harness task YAMLs")
        paths.append(path.resolve())
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    key = tuple(str(p) for p in paths)
    if tasks is not None:
        if (key, False) not in _MANAGERS:
            _MANAGERS[key, False] = TaskManager(include_path=list(key), include_defaults=False)
        if all(t in _MANAGERS[key, False].all_tasks for t in tasks):
            return _MANAGERS[key, False]
    if (key, True) not in _MANAGERS:
        _MANAGERS[key, True] = TaskManager(include_path=list(key))
    return _MANAGERS[key, True]


_MANAGERS: dict[tuple, object] = {}  # task indexes by folders and defaults (built once per process)


def check_tasks(settings: TaskSettings, manager=None):
    """Refuse unknown task names before any model is loaded; returns the task manager."""
    manager = manager or task_manager(settings.include_path, settings.tasks)
    if settings.num_fewshot is not None and settings.num_fewshot < 0:
        raise LlmoptError(f"--num-fewshot must be 0 or more, got {settings.num_fewshot}", "pass --num-fewshot N with N >= 0")
    if settings.limit is not None and settings.limit < 1:
        raise LlmoptError(f"--limit must be at least 1, got {settings.limit}", "pass --limit N with N >= 1, or leave it out for every item")
    known = set(manager.all_tasks)
    unknown = [t for t in settings.tasks if t not in known]
    if unknown:
        raise LlmoptError(
            f"unknown task{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}",
            f"use lm-evaluation-harness task names (e.g. {', '.join(STANDARD_TASKS[:3])}), the bundled "
            f"{' / '.join(BUNDLED_TASKS)}, or --include-path DIR for your own task YAMLs",
        )
    return manager


def evaluate_tasks(model: str | os.PathLike, settings: TaskSettings, manager=None, use_cache: bool = True) -> dict:
    """Scores of ``model`` on ``settings.tasks``: ``{"model", "tasks": {name: {...}}, "harness"}``.

    Each task has ``n`` (items scored), ``num_fewshot``, ``metrics`` (``{name: {"value",
    "stderr"}}``, the harness's figures), ``primary`` (its first metric) and ``items`` (per-item
    values, for paired differences). Figures are cached by checkpoint contents and settings.
    """
    from llmopt.checkpoints.models import resolve_model

    manager = check_tasks(settings, manager)
    path = resolve_model(model)
    stored = _cache_file(path, settings) if use_cache else None
    if stored is not None and stored.is_file():
        return {**json.loads(stored.read_text()), "model": str(model)}
    import lm_eval
    from lm_eval.utils import handle_non_serializable

    from llmopt.tasks.harness_model import LlmoptLM

    lm = LlmoptLM(path, batch_size=settings.batch_size, generation=settings.generation)
    try:
        raw = lm_eval.simple_evaluate(
            model=lm, tasks=list(settings.tasks), num_fewshot=settings.num_fewshot, limit=settings.limit,
            batch_size=settings.batch_size, task_manager=manager, log_samples=True, random_seed=settings.seed,
            numpy_random_seed=settings.seed, torch_random_seed=settings.seed, fewshot_random_seed=settings.seed)
    except (ConnectionError, OSError) as exc:  # offline, or a dataset that is not there
        raise LlmoptError(
            f"cannot load a task's data: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
            "the standard tasks download their data from the Hugging Face Hub; offline, use task YAMLs "
            "with local data files (--include-path DIR) or the bundled llmopt_tiny_mc / llmopt_tiny_gen",
        ) from exc
    result = {"model": str(model), "generation": lm.generation_backend or "none",
              "tasks": {name: _task_scores(raw, name) for name in settings.tasks if name in raw["results"]}}
    for group in raw["results"]:
        if group not in result["tasks"]:  # a group's subtasks: report each
            result["tasks"][group] = _task_scores(raw, group)
    raw.pop("samples", None)
    result["harness"] = json.loads(json.dumps(raw, default=handle_non_serializable))
    del lm
    if stored is not None:
        from llmopt.core.atomic import atomic_file

        with atomic_file(stored, overwrite=True) as tmp:
            tmp.write_text(json.dumps(result))
    return result


def _cache_file(path: Path, settings: TaskSettings) -> Path:
    from llmopt.checkpoints.provenance import model_fingerprint
    from llmopt.core.paths import cache_dir

    version = importlib.import_module("lm_eval").__version__ if importlib.util.find_spec("lm_eval") else "?"
    data = "|".join(_file_digest(p) for p in sorted(TASK_DATA.glob("*")) if p.is_file())
    key = "|".join([model_fingerprint(path), settings.key(), version, data])
    return cache_dir("tasks") / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def _task_scores(raw: dict, name: str) -> dict:
    """One task's figures from the harness's results: metric → value and standard error."""
    figures = raw["results"][name]
    metrics: dict[str, dict] = {}
    for key, value in figures.items():
        if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
            continue
        metric, filt = key.split(",", 1)
        label = metric if filt == "none" else f"{metric},{filt}"
        stderr = figures.get(f"{metric}_stderr,{filt}")
        metrics[label] = {"value": float(value), "stderr": float(stderr) if isinstance(stderr, (int, float)) else None}
    items: dict[str, dict[str, float]] = {}
    for sample in raw.get("samples", {}).get(name, []):
        filt = sample.get("filter", "none")
        for label in metrics:
            metric, _, want = label.partition(",")
            if (want or "none") == filt and isinstance(sample.get(metric), (int, float, bool)):
                items.setdefault(label, {})[str(sample["doc_id"])] = float(sample[metric])
    n = raw.get("n-samples", {}).get(name, {})
    return {
        "n": int(n.get("effective", 0)) if n else len(next(iter(items.values()), {})),
        "num_fewshot": raw.get("n-shot", {}).get(name),
        "metrics": metrics,
        "primary": next(iter(metrics), None),
        "items": items,
    }


def differences(result: dict, baseline: dict) -> dict:
    """Per task and metric: model minus baseline, with the standard error of that difference.

    The error is the paired one (the per-item differences' standard deviation over √n) when both
    were scored on the same items, which is the right error for two models on one test set;
    otherwise the unpaired √(se₁² + se₂²)."""
    out: dict[str, dict] = {}
    for name, task in result["tasks"].items():
        base = baseline["tasks"].get(name)
        if base is None:
            continue
        for metric, fig in task["metrics"].items():
            ref = base["metrics"].get(metric)
            if ref is None:
                continue
            mine, theirs = task["items"].get(metric, {}), base["items"].get(metric, {})
            if mine and mine.keys() == theirs.keys() and len(mine) > 1:
                d = [mine[k] - theirs[k] for k in mine]
                mean = sum(d) / len(d)
                stderr = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d))
                paired = True
            else:
                errs = [fig["stderr"], ref["stderr"]]
                stderr = math.sqrt(sum(e * e for e in errs)) if all(e is not None for e in errs) else None
                paired = False
            out.setdefault(name, {})[metric] = {"difference": fig["value"] - ref["value"], "stderr": stderr, "paired": paired}
    return out


def run_tasks(model: str | os.PathLike, tasks: str | Sequence[str], num_fewshot: int | None = None, limit: int | None = None,
              batch_size: int = 8, baseline: str | os.PathLike | None = None, include_path: Sequence[str] = (),
              generation: str = "auto", seed: int = 0, use_cache: bool = True) -> dict:
    """Evaluate ``model`` (and ``baseline``) on ``tasks``; returns ``{"model", "tasks",
    "settings", "harness"}`` plus ``"baseline"`` and ``"differences"`` with a baseline."""
    require_lm_eval()
    settings = TaskSettings(tasks=parse_tasks(tasks), num_fewshot=num_fewshot, limit=limit, batch_size=batch_size,
                            include_path=[str(p) for p in include_path], generation=generation, seed=seed)
    manager = check_tasks(settings)
    result = evaluate_tasks(model, settings, manager, use_cache)
    result["settings"] = {k: v for k, v in settings.__dict__.items()}
    if baseline is not None:
        base = evaluate_tasks(baseline, settings, manager, use_cache)
        result["baseline"] = base
        result["differences"] = differences(result, base)
    return result


def task_rows(result: dict) -> list[dict]:
    """Flat rows (task, metric, n, value, stderr, and with a baseline its value and the
    difference) for tables; the CLI renders them, ``tasks_markdown`` writes them."""
    rows = []
    base = result.get("baseline")
    diffs = result.get("differences", {})
    for name, task in result["tasks"].items():
        for metric, fig in task["metrics"].items():
            row = {"task": name, "metric": metric, "n": task["n"], "num_fewshot": task["num_fewshot"],
                   "value": fig["value"], "stderr": fig["stderr"]}
            if base is not None and name in base["tasks"] and metric in base["tasks"][name]["metrics"]:
                ref = base["tasks"][name]["metrics"][metric]
                d = diffs.get(name, {}).get(metric, {})
                row.update({"baseline": ref["value"], "baseline_stderr": ref["stderr"],
                            "difference": d.get("difference"), "difference_stderr": d.get("stderr")})
            rows.append(row)
    return rows


def _pm(value: float | None, stderr: float | None, signed: bool = False) -> str:
    if value is None:
        return "—"
    text = f"{100 * value:+.1f}" if signed else f"{100 * value:.1f}"
    return text + (f" ± {100 * stderr:.1f}" if stderr is not None else "")


def tasks_markdown(result: dict) -> str:
    """A markdown table of ``task_rows`` (scores in percent, ± one standard error)."""
    with_base = "baseline" in result
    head = "| task | metric | items | shots | model |" + (" baseline | difference |" if with_base else "")
    sep = "|---|---|---|---|---|" + ("---|---|" if with_base else "")
    lines = [head, sep]
    for r in task_rows(result):
        line = f"| {r['task']} | {r['metric']} | {r['n']} | {r['num_fewshot']} | {_pm(r['value'], r['stderr'])} |"
        if with_base:
            line += f" {_pm(r.get('baseline'), r.get('baseline_stderr'))} | {_pm(r.get('difference'), r.get('difference_stderr'), True)} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def summary(result: dict) -> dict:
    """Compact per-task figures (primary metric) for reports: value, stderr, n, and the
    difference against the baseline when there is one."""
    out = {}
    for name, task in result["tasks"].items():
        metric = task["primary"]
        if metric is None:
            continue
        fig = task["metrics"][metric]
        out[name] = {"metric": metric, "value": fig["value"], "stderr": fig["stderr"], "n": task["n"],
                     "num_fewshot": task["num_fewshot"]}
        d = result.get("differences", {}).get(name, {}).get(metric)
        if d:
            out[name].update({"difference": d["difference"], "difference_stderr": d["stderr"]})
    return out
