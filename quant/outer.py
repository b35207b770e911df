"""Quantize the token embedding and the output head (the matrices outside the decoder layers).

Formats (``OUTER_CHOICES``): ``int8`` — one scale per row, symmetric (W8A16's rule, the
runtime's int8 head kernels, GGUF Q8_0 exactly); ``int6`` / ``int5`` / ``int4`` — symmetric
groups of 32 along the row (int5: GGUF Q5_0 exactly, int4: W4A16 g32 and Q4_0 exactly, int6:
Q8_0 blocks holding 6-bit codes); ``int5a`` / ``int4a`` — the same groups with a zero point
(GGUF Q5_1 / Q4_1 exactly: half a bit more than the symmetric form, much less error); ``nl4`` — groups of 32 on llama.cpp's non-uniform IQ4_NL grid
(int8 codes in a checkpoint, GGUF IQ4_NL exactly: 4.5 bits, far more accurate than int4). Scales are chosen by a per-(row, group) clipping search
(least squared error, weighted by the per-column input energy when a Hessian diagonal of the
head's input is given).

A tied head (``tie_word_embeddings``) is one matrix: when head and embedding get the same
format it is quantized once and stays tied (saved under ``model.embed_tokens``); when they
differ the checkpoint is untied and holds both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from llmopt.formats.registry import GGUF_TYPE_CANDIDATES, OUTER_CANDIDATES
from llmopt.formats.schemes import QuantizedWeight, QuantScheme, search_qparams
from llmopt.quant.gptq import gptq_quantize_weight
from llmopt.quant.head_fisher import HeadFisher

OUTER_CHOICES = ("float", "int8", "int6", "int5a", "int5", "int4a", "nl4", "int4")  # (the registry's, in the CLI's order)
HEAD_GPTQ_ROWS = 8192  # rows of the head solved at once (two float32 copies of them at a time)
HEAD_GPTQ_NOTICE = ("the output head was quantized by GPTQ on its calibration inputs, its most probable rows "
                    "on their own KL-weighted Hessians")
EMBED = "model.embed_tokens"
HEAD = "lm_head"


def outer_scheme(kind: str, scale_dtype: str = "bfloat16") -> QuantScheme | None:
    """The scheme of an embedding/head format name (None: float): the registry's candidate of that
    name (:data:`~llmopt.formats.registry.OUTER_CANDIDATES`) or a llama.cpp type's (``q6_k`` …, from
    a mixture), scales stored in ``scale_dtype``."""
    if kind == "float":
        return None
    by_gguf_type = {c.name: c for c in GGUF_TYPE_CANDIDATES.values()}  # q6_k, q8_0 …: as llama.cpp's mixtures give them
    found = OUTER_CANDIDATES.get(kind) or by_gguf_type.get(kind)
    if found is None:
        raise ValueError(f"unknown embedding/head format {kind!r}: choose one of {', '.join(OUTER_CHOICES)}")
    return found.format.scheme(found.group_size).with_scale_dtype(scale_dtype)


def quantize_matrix(w: torch.Tensor, scheme: QuantScheme, col_weight: torch.Tensor | None = None) -> QuantizedWeight:
    """RTN with a clipping search of a ``[rows, cols]`` matrix, in row chunks (bounded memory)."""
    group = scheme.group_size
    if group is not None and w.shape[1] % group:
        raise ValueError(f"group size {group} does not divide the {w.shape[1]} columns of the embedding/head")
    parts = []
    for chunk in torch.split(w, 4096):
        scale, zp = search_qparams(chunk.float(), scheme, group, col_weight)
        parts.append(QuantizedWeight.from_weight(chunk.float(), scheme, group, scale, zp))
    return _joined(parts, scheme, group)


def _joined(parts: list[QuantizedWeight], scheme: QuantScheme, group: int | None) -> QuantizedWeight:
    """One QuantizedWeight from row chunks (zero points kept for the asymmetric formats)."""
    zp = None if parts[0].zero_point is None else torch.cat([p.zero_point for p in parts])
    return QuantizedWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), zp, scheme, group)


def gptq_matrix(w: torch.Tensor, scheme: QuantScheme, hessian: torch.Tensor, refit: bool = True,
                fisher: HeadFisher | None = None) -> QuantizedWeight:
    """GPTQ of a head ``[vocab, hidden]`` against its input Hessian ``2/n Σ x xᵀ``, in row chunks
    (``refit``: least-squares group scales, as :func:`~llmopt.quant.gptq.gptq_quantize_weight`);
    with ``fisher`` its most probable rows are solved again on their own KL-weighted Hessians."""
    group = scheme.group_size
    if group is not None and w.shape[1] % group:
        raise ValueError(f"group size {group} does not divide the {w.shape[1]} columns of the embedding/head")
    parts = [gptq_quantize_weight(chunk.float(), hessian, scheme, group, clip=True, refit=refit)
             for chunk in torch.split(w, HEAD_GPTQ_ROWS)]
    joined = _joined(parts, scheme, group)
    # the per-row pass re-solves free group scales: super-block scales (k · d, Q6_K …) and float zero points keep the joint solve
    return joined if fisher is None or scheme.scale_steps is not None or scheme.float_zero else fisher.requantize(w, joined)


def quantize_head(w: torch.Tensor, scheme: QuantScheme, hessian: torch.Tensor | None,
                  col_weight: torch.Tensor | None = None, refit: bool = True,
                  fisher: HeadFisher | None = None) -> QuantizedWeight:
    """The head's codes: GPTQ when its input Hessian is known (``refit``: least-squares scales;
    ``fisher``: the most probable rows on their own Hessians), else RTN with the clipping search."""
    if hessian is None:
        return quantize_matrix(w, scheme, col_weight)
    return gptq_matrix(w, scheme, hessian, refit, fisher)


FINAL_NORMS = ("norm", "final_layernorm", "final_layer_norm", "ln_f")


def head_input_hessian(model: nn.Module, state: dict[str, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor | None:
    """``2/n Σ x xᵀ`` (float64) of the head's inputs (:func:`head_inputs`); None when the model has
    no final norm we know (the head is then quantized without calibration)."""
    inputs = head_inputs(model, state, hidden)
    return None if inputs is None else input_hessian(inputs)


def input_hessian(x: torch.Tensor) -> torch.Tensor:
    """``2/n Σ x xᵀ`` (float64) of inputs ``x`` ``[n, hidden]``, in chunks."""
    h = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64)
    for chunk in torch.split(x, 4096):
        h += chunk.T.double() @ chunk.double()
    return h * (2.0 / max(x.shape[0], 1))


def head_inputs(model: nn.Module, state: dict[str, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor | None:
    """The head's inputs (float32 ``[positions, hidden]``): the final norm applied, with its
    tensors from ``state``, to the last decoder layer's outputs ``hidden``; None when the model has
    no final norm we know."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    norm = next((m for n in FINAL_NORMS if isinstance(m := getattr(decoder, n, None), nn.Module)), None)
    if norm is None:
        return None
    where = {id(m): n for n, m in model.named_modules()}[id(norm)]
    try:
        params = {n: state[f"{where}.{n}"].float() for n, _ in norm.named_parameters()}
    except KeyError:
        return None
    x = hidden.reshape(-1, hidden.shape[-1]).float()
    with torch.no_grad():
        return torch.cat([torch.func.functional_call(norm, params, (chunk,)).float() for chunk in torch.split(x, 4096)])


