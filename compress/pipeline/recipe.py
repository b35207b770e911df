"""Recipes: YAML pipelines of stages (quantize, prune, distill, export), validated before any work.

A recipe names the model, shared calibration settings, an ordered list of stages and optional
evaluation / benchmark / runtime settings::

    model: demo
    output: out/w4a16-gptq
    calibration: {dataset: austen, samples: 128, seq_len: 512, seed: 0}
    stages:
      - quantize: {scheme: W4A16, method: gptq, group_size: 32}
      - export: {format: gguf, type: Q4_0}
    evaluate: {max_windows: 16}

A ``draft:`` section makes a speculative-decoding draft from the same model with its own stages
(e.g. a distill stage with ``drop_layers``, then quantize), written under ``OUTPUT/draft/``; the
``runtime:`` block's ``speculative_config`` (method ``draft``, no ``model``) then runs it::

    draft:
      stages:
        - distill: {drop_layers: 26, steps: 300}
        - quantize: {scheme: W4A16, group_size: 32, head: int8}
    runtime:
      speculative_config: {method: draft, num_speculative_tokens: 4}

A stage's options are the fields of its config in the stage registry, which also generates the
CLI command's options (``llmopt quantize --group-size 32`` is ``group_size: 32``), so a recipe
and the CLI cannot disagree.
Errors name the file, the line and the key. llm-compressor recipes (``*_stage`` →
``*_modifiers``) are mapped onto these stages (see :mod:`llmopt.pipeline.llmcompressor`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from llmopt.core.errors import LlmoptError
from llmopt.pipeline.stages.base import convert_value, defaults, fields_of, recipe_keys

TOP_KEYS = {"model", "output", "calibration", "stages", "draft", "evaluate", "benchmark", "runtime", "description"}
CALIBRATION_KEYS = {"dataset": "calib", "samples": "calib_samples", "seq_len": "calib_seq_len", "seed": "seed"}
BENCHMARK_KEYS = {"single_stream": bool, "serving_requests": int, "prompt_len": list, "output_len": list, "rate": float}
# Required options the runner fills when a stage leaves them out (distill's teacher: the recipe's model).
RUNNER_DEFAULTS = {"distill": ("teacher",)}


class RecipeError(LlmoptError):
    """A recipe problem, located at ``file:line``."""


@dataclass
class Stage:
    kind: str  # quantize | prune | distill | export
    options: dict[str, Any]
    line: int

    def describe(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in self.options.items() if k in ("scheme", "method", "group_size", "sparsity", "pattern", "num", "format", "type", "steps"))
        return f"{self.kind}({shown})"


@dataclass
class Recipe:
    source: str
    model: str
    output: str
    stages: list[Stage]
    calibration: dict[str, Any] = field(default_factory=dict)
    evaluate: dict[str, Any] | None = None
    benchmark: dict[str, Any] | None = None
    runtime: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    raw: dict[str, Any] = field(default_factory=dict)
    draft: list[Stage] = field(default_factory=list)  # stages that make the speculative draft

    def resolved(self) -> dict[str, Any]:
        """The recipe with every stage's options complete (defaults filled in), for the record."""
        return {
            "model": self.model, "output": self.output, "calibration": self.calibration,
            "stages": [{s.kind: _jsonable(stage_settings(s, self))} for s in self.stages],
            **({"draft": {"stages": [{s.kind: _jsonable(stage_settings(s, self))} for s in self.draft]}} if self.draft else {}),
            "evaluate": self.evaluate, "benchmark": self.benchmark, "runtime": self.runtime,
        }


def _jsonable(options: dict) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in options.items()}


# ---------------------------------------------------------------------------------------------
# stage options: the registry's typed configs


def _config(kind: str) -> type:
    from llmopt.pipeline.registry import PIPELINE_STAGES, stage

    if kind not in PIPELINE_STAGES:
        raise RecipeError(f"unknown stage '{kind}'", f"use one of {', '.join(PIPELINE_STAGES)}")
    return stage(kind).config


def convert_options(kind: str, options: dict[str, Any], where: str) -> dict[str, Any]:
    """Check a stage's options against its config's fields and convert their types."""
    try:
        config = _config(kind)
    except RecipeError as exc:
        raise RecipeError(f"{where}: {exc.problem}", exc.fix) from exc
    keys = recipe_keys(config)
    by_name = {f.name: f for f in fields_of(config)}
    out = {}
    for key, value in options.items():
        name = keys.get(key.replace("-", "_"))
        if name is None:
            raise RecipeError(f"{where}: unknown option '{key}' for stage {kind}", f"known options: {', '.join(sorted(set(keys.values())))}")
        try:
            out[name] = convert_value(by_name[name], value, f"option '{key}' of stage {kind}")
        except LlmoptError as exc:
            raise RecipeError(f"{where}: {exc.problem}", exc.fix or "fix the value") from exc
    return out


