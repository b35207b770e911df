"""Round-to-nearest (RTN) weight quantization, optionally with a clipping search."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
from torch import nn

from llmopt.quant.clipping import search_qparams_hessian
from llmopt.formats.schemes import QuantizedWeight, QuantScheme, compute_qparams, search_qparams

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
    the search minimises the output error, otherwise the weight error.
    """
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
    """RTN-quantize ``modules`` (name → Linear); writes the dequantized weights in place."""
    out: dict[str, QuantizedWeight] = {}
    with torch.no_grad():
        for name, module in modules.items():
            h = hessians.get(name) if hessians else None
            qw = rtn_quantize_weight(module.weight.data, scheme, group_sizes[name], clip, h)
            module.weight.data.copy_(qw.dequantize(module.weight.dtype))
            out[name] = qw
    return out
