"""Unstructured and N:M pruning of every decoder-layer Linear (magnitude, Wanda, SparseGPT).

Wanda and SparseGPT run the sequential engine of :mod:`llmopt.calibration`: each decoder
layer is observed on the outputs of the already-pruned layers before it, then pruned. With the
OWL profile a first engine pass over the dense model measures each layer's outlier ratio
(from Wanda scores) to set per-layer sparsities. Linears sharing an input (q/k/v, gate/up)
share one set of statistics; SparseGPT stacks them row-wise (exact, since every row is pruned
and reconstructed independently).

Mixture-of-experts layers: fused experts are unfused first (``checkpoints.moe``) so every expert
projection is a Linear pruned on the tokens routed to it; routers stay dense. An expert
projection that saw fewer than ``MIN_EXPERT_TOKENS`` calibration tokens (routing starved it) is
pruned by magnitude, from its weights alone, and reported: never left dense, never a crash.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from llmopt.calibration import (
    IN_MEMORY,
    EngineTimings,
    LayerLifecycle,
    decoder_layers,
    for_each_layer,
    linear_modules,
    run_sequential,
)
from llmopt.linear_stats import LinearStats
from torch import nn

from llmopt.checkpoints.moe import is_expert, is_router, unfuse_experts
from llmopt.core.errors import NumericalError
from llmopt.pruning.magnitude import magnitude_mask
from llmopt.pruning.masks import Pattern, nm_valid, outlier_ratio, owl_sparsities
from llmopt.pruning.sparsegpt import sparsegpt_prune_weight
from llmopt.pruning.wanda import wanda_mask, wanda_scores

MASK_METHODS = ("magnitude", "wanda", "sparsegpt")
PROFILES = ("uniform", "owl")
MIN_EXPERT_TOKENS = 16  # an expert projection seeing fewer calibration tokens is pruned by magnitude


@dataclass
class SparsifyOptions:
    """How to prune: ``sparsity`` (per row) or ``pattern`` (N:M), and the per-layer profile."""

    method: str
    sparsity: float | None = None
    pattern: Pattern | None = None
    profile: str = "uniform"
    owl_lambda: float = 0.08
    owl_m: float = 5.0
    damp: float = 0.01
    block_size: int = 128
    batch_size: int = 8


@dataclass
class SparsifyResult:
    """Per-layer target sparsities, OWL outlier ratios (if used) and time taken."""

    layer_targets: list[float]
    outlier_ratios: list[float] | None = None
    seconds: float = 0.0
    notices: list[str] = field(default_factory=list)
    layer_zeros: list[dict[str, tuple[int, int, bool]]] = field(default_factory=list)  # name: (zeros, size, N:M valid)
    starved_experts: dict[str, int] = field(default_factory=dict)  # "layer i: name" -> calibration tokens seen
    timings: EngineTimings = field(default_factory=EngineTimings)  # the pruning pass
    owl_timings: EngineTimings | None = None  # OWL's observation pass


def layer_prefixes(model: nn.Module) -> list[str]:
    """``model.layers.{i}.`` for every decoder layer (the names its Linears have in the model)."""
    layers = decoder_layers(model)
    where = {id(m): n for n, m in model.named_modules()}
    return [f"{where[id(layers)]}.{i}." for i in range(len(layers))]


def sparsify_model(
    model: nn.Module,
    options: SparsifyOptions,
    calib_ids: torch.Tensor | None = None,
    *,
    progress: Any = None,
    show_progress: bool = True,
    lifecycle: LayerLifecycle = IN_MEMORY,
    observe_lifecycle: LayerLifecycle | None = None,
    device: str | torch.device | None = None,
) -> SparsifyResult:
    """Prune every Linear inside the decoder layers of ``model`` in place (weights set to
    exact zeros; SparseGPT also updates the kept weights). ``lifecycle`` / ``device``: as in
    :func:`~llmopt.calibration.run_sequential` (streaming, onloading); ``observe_lifecycle``
    serves OWL's read-only first pass (default: ``lifecycle``)."""
    if options.method not in MASK_METHODS:
        raise ValueError(f"unknown method {options.method!r}: choose one of {', '.join(MASK_METHODS)}")
    if options.profile not in PROFILES:
        raise ValueError(f"unknown profile {options.profile!r}: choose one of {', '.join(PROFILES)}")
    calibrated = options.method != "magnitude" or options.profile == "owl"
    if calibrated and calib_ids is None:
        raise ValueError(f"{options.method} with the {options.profile} profile needs calibration data")
    start = time.perf_counter()
    unfuse_experts(model)  # fused 3-D experts (transformers v5): one Linear per expert projection
    n_layers = len(decoder_layers(model))
    result = SparsifyResult([options.sparsity if options.pattern is None else options.pattern.sparsity] * n_layers)
    run = {"batch_size": options.batch_size, "progress": progress, "show_progress": show_progress, "device": device}
    if options.profile == "owl":
        if options.pattern is not None:
            raise ValueError("the OWL profile varies sparsity per layer and does not apply to N:M patterns")
        result.owl_timings = EngineTimings()
        result.outlier_ratios = owl_outlier_ratios(model, calib_ids, options.owl_m, **run,
                                                   lifecycle=observe_lifecycle or lifecycle, timings=result.owl_timings)
        result.layer_targets = owl_sparsities(result.outlier_ratios, options.sparsity, options.owl_lambda)

    def prune_layer(index: int, layer: nn.Module, run_layer: Any) -> None:
        unfuse_experts(layer)  # a streamed layer arrives fused
        mods = prunable(layer)
        sparsity = None if options.pattern is not None else result.layer_targets[index]
        if options.method == "magnitude":
            for module in mods.values():
                module.weight.data.mul_(magnitude_mask(module.weight, sparsity, options.pattern))
            result.layer_zeros.append(_zeros(mods, options.pattern))
            return
        wanda = options.method == "wanda"
        with LinearStats(mods, hessian=not wanda, channel=wanda) as stats:
            run_layer()
        all_mods, mods = mods, _starved_by_magnitude(mods, stats, sparsity, options, index, result)
        if wanda:
            for name, module in mods.items():
                module.weight.data.mul_(wanda_mask(module.weight, stats.l2_norm(name), sparsity, options.pattern))
        else:
            try:
                _sparsegpt_layer(mods, stats, sparsity, options)
            except NumericalError as exc:
                raise exc.at(f"decoder layer {index}") from exc
        result.layer_zeros.append(_zeros(all_mods, options.pattern))

    if calibrated and options.method != "magnitude":
        run_sequential(model, calib_ids, prune_layer, description=f"{options.method}", lifecycle=lifecycle,
                       timings=result.timings, **run)
    else:
        for_each_layer(model, lambda index, layer: prune_layer(index, layer, lambda: None),
                       lifecycle=lifecycle, device=device, timings=result.timings)
    result.seconds = time.perf_counter() - start
    if result.starved_experts:
        result.notices.append(f"{len(result.starved_experts)} expert Linears saw fewer than {MIN_EXPERT_TOKENS} calibration "
                              f"tokens: pruned by magnitude (weights alone), e.g. {next(iter(result.starved_experts))}")
    return result


