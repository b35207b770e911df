"""Plain-torch reference kernels: quantized linears and paged attention.

KV cache layout per layer: ``[kv_heads, num_blocks * block_size, head_dim]``; the slots of
block ``b`` are ``b * block_size ... (b + 1) * block_size - 1``. Viewed as rows of one block
and one head, ``[kv_heads * num_blocks, block_size * head_dim]``, row ``h * num_blocks + b``
holds head ``h`` of block ``b``: a gather of such rows (``gather_rows``) lays each head's keys
out contiguously. Gathers write into reusable workspace buffers: a fresh multi-megabyte tensor
per layer costs page faults that dwarf the copy itself. A quantized cache (int8 / float8 codes,
or packed int4 codes, see ``kv_quant``) has scales ``[kv_heads, num_blocks * block_size]``
(int4: ``[..., groups, 2]`` float16 pairs) beside it: ``write_kv`` quantizes, and the attention functions dequantize
the gathered rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from llmopt.formats.schemes import dequantize, fake_quantize_activations

from . import kv_quant


def dense_linear_t(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight_t (+ bias)`` for a 2-D ``x`` and a weight stored as ``[in, out]``."""
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


def quant_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    group_size: int | None,
    activations: str | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``x @ W.T`` for a quantized ``W``, dequantized for this call; W8A8 / FP8_DYNAMIC also
    quantize ``x`` per token (quantize-dequantize, as their kernels compute)."""
    if activations is not None:
        x = fake_quantize_activations(x, activations)
    weight = dequantize(codes, scale, zero_point, group_size, dtype=x.dtype)
    return F.linear(x, weight, bias)


def int8_activation_block(group_size: int | None, in_features: int, values_per_lane: int) -> int:
    """Inputs per activation block of matmul precision ``low`` (the C++ ``activation_block``): the
    largest power of two up to 32 that divides the weight's group (``in_features`` rounded up to
    whole lanes when per channel) and is a whole number of lanes."""
    group = group_size or -(-in_features // values_per_lane) * values_per_lane
    block = 32
    while block > values_per_lane and (group % block or block % values_per_lane):
        block //= 2
    return block


def round_activations_int8(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` rounded as matmul precision ``low`` feeds the integer GEMV: each row's blocks of
    ``block`` inputs become int8 codes ``round(x * 127 / max|x|)`` (ties to even) times
    ``max|x| / 127``, in float32 (llama.cpp's Q8_0 activations for a 32-input block)."""
    k = x.shape[-1]
    blocks = F.pad(x.float(), (0, -k % block)).unflatten(-1, (-1, block))
    absmax = blocks.abs().amax(-1, keepdim=True)
    # a true division, as the kernel's (torch's ``127.0 / t`` multiplies by the reciprocal: one ulp off)
    inv = torch.where(absmax > 0, torch.full_like(absmax, 127.0) / absmax, torch.zeros_like(absmax))
    codes = torch.round(blocks * inv).clamp_(-127, 127)
    return (codes * (absmax / 127.0)).flatten(-2)[..., :k].to(x.dtype)


