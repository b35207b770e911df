"""Engine defaults saved with a model: a checkpoint's ``llmopt.json`` ``runtime`` block, or the
``runtime`` section of the recipe whose output folder is served."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from llmopt.core.errors import LlmoptError
from llmopt.runtime.config import EngineConfig

RECIPE_FILE = "recipe.resolved.json"
RUN_FILE = "run.json"


def resolve_served_model(model: str) -> tuple[str, dict, str | None]:
    """``(model to load, saved engine settings, where they came from)``.

    A recipe's output folder (it holds ``run.json``) serves the recipe's final checkpoint with
    the recipe's ``runtime`` settings; a checkpoint uses its ``llmopt.json`` ``runtime`` block,
    else the ``runtime`` of a recipe whose output folder holds it.
    """
    path = Path(model)
    if not path.is_dir():
        return model, {}, None
    if (path / RUN_FILE).is_file() and (path / RECIPE_FILE).is_file():
        final = _read(path / RUN_FILE).get("final")
        if not final or not Path(final).is_dir():
            raise LlmoptError(f"{path / RUN_FILE} names no finished checkpoint", f"finish the recipe (llmopt run) or serve a checkpoint folder")
        runtime = _read(path / RECIPE_FILE).get("runtime") or {}
        return str(final), _checked(runtime, path / RECIPE_FILE), str(path / RECIPE_FILE)
    record = path / "llmopt.json"
    if record.is_file() and isinstance(_read(record).get("runtime"), dict):
        return model, _checked(_read(record)["runtime"], record), str(record)
    recipe = path.parent / RECIPE_FILE
    if recipe.is_file():
        runtime = _read(recipe).get("runtime") or {}
        if runtime:
            return model, _checked(runtime, recipe), str(recipe)
    return model, {}, None


def _read(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise LlmoptError(f"cannot read {file}: {exc}", "fix or remove the file") from exc
    return data if isinstance(data, dict) else {}


def _checked(runtime: dict, source: Path) -> dict:
    if not isinstance(runtime, dict):
        raise LlmoptError(f"{source}: 'runtime' must be a mapping", "e.g. \"runtime\": {\"max_num_seqs\": 32}")
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(runtime) - known)
    if unknown:
        raise LlmoptError(f"{source}: unknown runtime setting '{unknown[0]}'", f"known settings: {', '.join(sorted(known))}")
    return dict(runtime)
