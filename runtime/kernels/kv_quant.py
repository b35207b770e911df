"""KV cache storage: the model's dtype, a 16-bit float (``float16`` / ``bfloat16``: rounded as
written, widened as read), or int8 / float8 e4m3 codes with one float32 scale per token and KV head.

A token's head vector ``x`` (``head_dim`` values) is stored as ``codes = x / s`` with
``s = max|x| / QMAX`` (127 for int8, rounded to nearest; 448 for e4m3, the largest finite
value). Float8 codes are kept as their raw bytes (``uint8``), because torch's CPU indexing ops
do not take float8 tensors; ``dequantize`` reinterprets them.
"""

from __future__ import annotations

import torch
from llmopt.core.errors import LlmoptError

KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "int8")
FLOAT_STORAGE = {"float16": torch.float16, "bfloat16": torch.bfloat16}
QMAX = {"int8": 127.0, "fp8": 448.0}
STORAGE = {"int8": torch.int8, "fp8": torch.uint8}
SCALE_DTYPE = torch.float32


def check_kv_cache_dtype(kind: str) -> None:
    if kind not in KV_CACHE_DTYPES:
        raise LlmoptError(f"unknown KV cache dtype {kind!r}", f"use one of: {', '.join(KV_CACHE_DTYPES)}")


def is_quantized(kind: str) -> bool:
    return kind in STORAGE


def storage_dtype(kind: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of cache elements: the model's for ``auto``, the 16-bit float's, or the codes'."""
    check_kv_cache_dtype(kind)
    return STORAGE.get(kind) or FLOAT_STORAGE.get(kind, model_dtype)


def kind_of(cache: torch.Tensor) -> str:
    """``int8`` / ``fp8`` for a quantized cache tensor, ``auto`` for a float one."""
    return {torch.int8: "int8", torch.uint8: "fp8"}.get(cache.dtype, "auto")


def quantize(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (``x``'s shape, storage dtype) and scales (``x.shape[:-1]``, float32) of ``x``."""
    x = x.float()
    scale = (x.abs().amax(dim=-1) / QMAX[kind]).clamp_min(torch.finfo(torch.float32).tiny)
    y = x / scale.unsqueeze(-1)
    if kind == "int8":
        return y.round_().clamp_(-127, 127).to(torch.int8), scale
    return y.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes * scale`` in ``dtype``; ``scale`` has ``codes.shape[:-1]``."""
    values = codes.view(torch.float8_e4m3fn).float() if codes.dtype == torch.uint8 else codes.float()
    return (values * scale.unsqueeze(-1)).to(dtype)
