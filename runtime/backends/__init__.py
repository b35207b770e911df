"""Kernel backends: one is chosen once per engine, from its device and ``kernels`` setting.

Every module here but ``base`` is a backend, named by its file: it defines ``BACKEND`` (a
:class:`.base.Backend` subclass) and ``unavailable_reason(device)`` (None when it can run
there). Adding a backend means adding one file.
"""

from __future__ import annotations

import importlib
import warnings

import torch
from llmopt.core.errors import LlmoptError

from ..config import KERNEL_CHOICES
from .base import AttentionMetadata, Backend, ForwardBatch, PrefillChunk

__all__ = ["AttentionMetadata", "Backend", "ForwardBatch", "PrefillChunk", "choose_backend"]


def _auto(device: torch.device) -> str:
    """triton on CUDA; on the CPU the C++ kernels where they build, else the reference (with a warning)."""
    if device.type == "cuda":
        return "triton"
    if importlib.import_module(f"{__name__}.cpu").unavailable_reason(device) is None:
        return "cpu"
    warnings.warn("the C++ CPU kernels are not available here: the runtime runs the plain-torch reference (slower)",
                  RuntimeWarning, stacklevel=3)
    return "reference"


def choose_backend(kernels: str, device: torch.device, dtype: torch.dtype) -> Backend:
    """The backend for ``kernels`` (``auto`` or a backend's name) on ``device``; one that cannot
    run there is a clear error."""
    if kernels not in KERNEL_CHOICES:
        raise LlmoptError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, not {kernels!r}", "pick one of those")
    name = _auto(device) if kernels == "auto" else kernels
    module = importlib.import_module(f"{__name__}.{name}")
    reason = module.unavailable_reason(device)
    if reason is not None:
        raise LlmoptError(f"kernels={name} cannot run here: {reason}", "use kernels='auto' (or 'reference')")
    return module.BACKEND(device, dtype)
