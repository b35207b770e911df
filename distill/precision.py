"""Which mixed precision a run uses: ``auto`` picks bfloat16 where the hardware computes it natively."""

from __future__ import annotations

import torch
from llmopt.core.errors import LlmoptError
from llmopt.core.hardware import cpu_has_bf16

CHOICES = ("auto", "bf16", "fp16", "no")


def resolve_precision(requested: str, cpu: bool) -> str:
    """Turn ``auto`` into ``bf16``/``fp16``/``no`` for this machine; refuse what it cannot do."""
    if requested not in CHOICES:
        raise LlmoptError(f"unknown precision '{requested}'", f"use one of {', '.join(CHOICES)}")
    cuda = torch.cuda.is_available() and not cpu
    if requested == "auto":
        if cuda:
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "bf16" if cpu_has_bf16() else "no"
    if requested == "fp16" and not cuda:
        raise LlmoptError("fp16 mixed precision needs a GPU", "use --precision bf16 or no on the CPU")
    return requested
