"""Fused elementwise steps of the float32 forward in C++ (``csrc/fused.cpp``): the residual add
with RMSNorm, SwiGLU's ``silu(gate) * up``, and RoPE (with Qwen3's per-head q/k norm) applied in
place to the merged q/k/v output while k / v go to the KV cache.

``store_kv`` quantizes K / V into an int8 / fp8 / int4 KV cache in one call (in torch, a dozen
small operations per layer). ``hadamard`` runs online input transforms (compressed-tensors' R4) before a Linear.
``argmax`` serves greedy sampling (torch's runs one element at a time). A decode step runs each
of the others 30 times per token; in plain torch every one is several tensor
operations whose dispatch and temporaries cost more than their arithmetic. Built at first use by
:func:`build.load_extension`; when it cannot be built :func:`available` is False and the model
keeps the plain-torch forward.
"""

from __future__ import annotations

import torch

from .build import Extension

EXTENSION = Extension("cpu_fused", ["fused.cpp"])
extension = EXTENSION.module  # the compiled module: the functions below without the Python call in between
available = EXTENSION.available


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """``h += delta`` (when given, in place), then ``out = rms_norm(h) * weight``; float32 ``[tokens, hidden]``."""
    extension().add_rms_norm(h, delta, weight, eps, out)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a merged ``[tokens, 2 * intermediate]`` float32 output."""
    return extension().silu_mul(gate_up)


def rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
         qk_norm: torch.Tensor | None, eps: float, k_cache: torch.Tensor | None = None,
         v_cache: torch.Tensor | None = None, slots: torch.Tensor | None = None) -> None:
    """Rotate q and k in place inside ``qkv`` ``[tokens, (heads + 2 kv_heads) * head_dim]``
    (after ``qk_norm`` per head when given) with ``cos`` / ``sin`` ``[tokens, head_dim]``; then
    store k and v at ``slots`` of float32 caches ``[kv_heads, slots, head_dim]`` when given."""
    extension().rope(qkv, cos, sin, heads, kv_heads, qk_norm, eps, k_cache, v_cache, slots)


def store_kv(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             k_scale: torch.Tensor, v_scale: torch.Tensor, k_offsets: torch.Tensor | None = None,
             key_blocks: torch.Tensor | None = None) -> None:
    """Quantize float32 ``k`` / ``v`` ``[tokens, kv_heads, head_dim]`` (keys less their block's
    offset when given: ``k_offsets`` ``[kv_heads, blocks, head_dim]``, token t's row
    ``key_blocks[t]``) into an int8 / fp8 / int4 cache at int64 ``slots``: the codes and scales
    ``kernels.reference.write_kv`` writes, bit for bit."""
    extension().store_kv(k, v, slots, k_cache, v_cache, k_scale, v_scale, k_offsets, key_blocks)


def hadamard(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x V`` for block-diagonal Sylvester Hadamard blocks of order ``block`` scaled by
    ``1 / √block`` (a fast Walsh–Hadamard transform per block) on float32 ``[..., width]``."""
    return extension().hadamard(x, block)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of float32 ``[rows, vocab]`` logits, int64 ``[rows]``: torch's choice
    (the first of equal maxima; the first NaN when a row has one)."""
    return extension().argmax(logits)
