"""Sparsity masks from importance scores, N:M patterns and OWL per-layer sparsity profiles.

A mask is a bool tensor shaped like the weight, True where the weight is *kept*. Scores are
"higher = more important" (``|W|`` for magnitude, ``|W|·‖x‖₂`` for Wanda).

- Unstructured: each output row keeps its ``n - round(sparsity · n)`` highest-scoring inputs,
  so every row (and so every layer) has exactly the requested sparsity.
- N:M: every group of M consecutive inputs of a row keeps its N highest-scoring entries.
- OWL (Yin et al., 2024): layers with more outliers (scores above ``m`` × their mean) are
  pruned less; per-layer sparsities stay within ``target ± lam`` and average to ``target``.
"""

from __future__ import annotations

import torch

from llmopt.formats.sparsity import Pattern, nm_valid, parse_pattern  # noqa: F401  (the pruning API uses them)


def pruned_per_row(n_inputs: int, sparsity: float) -> int:
    """How many of a row's ``n_inputs`` weights a sparsity removes (rounded to nearest)."""
    return min(n_inputs, max(0, round(sparsity * n_inputs)))


def unstructured_mask(scores: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Keep-mask removing the ``round(sparsity · n)`` lowest scores of every row (ties: lower
    input index removed first)."""
    rows, n = scores.shape
    k = pruned_per_row(n, sparsity)
    keep = torch.ones(rows, n, dtype=torch.bool, device=scores.device)
    if k:
        order = torch.argsort(scores, dim=1, stable=True)
        keep.scatter_(1, order[:, :k], False)
    return keep


def nm_mask(scores: torch.Tensor, pattern: Pattern) -> torch.Tensor:
    """Keep-mask with the ``n`` highest scores of every ``m`` consecutive inputs of each row."""
    rows, n_in = scores.shape
    if n_in % pattern.m:
        raise ValueError(f"{pattern} sparsity needs the input size ({n_in}) to be a multiple of {pattern.m}")
    groups = scores.reshape(rows, n_in // pattern.m, pattern.m)
    top = groups.topk(pattern.n, dim=-1).indices
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, top, True)
    return keep.reshape(rows, n_in)


def select_mask(scores: torch.Tensor, sparsity: float | None, pattern: Pattern | None) -> torch.Tensor:
    """The N:M mask when a pattern is given, else the per-row unstructured mask."""
    if pattern is not None:
        return nm_mask(scores, pattern)
    if sparsity is None:
        raise ValueError("give a sparsity or an N:M pattern")
    return unstructured_mask(scores, sparsity)


def outlier_ratio(scores: list[torch.Tensor], m: float = 5.0) -> float:
    """OWL's layerwise outlier share: entries of all of a layer's scores above ``m`` × their mean."""
    flat = torch.cat([s.reshape(-1).float() for s in scores])
    return float((flat > m * flat.mean()).float().mean())


def owl_sparsities(ratios: list[float], target: float, lam: float = 0.08) -> list[float]:
    """OWL per-layer sparsities: density grows linearly with the outlier ratio over a range of
    width ``2·lam``, shifted so the mean sparsity is exactly ``target``; clipped to [0, 0.99]."""
    r = torch.tensor(ratios, dtype=torch.float64)
    spread = float(r.max() - r.min())
    density = (r - r.min()) / spread * (2 * lam) if spread > 0 else torch.zeros_like(r)
    density = density - density.mean() + (1.0 - target)
    return [min(0.99, max(0.0, 1.0 - float(d))) for d in density]
