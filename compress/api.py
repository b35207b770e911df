"""The Python API: the CLI's stages as functions, for notebooks and scripts.

Each function takes the same options as its command (``group_size=32`` is ``--group-size 32``),
checks them the same way, and returns the same record the command prints with ``--json``::

    import llmopt
    llmopt.quantize("demo", scheme="W4A16", method="gptq", group_size=32, output="out/w4")
    figures = llmopt.evaluate("out/w4", baseline="demo")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _run(kind: str, **values: Any) -> Any:
    from llmopt.pipeline.registry import stage
    from llmopt.pipeline.stages.base import build_config

    spec = stage(kind)
    return spec.run(build_config(spec.config, {k: v for k, v in values.items() if v is not None or k == "baseline"}))


def quantize(model: str, *, scheme: str, output: str | Path, **options: Any) -> dict:
    """Quantize ``model`` (options as ``llmopt quantize``); returns the provenance record."""
    return _run("quantize", model=str(model), scheme=scheme, output=str(output), **options)


def prune(model: str, *, method: str, output: str | Path, **options: Any) -> dict:
    """Prune ``model`` (options as ``llmopt prune``); returns the provenance record."""
    return _run("prune", model=str(model), method=method, output=str(output), **options)


def distill(teacher: str, *, steps: int, output: str | Path, **options: Any) -> dict:
    """Distil ``teacher`` into a student (options as ``llmopt distill``); returns the run record."""
    outcome = _run("distill", teacher=str(teacher), steps=steps, output=str(output), **options)
    if outcome.interrupted:
        raise KeyboardInterrupt
    return outcome.record


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
