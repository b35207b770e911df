"""Gemma 2 / Gemma 3 (text): RMSNorm as ``(1 + w)`` (folded into the weights at load), norms on
the attention and MLP outputs too ("sandwich"), GeLU-tanh gated MLP, embeddings scaled by
``sqrt(hidden)``, queries scaled by ``query_pre_attn_scalar ** -0.5``, sliding-window layers
alternating with global ones, soft-capped attention scores and logits (Gemma 2), q/k norms and
a separate RoPE table for the sliding layers (Gemma 3)."""

from __future__ import annotations

import copy
import dataclasses

import torch

from ..backends import Backend, ForwardBatch
from ..config import ModelArch
from ..kv_cache import KVCache
from ..loader import LayerWeights, ModelWeights, Reader, merge_linears, qk_norms
from ..rope import RotaryEmbedding


def load_layer(r: Reader, arch: ModelArch, i: int) -> LayerWeights:
    p, one = f"model.layers.{i}", arch.norm_offset
    attn, mlp = f"{p}.self_attn", f"{p}.mlp"
    return LayerWeights(
        input_norm=r.norm(f"{p}.input_layernorm.weight", one),
        post_norm=r.norm(f"{p}.pre_feedforward_layernorm.weight", one),
        qkv=merge_linears([r.linear(f"{attn}.{n}_proj") for n in "qkv"]),
        o=r.linear(f"{attn}.o_proj"),
        gate_up=merge_linears([r.linear(f"{mlp}.gate_proj"), r.linear(f"{mlp}.up_proj")]),
        down=r.linear(f"{mlp}.down_proj"),
        qk_norm=qk_norms(r, arch, attn),
        attn_out_norm=r.norm(f"{p}.post_attention_layernorm.weight", one),
        mlp_out_norm=r.norm(f"{p}.post_feedforward_layernorm.weight", one),
    )


class GemmaModel:
    """The Gemma 2 / 3 forward; the residual stream ``h`` is updated in place as in Llama's."""

    def __init__(self, arch: ModelArch, weights: ModelWeights, backend: Backend, max_model_len: int, dtype: torch.dtype) -> None:
        self.arch, self.w, self.backend = arch, weights, backend
        self.scale = arch.query_scale if arch.query_scale is not None else arch.head_dim ** -0.5
        self.eps = arch.rms_norm_eps
        self.windows = [w if w is not None and w < max_model_len else None for w in arch.layer_windows]
        self.sliding = [w is not None for w in arch.layer_windows]
        self.local_rope = None
        if arch.local_rope is not None:  # the sliding layers' own RoPE (Gemma 3: another base)
            cfg = copy.copy(arch.hf_config)
            cfg.rope_parameters = dict(arch.local_rope)
            self.local_rope = RotaryEmbedding(dataclasses.replace(arch, hf_config=cfg), max_model_len, dtype)
        self.act_mul = backend.gelu_mul if arch.activation == "gelu_tanh" else backend.silu_mul

    def layer_rope(self, index: int) -> RotaryEmbedding | None:
        """The RoPE table layer ``index`` turns its queries and keys by when it is not the
        runner's (Gemma 3's sliding layers); None: the runner's."""
        return self.local_rope if self.sliding[index] else None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        w, be, eps, arch = self.w, self.backend, self.eps, self.arch
        heads = arch.num_heads
        local = batch
        if self.local_rope is not None:
            cos, sin = self.local_rope.for_positions(batch.positions.cpu())
            local = dataclasses.replace(batch, cos=cos.unsqueeze(1).to(batch.cos.device), sin=sin.unsqueeze(1).to(batch.sin.device))
        h = w.embed_tokens(batch.input_ids) * torch.tensor(arch.embed_scale, dtype=w.norm.dtype)
        x, y = torch.empty_like(h), torch.empty_like(h)
        delta = None
        for i, layer in enumerate(w.layers):
            window = self.windows[i]
            x = be.add_rms_norm(h, delta, layer.input_norm, eps, x)
            rope_batch = local if self.sliding[i] else batch
            q, k, v = be.rope_and_store(layer.qkv(x), heads, layer.qk_norm, eps, rope_batch, cache, i)
            a = layer.o(be.attention(q, k, v, batch.attn, cache, i, self.scale, window=window, softcap=arch.attn_softcap))
            a = be.add_rms_norm(a, None, layer.attn_out_norm, eps, y)
            x = be.add_rms_norm(h, a, layer.post_norm, eps, x)
            m = layer.down(self.act_mul(layer.gate_up(x)))
            delta = be.add_rms_norm(m, None, layer.mlp_out_norm, eps, y)
        x = be.add_rms_norm(h, delta, w.norm, eps, x)
        rows = batch.sample_rows
        if rows is not None and rows.numel() != x.shape[0]:
            x = x.index_select(0, rows)
        logits = w.lm_head(x).float()
        if arch.final_softcap is not None:
            logits = torch.tanh(logits / arch.final_softcap) * arch.final_softcap
        return logits


Model = GemmaModel
