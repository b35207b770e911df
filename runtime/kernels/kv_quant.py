"""KV cache storage: the model's dtype, a 16-bit float (``float16`` / ``bfloat16``: rounded as
written, widened as read), int8 / float8 e4m3 codes with one float32 scale per token and KV
head, or int4 codes with a float16 scale and minimum per group of 32 values of a token and KV
head.

int8 / fp8: a token's head vector ``x`` (``head_dim`` values) is stored as ``codes = x / s``
with ``s = max|x| / QMAX`` (127 for int8, rounded to nearest; 448 for e4m3, the largest finite
value). Float8 codes are kept as their raw bytes (``uint8``), because torch's CPU indexing ops
do not take float8 tensors; ``dequantize`` reinterprets them.

int4 (asymmetric, per group of ``int4_group(head_dim, group)`` values: 32 for ``int4``, 16 for
``int4_g16`` (6 bits a value instead of 5), or the whole head when the group does not divide it): ``codes = round((x - low) / s)`` in 0..15 with ``s = (high - low) / 15``
and ``s`` and ``low`` rounded to float16 first (the codes are fitted to the stored pair), where
``low`` / ``high`` are the group's minimum and maximum moved inwards by ``INT4_TRIMS`` of its
range, whichever candidate reconstructs the group with the least squared error (trimming the
extremes a little refines the step of every other value), two codes per byte (element ``2i`` in the low nibble of byte ``i``), so the cache's last dimension
is ``head_dim / 2``; scales are ``[..., groups, 2]`` float16 pairs ``(s, min)``: 5 bits a value
for groups of 32, as llama.cpp's q4_1. The runtime stores int4 K/V in
a Hadamard-rotated basis with a calibrated key offset removed (``runtime.kv_cache``): rotation
spreads a head's outlier channels over all of them, which is what makes 4 bits hold.
"""

from __future__ import annotations

import torch
from llmopt.core.errors import LlmoptError

KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "int8", "int4", "int4_g16")
FLOAT_STORAGE = {"float16": torch.float16, "bfloat16": torch.bfloat16}
QMAX = {"int8": 127.0, "fp8": 448.0}
STORAGE = {"int8": torch.int8, "fp8": torch.uint8, "int4": torch.uint8, "int4_g16": torch.uint8}
SCALE_DTYPE = torch.float32  # int8 / fp8; int4 keeps float16 pairs (scale_dtype)
INT4_LEVELS = 15
INT4_GROUP = 32
INT4_GROUPS = {"int4": INT4_GROUP, "int4_g16": 16}  # the int4 KV dtypes: values per (scale, minimum) pair
# Range trimmed off each end of an int4 group, as a fraction of (max - min), per candidate pair: the
# pair whose codes reconstruct the group with the least squared error is kept (0: min and max).
INT4_TRIMS = torch.tensor([0.0125 * i for i in range(11)], dtype=torch.float32)


def check_kv_cache_dtype(kind: str) -> None:
    if kind not in KV_CACHE_DTYPES:
        raise LlmoptError(f"unknown KV cache dtype {kind!r}", f"use one of: {', '.join(KV_CACHE_DTYPES)}")


def is_quantized(kind: str) -> bool:
    return kind in STORAGE


