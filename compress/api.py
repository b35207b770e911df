"""The Python API: the CLI's stages as functions, for notebooks and scripts.

Each function takes the same options as its command (``group_size=32`` is ``--group-size 32``),
checks them the same way, and returns the same record the command prints with ``--json``::

    import llmopt
    llmopt.quantize("demo", scheme="W4A16", method="gptq", group_size=32, output="out/w4")
    figures = llmopt.evaluate("out/w4", baseline="demo")

:func:`quantize`, :func:`prune` and :func:`distill` also take a transformers model already in
memory (with its tokenizer): they compress it in place and return it, ready to ``generate``;
:func:`save` writes it as the command would have, :func:`oneshot` runs a recipe on it::

    model = llmopt.quantize(model, tokenizer, scheme="W4A16", method="gptq", dataset=["Some text.", ...])
    llmopt.save(model, "out/w4", tokenizer=tokenizer)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from llmopt.core.errors import LlmoptError


def _run(kind: str, **values: Any) -> Any:
    from llmopt.pipeline.registry import stage
    from llmopt.pipeline.stages.base import build_config

    spec = stage(kind)
    return spec.run(build_config(spec.config, {k: v for k, v in values.items() if v is not None or k == "baseline"}))


def _is_path(model: Any) -> bool:
    return isinstance(model, (str, os.PathLike))


def _path_options(kind: str, tokenizer: Any, dataset: Any, output: Any, options: dict) -> dict:
    """A checkpoint's stage options: ``dataset`` as ``calib``; refuse what only a model object takes."""
    if tokenizer is not None:
        raise LlmoptError("tokenizer= goes with a model object; a checkpoint brings its own", "drop tokenizer=")
    if output is None:
        raise LlmoptError(f"{kind} of a checkpoint writes a new one, and output= is missing",
                          f"pass output='out/...', or a model object to {kind} in memory")
    if dataset is not None:
        if not isinstance(dataset, str):
            raise LlmoptError("a checkpoint is calibrated on a corpus name or text file (as --calib)",
                              "pass dataset='austen' or a file, or load the model and pass the object")
        if "calib" in options:
            raise LlmoptError("dataset= and calib= both name the calibration data", "pass one of them")
        options = {**options, "calib": dataset}
    return {**options, "output": str(output)}


def _object_options(output: Any, options: dict) -> dict:
    return options if output is None else {**options, "output": str(output)}


def quantize(model: Any, tokenizer: Any = None, *, scheme: str, method: str = "rtn", dataset: Any = None,
             output: str | Path | None = None, **options: Any) -> Any:
    """Quantize ``model`` (options as ``llmopt quantize``). A path or model spec: writes ``output``
    and returns the provenance record. A transformers model in memory: quantizes it in place on
    ``dataset`` (a corpus name, a ``datasets.Dataset``, texts or token ids) and returns it, ready
    to generate; :func:`save` (or ``output=``) writes the same checkpoint the command writes."""
    if _is_path(model):
        return _run("quantize", model=str(model), scheme=scheme, method=method,
                    **_path_options("quantize", tokenizer, dataset, output, options))
    from llmopt.pipeline.objects.quantize import quantize_object

    return quantize_object(model, tokenizer, _object_options(output, {"scheme": scheme, "method": method, **options}), dataset)


def prune(model: Any, tokenizer: Any = None, *, method: str, dataset: Any = None, output: str | Path | None = None,
          **options: Any) -> Any:
    """Prune ``model`` (options as ``llmopt prune``). A path or model spec: writes ``output`` and
    returns the provenance record. A transformers model in memory: prunes it in place (on
    ``dataset`` where the method calibrates) and returns it."""
    if _is_path(model):
        return _run("prune", model=str(model), method=method, **_path_options("prune", tokenizer, dataset, output, options))
    from llmopt.pipeline.objects.prune import prune_object

    return prune_object(model, tokenizer, _object_options(output, {"method": method, **options}), dataset)


