"""Click parameters generated from a stage's config fields, and configs built back from them."""

from __future__ import annotations

from typing import Any

import click

from llmopt.pipeline.stages.base import FieldInfo, build_config, fields_of


def stage_options(config_cls: type, skip: tuple[str, ...] = ()):
    """Decorator: one click argument / option per CLI field of ``config_cls``, in field order."""

    def decorate(func):
        for f in reversed(fields_of(config_cls)):
            if f.meta.get("cli", True) and f.name not in skip:
                func = _param(f)(func)
        return func

    return decorate


def _click_type(f: FieldInfo) -> Any:
    choices = f.meta.get("choices")
    if choices:
        return click.Choice(choices, case_sensitive=f.meta.get("case_sensitive", True))
    low = f.meta.get("min")
    if low is not None:
        return click.IntRange(low) if f.base is int else click.FloatRange(low)
    return f.base


def _param(f: FieldInfo):
    if f.meta.get("argument"):
        return click.argument(f.name)
    flag = "--" + f.name.replace("_", "-")
    kwargs: dict[str, Any] = {"help": f.help}
    if f.base is bool and f.optional:
        decls = [f"{flag}/--no-{flag[2:]}"]
        kwargs["default"] = None
    elif f.base is bool:
        decls = [flag]
        kwargs.update(is_flag=True, default=bool(f.default))
    else:
        decls = [flag] + ([f.meta["short"]] if f.meta.get("short") else [])
        kwargs["type"] = _click_type(f)
        if f.meta.get("metavar"):
            kwargs["metavar"] = f.meta["metavar"]
        if f.multiple:
            kwargs["multiple"] = True
        elif f.required:
            kwargs["required"] = True
        else:
            kwargs["default"] = f.default
            kwargs["show_default"] = f.default is not None and f.meta.get("show_default", True)
    return click.option(*decls, f.name, **kwargs)


def config_from_cli(config_cls: type, params: dict[str, Any]) -> Any:
    """The config for a command's parsed parameters (checked as a recipe's would be)."""
    names = {f.name for f in fields_of(config_cls)}
    values = {k: v for k, v in params.items() if k in names}
    return build_config(config_cls, values, label=lambda name: f"--{name.replace('_', '-')}")
