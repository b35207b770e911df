"""What every stage is made of: a typed config (a dataclass whose fields carry their help,
choices and bounds) and one function that applies it and returns a result record.

The CLI builds its options from these fields and recipes check their stage options against
them, so an option cannot exist in one and not the other. Field names are the recipe keys and
the CLI's long option names (``group_size`` ↔ ``--group-size``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from typing import Any

from llmopt.core.errors import LlmoptError


def option(default: Any = MISSING, help: str = "", *, choices: tuple[str, ...] | None = None, min: int | float | None = None,
           metavar: str | None = None, short: str | None = None, aliases: tuple[str, ...] = (), argument: bool = False,
           case_sensitive: bool = True, show_default: bool = True, runner_owned: bool = False,
           cli: bool = True, recipe: bool = True) -> Any:
    """A config field with what the CLI and recipes need to know about it.

    ``aliases``: older recipe keys that mean this field. ``argument``: a positional CLI
    argument (MODEL). ``runner_owned``: set by the recipe runner, never by a recipe stage
    (model, output, overwrite). ``cli=False`` / ``recipe=False`` hide a field from one side.
    """
    meta = dict(help=help, choices=choices, min=min, metavar=metavar, short=short, aliases=aliases, argument=argument,
                case_sensitive=case_sensitive, show_default=show_default, runner_owned=runner_owned, cli=cli, recipe=recipe)
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple default")
    return field(default=default, metadata=meta)


def device_option() -> Any:
    """The ``device`` field of the calibrating stages."""
    return option("auto", "Where each layer is calibrated: cpu, cuda (cuda:N) or auto (the GPU when there is one); "
                  "layers stream through it one at a time, so a model larger than the GPU fits.")


def overwrite_option() -> Any:
    """The ``overwrite`` field of every stage that writes a checkpoint."""
    return option(False, "Replace an existing output directory.", runner_owned=True)


def eval_option() -> Any:
    """The ``eval`` field: evaluate a stage's output against its input afterwards."""
    return option(False, "Evaluate the result against MODEL afterwards (16 windows of 2048) and record it.",
                  aliases=("run_evaluation",))


@dataclass(frozen=True)
class FieldInfo:
    """One config field, its type reduced to what the CLI and recipes handle."""

    name: str
    base: type  # str, int, float, bool
    optional: bool  # None allowed
    multiple: bool  # tuple[str, ...]
    default: Any  # MISSING when required
    meta: dict

    @property
    def required(self) -> bool:
        return self.default is MISSING

    @property
    def help(self) -> str:
        return self.meta.get("help", "")


def fields_of(config_cls: type) -> list[FieldInfo]:
    """The fields of a stage config, in declaration order."""
    hints = typing.get_type_hints(config_cls)
    out = []
    for f in dataclasses.fields(config_cls):
        base, optional, multiple = _reduce(hints[f.name])
        default = f.default if f.default is not MISSING else MISSING
        out.append(FieldInfo(f.name, base, optional, multiple, default, dict(f.metadata)))
    return out


def _reduce(tp: Any) -> tuple[type, bool, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        base, _, multiple = _reduce(rest[0])
        return base, True, multiple
    if typing.get_origin(tp) is tuple:
        return args[0], False, True
    return tp, False, False


def recipe_keys(config_cls: type) -> dict[str, str]:
    """Recipe key → field name (names, their dashed spellings and aliases)."""
    keys = {}
    for f in fields_of(config_cls):
        if not f.meta.get("recipe", True) or f.meta.get("runner_owned"):
            continue
        for key in (f.name, *f.meta.get("aliases", ())):
            keys[key] = f.name
    return keys


def convert_value(f: FieldInfo, value: Any, label: str) -> Any:
    """Check and convert one value against its field (type, choices, bounds); LlmoptError if wrong."""
    if value is None:
        if f.optional or (f.default is None):
            return None
        raise LlmoptError(f"{label} needs a value", _hint(f))
    if f.multiple:
        items = value if isinstance(value, (list, tuple)) else [value]
        return tuple(convert_value(dataclasses.replace(f, multiple=False), item, label) for item in items)
    if f.base is bool:
        if not isinstance(value, bool):
            raise LlmoptError(f"{label} must be true or false, got {value!r}", "write true or false")
        return value
    if f.base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise LlmoptError(f"{label} must be an integer, got {value!r}", _hint(f))
    elif f.base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise LlmoptError(f"{label} must be a number, got {value!r}", _hint(f))
        value = float(value)
    elif f.base is str:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise LlmoptError(f"{label} must be a string, got {value!r}", _hint(f))
        value = str(value)
    choices = f.meta.get("choices")
    if choices:
        match = [c for c in choices if c == value or (not f.meta.get("case_sensitive", True) and c.lower() == str(value).lower())]
        if not match:
            raise LlmoptError(f"{label} must be one of {', '.join(choices)}, got {value!r}", "pick one of the listed values")
        value = match[0]
    low = f.meta.get("min")
    if low is not None and value < low:
        raise LlmoptError(f"{label} must be at least {low}, got {value!r}", _hint(f))
    return value


def _hint(f: FieldInfo) -> str:
    return f.help or "see the option's --help"


def defaults(config_cls: type) -> dict[str, Any]:
    """Field name → default, for every field with one."""
    return {f.name: (list(f.default) if isinstance(f.default, tuple) else f.default)
            for f in fields_of(config_cls) if not f.required}


def build_config(config_cls: type, values: dict[str, Any], label: Callable[[str], str] = lambda name: f"'{name}'") -> Any:
    """A config from plain values (recipe keys or field names), every value checked."""
    by_name = {f.name: f for f in fields_of(config_cls)}
    keys = {**{name: name for name in by_name}, **recipe_keys(config_cls)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        name = keys.get(key.replace("-", "_"))
        if name is None:
            raise LlmoptError(f"unknown option {label(key)}", f"known options: {', '.join(sorted(recipe_keys(config_cls)))}")
        kwargs[name] = convert_value(by_name[name], value, label(key))
    missing = [f.name for f in by_name.values() if f.required and f.name not in kwargs]
    if missing:
        raise LlmoptError(f"missing {', '.join(label(m) for m in missing)}", "add the missing option")
    config = config_cls(**kwargs)
    check = getattr(config, "check", None)
    if check is not None:
        check()
    return config


@dataclass(frozen=True)
class StageSpec:
    """One entry of the stage registry."""

    name: str
    config: type  # the config dataclass
    run: Callable[..., Any]  # run(config, progress=None) -> result record
    summary: str  # one line for listings
    input_field: str | None = "model"  # the field the recipe runner fills with the previous stage's checkpoint