def _runner_owned(kind: str) -> set[str]:
    """Options the runner supplies itself (input, output, overwrite) that a stage may not set."""
    from llmopt.pipeline.registry import STAGES

    spec = STAGES.get(kind)
    owned = {"model", "output", "overwrite", "as_json"}
    return owned | ({f.name for f in fields_of(spec.config) if f.meta.get("runner_owned")} if spec else set())


def uses_calibration(kind: str, settings: dict[str, Any]) -> bool:
    """Whether the recipe's shared calibration settings apply to this stage."""
    config = _config(kind)
    if kind not in ("quantize", "prune"):
        return True
    placeholders = {f.name: "" for f in fields_of(config) if f.required}
    try:
        return bool(config(**{**placeholders, **settings}).needs_calibration)
    except Exception:  # noqa: BLE001 - invalid settings are reported by validation, not here
        return True


def stage_settings(stage: Stage, recipe: Recipe) -> dict[str, Any]:
    """Every option of the stage: defaults, then shared calibration (where it applies), then the stage's own."""
    config = _config(stage.kind)
    owned = {f.name for f in fields_of(config) if f.meta.get("runner_owned")}
    settings = {k: v for k, v in defaults(config).items() if k not in owned}
    names = {f.name for f in fields_of(config)}
    if uses_calibration(stage.kind, {**settings, **stage.options}):
        for key, target in CALIBRATION_KEYS.items():
            if key in recipe.calibration and target in names:
                settings[target] = recipe.calibration[key]
    settings.update(stage.options)
    return settings


# ---------------------------------------------------------------------------------------------
# loading


def bundled_recipes() -> dict[str, Path]:
    folder = resources.files("llmopt.recipes")
    return {Path(str(f)).stem: Path(str(f)) for f in folder.iterdir() if str(f).endswith(".yaml")}


def load_recipe(spec: str, overrides: list[str] | None = None) -> Recipe:
    """Load a recipe file or a bundled recipe name, apply ``key=value`` overrides, validate it."""
    path = Path(spec)
    if not path.is_file():
        bundled = bundled_recipes()
        if spec not in bundled:
            raise LlmoptError(f"recipe not found: {spec}", f"pass a YAML file or a bundled recipe ({', '.join(sorted(bundled))})")
        path = bundled[spec]
    text = path.read_text()
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise RecipeError(f"{path}{line}: not valid YAML ({getattr(exc, 'problem', exc)})", "fix the YAML syntax") from exc
    lines = _line_index(node)
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a mapping with 'model' and 'stages'", "see `llmopt recipes show w4a16-gptq`")
    from llmopt.pipeline.llmcompressor import is_llmcompressor_recipe, map_llmcompressor

    if is_llmcompressor_recipe(data):
        data = map_llmcompressor(data, str(path), lines)
    data = apply_overrides(data, overrides or [], str(path))
    return validate(data, str(path), lines, default_output=f"out/{path.stem}")


def _line_index(node) -> dict[tuple, int]:
    """(key path) → 1-based line, for every mapping key and sequence item in the YAML."""
    index: dict[tuple, int] = {}

    def walk(n, path):
        if n is None:
            return
        index.setdefault(path, n.start_mark.line + 1)
        if isinstance(n, yaml.MappingNode):
            for key, value in n.value:
                index[path + (key.value,)] = key.start_mark.line + 1
                walk(value, path + (key.value,))
        elif isinstance(n, yaml.SequenceNode):
            for i, item in enumerate(n.value):
                walk(item, path + (i,))

    walk(node, ())
    return index


def apply_overrides(data: dict, overrides: list[str], source: str) -> dict:
    """``--set stages.0.quantize.group_size=64`` style overrides (values parsed as YAML)."""
    data = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise LlmoptError(f"--set {item!r} is not key=value", "write e.g. --set stages.0.quantize.group_size=64")
        key, raw = item.split("=", 1)
        target: Any = data
        parts = key.split(".")
        for part in parts[:-1]:
            target = target[int(part)] if isinstance(target, list) and part.isdigit() else target.setdefault(part, {})
            if not isinstance(target, (dict, list)):
                raise LlmoptError(f"--set {key}: '{part}' is not a section of {source}", "check the key path")
        last = parts[-1]
        value = yaml.safe_load(raw)
        if isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value
    return data