def storage_dtype(kind: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of cache elements: the model's for ``auto``, the 16-bit float's, or the codes'."""
    check_kv_cache_dtype(kind)
    return STORAGE.get(kind) or FLOAT_STORAGE.get(kind, model_dtype)


def is_int4(kind: str) -> bool:
    """Whether ``kind`` is one of the int4 KV dtypes (``int4``: pairs per 32 values, ``int4_g16``: per 16)."""
    return kind in INT4_GROUPS


def values_per_element(kind: str) -> int:
    """Head values per stored element: 2 for packed int4, 1 otherwise."""
    return 2 if is_int4(kind) else 1


def int4_group(head_dim: int, group: int = INT4_GROUP) -> int:
    """Values per int4 (scale, minimum) pair: ``group``, or the whole head when it does not divide it."""
    return group if head_dim % group == 0 else head_dim


def scale_shape(kind: str, head_dim: int) -> tuple[int, ...]:
    """The trailing shape of one token-head's scales: ``(groups, 2)`` (scale, minimum) pairs for
    int4, ``()`` otherwise."""
    return (head_dim // int4_group(head_dim, INT4_GROUPS[kind]), 2) if is_int4(kind) else ()


def scale_dtype(kind: str) -> torch.dtype:
    """float16 for int4's (scale, minimum) pairs, float32 for int8 / fp8 scales."""
    return torch.float16 if is_int4(kind) else SCALE_DTYPE


def kind_of(cache: torch.Tensor, scales: torch.Tensor | None = None) -> str:
    """``int8`` / ``fp8`` / ``int4`` for a quantized cache tensor (int4 by its ``[..., groups, 2]``
    scales), ``auto`` for a float one."""
    if scales is not None and scales.dim() == cache.dim() + 1:
        return "int4"
    return {torch.int8: "int8", torch.uint8: "fp8"}.get(cache.dtype, "auto")


def quantize(x: torch.Tensor, kind: str, groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (``x``'s shape, or its last dimension halved for int4) and scales (``x.shape[:-1]``
    in float32, or ``x.shape[:-1] + (groups, 2)`` float16 pairs for int4) of ``x``. An int4
    ``kind`` takes its group size from ``INT4_GROUPS``, or ``groups`` pairs per head when given
    (as an existing cache's scales were laid out)."""
    x = x.float()
    if is_int4(kind):
        dim = x.shape[-1]
        return _quantize_int4(x, dim // groups if groups else int4_group(dim, INT4_GROUPS[kind]))
    scale = (x.abs().amax(dim=-1) / QMAX[kind]).clamp_min(torch.finfo(torch.float32).tiny)
    y = x / scale.unsqueeze(-1)
    if kind == "int8":
        return y.round_().clamp_(-127, 127).to(torch.int8), scale
    return y.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8), scale


def _quantize_int4(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape[-1] % 2:
        raise LlmoptError(f"an int4 KV cache packs two values per byte; head_dim {x.shape[-1]} is odd",
                          "use kv_cache_dtype int8 for this model")
    dim = x.shape[-1]
    grouped = x.view(*x.shape[:-1], dim // group, group)
    largest = torch.finfo(torch.float16).max
    lo, hi = grouped.amin(dim=-1, keepdim=True), grouped.amax(dim=-1, keepdim=True)
    trim = (hi - lo) * INT4_TRIMS.to(x.device)  # [..., groups, candidates]
    low = (lo + trim).clamp(-largest, largest).to(torch.float16)
    scale = ((hi - trim - low.float()) / INT4_LEVELS).clamp(max=largest).to(torch.float16)
    step = scale.float().clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    values = grouped.unsqueeze(-2)  # [..., groups, 1, group]
    codes = ((values - low.float().unsqueeze(-1)) / step).round_().clamp_(0, INT4_LEVELS)
    error = (codes.double() * scale.double().unsqueeze(-1) + low.double().unsqueeze(-1) - values.double()).square_().sum(-1)
    best = error.argmin(dim=-1, keepdim=True)  # the first of equal errors: the least trimmed
    codes = codes.gather(-2, best.unsqueeze(-1).expand(*best.shape, group)).squeeze(-2).to(torch.uint8).view(x.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, torch.stack([scale.gather(-1, best).squeeze(-1), low.gather(-1, best).squeeze(-1)], dim=-1)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values in ``dtype`` of ``codes`` and their scales (see :func:`quantize`)."""
    if scale.dim() == codes.dim() + 1:  # int4: (scale, minimum) pairs per group
        values = torch.stack([codes & 0x0F, codes >> 4], dim=-1).flatten(-2).float()
        grouped = values.view(*values.shape[:-1], scale.shape[-2], -1)
        pairs = scale.float()
        return (grouped * pairs[..., :1] + pairs[..., 1:]).flatten(-2).to(dtype)
    values = codes.view(torch.float8_e4m3fn).float() if codes.dtype == torch.uint8 else codes.float()
    return (values * scale.unsqueeze(-1)).to(dtype)
