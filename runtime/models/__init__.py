"""Native model architectures: one small file each, on the shared layers (``runtime.layers``,
``runtime.loader``) and the engine's kernel backend.

Each module defines ``Model`` (the forward over a flattened batch with the paged KV cache) and
``load_layer`` (one decoder layer's weights under that architecture's tensor names).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from ..backends import Backend
from ..config import ModelArch
from ..loader import ModelWeights, load_weights

# model_type (config.json) -> module of this package
NATIVE = {
    "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
    "phi3": "phi3",
    "gemma2": "gemma", "gemma3_text": "gemma",
    "mixtral": "moe", "qwen2_moe": "moe", "qwen3_moe": "moe",
}


def load_model(path: Path, arch: ModelArch, dtype: torch.dtype, backend: Backend, lm_head: str, max_model_len: int):
    """The model of ``arch`` (native, or transformers' code when ``arch.generic``: ``models.generic``)
    with its weights from ``path`` on ``backend``: ``(model, weights)``."""
    if arch.generic:
        from . import generic

        return generic.load_model(path, arch, dtype, backend, lm_head, max_model_len)
    module = importlib.import_module(f"{__name__}.{NATIVE[arch.model_type]}")
    weights: ModelWeights = load_weights(path, arch, dtype, backend, lm_head, module.load_layer)
    return module.Model(arch, weights, backend, max_model_len, dtype), weights
