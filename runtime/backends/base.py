"""The kernel backend interface, and the forward's inputs every backend reads.

One :class:`Backend` runs every kernel of a forward: it lays the linears out at load
(``prepare_linear``), attends over one :class:`AttentionMetadata` (decode tokens through their
block tables, prompt chunks against their cached context and themselves), runs the elementwise
steps of a layer (``add_rms_norm``, ``silu_mul``, ``rope_and_store``) and greedy ``argmax``.
The methods here are the plain-torch composites; a backend overrides what it runs faster.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from llmopt.core.errors import LlmoptError
from llmopt.formats.hadamard import transform_inputs

from ..kernels import reference
from ..kv_cache import KVCache
from ..layers import DenseLinear, QuantLinear
from ..rope import apply_rotary

GROUP_COST_BLOCKS = 12  # one more attention call costs about as much as padding this many blocks


class PrefillChunk(NamedTuple):
    """``length`` prompt tokens of one sequence at batch rows ``start ...``: ``rows`` are the cache
    rows of its context (:func:`reference.block_rows`) and ``mask`` ``[length, context]`` bool
    says what each token may see; both None when nothing is cached before the chunk. ``sink``:
    the entry of the cache's sink store holding the sequence's first positions (-1: none)."""

    start: int
    length: int
    rows: torch.Tensor | None
    mask: torch.Tensor | None
    sink: int = -1


@dataclass
class AttentionMetadata:
    """What attention needs in one forward, the same for every backend.

    Batch rows ``0 .. num_decodes - 1`` are decode tokens (one per sequence, ascending context
    length) attending to ``context_lens`` tokens through ``block_tables`` ``[num_decodes, width]``
    (int64, padded with block 0); prompt chunks follow. With an int4 cache's sink store
    (``runtime.kv_sinks``): ``decode_sinks`` ``[num_decodes]`` int64, each decode row's entry
    (-1: none), and ``sink_writes`` (batch rows of position 0 of the sequences whose first chunk
    this is, their entries), None when nothing is written. ``key_blocks`` ``[T]`` int64: each
    token's ``position // block_size``, the row of the cache's key offsets it is stored less
    (``KVCache.k_offsets``). ``derived`` holds what a backend
    computes from these once per forward (device copies, padded groups) for every layer to reuse."""

    slots: torch.Tensor  # [T] KV cache slot of each token
    num_decodes: int = 0
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    derived: dict = field(default_factory=dict)
    decode_sinks: torch.Tensor | None = None
    sink_writes: tuple[torch.Tensor, torch.Tensor] | None = None
    key_blocks: torch.Tensor | None = None

    def to(self, device: torch.device) -> AttentionMetadata:
        def move(t):
            return None if t is None else t.to(device, non_blocking=True)

        chunks = [PrefillChunk(c.start, c.length, move(c.rows), move(c.mask), c.sink) for c in self.prefills]
        writes = None if self.sink_writes is None else (move(self.sink_writes[0]), move(self.sink_writes[1]))
        return AttentionMetadata(move(self.slots), self.num_decodes, move(self.block_tables), move(self.context_lens), chunks,
                                 decode_sinks=move(self.decode_sinks), sink_writes=writes, key_blocks=move(self.key_blocks))


@dataclass
class ForwardBatch:
    """Inputs of one forward: the tokens, their RoPE rows, attention metadata, rows to sample."""

    input_ids: torch.Tensor  # [T]
    cos: torch.Tensor  # [T, 1, head_dim]
    sin: torch.Tensor  # [T, 1, head_dim]
    attn: AttentionMetadata
    sample_rows: torch.Tensor | None = None  # rows whose next-token logits are needed
    positions: torch.Tensor | None = None  # [T] each token's position (models with a second RoPE table read it)

    def to(self, device: torch.device) -> ForwardBatch:
        rows = None if self.sample_rows is None else self.sample_rows.to(device, non_blocking=True)
        positions = None if self.positions is None else self.positions.to(device, non_blocking=True)
        return ForwardBatch(self.input_ids.to(device, non_blocking=True), self.cos.to(device, non_blocking=True),
                            self.sin.to(device, non_blocking=True), self.attn.to(device), rows, positions)


def group_by_length(blocks: list[int], cost: int = GROUP_COST_BLOCKS) -> list[tuple[int, int]]:
    """Split ascending per-sequence block counts into ``(start, end)`` runs minimising
    ``cost * runs + sum(run length * its largest count)``: each run is padded to its longest
    sequence, and every extra run is one more attention call."""
    n = len(blocks)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        for start in range(end):
            total = best[start] + cost + (end - start) * blocks[end - 1]
            if total < best[end]:
                best[end], cut[end] = total, start
    runs, end = [], n
    while end:
        runs.append((cut[end], end))
        end = cut[end]
    return runs[::-1]


class Backend:
    """Plain-torch kernels on any device; subclasses override what they run faster.

    ``name`` is the ``kernels`` setting that picks the backend; ``device`` / ``dtype`` are the
    engine's (weights, KV cache and activations live there)."""

    name = "reference"

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self.matmul_precision = "highest"

    def set_matmul_precision(self, precision: str) -> None:
        """Allow ``medium`` (bfloat16 products) where this backend has such kernels; set before
        the weights are prepared. Here every linear stays float: only ``highest`` is taken."""
        if precision != "highest":
            raise LlmoptError(f"matmul_precision={precision} applies to the C++ CPU kernels (kernels=cpu), not to the "
                              f"{self.name} backend", "leave matmul_precision at highest, or run on the CPU with kernels=cpu")
        self.matmul_precision = precision

    # -- linears ------------------------------------------------------------------------------
    def prepare_linear(self, lin: DenseLinear | QuantLinear) -> None:
        """Lay ``lin``'s weight out for this backend and bind ``lin.run``. Here: a float weight
        transposed ``[in, out]`` for ``torch.mm`` (CPU BLAS streams it faster for one token), a
        quantized one dequantized per call."""
        if isinstance(lin, DenseLinear):
            lin.set_layout(transposed=True)
            weight_t, bias = lin.weight_t, lin.bias
            # a narrower weight (bf16 head) is widened per call, as the C++ GEMV does in registers
            lin.run = lambda x: reference.dense_linear_t(x, weight_t.to(x.dtype), bias)
        else:
            lin.run = lambda x: reference.quant_linear(x, lin.codes, lin.scale, lin.zero_point, lin.group_size,
                                                       lin.activations, lin.bias)

    def prepare_head(self, head: DenseLinear | QuantLinear) -> None:
        """After :meth:`prepare_linear`: what the output head alone gets (nothing here)."""

    def input_transform(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """``x V``: block-diagonal Sylvester Hadamard blocks of order ``block``, scaled to be
        orthogonal (an online transform before a Linear). Here: one matrix product per block."""
        return transform_inputs(x, block)

    # -- a layer's elementwise steps ------------------------------------------------------------
    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out: torch.Tensor) -> torch.Tensor:
        """``h += delta`` (in place, when given), then ``rms_norm(h) * weight``, returned (``out``
        may receive it)."""
        if delta is not None:
            h.add_(delta)
        return F.rms_norm(h, h.shape[-1:], weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a merged ``[tokens, 2 * intermediate]`` output."""
        half = gate_up.shape[-1] // 2
        return F.silu(gate_up[:, :half]) * gate_up[:, half:]

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(gate) * up`` of a merged ``[tokens, 2 * intermediate]`` output (Gemma)."""
        half = gate_up.shape[-1] // 2
        return F.gelu(gate_up[:, :half], approximate="tanh") * gate_up[:, half:]

    def rope_and_store(self, qkv: torch.Tensor, heads: int, qk_norm: torch.Tensor | None, eps: float, batch: ForwardBatch,
                       cache: KVCache, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[tokens, heads, head_dim]`` of the merged projection ``qkv`` with q and k
        normalised per head (``qk_norm``, Qwen3) and rotated; k and v stored in layer ``index``
        (all three in the cache's basis, see ``KVCache.rotate``)."""
        kv_heads, dim = cache.k[index].shape[0], cache.head_dim
        qkv = qkv.view(qkv.shape[0], heads + 2 * kv_heads, dim)
        qk = qkv[:, :heads + kv_heads]
        if qk_norm is not None:
            qk = F.rms_norm(qk, (dim,), None, eps) * qk_norm
        qk = apply_rotary(qk, batch.cos, batch.sin)
        q, k, v = cache.to_cache_basis(qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:], index)
        cache.store(index, k, v, batch.attn.slots, batch.attn.sink_writes, batch.attn.key_blocks)
        return q, k, v

    # -- attention ------------------------------------------------------------------------------
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, cache: KVCache,
                  index: int, scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """``[tokens, heads * head_dim]`` for the batch's tokens, their K/V already in the cache.
        ``window``: each token sees only the last ``window`` positions (itself included);
        ``softcap``: scores become ``softcap * tanh(score / softcap)`` (Gemma 2). Either runs
        :meth:`masked_attention` (plain torch, every backend)."""
        return cache.unrotate_output(self._attention(q, k, v, meta, cache, index, scale, window, softcap))

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, cache: KVCache,
                   index: int, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
        if window is not None or softcap is not None:
            return self.masked_attention(q, k, v, meta, cache, index, scale, window, softcap)
        outs = []
        n = meta.num_decodes
        if n:
            outs.append(self.decode_attention(q[:n], meta, cache, index, scale))
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.length)
            outs.append(self.prefill_attention(q[rows], k[rows], v[rows], chunk, cache, index, scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: PrefillChunk, cache: KVCache,
                          index: int, scale: float) -> torch.Tensor:
        """One prompt chunk: causal over itself, and over its cached context when it has one."""
        if chunk.rows is None:
            return reference.prefill_attention(q, k, v, scale)
        return reference.chunked_prefill_attention(q, cache.k[index], cache.v[index], chunk.rows, chunk.mask,
                                                   cache.block_size, scale, cache.k_space, cache.v_space,
                                                   cache.k_scale[index], cache.v_scale[index],
                                                   sink_context(cache, index, chunk.sink), cache.offsets_of(index))

    def decode_attention(self, q: torch.Tensor, meta: AttentionMetadata, cache: KVCache, index: int,
                         scale: float) -> torch.Tensor:
        """The decode tokens ``q`` ``[num_decodes, heads, head_dim]``; here in runs of similar
        context length, each gathered and padded to its longest (``group_by_length``)."""
        groups = meta.derived.get("groups")
        if groups is None:
            groups = meta.derived["groups"] = decode_groups(meta, cache, q.dtype)
        sinks, offsets = decode_sinks(cache, meta, index), cache.offsets_of(index)
        outs = [reference.paged_decode_attention(q[start:start + count], cache.k[index], cache.v[index], rows, width, mask,
                                                 cache.block_size, scale, cache.k_space, cache.v_space,
                                                 cache.k_scale[index], cache.v_scale[index],
                                                 None if sinks is None else (*sinks[:2], sinks[2][start:start + count]),
                                                 offsets)
                for start, count, rows, width, mask in groups]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def masked_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, cache: KVCache,
                         index: int, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
        """Attention with a sliding window and/or score soft-capping, one sequence at a time:
        each decode token against its context read through its block table, each prompt chunk
        against its cached context (or itself)."""
        kv_heads, bs = cache.k[index].shape[0], cache.block_size
        outs = []

        def context(rows: torch.Tensor, ctx: int, sink: int) -> tuple[torch.Tensor, torch.Tensor]:
            kc = reference.gather_context(cache.k[index], cache.k_scale[index], rows, bs, cache.k_space, q.dtype)
            vc = reference.gather_context(cache.v[index], cache.v_scale[index], rows, bs, cache.v_space, q.dtype)
            dim = q.shape[-1]
            kc, vc = kc.view(1, kv_heads, -1, dim), vc.view(1, kv_heads, -1, dim)
            reference.restore_keys(kc, vc, sink_context(cache, index, sink), cache.offsets_of(index), bs)
            return kc[0, :, :ctx], vc[0, :, :ctx]

        lists = meta.derived.get("masked_lists")  # host copies, once per forward for every layer
        if lists is None:
            lens = meta.context_lens.tolist() if meta.num_decodes else []
            entries = meta.decode_sinks.tolist() if meta.num_decodes and meta.decode_sinks is not None else [-1] * len(lens)
            lists = meta.derived["masked_lists"] = (lens, entries)
        lens, decode_sinks = lists
        for b, ctx in enumerate(lens):
            rows = reference.block_rows(meta.block_tables[b, :-(-ctx // bs)], kv_heads, cache.num_blocks)
            kc, vc = context(rows, ctx, decode_sinks[b])
            outs.append(reference.masked_attention(q[b:b + 1], kc, vc, ctx - 1, scale, window, softcap))
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.length)
            if chunk.rows is None:
                kc, vc, start = k[rows].transpose(0, 1), v[rows].transpose(0, 1), 0
            else:
                ctx = chunk.mask.shape[1]
                kc, vc = context(chunk.rows, ctx, chunk.sink)
                start = ctx - chunk.length
            outs.append(reference.masked_attention(q[rows], kc, vc, start, scale, window, softcap))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    # -- sampling -------------------------------------------------------------------------------
    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Row-wise argmax of ``[rows, vocab]`` logits (the first of equal maxima)."""
        return logits.argmax(-1)


def decode_sinks(cache: KVCache, meta: AttentionMetadata, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(sink K, sink V, each decode row's entry) of layer ``index``, as the decode kernels take
    them; None when the cache keeps no sinks or the batch reads none."""
    sinks = cache.sinks_of(index)
    return None if sinks is None or meta.decode_sinks is None else (*sinks, meta.decode_sinks)


def sink_context(cache: KVCache, index: int, entry: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(sink K, sink V, ``[entry]``) of layer ``index`` for one sequence reading its sinks from
    entry ``entry``; None when it has none (-1) or the cache keeps none."""
    sinks = cache.sinks_of(index)
    if sinks is None or entry < 0:
        return None
    return (*sinks, _entry_index(entry, sinks[0].device))


@functools.lru_cache(maxsize=1024)
def _entry_index(entry: int, device: torch.device) -> torch.Tensor:
    """``[entry]`` int64 on ``device``, made once (every layer of every chunk asks for it)."""
    return torch.tensor([entry], device=device)


def decode_groups(meta: AttentionMetadata, cache: KVCache, dtype: torch.dtype) -> list[tuple]:
    """``(start, count, rows, width, mask)`` per run of decode sequences (see
    :func:`reference.paged_decode_attention`): cache rows of the run's padded block tables and
    an additive mask over the padding (None when every context in the run is ``width`` long)."""
    bs = cache.block_size
    lens = meta.context_lens.tolist()
    tables = meta.block_tables
    device = tables.device
    groups = []
    for start, end in group_by_length([-(-n // bs) for n in lens]):
        width = lens[end - 1]
        nblocks = -(-width // bs)
        rows = reference.block_rows(tables[start:end, :nblocks], cache.k[0].shape[0], cache.num_blocks)
        mask = None
        if lens[start] != width:
            visible = torch.arange(nblocks * bs, device=device)[None, :] < meta.context_lens[start:end, None]
            mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))[:, None, None, :]
        groups.append((start, end - start, rows, width, mask))
    return groups