def distill(model: Any = None, tokenizer: Any = None, *, steps: int, teacher: Any = None, dataset: Any = None,
            output: str | Path | None = None, **options: Any) -> Any:
    """Distil a student (options as ``llmopt distill``). With a path or model spec (or
    ``teacher=`` a path): ``model`` is the teacher, the student is made and saved to ``output``,
    and the run record is returned. With a transformers model in memory: ``model`` is the
    student, trained in place towards ``teacher`` (a model object or a path) on ``dataset``
    (else the ``data`` corpus), and returned."""
    if model is None or _is_path(model):
        if model is not None and teacher is not None:
            raise LlmoptError("the checkpoint given first is the teacher, and teacher= names another",
                              "pass one teacher, or a student model object first")
        teacher = model if model is not None else teacher
        options = _path_options("distill", tokenizer, None, output, options)
        if dataset is not None:
            options["data"] = _corpus(dataset)
        outcome = _run("distill", teacher=None if teacher is None else str(teacher), steps=steps, **options)
        if outcome.interrupted:
            raise KeyboardInterrupt
        return outcome.record
    from llmopt.pipeline.objects.distill import distill_object

    return distill_object(model, tokenizer, teacher, _object_options(output, {"steps": steps, **options}), dataset)


def _corpus(dataset: Any) -> str:
    if not isinstance(dataset, str):
        raise LlmoptError("a distillation from checkpoints trains on a corpus name or text file (as --data)",
                          "pass dataset='gutenberg' or a file, or pass the student model object")
    return dataset


def save(model: Any, path: str | Path, tokenizer: Any = None, *, overwrite: bool = False) -> Path:
    """Write a model object to ``path`` atomically: what ``llmopt quantize`` writes for a model
    :func:`quantize` quantized in memory (compressed-tensors, llmopt.json), the dense checkpoint
    ``llmopt prune`` writes for one it pruned. Read it back with :func:`llmopt.load_model`."""
    from llmopt.checkpoints.attached import save_model

    return save_model(model, path, tokenizer, overwrite=overwrite)


def oneshot(model: Any, recipe: str | Path | dict | list, dataset: Any = None, tokenizer: Any = None) -> Any:
    """Run a recipe's stages on a model object in memory and return it (llm-compressor's
    ``oneshot``): ``recipe`` is a YAML path or bundled recipe name, a dict (ours, or an
    llm-compressor recipe), or a list of stages (``{"quantize": {...}}``) or of llm-compressor
    modifiers (``{"GPTQModifier": {...}}``); ``dataset`` calibrates every stage that calibrates."""
    from llmopt.pipeline.objects.oneshot import oneshot as run

    return run(model, recipe, dataset=dataset, tokenizer=tokenizer)


def export(model: str, *, output: str | Path, **options: Any) -> dict:
    """Export ``model`` (options as ``llmopt export``); returns the export report."""
    return _run("export", model=str(model), output=str(output), **options).to_dict()


def evaluate(model: str, baseline: str | None = None, **options: Any) -> dict:
    """Perplexity and, with a baseline, KLD / top-1 agreement (options as ``llmopt eval``)."""
    return _run("eval", model=str(model), baseline=None if baseline is None else str(baseline), **options)


def run_recipe(recipe: str | Path | dict, *, overrides: list[str] | None = None, from_stage: int | None = None) -> dict:
    """Run a recipe: a YAML path, a bundled recipe name, or the recipe as a dict; returns the run record."""
    from llmopt.pipeline.recipe import apply_overrides, load_recipe, validate
    from llmopt.pipeline.runner import run_recipe as run

    if isinstance(recipe, dict):
        data = apply_overrides(recipe, overrides or [], "<dict>")
        loaded = validate(data, "<dict>", {}, default_output="out/recipe")
    else:
        loaded = load_recipe(str(recipe), overrides)
    return run(loaded, from_stage)
