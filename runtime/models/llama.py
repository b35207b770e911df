"""Llama / Mistral / Qwen2 / Qwen3 / SmolLM (and, with a mixture-of-experts MLP, Mixtral and
Qwen-MoE: ``models.moe``): pre-norm decoder layers, SwiGLU MLP, RoPE, optional q/k norms."""

from __future__ import annotations

import torch

from ..backends import Backend, ForwardBatch
from ..config import ModelArch
from ..kv_cache import KVCache
from ..loader import ModelWeights, llama_layer

load_layer = llama_layer


class LlamaModel:
    """Forward of Llama-family decoders on ``backend``'s kernels.

    The residual stream ``h`` is updated in place: each layer's output ``delta`` is added by
    the next norm (``Backend.add_rms_norm``, one C++ call on the CPU backend in float32). A
    layer with a window (``ModelArch.layer_windows``) attends to that many last tokens."""

    def __init__(self, arch: ModelArch, weights: ModelWeights, backend: Backend, max_model_len: int | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.arch = arch
        self.w = weights
        self.backend = backend
        self.scale = arch.head_dim ** -0.5
        self.eps = arch.rms_norm_eps
        windows = arch.layer_windows or (None,) * arch.num_layers
        # a window no sequence can exceed changes nothing: the fast path then
        self.windows = [w if w is not None and (max_model_len is None or w < max_model_len) else None for w in windows]

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
            window = self.windows[i]
            if window is None:
                delta = layer.o(be.attention(q, k, v, batch.attn, cache, i, self.scale))
            else:
                delta = layer.o(be.attention(q, k, v, batch.attn, cache, i, self.scale, window=window))
            x = be.add_rms_norm(h, delta, layer.post_norm, eps, x)
            delta = layer.down(be.silu_mul(layer.gate_up(x))) if layer.moe is None else layer.moe(x)
        x = be.add_rms_norm(h, delta, w.norm, eps, x)  # row-wise: select rows after
        rows = batch.sample_rows
        if rows is not None and rows.numel() != x.shape[0]:  # sample rows ascend: all rows means no selection
            x = x.index_select(0, rows)
        return w.lm_head(x).float()


Model = LlamaModel
