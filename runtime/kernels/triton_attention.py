"""Triton paged decode attention for CUDA: one query token per sequence against its cache.

K/V are read in place through each sequence's block table (no gather into a workspace), in
the cache layout of :mod:`.reference` (``[kv_heads, num_blocks * block_size, head_dim]`` per
layer). One program handles one (sequence, KV head, context partition): the query heads
sharing that KV head (grouped-query attention) form the rows of its ``tl.dot``, and an online
softmax runs over chunks of ``BLOCK_T`` tokens, which may span several small blocks. Long
contexts with few programs are split into partitions whose partial results (running max,
normaliser, unnormalised output) a second kernel combines (flash-decoding). A quantized cache
(int8 codes, or float8 e4m3 codes as bytes, with float32 scales ``[kv_heads, slots]``; or int4
codes two per byte with (scale, minimum) pairs ``[kv_heads, slots, 2]``; see ``kv_quant``) is
dequantized as it is read, to ``q``'s dtype as the reference does.
Arguments follow :func:`.cpu_attention.paged_decode_attention` (the C++ kernel's); the engine
reaches it through ``runtime.backends.triton``.
"""

from __future__ import annotations

import torch

from . import kv_quant
from .triton_common import (
    dot_dtype_is_f32,
    multiprocessors,
    next_power_of_2,
    tl,
    triton,
)

if triton is not None:
    from .triton_common import fp8e4m3_bits_to_f32

BLOCK_T = 64  # context tokens per softmax step
MIN_PART_TOKENS = 256  # shortest context partition worth a program of its own

KV_KINDS = {"auto": 0, "int8": 1, "fp8": 2, "int4": 3}  # float cache / int8 codes / float8 codes as bytes / int4 pairs

