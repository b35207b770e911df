"""Run a recipe on a model object in memory (llm-compressor's ``oneshot``).

The recipe is read and validated as ``llmopt run`` reads it (:mod:`llmopt.pipeline.recipe`, with
llm-compressor recipes mapped by :mod:`llmopt.pipeline.llmcompressor`); its quantize, prune and
distill stages then run on the model in place, in order, each with the recipe's shared
calibration settings where it calibrates. Stages that write files (export) are refused; the
recipe's evaluate / benchmark blocks, which compare checkpoints, are left to
:func:`llmopt.evaluate` after :func:`llmopt.save`; its runtime settings are saved with the model.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from torch import nn

from llmopt.core.errors import LlmoptError
from llmopt.pipeline.objects.common import IN_MEMORY

SOURCE = "<recipe>"


def oneshot(model: nn.Module, recipe: str | Path | dict | list, *, dataset: Any = None, tokenizer: Any = None) -> nn.Module:
    """Run ``recipe``'s stages on ``model`` in place and return it."""
    from llmopt.checkpoints.attached import compression_of
    from llmopt.checkpoints.in_memory import check_model_object
    from llmopt.core.console import notice

    check_model_object(model, "compressed")
    loaded = load(recipe)
    _refuse_files(loaded)
    for block in ("evaluate", "benchmark"):
        if getattr(loaded, block) is not None:
            notice(f"the recipe's {block} block compares checkpoints on disk: not run on a model object "
                   "(llmopt.save(model, path), then llmopt.evaluate(path, baseline=...))")
    teacher = copy.deepcopy(model) if any(s.kind == "distill" and not s.options.get("teacher") for s in loaded.stages) else None
    for stage in loaded.stages:
        _run_stage(model, tokenizer, stage, loaded, dataset, teacher)
    found = compression_of(model)
    if loaded.runtime and found is not None:
        found.record["runtime"] = loaded.runtime  # the engine's defaults, saved in llmopt.json
    return model


def load(recipe: str | Path | dict | list) -> Any:
    """The validated recipe (its ``model`` may be left out: the model object is the model)."""
    from llmopt.pipeline.llmcompressor import is_llmcompressor_recipe, map_llmcompressor
    from llmopt.pipeline.recipe import load_recipe, validate

    if isinstance(recipe, (str, Path)):
        return load_recipe(str(recipe))
    if isinstance(recipe, list):
        recipe = _from_list(recipe)
    if not isinstance(recipe, dict):
        raise LlmoptError(f"a recipe of type {type(recipe).__name__} is not one llmopt reads",
                          "pass a YAML path, a bundled recipe name, a dict, or a list of stages / modifiers")
    if is_llmcompressor_recipe(recipe):
        recipe = map_llmcompressor(recipe, SOURCE, {})
    return validate({"model": IN_MEMORY, **recipe}, SOURCE, {}, default_output=IN_MEMORY)


def _from_list(items: list) -> dict:
    """A list of stages (``{"quantize": {...}}``) or of llm-compressor modifiers (``{"GPTQModifier": {...}}``)."""
    if items and all(isinstance(i, dict) and len(i) == 1 and str(next(iter(i))).endswith("Modifier") for i in items):
        modifiers: dict = {}
        for item in items:
            (name, args), = item.items()
            if name in modifiers:
                raise LlmoptError(f"modifier {name} appears twice in the list", "give each modifier once")
            modifiers[name] = args
        return {"oneshot_stage": {"oneshot_modifiers": modifiers}}
    return {"stages": items}


def _refuse_files(loaded: Any) -> None:
    if loaded.draft:
        raise LlmoptError("a recipe's draft section makes a second checkpoint; oneshot compresses one model object",
                          "run the recipe on a path with llmopt.run_recipe, or drop the draft section")
    for i, stage in enumerate(loaded.stages, 1):
        if stage.kind not in ("quantize", "prune", "distill"):
            raise LlmoptError(f"stage {i} ({stage.kind}) works on a checkpoint on disk, not a model object",
                              f"drop it, then llmopt.save(model, path) and llmopt.{stage.kind}(path, ...)")


def _run_stage(model: nn.Module, tokenizer: Any, stage: Any, loaded: Any, dataset: Any, teacher: Any) -> None:
    """One stage on the model: its own options, plus the shared calibration settings where it
    calibrates (``dataset`` then replaces the recipe's calibration text)."""
    from llmopt.pipeline.recipe import CALIBRATION_KEYS, stage_settings, uses_calibration

    values = dict(stage.options)
    calibrated = stage.kind != "distill" and uses_calibration(stage.kind, values)
    if calibrated:
        settings = stage_settings(stage, loaded)
        values.update({name: settings[name] for key, name in CALIBRATION_KEYS.items()
                       if key in loaded.calibration and name in settings and name not in values})
        if dataset is not None:
            values.pop("calib", None)
    data = dataset if calibrated else None
    if stage.kind == "quantize":
        from llmopt.pipeline.objects.quantize import quantize_object

        quantize_object(model, tokenizer, values, data)
    elif stage.kind == "prune":
        from llmopt.pipeline.objects.prune import prune_object

        prune_object(model, tokenizer, values, data)
    else:
        from llmopt.pipeline.objects.distill import distill_object

        distill_object(model, tokenizer, values.pop("teacher", None) or teacher, values, None)
