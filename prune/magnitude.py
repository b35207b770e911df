"""Magnitude pruning: remove the smallest ``|W|`` of each row (or of each N:M group)."""

from __future__ import annotations

import torch

from llmopt.pruning.masks import Pattern, select_mask


@torch.no_grad()
def magnitude_mask(weight: torch.Tensor, sparsity: float | None = None, pattern: Pattern | None = None) -> torch.Tensor:
    """Keep-mask of ``weight`` ``[out, in]`` by absolute value (per row, or per N:M group)."""
    return select_mask(weight.detach().abs().float(), sparsity, pattern)