if triton is not None:

    @triton.jit
    def _load_kv(base, scales, slot, offs_d, t_mask, d_mask, stride_t, KV_KIND: tl.constexpr, INT4_GROUP: tl.constexpr,
                 HEAD_DIM: tl.constexpr):
        """``[tokens, head_dim]`` of one head at ``slot``: the cache's floats, or float32 values
        of quantized codes times their per-token scales (int4: codes times the scale plus the
        minimum of their group of ``INT4_GROUP`` values, float16 pairs). Masked-out entries read zero."""
        if KV_KIND == 3:  # element d is nibble d % 2 of byte d // 2
            mask = t_mask[:, None] & d_mask[None, :]
            byte = tl.load(base + slot[:, None] * stride_t + (offs_d // 2)[None, :], mask=mask, other=0)
            codes = ((byte.to(tl.int32) >> ((offs_d % 2) * 4)[None, :]) & 15).to(tl.float32)
            pair = scales + 2 * (slot[:, None] * (HEAD_DIM // INT4_GROUP) + (offs_d // INT4_GROUP)[None, :])
            step = tl.load(pair, mask=mask, other=0.0).to(tl.float32)
            low = tl.load(pair + 1, mask=mask, other=0.0).to(tl.float32)
            return tl.where(mask, codes * step + low, 0.0)
        x = tl.load(base + slot[:, None] * stride_t + offs_d[None, :], mask=t_mask[:, None] & d_mask[None, :], other=0)
        if KV_KIND != 0:
            if KV_KIND == 1:
                x = x.to(tl.float32)
            else:
                x = fp8e4m3_bits_to_f32(x)
            x = x * tl.load(scales + slot, mask=t_mask, other=0.0)[:, None]
        return x

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, lens_ptr, out_ptr, part_m_ptr, part_l_ptr, part_o_ptr,
        sink_k_ptr, sink_v_ptr, sink_index_ptr, sink_entries, offsets_ptr, offset_rows,
        qk_scale, tokens_per_part, block_size, num_parts,
        stride_qb, stride_qh, stride_kh, stride_kt, stride_vh, stride_vt, stride_sh, stride_tb, stride_ob,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, KV_KIND: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, INT4_GROUP: tl.constexpr,
        SINK_TOKENS: tl.constexpr, HAS_OFFSETS: tl.constexpr,
    ):
        """``qk_scale`` is the softmax scale times log2(e): scores are kept in base 2. Scales of a
        quantized cache are ``[kv_heads, slots]`` with row stride ``stride_sh``. ``SINK_TOKENS`` > 0:
        positions below it read float32 sinks ``[kv_heads, sink_entries, SINK_TOKENS, HEAD_DIM]``
        from entry ``sink_index[b]`` (-1: their codes). ``HAS_OFFSETS``: row ``position // block_size``
        of the float16 key offsets ``[kv_heads, offset_rows, HEAD_DIM]`` is added to each key."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        p = tl.program_id(2)
        ctx = tl.load(lens_ptr + b)
        start = p * tokens_per_part
        end = tl.minimum(start + tokens_per_part, ctx)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_t = tl.arange(0, BLOCK_T)
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        heads = kvh * GROUP + offs_g
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
        k_head = k_ptr + kvh.to(tl.int64) * stride_kh
        v_head = v_ptr + kvh.to(tl.int64) * stride_vh
        k_scales = k_scale_ptr + kvh.to(tl.int64) * stride_sh
        v_scales = v_scale_ptr + kvh.to(tl.int64) * stride_sh
        dtype = q_ptr.dtype.element_ty  # a quantized cache is dequantized to q's dtype, as the reference does
        table = tables_ptr + b.to(tl.int64) * stride_tb
        if SINK_TOKENS > 0:
            entry = tl.load(sink_index_ptr + b).to(tl.int64)
        for t0 in range(start, end, BLOCK_T):
            ts = t0 + offs_t
            t_mask = ts < end
            block = tl.load(table + ts // block_size, mask=t_mask, other=0)
            slot = block.to(tl.int64) * block_size + ts % block_size
            # Slots past the context were never written (NaN included): masked loads read zeros.
            k = _load_kv(k_head, k_scales, slot, offs_d, t_mask, d_mask, stride_kt, KV_KIND, INT4_GROUP, HEAD_DIM).to(dtype)
            v = _load_kv(v_head, v_scales, slot, offs_d, t_mask, d_mask, stride_vt, KV_KIND, INT4_GROUP, HEAD_DIM).to(dtype)
            if SINK_TOKENS > 0:
                sunk = t_mask & (ts < SINK_TOKENS) & (ts * 0 + entry >= 0)  # a block, not a scalar, for the mask
                sink_row = (kvh.to(tl.int64) * sink_entries + tl.maximum(entry, 0)) * SINK_TOKENS + tl.minimum(ts, SINK_TOKENS - 1)
                at = sink_row[:, None] * HEAD_DIM + offs_d[None, :]
                both = sunk[:, None] & d_mask[None, :]
                k = tl.where(sunk[:, None], tl.load(sink_k_ptr + at, mask=both, other=0.0).to(dtype), k)
                v = tl.where(sunk[:, None], tl.load(sink_v_ptr + at, mask=both, other=0.0).to(dtype), v)
            if HAS_OFFSETS:
                offset_row = kvh.to(tl.int64) * offset_rows + ts // block_size
                at = offset_row[:, None] * HEAD_DIM + offs_d[None, :]
                k = k + tl.load(offsets_ptr + at, mask=t_mask[:, None] & d_mask[None, :], other=0.0).to(dtype)
            if DOT_F32:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(t_mask[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            prob = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(prob, 1)
            if DOT_F32:
                pv = tl.dot(prob, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(prob.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out_mask = g_mask[:, None] & d_mask[None, :]
        if SPLIT:
            row = (b.to(tl.int64) * (tl.num_programs(1) * GROUP) + heads) * num_parts + p
            tl.store(part_m_ptr + row, m_i, mask=g_mask)
            tl.store(part_l_ptr + row, l_i, mask=g_mask)
            tl.store(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
        else:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            dst = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * HEAD_DIM + offs_d[None, :]
            tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _combine_parts_kernel(
        part_m_ptr, part_l_ptr, part_o_ptr, out_ptr, num_parts, stride_ob,
        HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """Merge the context partitions of one (sequence, query head)."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_p = tl.arange(0, BLOCK_P)
        offs_d = tl.arange(0, BLOCK_D)
        p_mask = offs_p < num_parts
        d_mask = offs_d < HEAD_DIM
        row = (b.to(tl.int64) * tl.num_programs(1) + h) * num_parts + offs_p
        m = tl.load(part_m_ptr + row, mask=p_mask, other=float("-inf"))
        l_part = tl.load(part_l_ptr + row, mask=p_mask, other=0.0)
        o = tl.load(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=p_mask[:, None] & d_mask[None, :], other=0.0)
        m_max = tl.max(m, 0)
        weight = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)
        total = tl.sum(weight * l_part, 0)
        out = tl.sum(weight[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def choose_parts(batch: int, kv_heads: int, max_context: int, device: torch.device) -> int:
    """Context partitions per sequence: enough programs for two per multiprocessor, none
    shorter than ``MIN_PART_TOKENS``."""
    programs = batch * kv_heads
    return max(1, min(-(-2 * multiprocessors(device) // programs), -(-max_context // MIN_PART_TOKENS)))


def triton_paged_decode_attention(
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
    max_context: int | None = None,
    num_parts: int | None = None,
    sinks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    key_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention on the Triton kernel (arguments as the C++ kernel's).

    ``q`` ``[B, heads, head_dim]``; caches ``[kv_heads, slots, head_dim]``, float or int8 /
    float8-byte codes with float32 ``k_scale``/``v_scale`` ``[kv_heads, slots]`` (int4:
    ``[kv_heads, slots, head_dim / 2]`` bytes with float16 ``[kv_heads, slots, groups, 2]`` pairs);
    ``block_tables`` ``[B, n]`` and ``context_lens`` ``[B]`` on ``q``'s device. ``max_context``
    bounds the lengths without reading them back (default ``n * block_size``); ``num_parts``
    fixes the context partitions (default: enough to fill the GPU); ``sinks`` (int4 caches) as the
    C++ kernel's: float32 sink K / V ``[kv_heads, entries, tokens, head_dim]`` and each sequence's
    entry ``[B]`` (-1: none), and ``key_offsets`` float16 ``[kv_heads, blocks, head_dim]``. Returns
    (or writes ``out``) ``[B, heads * head_dim]`` in ``q``'s dtype; a sequence of length 0 gives zeros.
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[0]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not share {kv_heads} KV heads evenly")
    quantized = k_cache.dtype in (torch.int8, torch.uint8)
    kind = kv_quant.kind_of(k_cache, k_scale)
    if quantized and (k_scale is None or v_scale is None):
        raise ValueError("a quantized KV cache needs k_scale and v_scale")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches' head dimension must be contiguous")
    if quantized and (not k_scale.is_contiguous() or v_scale.stride() != k_scale.stride()):
        raise ValueError("the KV scales must be contiguous [kv_heads, slots] ([kv_heads, slots, groups, 2] for int4)")
    int4_group = dim // k_scale.shape[2] if kind == "int4" else dim  # as the cache's scales lay the pairs out
    if kind == "int4" and (k_scale.shape[3:] != (2,) or dim % k_scale.shape[2] or int4_group % 2 or v_scale.shape != k_scale.shape):
        raise ValueError(f"int4 KV scales must be [kv_heads, slots, groups, 2] with groups of an even size dividing head_dim {dim}")
    group = heads // kv_heads
    if out is None:
        out = torch.empty(batch, heads * dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    block_tables = block_tables.to(torch.int32)
    context_lens = context_lens.to(torch.int32)
    if max_context is None:
        max_context = block_tables.shape[1] * block_size
    max_context = max(1, max_context)
    if num_parts is None:
        num_parts = choose_parts(batch, kv_heads, max_context, q.device)
    per_part = -(-max_context // num_parts)
    tokens_per_part = -(-per_part // BLOCK_T) * BLOCK_T  # whole chunks
    num_parts = -(-max_context // tokens_per_part)
    split = num_parts > 1
    block_d = max(16, next_power_of_2(dim))
    if split:
        part_m = torch.empty(batch * heads * num_parts, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_o = torch.empty(batch * heads * num_parts, dim, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_o = out
    scales = (k_scale, v_scale) if quantized else (k_cache, v_cache)  # unread for a float cache
    if sinks is not None:
        sink_k, sink_v, sink_index = sinks
        if kind != "int4" or sink_k.dtype != torch.float32 or not sink_k.is_contiguous() or sink_v.stride() != sink_k.stride() \
                or sink_k.shape[0] != kv_heads or sink_k.shape[3] != dim or sink_index.shape != (batch,):
            raise ValueError("sinks must be contiguous float32 [kv_heads, entries, tokens, head_dim] of an int4 cache, "
                             "with one entry per sequence")
        sink_args, sink_tokens = (sink_k, sink_v, sink_index.to(torch.int64), sink_k.shape[1]), sink_k.shape[2]
    else:
        sink_args, sink_tokens = (q, q, context_lens, 0), 0  # unread
    if key_offsets is not None:
        if kind != "int4" or key_offsets.dtype != torch.float16 or not key_offsets.is_contiguous() \
                or key_offsets.dim() != 3 or key_offsets.shape[0] != kv_heads or key_offsets.shape[2] != dim:
            raise ValueError("key offsets must be contiguous float16 [kv_heads, blocks, head_dim] of an int4 cache")
        if max_context > key_offsets.shape[1] * block_size:
            raise ValueError(f"contexts of {max_context} tokens are longer than the key offsets cover "
                             f"({key_offsets.shape[1]} blocks of {block_size})")
        offset_args = (key_offsets, key_offsets.shape[1])
    else:
        offset_args = (q, 0)  # unread
    _paged_decode_kernel[(batch, kv_heads, num_parts)](
        q, k_cache, v_cache, scales[0], scales[1], block_tables, context_lens, out, part_m, part_l, part_o, *sink_args,
        *offset_args,
        scale * 1.4426950408889634, tokens_per_part, block_size, num_parts,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        scales[0].stride(0), block_tables.stride(0), out.stride(0),
        GROUP=group, HEAD_DIM=dim, KV_KIND=KV_KINDS[kind], SPLIT=split,
        DOT_F32=dot_dtype_is_f32(q.dtype), BLOCK_G=max(16, next_power_of_2(group)), BLOCK_D=block_d, BLOCK_T=BLOCK_T,
        INT4_GROUP=int4_group, SINK_TOKENS=sink_tokens, HAS_OFFSETS=key_offsets is not None, num_warps=4, num_stages=2,
    )
    if split:
        _combine_parts_kernel[(batch, heads)](
            part_m, part_l, part_o, out, num_parts, out.stride(0),
            HEAD_DIM=dim, BLOCK_P=next_power_of_2(num_parts), BLOCK_D=block_d,
        )
    return out
