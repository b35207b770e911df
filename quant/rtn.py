"""Round-to-nearest (RTN) weight quantization, optionally with a clipping search."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn

from llmopt.formats import fp4
from llmopt.quant.clipping import search_qparams_hessian
from llmopt.formats.schemes import QuantizedWeight, QuantScheme, compute_qparams, search_qparams
from llmopt.linear_stats import LinearStats
from llmopt.quant.method import GroupSizes, Quantizer, Schemes

ClipMode = Literal["minmax", "mse"]


def rtn_quantize_weight(
    w: torch.Tensor,
    scheme: QuantScheme,
    group_size: int | None,
    clip: ClipMode = "minmax",
    hessian: torch.Tensor | None = None,
) -> QuantizedWeight:
    """Quantize one weight matrix ``[out, in]``.

    ``clip="mse"`` searches the range shrink per (row, group); with a calibration ``hessian``
    the search minimises the output error, otherwise the weight error. An NVFP4 scheme without
    a global scale takes ``w``'s own (:func:`~llmopt.formats.fp4.global_scale`).
    """
    if scheme.needs_global_scale and scheme.global_scale is None:
        scheme = scheme.with_global_scale(fp4.global_scale(w))
    if clip == "minmax":
        scale, zp = compute_qparams(w, scheme, group_size)
    elif clip == "mse":
        if hessian is not None:
            scale, zp = search_qparams_hessian(w, scheme, group_size, hessian, max_shrink=0.25)
        else:
            scale, zp = search_qparams(w, scheme, group_size)
    else:
        raise ValueError(f"unknown clip mode {clip!r}: use 'minmax' or 'mse'")
    return QuantizedWeight.from_weight(w, scheme, group_size, scale, zp)


def rtn_quantize_modules(
    modules: Mapping[str, nn.Linear],
    scheme: QuantScheme,
    group_sizes: Mapping[str, int | None],
    clip: ClipMode = "minmax",
    hessians: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, QuantizedWeight]:
    """RTN-quantize ``modules`` (name → Linear); writes the dequantized weights in place. NVFP4
    Linears that engines fuse (q/k/v, gate/up) share one global scale (:func:`fused_global_scales`)."""
    out: dict[str, QuantizedWeight] = {}
    globals_ = fused_global_scales(modules) if scheme.needs_global_scale else {}
    with torch.no_grad():
        for name, module in modules.items():
            h = hessians.get(name) if hessians else None
            own = scheme.with_global_scale(globals_[name]) if name in globals_ else scheme
            qw = rtn_quantize_weight(module.weight.data, own, group_sizes[name], clip, h)
            module.weight.data.copy_(qw.dequantize(module.weight.dtype))
            out[name] = qw
    return out


FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def fused_global_scales(modules: Mapping[str, nn.Linear]) -> dict[str, torch.Tensor]:
    """NVFP4 global scales of ``modules``, tied (the smallest) across the q/k/v and gate/up
    projections of one parent, as llm-compressor ties them for vLLM's fused layers."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name in modules:
        parent, _, leaf = name.rpartition(".")
        groups.setdefault((parent, FUSED.get(leaf, name)), []).append(name)
    out: dict[str, torch.Tensor] = {}
    for names in groups.values():
        tied = fp4.tied_global_scale([modules[n].weight.data for n in names])
        out.update({n: tied for n in names})
    return out


def rtn_mixed(mods: Mapping[str, nn.Linear], schemes: Schemes, group_sizes: GroupSizes, clip: ClipMode,
              hessians: Mapping[str, torch.Tensor] | None = None) -> dict[str, QuantizedWeight]:
    """RTN of ``mods``, each with its own scheme (one call per scheme)."""
    out: dict[str, QuantizedWeight] = {}
    by_scheme: dict[QuantScheme, dict[str, nn.Linear]] = {}
    for name, module in mods.items():
        by_scheme.setdefault(schemes[name], {})[name] = module
    for scheme, part in by_scheme.items():
        out.update(rtn_quantize_modules(part, scheme, group_sizes, clip, hessians))
    return out


@dataclass(frozen=True)
class Rtn(Quantizer):
    """Round to nearest; ``clip_search`` searches each group's range (on the output error when
    calibration statistics are at hand, else on the weight error)."""

    name: ClassVar[str] = "rtn"

    clip_search: bool = False

    @property
    def needs_hessian(self) -> bool:
        return self.clip_search

    def quantize(self, mods: Mapping[str, nn.Linear], schemes: Schemes, group_sizes: GroupSizes,
                 stats: LinearStats | None) -> dict[str, QuantizedWeight]:
        hessians = {n: stats.hessian(n) for n in mods if stats.has(n)} if self.clip_search and stats is not None else None
        return rtn_mixed(mods, schemes, group_sizes, "mse" if self.clip_search else "minmax", hessians)
