"""Our Llama-family decoder forward over a flattened batch with a paged KV cache.

All scheduled tokens of a step form one ``[tokens, hidden]`` matrix, so every Linear runs once
per layer for the whole batch. Only attention looks at sequences (``AttentionMetadata``). Every
kernel is the engine's backend's (``runtime.backends``), chosen once.
"""

from __future__ import annotations

import torch

from .backends import Backend, ForwardBatch
from .config import ModelArch
from .kernels import kv_quant
from .kernels.reference import Workspace
from .loader import ModelWeights


class KVCache:
    """Per layer K and V tensors ``[kv_heads, num_blocks * block_size, head_dim]``.

    ``kv_cache_dtype`` ``auto`` stores values in the model's dtype; ``int8`` / ``fp8`` store
    codes (one byte each) with float32 scales ``[kv_heads, num_blocks * block_size]`` per layer
    (one per token and KV head, see ``kernels.kv_quant``). Allocated once with ``torch.empty``:
    the operating system backs pages only as blocks are first written, so resident memory
    follows the blocks actually used.
    """

    def __init__(self, arch: ModelArch, num_blocks: int, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                 device: torch.device | str = "cpu") -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        storage = kv_quant.storage_dtype(kv_cache_dtype, dtype)
        shape = (arch.num_layers, 2, arch.num_kv_heads, num_blocks * block_size, arch.head_dim)
        self.data = torch.empty(shape, dtype=storage, device=device)
        self.k = [self.data[i, 0] for i in range(arch.num_layers)]
        self.v = [self.data[i, 1] for i in range(arch.num_layers)]
        self.scales = None
        self.k_scale: list[torch.Tensor | None] = [None] * arch.num_layers
        self.v_scale: list[torch.Tensor | None] = [None] * arch.num_layers
        if kv_quant.is_quantized(kv_cache_dtype):
            self.scales = torch.empty(shape[:-1], dtype=kv_quant.SCALE_DTYPE, device=device)
            self.k_scale = [self.scales[i, 0] for i in range(arch.num_layers)]
            self.v_scale = [self.scales[i, 1] for i in range(arch.num_layers)]
        self.k_space = Workspace(storage, device)  # scratch for gathered context, reused by every layer
        self.v_space = Workspace(storage, device)

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
    """Forward of Llama / Mistral / Qwen2 / Qwen3 / SmolLM decoders on ``backend``'s kernels.

    The residual stream ``h`` is updated in place: each layer's output ``delta`` is added by
    the next norm (``Backend.add_rms_norm``, one C++ call on the CPU backend in float32)."""

    def __init__(self, arch: ModelArch, weights: ModelWeights, backend: Backend) -> None:
        self.arch = arch
        self.w = weights
        self.backend = backend
        self.scale = arch.head_dim ** -0.5
        self.eps = arch.rms_norm_eps

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Logits ``[len(batch.sample_rows), vocab]`` (float32)."""
        w, be, eps, heads = self.w, self.backend, self.eps, self.arch.num_heads
        h = w.embed_tokens(batch.input_ids).contiguous()  # a fresh tensor: ours to update
        x = torch.empty_like(h)
        delta = None
        for i, layer in enumerate(w.layers):
            x = be.add_rms_norm(h, delta, layer.input_norm, eps, x)
            q, k, v = be.rope_and_store(layer.qkv(x), heads, layer.qk_norm, eps, batch, cache, i)
            delta = layer.o(be.attention(q, k, v, batch.attn, cache, i, self.scale))
            x = be.add_rms_norm(h, delta, layer.post_norm, eps, x)
            delta = layer.down(be.silu_mul(layer.gate_up(x)))
        x = be.add_rms_norm(h, delta, w.norm, eps, x)  # row-wise: select rows after
        rows = batch.sample_rows
        if rows is not None and rows.numel() != x.shape[0]:  # sample rows ascend: all rows means no selection
            x = x.index_select(0, rows)
        return w.lm_head(x).float()
