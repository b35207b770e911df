"""Run a validated recipe: each stage writes its checkpoint under the output directory; a rerun
skips stages whose input and settings are unchanged (content hash) and so resumes after an
interruption; ``from_stage`` forces a rerun from a stage on. A recipe's ``draft:`` stages run
first, from the same model, under ``OUTPUT/draft/``; the runtime settings saved with the final
checkpoint then name that draft (a path relative to the checkpoint)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from llmopt.core.atomic import atomic_file
from llmopt.pipeline.recipe import Recipe, Stage, stage_settings

MARKER = "llmopt-stage.json"


@dataclass
class StagePlan:
    index: int  # 1-based
    stage: Stage
    directory: Path
    key: str
    settings: dict
    done: bool
    draft: bool = False  # a stage of the recipe's draft section

    @property
    def label(self) -> str:
        return f"draft {self.index}" if self.draft else str(self.index)


def _hash(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _source_key(spec: str) -> str:
    from llmopt.checkpoints.models import resolve_model
    from llmopt.checkpoints.provenance import model_fingerprint

    return model_fingerprint(resolve_model(spec))


def plan(recipe: Recipe, from_stage: int | None = None) -> list[StagePlan]:
    """Each stage's directory, content key and whether a finished run with that key exists: the
    draft section's stages first (``from_stage`` counts the main stages only)."""
    source = _source_key(recipe.model)
    out = Path(recipe.output)
    return _chain(recipe, recipe.draft, out / "draft", source, None, True) + _chain(recipe, recipe.stages, out, source, from_stage, False)


def _chain(recipe: Recipe, stages: list[Stage], out: Path, key: str, from_stage: int | None, draft: bool) -> list[StagePlan]:
    """One chain of stages, each fed by the one before (the first by the recipe's model)."""
    plans = []
    for i, stage in enumerate(stages, start=1):
        settings = stage_settings(stage, recipe)
        key = _hash(key, stage.kind, settings)
        directory = out / f"{i:02d}-{stage.kind}"
        marker = directory / MARKER
        done = marker.is_file() and json.loads(marker.read_text()).get("key") == key
        if from_stage is not None and i >= from_stage:
            done = False
        plans.append(StagePlan(i, stage, directory, key, settings, done, draft))
    # a stage rerun invalidates everything after it (their input changes)
    for a, b in zip(plans, plans[1:]):
        if not a.done:
            b.done = False
    return plans


def _stage_values(item: StagePlan, recipe: Recipe, input_dir: str) -> dict:
    """The stage's settings plus what the runner owns: its input, its output, and resuming."""
    values = dict(item.settings)
    values["overwrite"] = True  # a stage reruns only when its key changed: its old output is stale
    kind = item.stage.kind
    if kind == "distill":
        from llmopt.distillation import checkpoint

        values["teacher"] = values.get("teacher") or recipe.model
        if not values.get("student") and not values.get("student_from"):
            # drop_layers / width make the student from the input; else the input is the student
            values["student_from" if values.get("drop_layers") or values.get("width") else "student"] = input_dir
        values["output"] = str(item.directory)
        checkpoints = Path(values.get("checkpoint_dir") or f"{item.directory}.checkpoints")
        if checkpoint.latest(checkpoints) is not None:
            values["resume"] = True  # an interrupted run continues from its last checkpoint
    elif kind == "export":
        values["model"] = input_dir
        values["format"] = values.get("format") or "gguf"
        values["output"] = str(item.directory / ("model.gguf" if values["format"] == "gguf" else "model"))
        item.directory.mkdir(parents=True, exist_ok=True)
    else:
        values["model"] = input_dir
        values["output"] = str(item.directory)
    return values


def _invoke(item: StagePlan, recipe: Recipe, input_dir: str) -> None:
    """Run a stage through the registry (its summary goes to stderr: progress, not the run's data)."""
    from llmopt.pipeline.registry import stage
    from llmopt.pipeline.stages.base import build_config

    spec = stage(item.stage.kind)
    config = build_config(spec.config, _stage_values(item, recipe, input_dir))
    with contextlib.redirect_stdout(sys.stderr):
        result = spec.run(config)
    if getattr(result, "interrupted", False):
        raise KeyboardInterrupt


def run_recipe(recipe: Recipe, from_stage: int | None = None, on_stage=None) -> dict:
    """Run (or resume) every stage, then the optional evaluation; returns the run record."""
    out = Path(recipe.output)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_file(out / "recipe.resolved.json", overwrite=True) as tmp:
        tmp.write_text(json.dumps(recipe.resolved(), indent=2, default=str) + "\n")
    if Path(recipe.source).is_file():
        (out / "recipe.yaml").write_text(Path(recipe.source).read_text())
    record: dict = {"recipe": recipe.source, "output": str(out), "stages": []}
    if recipe.draft:
        record["draft_stages"] = []
    current = draft = recipe.model
    for item in plan(recipe, from_stage):
        if on_stage:
            on_stage(item)
        start = time.perf_counter()
        source = draft if item.draft else current
        if not item.done:
            _invoke(item, recipe, source)
            with atomic_file(item.directory / MARKER, overwrite=True) as tmp:
                tmp.write_text(json.dumps({"key": item.key, "stage": item.stage.kind, "settings": item.settings,
                                           "seconds": round(time.perf_counter() - start, 2)}, indent=2, default=str))
        marker = json.loads((item.directory / MARKER).read_text())
        record["draft_stages" if item.draft else "stages"].append({
            "index": item.index, "stage": item.stage.describe(), "directory": str(item.directory),
            "skipped": item.done, "seconds": marker.get("seconds")})
        if item.stage.kind != "export":
            draft, current = (str(item.directory), current) if item.draft else (draft, str(item.directory))
    record["final"] = current
    if recipe.draft:
        record["draft"] = draft
    if recipe.runtime and current != recipe.model:
        from llmopt.checkpoints.provenance import update_provenance

        runtime = _with_draft(recipe.runtime, draft, current) if recipe.draft else recipe.runtime
        update_provenance(current, runtime=runtime)  # the engine's defaults for this checkpoint
        record["runtime"] = runtime
    if recipe.evaluate is not None:
        from llmopt.pipeline.stages.base import build_config
        from llmopt.pipeline.stages.evaluate import EvalConfig, run_evaluate

        config = build_config(EvalConfig, {**recipe.evaluate, "model": current, "baseline": recipe.model})
        figures = run_evaluate(config)
        record["evaluation"] = {k: v for k, v in figures.items() if k not in ("model", "baseline")}
    with atomic_file(out / "run.json", overwrite=True) as tmp:
        tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return record


def _with_draft(runtime: dict, draft: str, checkpoint: str) -> dict:
    """The runtime settings with ``speculative_config.model`` the recipe's draft, relative to the
    checkpoint the settings are saved with (the engine reads it from there)."""
    spec = {**runtime["speculative_config"], "method": "draft", "model": os.path.relpath(draft, checkpoint)}
    return {**runtime, "speculative_config": spec}
