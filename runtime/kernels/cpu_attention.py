"""C++ paged decode attention (``csrc/attention.cpp``): reads K/V through the block tables in place.

Built at first use by :func:`llmopt.runtime.kernels.build.load_extension`; when it cannot be
built (no compiler, ``LLMOPT_KERNELS=reference``) :func:`available` is False and callers use
the plain-torch reference.
"""

from __future__ import annotations

import torch
from llmopt.core.errors import LlmoptError

from .build import Extension

EXTENSION = Extension("llmopt_attention", ["attention.cpp"])
extension = EXTENSION.module
available = EXTENSION.available


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    portable: bool = False,
    splits: int = 0,
    sinks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    key_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence against its cached context, through its block table.

    ``q`` ``[B, heads, head_dim]``; caches ``[kv_heads, num_blocks * block_size, head_dim]``
    (float, or int8 / float8-byte codes with ``[kv_heads, slots]`` float32 scales);
    ``block_tables`` ``[B, width]`` and ``context_lens`` ``[B]`` int32 or int64. Returns (or
    fills ``out``) ``[B, heads * head_dim]`` in ``q``'s dtype. ``portable`` forces the scalar
    path; ``splits`` > 0 fixes how many pieces each context is split into (0: automatic).
    ``sinks`` (int4 caches): float32 sink K and V ``[kv_heads, entries, tokens, head_dim]`` and
    each sequence's entry ``[B]`` (-1: none), read in place of its first positions' codes;
    ``key_offsets`` (int4 caches) float16 ``[kv_heads, blocks, head_dim]``, row j added back to
    the keys of each context's block j.
    """
    ext = extension()
    if ext is None:
        raise LlmoptError("the C++ attention kernel is not available", "use kernels.reference.paged_decode_attention")
    if out is None:
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype)
    return ext.paged_decode(q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, block_size, scale,
                            out, portable, splits, *(sinks or (None, None, None)), key_offsets)


def has_avx2() -> bool:
    ext = extension()
    return ext is not None and ext.has_avx2()