def validate(data: dict, source: str, lines: dict[tuple, int], default_output: str) -> Recipe:
    """Check keys, types and stage order; raise RecipeError naming file, line and key."""

    def at(*path) -> str:
        for cut in range(len(path), -1, -1):
            if path[:cut] in lines:
                return f"{source}:{lines[path[:cut]]}"
        return source

    for key in data:
        if key not in TOP_KEYS:
            raise RecipeError(f"{at(key)}: unknown key '{key}'", f"known keys: {', '.join(sorted(TOP_KEYS))}")
    if not isinstance(data.get("model"), str):
        raise RecipeError(f"{at('model')}: 'model' must be a model spec string", "e.g. model: demo")
    stages_raw = data.get("stages")
    if not isinstance(stages_raw, list) or not stages_raw:
        raise RecipeError(f"{at('stages')}: 'stages' must be a non-empty list", "e.g. stages: [{quantize: {scheme: W4A16}}]")
    calibration = _section(data, "calibration", {k: (str if k == "dataset" else int) for k in CALIBRATION_KEYS}, at)
    evaluate = _section(data, "evaluate", _evaluate_keys(), at, allow_bool=True)
    benchmark = _section(data, "benchmark", BENCHMARK_KEYS, at, allow_bool=True)
    runtime = data.get("runtime") or {}
    if not isinstance(runtime, dict):
        raise RecipeError(f"{at('runtime')}: 'runtime' must be a mapping", "e.g. runtime: {max_num_seqs: 32}")
    stages = _stages(stages_raw, ("stages",), at, lines)
    _check_order(stages, source)
    draft = _draft(data, at, lines)
    _check_order(draft, source)
    recipe = Recipe(
        source=source, model=data["model"], output=str(data.get("output") or default_output), stages=stages,
        calibration=calibration or {}, evaluate=evaluate, benchmark=benchmark, runtime=runtime,
        description=str(data.get("description", "")), raw=data, draft=draft,
    )
    for stage in stages + draft:
        _check_required(stage, recipe, source)
    _check_runtime(runtime, at)
    _check_speculation(runtime, bool(draft), at)
    return recipe


def _stages(items: list, path: tuple, at, lines: dict[tuple, int]) -> list[Stage]:
    """The stage list at ``path`` (``stages`` or ``draft.stages``), each stage's options checked."""
    stages = []
    for i, item in enumerate(items):
        where = at(*path, i)
        if not isinstance(item, dict) or len(item) != 1:
            raise RecipeError(f"{where}: each stage is a one-key mapping like '- quantize: {{...}}'", "write one stage per list item")
        (kind, options), = item.items()
        options = options or {}
        if not isinstance(options, dict):
            raise RecipeError(f"{where}: options of stage {kind} must be a mapping", "e.g. - quantize: {scheme: W4A16}")
        for key in options:
            if key.replace("-", "_") in _runner_owned(kind):
                raise RecipeError(f"{at(*path, i, kind, key)}: '{key}' is set by the recipe runner", "set 'model' / 'output' at the top level")
        try:
            converted = convert_options(kind, options, where)
        except RecipeError as exc:
            bad = next((k for k in options if f"'{k}'" in str(exc)), None)
            if bad is not None:
                raise RecipeError(str(exc).replace(where, at(*path, i, kind, bad), 1)) from exc
            raise
        stages.append(Stage(kind, converted, lines.get(path + (i,), 0)))
    return stages


def _draft(data: dict, at, lines: dict[tuple, int]) -> list[Stage]:
    """The ``draft:`` section's stages (none without the section); a draft is a checkpoint, so no export."""
    section = data.get("draft")
    if section is None:
        return []
    if not isinstance(section, dict) or set(section) != {"stages"}:
        raise RecipeError(f"{at('draft')}: 'draft' must be a mapping with only 'stages'",
                          "e.g. draft: {stages: [{distill: {drop_layers: 26, steps: 300}}]}")
    items = section["stages"]
    if not isinstance(items, list) or not items:
        raise RecipeError(f"{at('draft', 'stages')}: 'draft.stages' must be a non-empty list", "e.g. - distill: {drop_layers: 26, steps: 300}")
    stages = _stages(items, ("draft", "stages"), at, lines)
    for i, stage in enumerate(stages):
        if stage.kind in ("export", "eval"):
            raise RecipeError(f"{at('draft', 'stages', i)}: a draft's stages make a checkpoint for the runtime, '{stage.kind}' does not",
                              "use prune, distill and quantize stages in 'draft'")
    return stages


