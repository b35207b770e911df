"""SmoothQuant (Xiao et al., 2023) pre-pass for W8A8: migrate activation outliers into the
weights with ``s_j = max|x_j|^α / max|W_j|^(1−α)`` per input channel, folded into the producer
(norm or Linear) so the model stays an ordinary float model."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from llmopt.formats.schemes import QuantScheme
from llmopt.linear_stats import LinearStats
from llmopt.quant.mappings import ScaleMapping
from llmopt.quant.method import GroupSizes, ScaleTransform, Schemes


@dataclass
class SmoothResult:
    name: str
    max_scale: float
    min_scale: float


def smoothquant_scale(mapping: ScaleMapping, stats: LinearStats, alpha: float = 0.5) -> torch.Tensor | None:
    """Producer-channel smoothing scale of ``mapping`` from the observed max |x| (over every
    consumer's inputs: experts see their routed tokens); None when no consumer saw an input."""
    pooled = stats.pooled_abs_max(list(mapping.linears))
    if pooled is None:
        return None
    x_max = mapping.reduce(pooled.float(), "max")
    w_max = torch.stack(
        [lin.weight.detach().abs().amax(0).float() for lin in mapping.linears.values()]
    ).amax(0)
    w_max = mapping.reduce(w_max, "max")
    s = x_max.clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1.0 - alpha)
    # Channels never active in calibration (or with all-zero weights) are left alone.
    return torch.where((x_max > 0) & (w_max > 0), s.clamp(min=1e-5), torch.ones_like(s))


def smoothquant_apply_layer(
    mappings: list[ScaleMapping], stats: LinearStats, alpha: float = 0.5
) -> list[SmoothResult]:
    """Smooth every mapping of a layer in turn, keeping ``stats`` consistent."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"SmoothQuant alpha must be in [0, 1], got {alpha}")
    results = []
    for mapping in mappings:
        s = smoothquant_scale(mapping, stats, alpha)
        if s is None:
            continue  # an expert no token was routed to
        mapping.fold(s)
        stats.scale_inputs(mapping.consumers, mapping.expand(s))
        results.append(SmoothResult(mapping.name, float(s.max()), float(s.min())))
    return results


@dataclass(frozen=True)
class SmoothQuant(ScaleTransform):
    """SmoothQuant's migration of activation outliers into the weights, for int8 activations;
    ``alpha``: migration strength in [0, 1]."""

    name: ClassVar[str] = "smoothquant"
    weight_only: ClassVar[bool] = False
    takes_plan: ClassVar[bool] = False

    alpha: float = 0.5

    def check(self, scheme: QuantScheme) -> None:
        if scheme.activations != "int8":
            raise ValueError(
                f"SmoothQuant prepares int8 activation quantization and needs scheme W8A8 or W4A8, not {scheme.name}; "
                "for weight-only schemes use awq or gptq"
                + (", for FP8_DYNAMIC use rtn or gptq" if scheme.activations == "fp8" else "")
            )
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"SmoothQuant alpha must be in [0, 1], got {self.alpha}")

    def apply(self, mappings: list[ScaleMapping], stats: LinearStats, scheme: QuantScheme, schemes: Schemes,
              group_sizes: GroupSizes, calibrated: Mapping[str, nn.Linear]) -> list[SmoothResult]:
        return smoothquant_apply_layer(mappings, stats, self.alpha)