class Workspace:
    """A grow-only scratch buffer handing out contiguous views of the requested shape."""

    def __init__(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.buffer = torch.empty(0, dtype=dtype, device=device)

    def take(self, *shape: int) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        if self.buffer.numel() < n:
            self.buffer = torch.empty(n, dtype=self.buffer.dtype, device=self.buffer.device)
        return self.buffer[:n].view(shape)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store ``k``/``v`` (``[tokens, kv_heads, head_dim]``) at ``slots``, quantized (codes and
    per-token, per-head scales) when the cache has scales, rounded to a 16-bit float cache's dtype."""
    if k_scale is None:
        k_cache.index_copy_(1, slots, k.transpose(0, 1).to(k_cache.dtype))
        v_cache.index_copy_(1, slots, v.transpose(0, 1).to(v_cache.dtype))
        return
    kind = kv_quant.kind_of(k_cache, k_scale)
    groups = k_scale.shape[-2] if kind == "int4" else None  # pairs per head, as the cache lays them out
    codes, s = kv_quant.quantize(torch.stack([k, v]), kind, groups)  # K and V in one pass
    for i, (cache, scales) in enumerate(((k_cache, k_scale), (v_cache, v_scale))):
        cache.index_copy_(1, slots, codes[i].transpose(0, 1))
        scales.index_copy_(1, slots, s[i].transpose(0, 1))


def gather_rows(cache: torch.Tensor, rows: torch.Tensor, block_size: int, out: torch.Tensor) -> torch.Tensor:
    """Copy block-head rows (see the module doc) of ``cache`` into ``out`` ``[len(rows), block_size * head_dim]``."""
    heads, slots, dim = cache.shape
    return torch.index_select(cache.view(heads * slots // block_size, block_size * dim), 0, rows, out=out)


def gather_context(
    cache: torch.Tensor, scales: torch.Tensor | None, rows: torch.Tensor, block_size: int, space: Workspace, dtype: torch.dtype,
) -> torch.Tensor:
    """Rows of ``cache`` as ``[len(rows), block_size * head_dim]`` values of ``dtype`` (dequantized
    when ``scales`` is given, widened from a 16-bit float cache; a view of ``space`` otherwise)."""
    heads, slots, dim = cache.shape
    gathered = gather_rows(cache, rows, block_size, space.take(len(rows), block_size * dim))
    if scales is None:
        return gathered if gathered.dtype == dtype else gathered.to(dtype)
    s = torch.index_select(scales.view(heads * slots // block_size, block_size, *scales.shape[2:]), 0, rows)
    return kv_quant.dequantize(gathered.view(len(rows), block_size, dim), s, dtype).view(len(rows), -1)


def apply_sinks(k: torch.Tensor, v: torch.Tensor, sink_k: torch.Tensor, sink_v: torch.Tensor, entries: torch.Tensor) -> None:
    """Replace the first positions of gathered contexts ``k``/``v`` ``[B, kv_heads, ctx, dim]`` (in
    place) by the float32 sinks of entries ``entries`` ``[B]`` of the store ``sink_k``/``sink_v``
    ``[kv_heads, entries, tokens, dim]``; a sequence with entry -1 keeps its own."""
    rows = (entries >= 0).nonzero().flatten()
    if not len(rows):
        return
    chosen = entries.index_select(0, rows)
    tokens = min(sink_k.shape[2], k.shape[2])
    for context, store in ((k, sink_k), (v, sink_v)):
        context[rows, :, :tokens] = store[:, chosen, :tokens].transpose(0, 1).to(context.dtype)


def add_key_offsets(k: torch.Tensor, offsets: torch.Tensor, block_size: int) -> None:
    """Add back to gathered keys ``k`` ``[B, kv_heads, blocks * block_size, dim]`` (in place, whole
    blocks from position 0) each block's offset ``offsets[:, block]`` (``[kv_heads, rows, dim]``,
    an int4 cache's ``k_offsets``), which the cache removed before rounding."""
    batch, heads, length, dim = k.shape
    blocks = length // block_size
    if blocks > offsets.shape[1]:
        raise ValueError(f"keys span {blocks} blocks but the cache has key offsets for {offsets.shape[1]}")
    k.view(batch, heads, blocks, block_size, dim).add_(offsets[:, :blocks, None, :].to(k.dtype))


def restore_keys(k: torch.Tensor, v: torch.Tensor, sinks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                 key_offsets: torch.Tensor | None, block_size: int) -> None:
    """Gathered whole-block contexts ``k``/``v`` ``[B, kv_heads, blocks * block_size, dim]`` as an
    int4 cache means them (in place): sinks read in (:func:`apply_sinks`), then key offsets
    added back (:func:`add_key_offsets`); nothing for a cache with neither."""
    if sinks is not None:
        apply_sinks(k, v, *sinks)
    if key_offsets is not None:
        add_key_offsets(k, key_offsets, block_size)


def block_rows(block_ids: torch.Tensor, kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Rows for ``block_ids`` ``[..., n]`` ordered ``[..., head, block]``."""
    heads = torch.arange(kv_heads, device=block_ids.device) * num_blocks
    return (block_ids.unsqueeze(-2) + heads[:, None]).flatten()


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
    width: int,
    mask: torch.Tensor | None,
    block_size: int,
    scale: float,
    k_space: Workspace,
    v_space: Workspace,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    key_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence against its cached context.

    ``q`` ``[B, heads, head_dim]``; ``rows`` from :func:`block_rows` of the padded block
    tables ``[B, width / block_size]``; ``mask`` ``[B, 1, 1, width]`` additive (0 / -inf), or
    None when every sequence has exactly ``width`` tokens; ``k_scale``/``v_scale`` for a
    quantized cache; ``sinks`` (sink K, sink V, entries ``[B]``) read each sequence's first
    positions from an int4 cache's sink store (:func:`apply_sinks`); ``key_offsets`` (an int4
    cache's) are added back to the keys (:func:`add_key_offsets`). Returns ``[B, heads * head_dim]``.
    """
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[0]
    k = gather_context(k_cache, k_scale, rows, block_size, k_space, q.dtype).view(batch, kv_heads, -1, dim)
    v = gather_context(v_cache, v_scale, rows, block_size, v_space, q.dtype).view(batch, kv_heads, -1, dim)
    restore_keys(k, v, sinks, key_offsets, block_size)
    if mask is None:
        k, v = k[:, :, :width], v[:, :, :width]
    else:
        # Slots past a sequence's end were never written: whatever the memory held (NaN
        # included) must not reach the output, where 0 * NaN would still be NaN.
        unwritten = torch.isinf(mask).reshape(batch, 1, -1, 1)
        k.masked_fill_(unwritten, 0)
        v.masked_fill_(unwritten, 0)
    # Grouped-query attention without repeating K/V: the query heads sharing a KV head are its rows.
    qg = q.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return out.reshape(batch, heads * dim)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a prompt chunk with no cached context. ``q`` ``[n, heads, dim]``,
    ``k``/``v`` ``[n, kv_heads, dim]``; returns ``[n, heads * dim]``."""
    n, heads, dim = q.shape
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        is_causal=True, scale=scale, enable_gqa=heads != k.shape[1],
    )
    return out[0].transpose(0, 1).reshape(n, heads * dim)


def chunked_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
    mask: torch.Tensor,
    block_size: int,
    scale: float,
    k_space: Workspace,
    v_space: Workspace,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    key_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """A prompt chunk attending to its cached context and itself (already written to the cache).

    ``q`` ``[n, heads, dim]`` at positions ``ctx - n ... ctx - 1``; ``rows`` from
    :func:`block_rows` of the blocks covering ``ctx``; ``mask`` ``[n, ctx]`` bool (True: may
    attend); ``k_scale``/``v_scale`` for a quantized cache; ``sinks`` (entries ``[1]``) and
    ``key_offsets`` as in :func:`paged_decode_attention`. Returns ``[n, heads * dim]``.
    """
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[0]
    ctx = mask.shape[1]
    k = gather_context(k_cache, k_scale, rows, block_size, k_space, q.dtype).view(1, kv_heads, -1, dim)
    v = gather_context(v_cache, v_scale, rows, block_size, v_space, q.dtype).view(1, kv_heads, -1, dim)
    restore_keys(k, v, sinks, key_offsets, block_size)
    k, v = k[:, :, :ctx], v[:, :, :ctx]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask, scale=scale, enable_gqa=heads != kv_heads,
    )
    return out[0].transpose(0, 1).reshape(n, heads * dim)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                     window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of ``q`` ``[n, heads, dim]`` at positions ``start ... start + n - 1``
    over ``k``/``v`` ``[kv_heads, ctx, dim]`` at positions ``0 ... ctx - 1``; a key is seen when
    its position is at most the query's and, with ``window``, above ``query - window``; scores
    soft-capped (``softcap * tanh(s / softcap)``) before the mask, softmax in float32 (as
    transformers' eager attention). Returns ``[n, heads * dim]``."""
    n, heads, dim = q.shape
    kv_heads, ctx, _ = k.shape
    qg = q.reshape(n, kv_heads, heads // kv_heads, dim).permute(1, 2, 0, 3)  # [kv_heads, group, n, dim]
    scores = torch.matmul(qg, k.transpose(-1, -2).unsqueeze(1)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    qpos = torch.arange(start, start + n, device=q.device)[:, None]
    kpos = torch.arange(ctx, device=q.device)[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs, v.unsqueeze(1))  # [kv_heads, group, n, dim]
    return out.permute(2, 0, 1, 3).reshape(n, heads * dim)