def prunable(layer: nn.Module) -> dict[str, nn.Linear]:
    """The Linears of a decoder layer that pruning touches: all but MoE routers."""
    return {n: m for n, m in linear_modules(layer).items() if not is_router(f".{n}")}


def _tokens_seen(stats: LinearStats, name: str) -> int:
    try:
        return stats.stats(name).n_tokens
    except KeyError:  # routing sent no token to this expert
        return 0


def _starved_by_magnitude(mods: dict[str, nn.Linear], stats: LinearStats, sparsity: float | None, options: SparsifyOptions,
                          index: int, result: SparsifyResult) -> dict[str, nn.Linear]:
    """Prune the expert Linears that saw fewer than ``MIN_EXPERT_TOKENS`` tokens by magnitude,
    record them, and return the others (pruned from their statistics)."""
    seen = {n: _tokens_seen(stats, n) for n in mods}
    starved = {n: m for n, m in mods.items() if is_expert(f".{n}") and seen[n] < MIN_EXPERT_TOKENS}
    for name, module in starved.items():
        module.weight.data.mul_(magnitude_mask(module.weight, sparsity, options.pattern))
        result.starved_experts[f"layer {index}: {name}"] = seen[name]
    return {n: m for n, m in mods.items() if n not in starved}


def _sparsegpt_layer(mods: dict[str, nn.Linear], stats: LinearStats, sparsity: float | None, options: SparsifyOptions) -> None:
    for names in stats.shared_groups():
        if not all(n in mods for n in names):  # a starved expert's group (pruned by magnitude)
            continue
        weights = [mods[n].weight for n in names]
        try:
            w, _ = sparsegpt_prune_weight(
                torch.cat([x.detach() for x in weights]), stats.hessian(names[0]), sparsity, options.pattern,
                block_size=options.block_size, damp=options.damp,
            )
        except NumericalError as exc:
            raise exc.at(f"SparseGPT on {', '.join(names)}") from exc
        for weight, part in zip(weights, w.split([x.shape[0] for x in weights])):
            weight.data.copy_(part)


