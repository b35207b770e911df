"""Let a package double as a function: ``llmopt.prune(...)`` runs the prune stage although
``llmopt.prune`` is also the package of pruning algorithms (the user's folder layout)."""

from __future__ import annotations

import importlib
import sys
import types


def make_callable(module_name: str, target: str) -> None:
    """Calling module ``module_name`` calls ``target`` (``"package.module:function"``), imported on first call."""
    module_path, function = target.split(":")

    class CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return getattr(importlib.import_module(module_path), function)(*args, **kwargs)

    sys.modules[module_name].__class__ = CallableModule
