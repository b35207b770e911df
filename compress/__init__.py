"""llmopt: compress, run and measure Hugging Face causal language models."""

from __future__ import annotations

__version__ = "0.1.0"


def resolve_model(spec):
    """The local Hugging Face directory for a model spec (``demo``, a directory, a .gguf, a Hub id)."""
    from llmopt.checkpoints.models import resolve_model as resolve

    return resolve(spec)


def load_model(spec, dtype: str = "float32"):
    """``(model, tokenizer)`` for a model spec, on the CPU in eval mode."""
    from llmopt.checkpoints.models import load_model as load

    return load(spec, dtype)


__all__ = ["__version__", "load_model", "resolve_model"]
