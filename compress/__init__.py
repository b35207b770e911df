"""llmopt: compress, run and measure Hugging Face causal language models.

The Python API mirrors the CLI: :func:`quantize`, :func:`prune`, :func:`distill`,
:func:`export`, :func:`evaluate`, :func:`run_recipe` (plain functions of :mod:`llmopt.api`),
and :func:`load_model` / :func:`resolve_model` for model specs (:mod:`llmopt.checkpoints.models`).
``quantize`` / ``prune`` / ``distill`` also compress a transformers model in memory; :func:`save`
writes it as the CLI would, :func:`oneshot` runs a recipe on it.
Both modules are light to import: the stages behind the API functions are imported when called.

The algorithm packages import as ``llmopt.quant``, ``llmopt.pruning`` and ``llmopt.distillation``
(folders ``quant/``, ``prune/``, ``distill/``), so no package name clashes with an API function.
"""

from __future__ import annotations

__version__ = "0.1.0"  # first: modules imported below may read it

from llmopt.api import distill, evaluate, export, oneshot, prune, quantize, run_recipe, save  # noqa: E402
from llmopt.checkpoints.models import load_model, resolve_model  # noqa: E402

__all__ = ["__version__", "quantize", "prune", "distill", "export", "evaluate", "run_recipe", "load_model", "resolve_model",
           "save", "oneshot"]
