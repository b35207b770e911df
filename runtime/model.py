"""Our Llama-family decoder forward over a flattened batch with a paged KV cache.

All scheduled tokens of a step form one ``[tokens, hidden]`` matrix, so every Linear runs once
per layer for the whole batch. Only attention looks at sequences: the decode tokens (one per
sequence) attend in one call, either the C++ kernel reading each sequence's blocks through its
block table (``PagedDecode``) or the reference over gathered, padded groups (``DecodeGroup``);
each prompt chunk attends causally to its cached context and itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .config import ModelArch
from .kernels import cpu_attention, cpu_fused, kv_quant
from .kernels import reference as kernels
from .kernels.reference import Workspace
from .loader import LayerWeights, ModelWeights
from .rope import apply_rotary


@dataclass
class PrefillChunk:
    """A run of ``length`` prompt tokens of one sequence starting at row ``start`` of the batch."""

    start: int
    length: int
    rows: torch.Tensor | None  # cache rows of the context (see kernels.reference); None: no cached context
    mask: torch.Tensor | None  # [length, context] bool, with rows


@dataclass
class DecodeGroup:
    """``count`` decode tokens (one per sequence) at rows ``start ...``, attended in one call
    over their block tables padded to ``width`` tokens."""

    start: int
    count: int
    rows: torch.Tensor
    width: int
    mask: torch.Tensor | None  # [count, 1, 1, width] additive; None when all contexts are ``width`` long


@dataclass
class PagedDecode:
    """``count`` decode tokens at rows ``start ...`` for the C++ kernel: each sequence's block
    table (``[count, width]`` int64, padded with block 0) and context length (``[count]`` int64)."""

    start: int
    count: int
    tables: torch.Tensor
    lens: torch.Tensor


@dataclass
class ForwardBatch:
    """Inputs of one forward: decode tokens first (in groups of similar context length), then chunks."""

    input_ids: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] KV cache slot of each token
    cos: torch.Tensor  # [T, 1, head_dim]
    sin: torch.Tensor  # [T, 1, head_dim]
    decodes: list[DecodeGroup] = field(default_factory=list)
    paged_decode: PagedDecode | None = None  # instead of ``decodes`` when the C++ kernel runs
    prefills: list[PrefillChunk] = field(default_factory=list)
    sample_rows: torch.Tensor | None = None  # rows whose next-token logits are needed


class KVCache:
    """Per layer K and V tensors ``[kv_heads, num_blocks * block_size, head_dim]``.

    ``kv_cache_dtype`` ``auto`` stores values in the model's dtype; ``int8`` / ``fp8`` store
    codes (one byte each) with float32 scales ``[kv_heads, num_blocks * block_size]`` per layer
    (one per token and KV head, see ``kernels.kv_quant``). Allocated once with ``torch.empty``:
    the operating system backs pages only as blocks are first written, so resident memory
    follows the blocks actually used.
    """

    def __init__(self, arch: ModelArch, num_blocks: int, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        storage = kv_quant.storage_dtype(kv_cache_dtype, dtype)
        shape = (arch.num_layers, 2, arch.num_kv_heads, num_blocks * block_size, arch.head_dim)
        self.data = torch.empty(shape, dtype=storage)
        self.k = [self.data[i, 0] for i in range(arch.num_layers)]
        self.v = [self.data[i, 1] for i in range(arch.num_layers)]
        self.scales = None
        self.k_scale: list[torch.Tensor | None] = [None] * arch.num_layers
        self.v_scale: list[torch.Tensor | None] = [None] * arch.num_layers
        if kv_quant.is_quantized(kv_cache_dtype):
            self.scales = torch.empty(shape[:-1], dtype=kv_quant.SCALE_DTYPE)
            self.k_scale = [self.scales[i, 0] for i in range(arch.num_layers)]
            self.v_scale = [self.scales[i, 1] for i in range(arch.num_layers)]
        self.k_space = kernels.Workspace(storage)  # scratch for gathered context, reused by every layer
        self.v_space = kernels.Workspace(storage)

    @staticmethod
    def bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        element = torch.empty((), dtype=kv_quant.storage_dtype(kv_cache_dtype, dtype)).element_size()
        per_token_head = arch.head_dim * element
        if kv_quant.is_quantized(kv_cache_dtype):
            per_token_head += torch.empty((), dtype=kv_quant.SCALE_DTYPE).element_size()
        return arch.num_layers * 2 * arch.num_kv_heads * block_size * per_token_head

    @property
    def nbytes(self) -> int:
        total = self.data.numel() * self.data.element_size()
        if self.scales is not None:
            total += self.scales.numel() * self.scales.element_size()
        return total


class LlamaModel:
    """Forward of Llama / Mistral / Qwen2 / Qwen3 / SmolLM decoders.

    Float32 models with the C++ kernels (``kernels`` auto / cpu, ``cpu_fused`` built) run the
    fused forward: the residual stream is updated in place, and the residual add + RMSNorm,
    SwiGLU's product and RoPE + KV write are one C++ call each (``kernels.cpu_fused``). Other
    dtypes and ``kernels="reference"`` run the plain-torch forward; both compute the same
    operations, so they agree up to float32 rounding.
    """

    def __init__(self, arch: ModelArch, weights: ModelWeights, kernels: str = "auto") -> None:
        self.arch = arch
        self.w = weights
        self.scale = arch.head_dim ** -0.5
        self.eps = arch.rms_norm_eps
        self.hidden_shape = (arch.hidden_size,)
        self.head_shape = (arch.head_dim,)
        self.fused = (kernels != "reference" and weights.norm.dtype == torch.float32 and weights.norm.device.type == "cpu"
                      and cpu_fused.available())
        self.ops = cpu_fused.extension() if self.fused else None  # called directly: 30 layers a token
        attention = cpu_attention.extension() if self.fused else None
        self.attention = attention.paged_decode if attention is not None else None
        self.attn_space = Workspace(weights.norm.dtype)  # the decode attention's output, reused

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Logits ``[len(batch.sample_rows), vocab]`` (float32)."""
        if self.fused:
            return self._forward_fused(batch, cache)
        h = self.w.embed_tokens(batch.input_ids)
        for i, layer in enumerate(self.w.layers):
            x = F.rms_norm(h, self.hidden_shape, layer.input_norm, self.eps)
            h = h + layer.o(self._attention(layer, x, batch, cache, i))
            x = F.rms_norm(h, self.hidden_shape, layer.post_norm, self.eps)
            gate_up = layer.gate_up(x)
            half = gate_up.shape[-1] // 2
            h = h + layer.down(F.silu(gate_up[:, :half]) * gate_up[:, half:])
        if batch.sample_rows is not None:
            h = h.index_select(0, batch.sample_rows)
        h = F.rms_norm(h, self.hidden_shape, self.w.norm, self.eps)
        return self.w.lm_head(h).float()

    def _forward_fused(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """The forward with the C++ fused steps: each layer's output ``delta`` is added to the
        residual stream ``h`` (in place) by the next norm."""
        w, ops, eps = self.w, self.ops, self.eps
        h = w.embed_tokens(batch.input_ids).contiguous()  # a fresh tensor: ours to update
        x = torch.empty_like(h)
        delta = None
        for i, layer in enumerate(w.layers):
            ops.add_rms_norm(h, delta, layer.input_norm, eps, x)
            delta = layer.o(self._attention_fused(layer, layer.qkv(x), batch, cache, i))
            ops.add_rms_norm(h, delta, layer.post_norm, eps, x)
            delta = layer.down(ops.silu_mul(layer.gate_up(x)))
        ops.add_rms_norm(h, delta, w.norm, eps, x)  # row-wise: select rows after
        rows = batch.sample_rows
        if rows is not None and rows.numel() != x.shape[0]:  # sample rows ascend: all rows means no selection
            x = x.index_select(0, rows)
        return w.lm_head(x).float()

    def _attention(self, layer: LayerWeights, x: torch.Tensor, b: ForwardBatch, cache: KVCache, index: int) -> torch.Tensor:
        arch = self.arch
        heads, kv_heads = arch.num_heads, arch.num_kv_heads
        qkv = layer.qkv(x).view(x.shape[0], heads + 2 * kv_heads, arch.head_dim)
        qk = qkv[:, :heads + kv_heads]
        if layer.qk_norm is not None:
            qk = F.rms_norm(qk, self.head_shape, None, self.eps) * layer.qk_norm
        qk = apply_rotary(qk, b.cos, b.sin)
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]
        kernels.write_kv(cache.k[index], cache.v[index], k, v, b.slots, cache.k_scale[index], cache.v_scale[index])
        return self._attend(q, k, v, b, cache, index)

    def _attention_fused(self, layer: LayerWeights, qkv: torch.Tensor, b: ForwardBatch, cache: KVCache, index: int) -> torch.Tensor:
        """:meth:`_attention` with q/k norm, RoPE and (float caches) the KV write in one C++ call,
        in place on the merged q/k/v output."""
        arch = self.arch
        heads, kv_heads = arch.num_heads, arch.num_kv_heads
        k_cache, v_cache, k_scale = cache.k[index], cache.v[index], cache.k_scale[index]
        if k_scale is None:
            self.ops.rope(qkv, b.cos, b.sin, heads, kv_heads, layer.qk_norm, self.eps, k_cache, v_cache, b.slots)
        else:
            self.ops.rope(qkv, b.cos, b.sin, heads, kv_heads, layer.qk_norm, self.eps, None, None, None)
        qkv = qkv.view(qkv.shape[0], heads + 2 * kv_heads, arch.head_dim)
        d = b.paged_decode
        if d is not None and k_scale is None and not b.decodes and not b.prefills and self.attention is not None:
            # decode only: the C++ kernel directly (as cpu_attention.paged_decode_attention calls it)
            out = self.attn_space.take(d.count, heads * arch.head_dim)
            return self.attention(qkv[:, :heads], k_cache, v_cache, None, None, d.tables, d.lens, cache.block_size,
                                  self.scale, out, False, 0)
        q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
        if k_scale is not None:
            kernels.write_kv(k_cache, v_cache, k, v, b.slots, k_scale, cache.v_scale[index])
        return self._attend(q, k, v, b, cache, index)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: ForwardBatch, cache: KVCache, index: int) -> torch.Tensor:
        """Attention of the batch's tokens (their K/V already in the cache)."""
        k_cache, v_cache = cache.k[index], cache.v[index]
        k_scale, v_scale = cache.k_scale[index], cache.v_scale[index]
        outs = []
        if b.paged_decode is not None:
            d = b.paged_decode
            out = self.attn_space.take(d.count, q.shape[1] * q.shape[2])  # consumed by o before the next layer
            outs.append(cpu_attention.paged_decode_attention(
                q[d.start:d.start + d.count], k_cache, v_cache, d.tables, d.lens, cache.block_size, self.scale,
                k_scale, v_scale, out=out))
        for g in b.decodes:
            outs.append(kernels.paged_decode_attention(
                q[g.start:g.start + g.count], k_cache, v_cache, g.rows, g.width, g.mask, cache.block_size, self.scale,
                cache.k_space, cache.v_space, k_scale, v_scale))
        for chunk in b.prefills:
            rows = slice(chunk.start, chunk.start + chunk.length)
            if chunk.rows is None:
                outs.append(kernels.prefill_attention(q[rows], k[rows], v[rows], self.scale))
            else:
                outs.append(kernels.chunked_prefill_attention(
                    q[rows], k_cache, v_cache, chunk.rows, chunk.mask, cache.block_size, self.scale,
                    cache.k_space, cache.v_space, k_scale, v_scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs)
