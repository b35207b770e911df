"""AWQ (Lin et al., 2023): activation-aware per-channel scaling before weight quantization.

For each scale mapping (see :mod:`.mappings`) a scale ``s = mean|x|^α`` (normalised) is chosen
from an α grid in [0, 1] to minimise the output error of the consumers when their weights are
quantized as ``Q(W·s)/s``. The output error ``‖X Wᵀ − X Ŵᵀ‖²`` is evaluated exactly through the
input Hessian, ``tr(E H Eᵀ)``, so every calibration token counts at the cost of an ``[in, in]``
product. The chosen ``s`` is folded into the model (which stays an ordinary float model), the
calibration statistics are rescaled accordingly, and optionally the weight ranges are clipped
(AWQ's auto-clip). Quantization itself is left to RTN or GPTQ.

For llama.cpp (``llama_activations``: a mixture by name, ``--for llama.cpp``) the loss also counts
the rounding llama.cpp applies to every quantized matmul's input — int8 blocks of the weight
type's block size (Q8_0 / Q8_1 per 32, Q8_K per 256), step ``max|x/s| / 127`` — which the scaling
``s`` itself changes: a channel of large activations widens its whole block's step. It is
simulated on a sample of the calibration inputs (every ``SAMPLE_EVERY``-th token). (Ordering the
MLP's channels for those blocks, :mod:`.channel_order`, as GPTQ alone gets for llama.cpp, did not
lower llama.cpp's KLD after AWQ's scaling on the demo model, before or after the search.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from llmopt.linear_stats import LinearStats

from llmopt.quant.rounding_cost import SAMPLE_EVERY, activation_block, activation_rounding_error, weight_rounding_error
from llmopt.quant.clipping import clamp_to_ratio, search_clip_ratio
from llmopt.formats.schemes import QuantScheme
from llmopt.quant.mappings import ScaleMapping
from llmopt.quant.method import GroupSizes, ScaleTransform, Schemes


@dataclass
class AwqMappingResult:
    """Outcome of the scale search for one mapping (losses: summed consumer output error)."""

    name: str
    alpha: float
    loss_unscaled: float  # α = 0, i.e. no scaling
    loss: float  # at the chosen α (never above loss_unscaled)


def awq_search_scale(
    mapping: ScaleMapping,
    stats: LinearStats,
    scheme: QuantScheme,
    group_sizes: Mapping[str, int | None],
    targets: set[str],
    n_grid: int = 20,
    schemes: Mapping[str, QuantScheme] | None = None,
    llama_activations: bool = False,
) -> tuple[torch.Tensor, AwqMappingResult]:
    """Best producer-channel scale for ``mapping`` over ``α = i/(n_grid-1)``, i = 0…n_grid-1.

    Only consumers in ``targets`` (the Linears that will be quantized) enter the loss, each with
    its own scheme from ``schemes`` (a mixed-precision plan) or else ``scheme``;
    ``llama_activations`` adds llama.cpp's rounding of their inputs (:func:`activation_rounding_error`,
    on the inputs ``stats`` sampled).
    """
    schemes = schemes or {}
    names = [n for n in mapping.linears if n in targets and stats.has(n)]
    x_mean = mapping.reduce(stats.pooled_abs_mean(names), "mean").clamp(min=1e-5)
    # Consumers sharing one input, scheme and group size are evaluated as one row-stacked matrix.
    by_input: dict[tuple, list[str]] = {}
    for n in names:
        by_input.setdefault((id(stats.stats(n)), schemes.get(n, scheme), group_sizes[n]), []).append(n)
    parts = []
    for (_, part_scheme, gs), group in by_input.items():
        w = torch.cat([mapping.linears[n].weight.detach().float() for n in group], dim=0)
        block = activation_block(part_scheme, w.shape[1], gs) if llama_activations else None
        sample = stats.samples(group[0]) if block is not None else None
        parts.append((w, stats.hessian(group[0]).float(), part_scheme, gs, block, sample))

    def loss(s: torch.Tensor | None) -> float:
        se = None if s is None else mapping.expand(s)
        total = 0.0
        for w, h, part_scheme, gs, block, sample in parts:
            total += weight_rounding_error(w, h, part_scheme, gs, se, grid_tries=0)  # a quick range: the search ranks scalings
            if sample is not None:
                total += activation_rounding_error(w, sample, block, se)
        return total

    base = loss(None)
    best_loss, best_alpha = base, 0.0
    best_s = torch.ones_like(x_mean)
    for i in range(1, n_grid):
        alpha = i / (n_grid - 1)
        s = x_mean.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        val = loss(s)
        if val < best_loss:
            best_loss, best_alpha, best_s = val, alpha, s
    return best_s, AwqMappingResult(mapping.name, best_alpha, base, best_loss)


def awq_apply_layer(
    mappings: list[ScaleMapping],
    stats: LinearStats,
    scheme: QuantScheme,
    group_sizes: Mapping[str, int | None],
    targets: set[str],
    n_grid: int = 20,
    schemes: Mapping[str, QuantScheme] | None = None,
    llama_activations: bool = False,
) -> list[AwqMappingResult]:
    """Search and fold the scales of each mapping in turn, keeping ``stats`` consistent."""
    results = []
    for mapping in mappings:
        if not any(n in targets and stats.has(n) for n in mapping.linears):
            continue  # nothing calibrated behind it (an expert no token was routed to)
        s, res = awq_search_scale(mapping, stats, scheme, group_sizes, targets, n_grid, schemes, llama_activations)
        if res.alpha > 0:
            mapping.fold(s)
            stats.scale_inputs(mapping.consumers, mapping.expand(s))
        results.append(res)
    return results


@torch.no_grad()
def awq_clip_layer(
    modules: Mapping[str, torch.nn.Linear],
    stats: LinearStats,
    scheme: QuantScheme,
    group_sizes: Mapping[str, int | None],
    skip: tuple[str, ...] = ("q_proj", "k_proj"),
    n_grid: int = 20,
    max_shrink: float = 0.5,
    schemes: Mapping[str, QuantScheme] | None = None,
) -> None:
    """AWQ auto-clip: clamp each weight (row, group) to the range minimising its output error
    under its scheme (``schemes``, else ``scheme``).

    q/k projections are skipped as in AWQ (their error is reshaped by the softmax).
    """
    schemes = schemes or {}
    for name, module in modules.items():
        if name.rsplit(".", 1)[-1] in skip:
            continue
        w = module.weight.data
        gs = group_sizes[name]
        own = schemes.get(name, scheme)
        ratio = search_clip_ratio(w, own, gs, stats.hessian(name), n_grid, max_shrink)
        w.copy_(clamp_to_ratio(w, own, gs, ratio))


@dataclass(frozen=True)
class Awq(ScaleTransform):
    """AWQ's activation-aware scale search for weight-only schemes; ``grid``: α points in [0, 1];
    ``clip``: AWQ's auto-clip after the scales (off: the output-weighted clip search at
    quantization did better on the demo model); ``llama_activations``: count llama.cpp's int8
    rounding of the inputs too (set for llama.cpp mixtures and ``--for llama.cpp``)."""

    name: ClassVar[str] = "awq"
    needs_hessian: ClassVar[bool] = True

    grid: int = 20
    clip: bool = False
    llama_activations: bool = False

    @property
    def sample_every(self) -> int:
        return SAMPLE_EVERY if self.llama_activations else 0

    def for_llama_cpp(self) -> Awq:
        return replace(self, llama_activations=True)

    def check(self, scheme: QuantScheme) -> None:
        if scheme.is_fp4:
            raise ValueError(f"awq does not search scales for {scheme.name}'s FP4 weights; use rtn or gptq")
        if scheme.activations is not None:
            raise ValueError(
                f"AWQ optimizes weight-only quantization and does not account for {scheme.name}'s activation "
                "quantization; use smoothquant or smoothquant+gptq for W8A8 / W4A8, rtn or gptq for FP8_DYNAMIC"
            )

    def apply(self, mappings: list[ScaleMapping], stats: LinearStats, scheme: QuantScheme, schemes: Schemes,
              group_sizes: GroupSizes, calibrated: Mapping[str, torch.nn.Linear]) -> list[AwqMappingResult]:
        found = awq_apply_layer(mappings, stats, scheme, group_sizes, set(calibrated), self.grid, schemes,
                                self.llama_activations)
        if self.clip:
            awq_clip_layer(calibrated, stats, scheme, group_sizes, schemes=schemes)
        return found
