"""Run a validated recipe: each stage writes its checkpoint under the output directory; a rerun
skips stages whose input and settings are unchanged (content hash) and so resumes after an
interruption; ``from_stage`` forces a rerun from a stage on."""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from llmopt.core.atomic import atomic_file
from llmopt.pipeline.recipe import Recipe, Stage, stage_commands, stage_settings

MARKER = "llmopt-stage.json"


@dataclass
class StagePlan:
    index: int  # 1-based
    stage: Stage
    directory: Path
    key: str
    settings: dict
    done: bool


def _hash(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _source_key(spec: str) -> str:
    from llmopt.accuracy import model_fingerprint
    from llmopt.checkpoints.models import resolve_model

    return model_fingerprint(resolve_model(spec))


def plan(recipe: Recipe, from_stage: int | None = None) -> list[StagePlan]:
    """Each stage's directory, content key and whether a finished run with that key exists."""
    out = Path(recipe.output)
    key = _source_key(recipe.model)
    plans = []
    for i, stage in enumerate(recipe.stages, start=1):
        settings = stage_settings(stage, recipe)
        key = _hash(key, stage.kind, settings)
        directory = out / f"{i:02d}-{stage.kind}"
        marker = directory / MARKER
        done = marker.is_file() and json.loads(marker.read_text()).get("key") == key
        if from_stage is not None and i >= from_stage:
            done = False
        plans.append(StagePlan(i, stage, directory, key, settings, done))
    # a stage rerun invalidates everything after it (their input changes)
    for a, b in zip(plans, plans[1:]):
        if not a.done:
            b.done = False
    return plans


def _invoke(item: StagePlan, recipe: Recipe, input_dir: str) -> None:
    """Run a stage through its CLI command's own code (unwrapped, so errors propagate)."""
    command = stage_commands()[item.stage.kind]
    kwargs = dict(item.settings)
    kwargs.update(overwrite=True, as_json=False)
    kind = item.stage.kind
    if kind == "distill":
        kwargs["teacher"] = kwargs.get("teacher") or recipe.model
        if not kwargs.get("student") and not kwargs.get("student_from"):
            kwargs["student"] = input_dir
        kwargs["output"] = str(item.directory)
    elif kind == "export":
        kwargs["model"] = input_dir
        gguf = kwargs.get("fmt") in (None, "gguf")
        kwargs["fmt"] = kwargs.get("fmt") or "gguf"
        kwargs["output"] = str(item.directory / "model.gguf") if gguf else str(item.directory / "model")
        item.directory.mkdir(parents=True, exist_ok=True)
    else:
        kwargs["model"] = input_dir
        kwargs["output"] = str(item.directory)
    if kind == "quantize":
        kwargs["ignore"] = tuple(kwargs.get("ignore") or ())
    with contextlib.redirect_stdout(sys.stderr):  # stage summaries are progress, not the run's data
        command.callback.__wrapped__(**kwargs)


def run_recipe(recipe: Recipe, from_stage: int | None = None, on_stage=None) -> dict:
    """Run (or resume) every stage, then the optional evaluation; returns the run record."""
    out = Path(recipe.output)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_file(out / "recipe.resolved.json", overwrite=True) as tmp:
        tmp.write_text(json.dumps(recipe.resolved(), indent=2, default=str) + "\n")
    if Path(recipe.source).is_file():
        (out / "recipe.yaml").write_text(Path(recipe.source).read_text())
    record: dict = {"recipe": recipe.source, "output": str(out), "stages": []}
    current = recipe.model
    for item in plan(recipe, from_stage):
        if on_stage:
            on_stage(item)
        start = time.perf_counter()
        if not item.done:
            _invoke(item, recipe, current)
            with atomic_file(item.directory / MARKER, overwrite=True) as tmp:
                tmp.write_text(json.dumps({"key": item.key, "stage": item.stage.kind, "settings": item.settings,
                                           "seconds": round(time.perf_counter() - start, 2)}, indent=2, default=str))
        marker = json.loads((item.directory / MARKER).read_text())
        record["stages"].append({"index": item.index, "stage": item.stage.describe(), "directory": str(item.directory),
                                 "skipped": item.done, "seconds": marker.get("seconds")})
        if item.stage.kind != "export":
            current = str(item.directory)
    record["final"] = current
    if recipe.evaluate is not None:
        from llmopt.accuracy import run_eval

        settings = dict(recipe.evaluate)
        record["evaluation"] = run_eval(
            current, recipe.model, settings.get("dataset", "wikitext2"), settings.get("seq_len", 2048),
            settings.get("max_windows", 16) or None, settings.get("top_k", 1024),
        ).to_dict()
    with atomic_file(out / "run.json", overwrite=True) as tmp:
        tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return record
