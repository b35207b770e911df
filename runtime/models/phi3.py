"""Phi-3: a Llama-family decoder whose q/k/v and gate/up projections are stored fused
(``self_attn.qkv_proj``, ``mlp.gate_up_proj``), each one linear as checkpointed."""

from __future__ import annotations

from ..config import ModelArch
from ..loader import LayerWeights, Reader
from .llama import LlamaModel


def load_layer(r: Reader, arch: ModelArch, i: int) -> LayerWeights:
    p = f"model.layers.{i}"
    return LayerWeights(
        input_norm=r.norm(f"{p}.input_layernorm.weight"),
        post_norm=r.norm(f"{p}.post_attention_layernorm.weight"),
        qkv=r.linear(f"{p}.self_attn.qkv_proj"),
        o=r.linear(f"{p}.self_attn.o_proj"),
        gate_up=r.linear(f"{p}.mlp.gate_up_proj"),
        down=r.linear(f"{p}.mlp.down_proj"),
        qk_norm=None,
    )


Model = LlamaModel
