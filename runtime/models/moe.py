"""Mixtral, Qwen2-MoE, Qwen3-MoE: Llama-family decoders whose MLP is a mixture of experts
(``layers.SparseMoE``: float router, top-k experts, each expert's linears quantized or not
like any other, Qwen2-MoE's gated shared expert). Layers without experts (``mlp_only_layers``,
``decoder_sparse_step``) keep a dense MLP.

Expert tensors are read under any of the names checkpoints use: per expert
``mlp.experts.j.{gate,up,down}_proj`` (Qwen, and llmopt's quantized checkpoints of every MoE),
``block_sparse_moe.experts.j.w1/w3/w2`` (Mixtral's own), or fused 3-D
``mlp.experts.gate_up_proj`` / ``down_proj`` tensors (transformers' in-memory layout).
"""

from __future__ import annotations

from llmopt.core.errors import LlmoptError

from ..config import ModelArch
from ..layers import DenseLinear, GatedMLP, Linear, SparseMoE
from ..loader import LayerWeights, Reader, merge_linears, qk_norms
from .llama import LlamaModel


def _experts(r: Reader, p: str, n: int) -> list[tuple[Linear, Linear]]:
    """``(gate_up, down)`` of each of the ``n`` experts of layer prefix ``p``."""
    for block, (g, u, d) in ((f"{p}.mlp", ("gate_proj", "up_proj", "down_proj")),
                             (f"{p}.block_sparse_moe", ("w1", "w3", "w2")),
                             (f"{p}.mlp", ("w1", "w3", "w2"))):
        if r.has(f"{block}.experts.0.{g}"):
            e = f"{block}.experts"
            return [(merge_linears([r.linear(f"{e}.{j}.{g}"), r.linear(f"{e}.{j}.{u}")]), r.linear(f"{e}.{j}.{d}"))
                    for j in range(n)]
    fused = r.tensor(f"{p}.mlp.experts.gate_up_proj", required=False)
    if fused is not None:
        down = r.tensor(f"{p}.mlp.experts.down_proj")
        return [(DenseLinear.from_weight(fused[j]), DenseLinear.from_weight(down[j])) for j in range(n)]
    raise LlmoptError(f"{r.path}: no expert weights for {p}", "the checkpoint does not fit its config.json; re-create it")


def _router(r: Reader, p: str) -> Linear:
    for name in (f"{p}.mlp.gate", f"{p}.block_sparse_moe.gate"):
        if r.has(name):
            lin = r.linear(name)
            if not isinstance(lin, DenseLinear):  # the router decides which experts run: kept in float
                raise LlmoptError(f"{r.path}: the router {name} is quantized", "re-quantize with the router left in float")
            return lin
    raise LlmoptError(f"{r.path}: no router weight for {p}", "the checkpoint does not fit its config.json; re-create it")


def load_layer(r: Reader, arch: ModelArch, i: int) -> LayerWeights:
    p = f"model.layers.{i}"
    attn, mlp = f"{p}.self_attn", f"{p}.mlp"
    spec = arch.moe
    layer = LayerWeights(
        input_norm=r.norm(f"{p}.input_layernorm.weight"),
        post_norm=r.norm(f"{p}.post_attention_layernorm.weight"),
        qkv=merge_linears([r.linear(f"{attn}.{n}_proj") for n in "qkv"]),
        o=r.linear(f"{attn}.o_proj"),
        gate_up=None,
        down=None,
        qk_norm=qk_norms(r, arch, attn),
    )
    if not spec.sparse_layers[i]:
        layer.gate_up = merge_linears([r.linear(f"{mlp}.gate_proj"), r.linear(f"{mlp}.up_proj")])
        layer.down = r.linear(f"{mlp}.down_proj")
        return layer
    act = r.backend.silu_mul
    experts = [GatedMLP(gu, d, act) for gu, d in _experts(r, p, spec.num_experts)]
    shared = shared_gate = None
    if spec.shared_intermediate:
        s = f"{mlp}.shared_expert"
        shared = GatedMLP(merge_linears([r.linear(f"{s}.gate_proj"), r.linear(f"{s}.up_proj")]), r.linear(f"{s}.down_proj"), act)
        shared_gate = r.linear(f"{mlp}.shared_expert_gate") if r.has(f"{mlp}.shared_expert_gate") else None
    layer.moe = SparseMoE(_router(r, p), experts, spec.top_k, spec.renormalize, shared, shared_gate)
    return layer


Model = LlamaModel
