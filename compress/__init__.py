"""llmopt: compress, run and measure Hugging Face causal language models.

The Python API mirrors the CLI: :func:`quantize`, :func:`prune`, :func:`distill`,
:func:`export`, :func:`evaluate`, :func:`run_recipe`, and :func:`load_model` /
:func:`resolve_model` for model specs. Names are imported on first use, so ``import llmopt``
stays light and lower layers never load the upper ones.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_API = {"quantize", "prune", "distill", "export", "evaluate", "run_recipe"}
_CHECKPOINTS = {"load_model", "resolve_model"}
__all__ = ["__version__", *_API, *_CHECKPOINTS]


def __getattr__(name: str) -> Any:
    if name in ("prune", "distill"):  # packages that are also callable (see llmopt.core.callable_module)
        import importlib

        return importlib.import_module(f"llmopt.{name}")
    if name in _API:
        from llmopt import api

        return getattr(api, name)
    if name in _CHECKPOINTS:
        from llmopt.checkpoints import models

        return getattr(models, name)
    raise AttributeError(f"module 'llmopt' has no attribute {name!r}")
