"""The Llama-family forward (kept importable here; the architectures live in ``runtime.models``)."""

from __future__ import annotations

from .models.llama import LlamaModel

__all__ = ["LlamaModel"]
