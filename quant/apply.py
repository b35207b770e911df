"""One entry point to quantize a model's Linear weights with any scheme and method.

Methods: ``rtn``; ``gptq``; ``awq`` (AWQ scaling, then RTN); ``awq+gptq``; ``smoothquant``
(W8A8 only: SmoothQuant, then RTN); ``smoothquant+gptq``. Calibrated methods run the
sequential engine of :mod:`llmopt.calibration`. GPTQ solves each layer in one lockstep pass, in
true sequential order (each Linear on inputs from the already-quantized Linears before it); with
``awq+gptq`` that pass follows the statistics pass that AWQ's scale search reads (weight-only
schemes outside routed experts). The model is modified in place (dequantized
weights written back, scales folded into norms and Linears); the returned
:class:`QuantizeResult` holds the codes and qparams for the savers. Invalid requests raise
``ValueError`` with a message that says what is wrong and how to fix it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
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
    resolve_device,
    run_sequential,
)
from llmopt.linear_stats import LinearStats
from torch import nn

from llmopt.checkpoints.moe import is_expert, is_router, unfuse_experts
from llmopt.core.errors import NumericalError
from llmopt.core.hardware import native_bf16
from llmopt.float_reference import FloatReference
from llmopt.core.lockstep import Lockstep
from llmopt.quant.awq import AwqMappingResult, awq_apply_layer, awq_clip_layer
from llmopt.formats.schemes import (
    GROUPED_SCHEMES,
    PRESETS,
    QuantizedWeight,
    QuantScheme,
    effective_group_size,
    fake_quantize_activations,
    get_scheme,
)
from llmopt.quant.columns import column_loop_threads
from llmopt.quant.gptq import float_target_weight, gptq_quantize_weight, split_rows
from llmopt.quant.mappings import layer_mappings
from llmopt.quant.rtn import rtn_quantize_modules
from llmopt.quant.smoothquant import SmoothResult, smoothquant_apply_layer

METHODS = ("rtn", "gptq", "awq", "awq+gptq", "smoothquant", "smoothquant+gptq")
DEFAULT_IGNORE = ("lm_head",)
SPARSE_ZERO_FRACTION = 0.1  # preserve_zeros=None: keep zeros of layers at least this sparse
# An expert whose Linears saw fewer calibration tokens than this (routing sent it few or none)
# is quantized from its weights alone (RTN, MSE range search) instead of by the calibrated
# method, whose statistics would be empty or fit to a handful of tokens; never left in float.
MIN_EXPERT_TOKENS = 16


@dataclass
class QuantizeResult:
    """What :func:`quantize_model` did."""

    scheme: QuantScheme
    method: str
    weights: dict[str, QuantizedWeight]
    group_sizes: dict[str, int | None]  # per quantized Linear, the group size actually used
    notices: list[str] = field(default_factory=list)
    seconds: float = 0.0
    mappings: list[AwqMappingResult | SmoothResult] = field(default_factory=list)
    timings: EngineTimings = field(default_factory=EngineTimings)
    starved_experts: dict[str, int] = field(default_factory=dict)  # expert Linear -> calibration tokens it saw (< MIN_EXPERT_TOKENS)
    final_hidden: torch.Tensor | None = None  # the last layer's calibration outputs (``keep_final_hidden``)
    sink: Callable[[dict[str, QuantizedWeight]], None] | None = None

    def store(self, weights: dict[str, QuantizedWeight]) -> None:
        """Keep one layer's quantized weights (on the CPU); with a ``sink`` (streaming) hand
        them to it and keep only their scheme and group size."""
        weights = {n: _on_cpu(qw) for n, qw in weights.items()}
        if self.sink is None:
            self.weights.update(weights)
            return
        self.sink(weights)
        empty = torch.empty(0, dtype=torch.int8)
        self.weights.update({n: QuantizedWeight(empty, empty, None, qw.scheme, qw.group_size) for n, qw in weights.items()})


def _on_cpu(qw: QuantizedWeight) -> QuantizedWeight:
    if qw.codes.device.type == "cpu":
        return qw
    zp = None if qw.zero_point is None else qw.zero_point.cpu()
    return QuantizedWeight(qw.codes.cpu(), qw.scale.cpu(), zp, qw.scheme, qw.group_size)


def validate_request(
    scheme_name: str,
    method: str,
    group_size: int | None,
    has_calibration: bool,
    act_order: bool = False,
) -> QuantScheme:
    """The scheme for a request, or ``ValueError`` for impossible combinations."""
    if scheme_name.upper() not in PRESETS:
        raise ValueError(f"unknown scheme {scheme_name!r}: choose one of {', '.join(PRESETS)}")
    key = scheme_name.upper()
    if group_size is not None and group_size < 0:
        raise ValueError(f"group size must be positive (or 0 for per-channel), got {group_size}")
    if group_size and key not in GROUPED_SCHEMES:
        raise ValueError(
            f"scheme {key} is per-channel and takes no group size (got {group_size}); "
            f"group sizes apply to {', '.join(sorted(GROUPED_SCHEMES))}"
        )
    return check_method(get_scheme(key, group_size), method, has_calibration, act_order)


def check_method(scheme: QuantScheme, method: str, has_calibration: bool, act_order: bool = False) -> QuantScheme:
    """``scheme`` if ``method`` can produce it, else ``ValueError`` saying why and what to use."""
    key = scheme.name
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
    if method.startswith("smoothquant") and scheme.activations != "int8":
        raise ValueError(
            f"SmoothQuant prepares int8 activation quantization and needs scheme W8A8, not {key}; "
            "for weight-only schemes use awq or gptq"
            + (", for FP8_DYNAMIC use rtn or gptq" if key == "FP8_DYNAMIC" else "")
        )
    if method.startswith("awq") and scheme.activations is not None:
        raise ValueError(
            f"AWQ optimizes weight-only quantization and does not account for {key}'s activation "
            "quantization; use smoothquant or smoothquant+gptq for W8A8, rtn or gptq for FP8_DYNAMIC"
        )
    if method != "rtn" and not has_calibration:
        raise ValueError(f"method {method} needs calibration data (token ids [n_samples, seq_len])")
    if act_order and "gptq" not in method:
        raise ValueError(f"act-order is a GPTQ option; method {method} does not use GPTQ")
    return scheme


def select_targets(model: nn.Module, ignore: Iterable[str] = ()) -> dict[str, nn.Linear]:
    """Linears of the decoder layers not matched (``re.search``) by any ``ignore`` pattern.

    Embeddings and ``lm_head`` live outside the decoder layers and are never quantized;
    mixture-of-experts routers stay in float too.
    """
    try:
        patterns = [re.compile(p) for p in ignore]
    except re.error as exc:
        raise ValueError(f"invalid ignore pattern: {exc}") from exc
    names = _layer_prefixes(model)
    out: dict[str, nn.Linear] = {}
    for layer, prefix in names:
        for name, module in linear_modules(layer, prefix).items():
            if not any(p.search(name) for p in patterns) and not is_router(name):
                out[name] = module
    return out


def _layer_prefixes(model: nn.Module) -> list[tuple[nn.Module, str]]:
    layers = decoder_layers(model)
    where = {id(m): n for n, m in model.named_modules()}
    base = where[id(layers)]
    return [(layer, f"{base}.{i}.") for i, layer in enumerate(layers)]


def resolve_group_sizes(
    targets: dict[str, nn.Linear], scheme: QuantScheme, strict: bool
) -> tuple[dict[str, int | None], list[str]]:
    """Per-Linear group size (falling back to a divisor of the input features) and notices;
    with ``strict`` a fallback is an error naming the layers."""
    sizes: dict[str, int | None] = {}
    fallbacks: dict[tuple[int | None, int], list[str]] = {}
    for name, module in targets.items():
        g = effective_group_size(module.in_features, scheme.group_size)
        sizes[name] = g
        if g != scheme.group_size:
            fallbacks.setdefault((g, module.in_features), []).append(name)
    notices = []
    for (g, n_in), names in fallbacks.items():
        kinds = ", ".join(dict.fromkeys(n.rsplit(".", 1)[-1] for n in names))
        what = f"{len(names)} layer{'s' if len(names) > 1 else ''} ({kinds})"
        if strict:
            raise ValueError(
                f"group size {scheme.group_size} does not divide the {n_in} input features of "
                f"{what}; choose a group size that divides {n_in} (e.g. {g}) or allow "
                "per-layer fallback group sizes"
            )
        notices.append(f"{what} use group size {g}: {scheme.group_size} does not divide {n_in} input features")
    return sizes, notices


def quantize_model(
    model: nn.Module,
    scheme: QuantScheme | str,
    method: str = "rtn",
    group_size: int | None = None,
    calib_ids: torch.Tensor | None = None,
    ignore: Iterable[str] = DEFAULT_IGNORE,
    strict_groups: bool = False,
    *,
    clip_search: bool | None = None,
    act_order: bool | None = None,
    float_targets: bool = False,
    scale_refit: bool = True,
    damp: float = 0.01,
    block_size: int = 128,
    awq_grid: int = 20,
    awq_clip: bool = False,
    smooth_alpha: float = 0.5,
    preserve_zeros: bool | None = None,
    batch_size: int = 8,
    compute_dtype: torch.dtype | str | None = "auto",
    progress: Any = None,
    show_progress: bool = True,
    lifecycle: LayerLifecycle = IN_MEMORY,
    device: str | torch.device | None = None,
    sink: Callable[[dict[str, QuantizedWeight]], None] | None = None,
    plan: dict[str, QuantScheme] | None = None,
    keep_final_hidden: bool = False,
) -> QuantizeResult:
    """Quantize the decoder-layer Linears of ``model`` in place.

    ``scheme``: a parsed :class:`QuantScheme` (its group size is used as it is) or a preset
    name with ``group_size`` (None for the scheme's default, 0 for per-channel).
    ``ignore``: regexes of Linear names to keep in float (``lm_head`` and embeddings are never
    quantized). ``clip_search``: range search per (row, group) — RTN weighs the weight error,
    calibrated methods the output error (default: on for calibrated methods, off for RTN).
    ``act_order``: GPTQ activation ordering with static groups (None: on for GPTQ methods —
    it cut the demo model's KLD by about 30% at no cost). ``float_targets``: GPTQ fits each
    Linear to the float model's outputs on the float model's inputs (asymmetric calibration,
    :func:`~llmopt.quant.gptq.float_target_weight`; the float hidden states run alongside) rather
    than to its own float output on the quantized model's inputs (GPTQ methods only; routed
    experts keep the plain target). ``scale_refit``: GPTQ re-solves each row's group scales by
    least squares for its chosen codes, quantizes once more on them and keeps each row's best
    (:mod:`~llmopt.quant.scale_refit`). ``damp``/``block_size``: GPTQ
    dampening (fraction of the mean Hessian diagonal) and lazy-update block. ``awq_grid``:
    number of α points in [0, 1]; ``awq_clip``: AWQ's auto-clip (weights clamped to the
    output-optimal range, shrink up to 50%) — off by default, the output-weighted
    ``clip_search`` done at quantization did better on the demo model. ``preserve_zeros``:
    keep exact zeros (pruned weights) zero in GPTQ; None decides per Linear (≥10% exact
    zeros). ``smooth_alpha``: SmoothQuant migration strength. ``batch_size``: calibration
    samples per forward. ``compute_dtype``: dtype of the calibration forward passes (autocast;
    ``auto``: bfloat16 where the device computes it natively — about 2× faster on such CPUs —
    else the model's dtype; None: the model's dtype). The Hessians' ``xᵀx`` products are float32
    whatever it is (bfloat16 products doubled the GPTQ error of an attention output projection
    on the demo model), accumulated in float64; GPTQ and the written weights stay in float32 /
    the model's dtype. ``progress``: an optional ``rich.progress.Progress``
    to report layers to (``show_progress=False``: no bar at all). ``lifecycle``: how each
    decoder layer is got and released (:class:`~llmopt.checkpoints.streaming.StreamedModel`
    streams them from a checkpoint); ``device``: cpu / cuda / auto, where each layer is
    calibrated (moved there and back); ``sink``: receives each layer's quantized weights as
    soon as they exist (the result then keeps only their schemes). ``plan``: a scheme per
    Linear (group size resolved) for mixed precision; Linears it does not name stay in float
    (RTN and GPTQ methods only). ``keep_final_hidden``: calibrated methods keep the last layer's
    outputs (before the final norm) in ``result.final_hidden``, the output head's inputs.
    """
    start = time.perf_counter()
    if isinstance(scheme, QuantScheme):  # parsed once by the caller (group size included)
        scheme = check_method(scheme, method, calib_ids is not None, bool(act_order))
    else:
        scheme = validate_request(scheme, method, group_size, calib_ids is not None, bool(act_order))
    if act_order is None:
        act_order = "gptq" in method
    if float_targets and "gptq" not in method:
        raise ValueError(f"float targets are part of GPTQ; method {method} has no GPTQ step: use gptq")
    if clip_search is None:
        clip_search = method != "rtn"
    if compute_dtype == "auto":
        compute_dtype = auto_compute_dtype(model, device)
    ignore = list(ignore)
    unfuse_experts(model)  # fused 3-D experts (transformers v5) become one Linear per projection
    targets = select_targets(model, ignore)
    if not targets:
        raise ValueError("no Linear layers left to quantize: the ignore patterns match all of them")
    group_sizes, notices = resolve_group_sizes(targets, scheme, strict_groups)
    if plan is not None:
        if "smoothquant" in method:
            raise ValueError(f"a per-layer plan takes methods rtn, gptq, awq or awq+gptq, not {method}")
        targets = {n: m for n, m in targets.items() if n in plan}
        group_sizes = {n: plan[n].group_size for n in targets}
        notices = []
    result = QuantizeResult(scheme, method, {}, group_sizes, notices, sink=sink)
    schemes = {n: (plan[n] if plan is not None else scheme) for n in targets}

    if method == "rtn":
        clip = "mse" if clip_search else "minmax"
        prefixes = _layer_prefixes(model)

        def rtn_layer(index: int, layer: nn.Module) -> None:
            mods = {n: m for n, m in targets.items() if n.startswith(prefixes[index][1])}
            result.store(_rtn_mixed(mods, schemes, group_sizes, clip))

        for_each_layer(model, rtn_layer, lifecycle=lifecycle, device=device, timings=result.timings)
    else:
        opts = _Options(
            scheme, method, clip_search, act_order, damp, block_size, awq_grid, awq_clip,
            smooth_alpha, preserve_zeros, float_targets, schemes, scale_refit,
        )
        _quantize_calibrated(model, calib_ids, targets, group_sizes, opts, result,
                             dict(batch_size=batch_size, compute_dtype=compute_dtype,
                                  progress=progress, show_progress=show_progress,
                                  lifecycle=lifecycle, device=device, timings=result.timings,
                                  return_hidden=keep_final_hidden))
    result.seconds = time.perf_counter() - start
    return result


def auto_compute_dtype(model: nn.Module, device: str | torch.device | None) -> torch.dtype | None:
    """The calibration forwards' autocast dtype: bfloat16 where the calibration device computes
    it natively, else None (the model's own dtype)."""
    target = resolve_device(device) or next(model.parameters()).device
    if target.type == "meta":  # a skeleton streamed from disk: its layers are materialized on the CPU
        target = torch.device("cpu")
    return torch.bfloat16 if native_bf16(target) else None


@dataclass
class _Options:
    scheme: QuantScheme
    method: str
    clip_search: bool
    act_order: bool
    damp: float
    block_size: int
    awq_grid: int
    awq_clip: bool
    smooth_alpha: float
    preserve_zeros: bool | None
    float_targets: bool = False
    schemes: dict[str, QuantScheme] = field(default_factory=dict)  # per Linear
    scale_refit: bool = True


def _quantize_calibrated(
    model: nn.Module,
    calib_ids: torch.Tensor,
    targets: dict[str, nn.Linear],
    group_sizes: dict[str, int | None],
    opts: _Options,
    result: QuantizeResult,
    engine_options: dict[str, Any],
) -> None:
    prefixes = _layer_prefixes(model)
    use_gptq = opts.method.endswith("gptq")
    use_awq = opts.method.startswith("awq")
    use_smooth = opts.method.startswith("smoothquant")
    act_hooks: list[Any] = []
    hessian_dtype = torch.float32  # (bfloat16 products lose the small directions of ill-conditioned Hessians)
    one_pass = opts.method == "gptq" and opts.scheme.activations is None
    input_groups: dict[tuple[str, tuple[str, ...]], list[list[str]]] = {}  # per layer structure
    reference = FloatReference(skip=is_expert) if use_gptq and opts.float_targets else None

    def layer_fn(index: int, layer: nn.Module, run_layer: Any) -> None:
        prefix = prefixes[index][1]
        mods = {n: m for n, m in targets.items() if n.startswith(prefix)}
        if not mods:
            return
        need_hessian = use_gptq or use_awq or opts.clip_search
        need_channel = use_awq or use_smooth
        observed = linear_modules(layer, prefix) if need_channel else mods
        experts = any(is_expert(n) for n in observed)  # routing varies by batch: no early stop
        if one_pass and not experts and _gptq_one_pass(layer, prefix, mods, run_layer, group_sizes, opts, result,
                                                       hessian_dtype, input_groups, reference):
            return
        # after AWQ's scales GPTQ takes its own pass, in true sequential order (the statistics pass
        # then feeds the scale search alone, with no float targets)
        sequential = use_gptq and use_awq and not experts and opts.scheme.activations is None
        with LinearStats(observed, hessian=need_hessian, channel=need_channel, hessian_dtype=hessian_dtype,
                         stop_early=not experts, reference=reference if use_gptq and not sequential else None) as stats:
            run_layer()
        starved = _starved_experts(mods, stats) if experts else {}
        calibrated = {n: m for n, m in mods.items() if n not in starved}
        if use_smooth or use_awq:
            mappings, skipped = layer_mappings(layer, prefix)
            if index == 0:
                result.notices.extend(skipped)
            if use_smooth:
                found = smoothquant_apply_layer(mappings, stats, opts.smooth_alpha)
            else:
                found = awq_apply_layer(mappings, stats, opts.scheme, group_sizes, set(calibrated), opts.awq_grid, opts.schemes)
                if sequential and reference is not None:  # float inputs on the folded scales, as GPTQ's pass will read them
                    reference.refresh_layer(layer)
                if opts.awq_clip:
                    awq_clip_layer(calibrated, stats, opts.scheme, group_sizes, schemes=opts.schemes)
            for r in found:
                r.name = f"{prefix}{r.name}"
            result.mappings.extend(found)
        if starved:  # after the scales are folded: their weights are final now
            _starved_experts_rtn(starved, mods, opts, group_sizes, result)
            mods = calibrated
        if sequential:
            del stats  # (its Hessians: the pass below gathers its own)
            if _gptq_one_pass(layer, prefix, mods, run_layer, group_sizes, opts, result, hessian_dtype, input_groups,
                              reference):
                return  # weight-only: no activation hooks to add
            with LinearStats(mods, hessian=True, channel=False, hessian_dtype=hessian_dtype) as stats:
                run_layer()
        if use_gptq:
            result.store(_gptq_layer(mods, stats, group_sizes, opts))
        else:
            hessians = {n: stats.hessian(n) for n in mods} if opts.clip_search and need_hessian else None
            clip = "mse" if opts.clip_search else "minmax"
            result.store(_rtn_mixed(mods, opts.schemes, group_sizes, clip, hessians))
        if opts.scheme.activations is not None:
            kind = opts.scheme.activations
            for m in mods.values():  # later layers calibrate on activation-quantized inputs
                act_hooks.append(m.register_forward_pre_hook(
                    lambda _m, args, kind=kind: (fake_quantize_activations(args[0], kind),) + args[1:]
                ))

    try:
        result.final_hidden = run_sequential(model, calib_ids, layer_fn, description=f"{opts.method} {opts.scheme.name}",
                                             reference=reference, **engine_options)
    finally:
        for h in act_hooks:
            h.remove()
        if reference is not None:
            reference.release()


def _gptq_one_pass(layer: nn.Module, prefix: str, mods: dict[str, nn.Linear], run_layer: Any,
                   group_sizes: dict[str, int | None], opts: _Options, result: QuantizeResult,
                   hessian_dtype: torch.dtype, input_groups: dict, reference: FloatReference | None = None) -> bool:
    """GPTQ of one decoder layer in a single calibration pass, in true sequential order.

    The batches run in lockstep (:mod:`llmopt.core.lockstep`): at the first Linear of each group
    sharing an input (q/k/v, gate/up, …) every batch waits until all have added that input to
    the group's Hessian; the group is then solved and the forward goes on with its quantized
    weights. So each Linear is calibrated on inputs that come from the already-quantized
    Linears before it, and the pass's outputs are the next layer's inputs: one forward per
    layer instead of an observation pass plus a re-run. The groups come from one batch run
    once per layer structure. Returns False (nothing done) when a target Linear is not reached
    by the forward, for the two-pass path to handle.
    """
    structure = (type(layer).__name__, tuple(n[len(prefix):] for n in mods))
    if structure not in input_groups:
        with LinearStats(mods, hessian=False, channel=False, stop_early=False) as probe:
            run_layer(batches=1)
        input_groups[structure] = [[n[len(prefix):] for n in g] for g in probe.shared_groups()]
    groups = [[prefix + n for n in g] for g in input_groups[structure]]
    if sorted(n for g in groups for n in g) != sorted(mods):
        return False
    lockstep = Lockstep()
    with LinearStats(mods, hessian=True, channel=False, hessian_dtype=hessian_dtype, stop_early=False,
                     reference=reference) as stats:
        stats.declare_groups(groups)
        handles = []
        for group in groups:
            def solve(members: dict[str, nn.Linear] = {n: mods[n] for n in group}) -> None:
                device = next(iter(members.values())).weight.device.type
                with torch.autocast(device, enabled=False):  # (the batches' forwards run under autocast)
                    result.store(_gptq_layer(members, stats, group_sizes, opts))

            handles.append(mods[group[0]].register_forward_pre_hook(
                lambda _m, _args, key=group[0], solve=solve: lockstep.meet(key, solve)))
        try:
            run_layer(keep_outputs=True, lockstep=lockstep)
        finally:
            for h in handles:
                h.remove()
    return True


def _starved_experts(mods: dict[str, nn.Linear], stats: LinearStats) -> dict[str, int]:
    """Expert Linears that saw fewer than ``MIN_EXPERT_TOKENS`` calibration tokens → tokens seen."""
    seen = {name: stats.stats(name).n_tokens if stats.has(name) else 0 for name in mods}
    return {n: seen[n] for n in mods if is_expert(n) and seen[n] < MIN_EXPERT_TOKENS}


def _starved_experts_rtn(starved: dict[str, int], mods: dict[str, nn.Linear], opts: _Options,
                         group_sizes: dict[str, int | None], result: QuantizeResult) -> None:
    """Quantize the ``starved`` expert Linears from their weights alone (RTN, MSE range search)
    and record them."""
    result.store(_rtn_mixed({n: mods[n] for n in starved}, opts.schemes, group_sizes, "mse"))
    result.starved_experts.update(starved)
    result.notices.append(f"{len(starved)} expert Linears saw fewer than {MIN_EXPERT_TOKENS} calibration tokens: "
                          f"quantized from their weights alone (RTN), e.g. {next(iter(starved))}")


@torch.no_grad()
def _gptq_layer(
    mods: dict[str, nn.Linear],
    stats: LinearStats,
    group_sizes: dict[str, int | None],
    opts: _Options,
) -> dict[str, QuantizedWeight]:
    """GPTQ for one layer; Linears sharing an input (q/k/v, gate/up) are stacked row-wise and
    quantized in one pass, which is exact since GPTQ treats rows independently."""
    batches: dict[tuple[int, int | None, QuantScheme], list[str]] = {}
    for name in mods:
        batches.setdefault((id(stats.stats(name)), group_sizes[name], opts.schemes.get(name, opts.scheme)), []).append(name)
    out: dict[str, QuantizedWeight] = {}
    uses = [key[0] for key in batches]
    for (sid, gs, scheme), names in batches.items():
        weights = [mods[n].weight.detach() for n in names]
        stacked = len(weights) > 1  # a fresh tensor, handed over to the solver as its working copy
        w = torch.cat(weights, dim=0) if stacked else weights[0]
        mask = None
        keep = opts.preserve_zeros
        zero_frac = float((w == 0).float().mean())
        if keep is None:
            keep = zero_frac >= SPARSE_ZERO_FRACTION
        if keep and zero_frac > 0:
            mask = w != 0
        uses.remove(sid)
        # a float64 tensor handed over to the solver: on its last use the accumulator itself
        last = sid not in uses
        hessian = [stats.take_hessian(names[0]) if last else stats.hessian(names[0])]
        drift = stats.drift(names[0], take=last)
        if drift is not None:  # fit the float model's outputs (asymmetric calibration)
            w, stacked = float_target_weight(w, hessian[0], drift, opts.damp), True
            del drift
        weight, device = [w], w.device
        del w
        try:
            # the range search and factorization of a small Linear are latency-bound too (12 s -> 0.9 s on a loaded machine)
            with column_loop_threads(device, weight[0].numel()):
                qw = gptq_quantize_weight(
                    weight.pop(), hessian.pop(), scheme, gs, block_size=opts.block_size, damp=opts.damp,
                    act_order=opts.act_order, clip=opts.clip_search, mask=mask, hessian_owned=True, weight_owned=stacked,
                    refit=opts.scale_refit,
                )
        except NumericalError as exc:
            raise exc.at(f"GPTQ on {', '.join(names)}") from exc
        for name, part in zip(names, split_rows(qw, [x.shape[0] for x in weights])):
            module = mods[name]
            module.weight.data.copy_(part.dequantize(module.weight.dtype))
            out[name] = part
    return out


def _rtn_mixed(mods: dict[str, nn.Linear], schemes: dict[str, QuantScheme], group_sizes: dict[str, int | None],
               clip: str, hessians: dict[str, torch.Tensor] | None = None) -> dict[str, QuantizedWeight]:
    """RTN of ``mods``, each with its own scheme (one call per scheme)."""
    out: dict[str, QuantizedWeight] = {}
    by_scheme: dict[QuantScheme, dict[str, nn.Linear]] = {}
    for name, module in mods.items():
        by_scheme.setdefault(schemes[name], {})[name] = module
    for scheme, part in by_scheme.items():
        out.update(rtn_quantize_modules(part, scheme, group_sizes, clip, hessians))
    return out
