"""What rounding for llama.cpp costs a Linear's output: the cost model AWQ's scale search for
llama.cpp and the MLP channel order (:mod:`.channel_order`) both price their choices with.

Two parts, on the scale of ``tr(E H Eᵀ)`` with ``H = 2/n Σ x xᵀ``: llama.cpp's int8 rounding of the
matmul's input in blocks of its weight type (:mod:`llmopt.formats.llama_cpp_inputs`), simulated on
sampled calibration rows, and the weight's own round-to-nearest error weighted by the Hessian.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES

from llmopt.formats.llama_cpp_inputs import rounded_to_int8_blocks
from llmopt.formats.schemes import QuantScheme, compute_qparams, fake_quantize

SAMPLE_EVERY = 61  # calibration tokens between the input rows kept for the simulation


def activation_block(scheme: QuantScheme, in_features: int, group_size: int | None) -> int | None:
    """The block size llama.cpp rounds this weight's inputs in (its GGUF block type's), or None
    when the weight would be written as a float tensor (whose inputs stay float)."""
    from llmopt.formats.registry import format_for

    try:
        carrier = format_for(scheme).gguf_carrier(in_features, group_size)
    except ValueError:
        return None
    return None if carrier is None else GGML_QUANT_SIZES[carrier.qtype][0]


def activation_rounding_error(w: torch.Tensor, x: torch.Tensor, block: int, s: torch.Tensor | None = None) -> float:
    """``2 · mean‖(W s)(r(x/s) − x/s)‖²`` over the sampled inputs ``x`` (the scale of
    ``tr(E H Eᵀ)``), ``r`` the rounding to int8 blocks of ``block`` values."""
    if x.shape[1] % block:
        return 0.0
    ws = w.float() if s is None else w.float() * s.float().unsqueeze(0)
    xs = x if s is None else x / s.float().unsqueeze(0)
    noise = rounded_to_int8_blocks(xs, block) - xs
    return 2 * float((noise @ ws.T).pow(2).sum(1).mean())


def weight_rounding_error(w: torch.Tensor, hessian: torch.Tensor, scheme: QuantScheme, group_size: int | None,
                          s: torch.Tensor | None = None, grid_tries: int | None = None) -> float:
    """``tr(E H Eᵀ)`` with ``E = W − Q(W·s)/s``, round-to-nearest in ``scheme`` (``grid_tries``: its range
    search, None its default): with ``H = 2/n Σ x xᵀ`` twice the mean squared output error of
    quantizing ``W`` with input scaling ``s``, computed in ``hessian``'s dtype."""
    wf = w.float()
    ws = wf if s is None else wf * s.float().unsqueeze(0)
    scale, zero = compute_qparams(ws, scheme, group_size, grid_tries=grid_tries)
    wq = fake_quantize(ws, scale, zero, scheme, group_size)
    if s is not None:
        wq = wq / s.float().unsqueeze(0)
    e = (wf - wq).to(hessian.dtype)
    return float(((e @ hessian) * e).sum())
