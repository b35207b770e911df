"""The calibration engine's side of quantization: one request in, codes and scales out.

:func:`quantize_model` selects the decoder-layer Linears, resolves their group sizes and hands
each layer to the request's method (:mod:`llmopt.quant.method`): uncalibrated quantizers (RTN,
HQQ) layer by layer from the weights alone; calibrated methods through the sequential engine of
:mod:`llmopt.calibration`. A one-pass quantizer (GPTQ) solves each group of Linears sharing an
input in lockstep with the calibration forward, in true sequential order (each Linear on inputs
from the already-quantized Linears before it); after a weight-only transform (AWQ) that pass
follows the statistics pass the transform reads. The model is modified in place (dequantized
weights written back, scales folded into norms and Linears). Invalid requests raise
``ValueError`` with a message that says what is wrong and how to fix it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

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
from llmopt.checkpoints.moe import is_expert, is_router, unfuse_experts
from llmopt.core.hardware import native_bf16
from llmopt.core.lockstep import Lockstep
from llmopt.core.patterns import check_ignore_pattern, ignore_matches
from llmopt.float_reference import FloatReference
from llmopt.formats.schemes import QuantizedWeight, QuantScheme, effective_group_size, fake_quantize_activations
from llmopt.linear_stats import LinearStats
from llmopt.quant.imatrix import ImatrixStats
from llmopt.quant.mappings import layer_mappings
from llmopt.quant.method import QuantMethod, Schemes
from llmopt.quant.request import QuantizeRequest
from llmopt.quant.rtn import rtn_mixed

# An expert whose Linears saw fewer calibration tokens than this (routing sent it few or none)
# is quantized from its weights alone (RTN, MSE range search) instead of by the calibrated
# method, whose statistics would be empty or fit to a handful of tokens; never left in float.
MIN_EXPERT_TOKENS = 16


@dataclass
class QuantizeResult:
    """What :func:`quantize_model` did."""

    scheme: QuantScheme
    method: QuantMethod
    weights: dict[str, QuantizedWeight]  # codes and scales (only schemes and group sizes where streamed out)
    group_sizes: dict[str, int | None]  # per quantized Linear, the group size actually used
    notices: list[str] = field(default_factory=list)
    seconds: float = 0.0
    mappings: list[Any] = field(default_factory=list)  # the transform's record per scale mapping
    timings: EngineTimings = field(default_factory=EngineTimings)
    starved_experts: dict[str, int] = field(default_factory=dict)  # expert Linear -> calibration tokens it saw (< MIN_EXPERT_TOKENS)
    final_hidden: torch.Tensor | None = None  # the last layer's calibration outputs when the head is quantized
    inputs: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)  # Linear → (Σ x² per column, tokens)
    record_inputs: bool = False

    def observe(self, stats: Any, names: Any) -> None:
        """Keep the sums of squared inputs of ``names`` from calibration ``stats`` (when asked)."""
        if not self.record_inputs:
            return
        for name in names:
            if stats.has(name) and name not in self.inputs:
                n = stats.stats(name).n_tokens
                self.inputs[name] = ((stats.hessian(name).diagonal().double() * (n / 2.0)).cpu(), n)

    def store(self, weights: dict[str, QuantizedWeight], lifecycle: LayerLifecycle = IN_MEMORY) -> None:
        """Keep one layer's quantized weights (on the CPU); where ``lifecycle`` takes them
        (streaming) keep only their scheme and group size."""
        weights = {n: _on_cpu(qw) for n, qw in weights.items()}
        if not lifecycle.keep(weights):
            self.weights.update(weights)
            return
        empty = torch.empty(0, dtype=torch.int8)
        self.weights.update({n: QuantizedWeight(empty, empty, None, qw.scheme, qw.group_size) for n, qw in weights.items()})


def _on_cpu(qw: QuantizedWeight) -> QuantizedWeight:
    if qw.codes.device.type == "cpu":
        return qw
    zp = None if qw.zero_point is None else qw.zero_point.cpu()
    return QuantizedWeight(qw.codes.cpu(), qw.scale.cpu(), zp, qw.scheme, qw.group_size)


def select_targets(model: nn.Module, ignore: Iterable[str] = ()) -> dict[str, nn.Linear]:
    """Linears of the decoder layers not matched by any ``ignore`` pattern (a regular expression
    found in the name, or compressed-tensors' ``re:REGEX``: :func:`~llmopt.core.patterns.ignore_matches`).

    Embeddings and ``lm_head`` live outside the decoder layers and are never quantized;
    mixture-of-experts routers stay in float too.
    """
    patterns = list(ignore)
    for pattern in patterns:
        check_ignore_pattern(pattern)
    names = _layer_prefixes(model)
    out: dict[str, nn.Linear] = {}
    for layer, prefix in names:
        for name, module in linear_modules(layer, prefix).items():
            if not any(ignore_matches(name, p) for p in patterns) and not is_router(name):
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
        if scheme.is_fp4:
            raise ValueError(f"{scheme.name} quantizes in groups of {scheme.group_size}, which do not divide the {n_in} "
                             f"input features of {what}; keep them in float with --ignore")
        if strict:
            raise ValueError(
                f"group size {scheme.group_size} does not divide the {n_in} input features of "
                f"{what}; choose a group size that divides {n_in} (e.g. {g}) or allow "
                "per-layer fallback group sizes"
            )
        notices.append(f"{what} use group size {g}: {scheme.group_size} does not divide {n_in} input features")
    return sizes, notices


def quantize_model(model: nn.Module, request: QuantizeRequest, calibration: torch.Tensor | None = None, *,
                   lifecycle: LayerLifecycle = IN_MEMORY, progress: Any = None) -> QuantizeResult:
    """Quantize the decoder-layer Linears of ``model`` in place as ``request`` says.

    ``calibration``: token ids ``[n_samples, seq_len]`` for calibrated methods. Linears matched
    by ``request.ignore``, embeddings, the output head (see :mod:`llmopt.quant.streaming`) and
    mixture-of-experts routers stay in float; the dequantized weights are written back into the
    model, and the returned :class:`QuantizeResult` holds the codes and scales (unless
    ``lifecycle`` takes them: streaming). ``lifecycle``: how each decoder layer is got and
    released (:class:`~llmopt.checkpoints.streaming.StreamedModel` streams them from a
    checkpoint). ``progress``: a ``rich.progress.Progress`` to report layers to; None: a
    transient bar of its own; False: none.

    The calibration forwards run under autocast to ``request.compute_dtype``; the Hessians'
    ``xᵀx`` products are float32 whatever it is (bfloat16 products doubled the GPTQ error of an
    attention output projection on the demo model), accumulated in float64.
    """
    start = time.perf_counter()
    method = request.method
    scheme = method.check(request.scheme, calibration is not None)
    compute_dtype = request.compute_dtype
    if compute_dtype == "auto":
        compute_dtype = auto_compute_dtype(model, request.device)
    unfuse_experts(model)  # fused 3-D experts (transformers v5) become one Linear per projection
    targets = select_targets(model, request.ignore)
    if not targets:
        raise ValueError("no Linear layers left to quantize: the ignore patterns match all of them")
    group_sizes, notices = resolve_group_sizes(targets, scheme, request.strict_groups)
    plan = request.plan
    if plan is not None:
        if not method.takes_plan:
            raise ValueError(f"a per-layer plan cannot be quantized with method {method.name}: "
                             "use rtn, gptq, hqq, awq or awq+gptq")
        targets = {n: m for n, m in targets.items() if n in plan}
        group_sizes = {n: plan[n].group_size for n in targets}
        notices = []
    result = QuantizeResult(scheme, method, {}, group_sizes, notices, record_inputs=request.record_inputs)
    schemes = {n: (plan[n] if plan is not None else scheme) for n in targets}

    if not method.calibrated:
        prefixes = _layer_prefixes(model)

        weighting = ImatrixStats(request.imatrix) if request.imatrix else None

        def quantize_layer(index: int, layer: nn.Module) -> None:
            mods = {n: m for n, m in targets.items() if n.startswith(prefixes[index][1])}
            result.store(method.quantizer.quantize(mods, schemes, group_sizes, weighting), lifecycle)

        for_each_layer(model, quantize_layer, lifecycle=lifecycle, device=request.device, timings=result.timings)
    else:
        engine = dict(batch_size=request.batch_size, compute_dtype=compute_dtype, progress=progress or None,
                      show_progress=progress is not False, lifecycle=lifecycle, device=request.device,
                      timings=result.timings, return_hidden=request.head != "float")
        _quantize_calibrated(model, calibration, targets, group_sizes, schemes, result, engine)
    result.seconds = time.perf_counter() - start
    return result


def auto_compute_dtype(model: nn.Module, device: str | torch.device | None) -> torch.dtype | None:
    """The calibration forwards' autocast dtype: bfloat16 where the calibration device computes
    it natively, else None (the model's own dtype)."""
    target = resolve_device(device) or next(model.parameters()).device
    if target.type == "meta":  # a skeleton streamed from disk: its layers are materialized on the CPU
        target = torch.device("cpu")
    return torch.bfloat16 if native_bf16(target) else None


def _quantize_calibrated(model: nn.Module, calibration: torch.Tensor, targets: dict[str, nn.Linear],
                         group_sizes: dict[str, int | None], schemes: Schemes, result: QuantizeResult,
                         engine: dict[str, Any]) -> None:
    """Run the sequential engine with the method's statistics, transform and quantizer."""
    prefixes = _layer_prefixes(model)
    method, scheme = result.method, result.scheme
    quantizer, transform = method.quantizer, method.transform
    lifecycle = engine["lifecycle"]
    act_hooks: list[Any] = []
    hessian_dtype = torch.float32  # (bfloat16 products lose the small directions of ill-conditioned Hessians)
    weight_only = scheme.activations is None
    input_groups: dict[tuple[str, tuple[str, ...]], list[list[str]]] = {}  # per layer structure
    reference = FloatReference(skip=is_expert) if quantizer.uses_float_reference else None

    def one_pass(layer: nn.Module, prefix: str, mods: dict[str, nn.Linear], run_layer: Any) -> bool:
        return _one_pass(layer, prefix, mods, run_layer, group_sizes, schemes, result, hessian_dtype,
                         input_groups, reference, lifecycle)

    def layer_fn(index: int, layer: nn.Module, run_layer: Any) -> None:
        prefix = prefixes[index][1]
        mods = {n: m for n, m in targets.items() if n.startswith(prefix)}
        if not mods:
            return
        observed = linear_modules(layer, prefix) if transform is not None else mods
        experts = any(is_expert(n) for n in observed)  # routing varies by batch: no early stop
        if method.one_pass and transform is None and weight_only and not experts and one_pass(layer, prefix, mods, run_layer):
            return
        # after a weight-only transform the quantizer takes its own pass, in true sequential order
        # (the statistics pass then feeds the scale search alone, with no float targets)
        sequential = method.one_pass and transform is not None and weight_only and not experts
        with LinearStats(observed, hessian=method.needs_hessian, channel=transform is not None,
                         hessian_dtype=hessian_dtype, stop_early=not experts,
                         reference=None if sequential else reference,
                         sample_every=0 if transform is None else transform.sample_every) as stats:
            run_layer()
        starved = _starved_experts(mods, stats) if experts else {}
        calibrated = {n: m for n, m in mods.items() if n not in starved}
        if transform is not None:
            mappings, skipped = layer_mappings(layer, prefix)
            if index == 0:
                result.notices.extend(skipped)
            found = transform.apply(mappings, stats, scheme, schemes, group_sizes, calibrated)
            if sequential and reference is not None:  # float inputs on the folded scales, as the pass will read them
                reference.refresh_layer(layer)
            for r in found:
                r.name = f"{prefix}{r.name}"
            result.mappings.extend(found)
        if starved:  # after the scales are folded: their weights are final now
            _starved_experts_rtn(starved, mods, schemes, group_sizes, result, lifecycle)
            mods = calibrated
        if sequential:
            del stats  # (its Hessians: the pass below gathers its own)
            if one_pass(layer, prefix, mods, run_layer):
                return  # weight-only: no activation hooks to add
            with LinearStats(mods, hessian=True, channel=False, hessian_dtype=hessian_dtype) as stats:
                run_layer()
        if method.needs_hessian or sequential:
            result.observe(stats, mods)
        result.store(quantizer.quantize(mods, schemes, group_sizes, stats), lifecycle)
        if not weight_only:
            kind = scheme.activations
            for m in mods.values():  # later layers calibrate on activation-quantized inputs
                act_hooks.append(m.register_forward_pre_hook(
                    lambda _m, args, kind=kind: (fake_quantize_activations(args[0], kind),) + args[1:]
                ))

    try:
        result.final_hidden = run_sequential(model, calibration, layer_fn, description=f"{method.name} {scheme.name}",
                                             reference=reference, **engine)
    finally:
        for h in act_hooks:
            h.remove()
        if reference is not None:
            reference.release()


def _one_pass(layer: nn.Module, prefix: str, mods: dict[str, nn.Linear], run_layer: Any,
              group_sizes: dict[str, int | None], schemes: Schemes, result: QuantizeResult,
              hessian_dtype: torch.dtype, input_groups: dict, reference: FloatReference | None,
              lifecycle: LayerLifecycle) -> bool:
    """One decoder layer quantized in a single calibration pass, in true sequential order.

    The batches run in lockstep (:mod:`llmopt.core.lockstep`): at the first Linear of each group
    sharing an input (q/k/v, gate/up, …) every batch waits until all have added that input to
    the group's Hessian; the group is then solved and the forward goes on with its quantized
    weights. So each Linear is calibrated on inputs that come from the already-quantized
    Linears before it, and the pass's outputs are the next layer's inputs: one forward per
    layer instead of an observation pass plus a re-run. The groups come from one batch run
    once per layer structure. Returns False (nothing done) when a target Linear is not reached
    by the forward, for the two-pass path to handle.
    """
    quantizer = result.method.quantizer
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
                    result.observe(stats, members)
                    result.store(quantizer.quantize(members, schemes, group_sizes, stats), lifecycle)

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


def _starved_experts_rtn(starved: dict[str, int], mods: dict[str, nn.Linear], schemes: Schemes,
                         group_sizes: dict[str, int | None], result: QuantizeResult, lifecycle: LayerLifecycle) -> None:
    """Quantize the ``starved`` expert Linears from their weights alone (RTN, MSE range search)
    and record them."""
    result.store(rtn_mixed({n: mods[n] for n in starved}, schemes, group_sizes, "mse"), lifecycle)
    result.starved_experts.update(starved)
    result.notices.append(f"{len(starved)} expert Linears saw fewer than {MIN_EXPERT_TOKENS} calibration tokens: "
                          f"quantized from their weights alone (RTN), e.g. {next(iter(starved))}")