@dataclass
class OuterResult:
    """Quantized outer matrices by module name, float tensors to write instead, and whether the
    checkpoint must be untied."""

    weights: dict[str, QuantizedWeight] = field(default_factory=dict)
    floats: dict[str, torch.Tensor] = field(default_factory=dict)
    untie: bool = False
    notices: list[str] = field(default_factory=list)


def quantize_outer(tensors: dict[str, torch.Tensor], tied: bool, head: str = "float", embedding: str = "float",
                   head_hessian_diag: torch.Tensor | None = None, head_inputs: torch.Tensor | None = None,
                   refit: bool = True, scale_dtype: str = "bfloat16") -> OuterResult:
    """Quantize ``model.embed_tokens.weight`` / ``lm_head.weight`` of ``tensors`` (a tied model has
    only the former) as asked; the head by GPTQ when its calibration ``head_inputs`` are given
    (its most probable rows on their own KL-weighted Hessians, :mod:`.head_fisher`).
    Keys of ``tensors`` not returned in ``weights``/``floats`` stay as they are."""
    result = OuterResult()
    head_s, embed_s = outer_scheme(head, scale_dtype), outer_scheme(embedding, scale_dtype)
    embed_w = tensors[f"{EMBED}.weight"]
    head_w = embed_w if tied else tensors.get(f"{HEAD}.weight")
    if head_w is None:
        raise ValueError("the checkpoint has no lm_head.weight and its embeddings are not tied")
    head_hessian = fisher = None
    if head_inputs is not None and head_s is not None:
        head_hessian = input_hessian(head_inputs)
        fisher = HeadFisher.measure(head_inputs, head_w)
    if tied and head_s == embed_s:
        if head_s is not None:
            result.weights[EMBED] = quantize_head(embed_w, head_s, head_hessian, head_hessian_diag, refit, fisher)
        return result
    if tied:
        result.untie = True
        result.notices.append(f"the tied embedding/head is untied (embedding {embedding}, head {head}): the checkpoint holds both")
        if head_s is None:
            result.floats[f"{HEAD}.weight"] = head_w.clone()
    if embed_s is not None:
        result.weights[EMBED] = quantize_matrix(embed_w, embed_s)
    if head_s is not None:
        result.weights[HEAD] = quantize_head(head_w, head_s, head_hessian, head_hessian_diag, refit, fisher)
    return result