def _check_speculation(runtime: dict, has_draft: bool, at) -> None:
    """``runtime.speculative_config`` with method ``draft`` and a ``draft:`` section come together."""
    spec = runtime.get("speculative_config")
    if spec is None:
        if has_draft:
            raise RecipeError(f"{at('draft')}: the draft section makes a draft model, but the runtime block does not run it",
                              "add runtime: {speculative_config: {method: draft, num_speculative_tokens: 4}}")
        return
    from llmopt.runtime.speculative import SpeculativeConfig

    try:  # the draft section fills 'model'; everything else is checked now
        SpeculativeConfig.parse({**spec, "model": spec.get("model") or "draft"} if isinstance(spec, dict) and spec.get("method", "draft") == "draft" else spec)
    except LlmoptError as exc:
        raise RecipeError(f"{at('runtime', 'speculative_config')}: {exc.problem}", exc.fix) from exc
    method = spec.get("method", "draft")
    if has_draft and (method != "draft" or spec.get("model")):
        raise RecipeError(f"{at('draft')}: the draft section makes the draft model, but runtime.speculative_config does not run it",
                          "set runtime: {speculative_config: {method: draft, num_speculative_tokens: 4}} (no 'model': the recipe fills it)")
    if not has_draft and method == "draft" and not spec.get("model"):
        raise RecipeError(f"{at('runtime', 'speculative_config')}: speculative method 'draft' needs a draft model",
                          "add a 'draft:' section that makes it, or give speculative_config a model")


def _evaluate_keys() -> dict[str, type]:
    """The ``evaluate:`` block's keys: the eval stage's options the runner does not set."""
    from llmopt.pipeline.stages.evaluate import EvalConfig

    return {f.name: f.base for f in fields_of(EvalConfig) if not f.meta.get("runner_owned")}


def _section(data: dict, name: str, schema: dict, at, allow_bool: bool = False) -> dict | None:
    value = data.get(name)
    if value is None or value is False:
        return None
    if value is True and allow_bool:
        return {}
    if not isinstance(value, dict):
        raise RecipeError(f"{at(name)}: '{name}' must be a mapping", f"keys: {', '.join(schema)}")
    for key, item in value.items():
        if key not in schema:
            raise RecipeError(f"{at(name, key)}: unknown key '{key}' in {name}", f"known keys: {', '.join(schema)}")
        expected = schema[key]
        ok = isinstance(item, expected) and not (expected is int and isinstance(item, bool))
        if expected is float:
            ok = isinstance(item, (int, float)) and not isinstance(item, bool)
        if not ok:
            raise RecipeError(f"{at(name, key)}: '{name}.{key}' must be {expected.__name__}, got {type(item).__name__}", "fix the value's type")
    return dict(value)


def _check_order(stages: list[Stage], source: str) -> None:
    """Quantized weights cannot be pruned, trained or quantized again; export comes last."""
    quantized_at = None
    for i, stage in enumerate(stages):
        where = f"{source}:{stage.line}"
        if stage.kind == "export":
            if i != len(stages) - 1 and any(s.kind != "export" for s in stages[i + 1:]):
                raise RecipeError(f"{where}: stage {i + 1} exports, but compression stages follow it", "move export stages to the end")
            continue
        if quantized_at is not None:
            what = "quantize again" if stage.kind == "quantize" else stage.kind
            method = stage.options.get("method", "")
            detail = f" ({method} scales weights that are already quantized)" if method.startswith("awq") else ""
            raise RecipeError(
                f"{where}: stage {i + 1} would {what} after stage {quantized_at + 1} quantized the weights{detail}",
                "put pruning, distillation and scaling methods (AWQ, SmoothQuant) before the quantize stage, and quantize once",
            )
        if stage.kind == "quantize":
            quantized_at = i


def _check_required(stage: Stage, recipe: Recipe, source: str) -> None:
    settings = stage_settings(stage, recipe)
    for f in fields_of(_config(stage.kind)):
        if f.meta.get("runner_owned") or f.name in RUNNER_DEFAULTS.get(stage.kind, ()):
            continue
        if f.required and settings.get(f.name) is None:
            raise RecipeError(f"{source}:{stage.line}: stage {stage.kind} needs '{f.name}'", f"add {f.name}: … to the stage")


def _check_runtime(runtime: dict, at) -> None:
    try:
        from llmopt.runtime.config import EngineConfig
    except ImportError:
        return
    import dataclasses

    known = {f.name for f in dataclasses.fields(EngineConfig)} if dataclasses.is_dataclass(EngineConfig) else set()
    for key in runtime:
        if known and key not in known:
            raise RecipeError(f"{at('runtime', key)}: unknown runtime setting '{key}'", f"known settings: {', '.join(sorted(known))}")
