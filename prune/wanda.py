"""Wanda (Sun et al., 2023): prune by ``|W_ij| · ‖x_j‖₂``, compared within each output row.

``‖x_j‖₂`` is the L2 norm of input channel ``j`` over all calibration tokens, gathered by the
sequential engine's :class:`~llmopt.calibration.LinearStats`. No weight update.
"""

from __future__ import annotations

import torch

from llmopt.pruning.masks import Pattern, select_mask


def wanda_scores(weight: torch.Tensor, input_norm: torch.Tensor) -> torch.Tensor:
    """``|W| · ‖x‖₂`` broadcast over rows: ``[out, in]`` scores, float32."""
    if input_norm.shape != (weight.shape[1],):
        raise ValueError(f"input norms {tuple(input_norm.shape)} do not match weight {tuple(weight.shape)}")
    return weight.detach().abs().float() * input_norm.float().to(weight.device).unsqueeze(0)


@torch.no_grad()
def wanda_mask(
    weight: torch.Tensor, input_norm: torch.Tensor, sparsity: float | None = None, pattern: Pattern | None = None
) -> torch.Tensor:
    """Keep-mask of ``weight`` by the Wanda score (per row, or per N:M group of inputs)."""
    return select_mask(wanda_scores(weight, input_norm), sparsity, pattern)