def owl_outlier_ratios(
    model: nn.Module, calib_ids: torch.Tensor, m: float = 5.0, **run: Any
) -> list[float]:
    """OWL's outlier ratio of each decoder layer (Wanda scores of all its Linears > ``m`` × mean),
    measured on the dense model through the sequential engine. Nothing is modified, so the
    observing run's outputs are the next layer's inputs: one forward per layer, no re-run."""
    ratios: list[float] = []

    def observe(index: int, layer: nn.Module, run_layer: Any) -> None:
        unfuse_experts(layer)
        mods = prunable(layer)
        with LinearStats(mods, hessian=False, channel=True, stop_early=False) as stats:
            run_layer(keep_outputs=True)
        seen = {n: mod for n, mod in mods.items() if _tokens_seen(stats, n) > 0}
        ratios.append(outlier_ratio([wanda_scores(mod.weight, stats.l2_norm(n)) for n, mod in seen.items()], m))

    run_sequential(model, calib_ids, observe, description="OWL outlier ratios", return_hidden=False, **run)
    return ratios


def _zeros(mods: dict[str, nn.Linear], pattern: Pattern | None) -> dict[str, tuple[int, int, bool]]:
    return {n: (int((m.weight == 0).sum()), m.weight.numel(), pattern is None or nm_valid(m.weight, pattern))
            for n, m in mods.items()}


def report_from_zeros(prefixes: list[str], layer_zeros: list[dict[str, tuple[int, int, bool]]],
                      pattern: Pattern | None = None) -> dict:
    """:func:`sparsity_report` from the per-layer counts :func:`sparsify_model` recorded while
    each layer was in memory (the streaming path has no whole model to inspect afterwards)."""
    modules: dict[str, float] = {}
    layers: list[float] = []
    zeros = total = 0
    valid = True
    for prefix, counts in zip(prefixes, layer_zeros):
        lz = lt = 0
        for name, (z, n, ok) in counts.items():
            modules[f"{prefix}{name}"] = round(z / n, 6)
            lz, lt, valid = lz + z, lt + n, valid and ok
        layers.append(round(lz / lt, 6) if lt else 0.0)
        zeros, total = zeros + lz, total + lt
    report = {"overall": round(zeros / total, 6) if total else 0.0, "layers": layers, "modules": modules}
    if pattern is not None:
        report["pattern_valid"] = valid
    return report


@torch.no_grad()
def sparsity_report(model: nn.Module, pattern: Pattern | None = None) -> dict:
    """Measured sparsity of every decoder-layer Linear, per layer and overall, and whether
    every Linear satisfies ``pattern`` (when given)."""
    counts = [_zeros(prunable(layer), pattern) for layer in decoder_layers(model)]
    return report_from_zeros(layer_prefixes(model), counts, pattern)
