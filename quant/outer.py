"""Quantize the token embedding and the output head (the matrices outside the decoder layers).

Formats (``OUTER_CHOICES``): ``int8`` — one scale per row, symmetric (W8A16's rule, the
runtime's int8 head kernels, GGUF Q8_0 exactly); ``int6`` / ``int5`` / ``int4`` — symmetric
groups of 32 along the row (int5: GGUF Q5_0 exactly, int4: W4A16 g32 and Q4_0 exactly, int6:
Q8_0 blocks holding 6-bit codes). Scales are chosen by a per-(row, group) clipping search
(least squared error, weighted by the per-column input energy when a Hessian diagonal of the
head's input is given).

A tied head (``tie_word_embeddings``) is one matrix: when head and embedding get the same
format it is quantized once and stays tied (saved under ``model.embed_tokens``); when they
differ the checkpoint is untied and holds both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmopt.formats.schemes import QuantizedWeight, QuantScheme, get_scheme, int_weight_scheme, search_qparams

OUTER_CHOICES = ("float", "int8", "int6", "int5", "int4")
OUTER_GROUP = 32  # the group size of the grouped embedding/head formats
EMBED = "model.embed_tokens"
HEAD = "lm_head"


def outer_scheme(kind: str) -> QuantScheme | None:
    """The scheme of an embedding/head format name (None: float)."""
    if kind == "float":
        return None
    if kind == "int8":
        return get_scheme("W8A16")
    if kind in ("int6", "int5", "int4"):
        return int_weight_scheme(int(kind[3:]), OUTER_GROUP)
    raise ValueError(f"unknown embedding/head format {kind!r}: choose one of {', '.join(OUTER_CHOICES)}")


def quantize_matrix(w: torch.Tensor, scheme: QuantScheme, col_weight: torch.Tensor | None = None) -> QuantizedWeight:
    """RTN with a clipping search of a ``[rows, cols]`` matrix, in row chunks (bounded memory)."""
    group = scheme.group_size
    if group is not None and w.shape[1] % group:
        raise ValueError(f"group size {group} does not divide the {w.shape[1]} columns of the embedding/head")
    parts = []
    for chunk in torch.split(w, 4096):
        scale, zp = search_qparams(chunk.float(), scheme, group, col_weight)
        parts.append(QuantizedWeight.from_weight(chunk.float(), scheme, group, scale, zp))
    codes = torch.cat([p.codes for p in parts])
    scale = torch.cat([p.scale for p in parts])
    return QuantizedWeight(codes, scale, None, scheme, group)


@dataclass
class OuterResult:
    """Quantized outer matrices by module name, float tensors to write instead, and whether the
    checkpoint must be untied."""

    weights: dict[str, QuantizedWeight] = field(default_factory=dict)
    floats: dict[str, torch.Tensor] = field(default_factory=dict)
    untie: bool = False
    notices: list[str] = field(default_factory=list)


def quantize_outer(tensors: dict[str, torch.Tensor], tied: bool, head: str = "float", embedding: str = "float",
                   head_hessian_diag: torch.Tensor | None = None) -> OuterResult:
    """Quantize ``model.embed_tokens.weight`` / ``lm_head.weight`` of ``tensors`` (a tied model has
    only the former) as asked. Keys of ``tensors`` not returned in ``weights``/``floats`` stay as they are."""
    result = OuterResult()
    head_s, embed_s = outer_scheme(head), outer_scheme(embedding)
    embed_w = tensors[f"{EMBED}.weight"]
    head_w = embed_w if tied else tensors.get(f"{HEAD}.weight")
    if head_w is None:
        raise ValueError("the checkpoint has no lm_head.weight and its embeddings are not tied")
    if tied and head_s == embed_s:
        if head_s is not None:
            result.weights[EMBED] = quantize_matrix(embed_w, head_s, head_hessian_diag)
        return result
    if tied:
        result.untie = True
        result.notices.append(f"the tied embedding/head is untied (embedding {embedding}, head {head}): the checkpoint holds both")
        if head_s is None:
            result.floats[f"{HEAD}.weight"] = head_w.clone()
    if embed_s is not None:
        result.weights[EMBED] = quantize_matrix(embed_w, embed_s)
    if head_s is not None:
        result.weights[HEAD] = quantize_matrix(head_w, head_s, head_hessian_diag)
    return result
