"""Our Llama-family decoder forward over a flattened batch with a paged KV cache.

All scheduled tokens of a step form one ``[tokens, hidden]`` matrix, so every Linear runs once
per layer for the whole batch. Only attention looks at sequences (``AttentionMetadata``). Every
kernel is the engine's backend's (``runtime.backends``), chosen once.
"""

from __future__ import annotations

import torch

from .backends import Backend, ForwardBatch
from .config import ModelArch
from .kv_cache import KVCache
from .loader import ModelWeights


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
