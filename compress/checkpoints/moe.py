"""Mixture-of-experts models with one ``nn.Linear`` per expert projection.

transformers (v5) holds the experts of Mixtral / Qwen2-MoE / Qwen3-MoE … as fused 3-D
parameters (``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``), which
nothing that walks Linears (quantization, pruning, calibration statistics) can see: experts
would silently stay in float. :func:`unfuse_experts` replaces each such module by
:class:`UnfusedExperts` — the same forward, expert ``j`` being ``experts.j.{gate,up,down}_proj``
Linears — so every method treats an expert like any MLP, calibrated on the tokens routed to it.
Those names are the per-expert names checkpoints store (Qwen-MoE; Mixtral's own
``block_sparse_moe.experts.j.w1/w3/w2`` are mapped by :func:`canonical_key`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

_MIXTRAL = re.compile(r"\.block_sparse_moe\.(experts\.\d+\.)?(w1|w2|w3|gate)\.")
_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj", "gate": "gate"}
_UNFUSED = re.compile(r"\.mlp\.(?:(experts\.\d+\.)(gate_proj|up_proj|down_proj)|(gate))\.")
# model types whose checkpoints store experts and router as Mixtral does (transformers' own save writes
# ``block_sparse_moe.experts.j.w1`` for these and loads nothing else into the experts)
BLOCK_SPARSE_MOE_TYPES = ("mixtral",)


class ExpertMLP(nn.Module):
    """One expert: ``down_proj(act(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden: int, intermediate: int, act: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, device=device, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, device=device, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, device=device, dtype=dtype)
        self.act_fn = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class UnfusedExperts(nn.ModuleList):
    """Drop-in for transformers' fused ``*Experts``: ``forward(hidden, top_k_index, top_k_weights)``
    runs each routed expert on its tokens and sums the weighted outputs in expert order."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in top_k_index.unique().tolist():
            if not 0 <= e < len(self):
                continue
            token, slot = torch.where(top_k_index == e)
            y = self[e](hidden_states[token]) * top_k_weights[token, slot, None]
            # tokens are distinct (top-k picks an expert once per token): a plain indexed add; CPU
            # index_add_ runs tiny adds through the thread pool (slow on a loaded machine)
            out[token] += y.to(out.dtype)
        return out


def is_fused_experts(module: nn.Module) -> bool:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3 and down.dim() == 3


@torch.no_grad()
def unfuse_experts(model: nn.Module) -> int:
    """Replace every fused experts module of ``model`` by :class:`UnfusedExperts` (weights
    copied; on the ``meta`` device they stay empty). Returns how many were replaced."""
    found = [(name, m) for name, m in model.named_modules() if is_fused_experts(m)]
    for name, fused in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        n, two_i, hidden = fused.gate_up_proj.shape
        inter = two_i // 2
        gate_up, down = fused.gate_up_proj, fused.down_proj
        if getattr(fused, "is_transposed", False):  # some models store [E, H, 2I]
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
            n, two_i, hidden = gate_up.shape
            inter = two_i // 2
        experts = UnfusedExperts([ExpertMLP(hidden, inter, fused.act_fn, gate_up.device, gate_up.dtype) for _ in range(n)])
        if gate_up.device.type != "meta":
            for j, e in enumerate(experts):
                e.gate_proj.weight.copy_(gate_up[j, :inter])
                e.up_proj.weight.copy_(gate_up[j, inter:])
                e.down_proj.weight.copy_(down[j])
        setattr(parent, child, experts)
    return len(found)


def canonical_key(key: str) -> str:
    """A stored tensor name under the unfused model's names (Mixtral's ``block_sparse_moe.experts.j.w1``
    -> ``mlp.experts.j.gate_proj``); other names unchanged."""
    m = _MIXTRAL.search(key)
    if m is None:
        return key
    return f"{key[:m.start()]}.mlp.{m.group(1) or ''}{_MIXTRAL_NAMES[m.group(2)]}.{key[m.end():]}"


def stored_key(key: str, model_type: str | None) -> str:
    """The name a checkpoint of ``model_type`` stores the unfused model's tensor ``key`` under (the
    inverse of :func:`canonical_key`): Mixtral's ``mlp.experts.j.gate_proj`` is
    ``block_sparse_moe.experts.j.w1`` (so transformers loads what llmopt writes); others unchanged."""
    if model_type not in BLOCK_SPARSE_MOE_TYPES:
        return key
    m = _UNFUSED.search(key)
    if m is None:
        return key
    local = {v: k for k, v in _MIXTRAL_NAMES.items()}[m.group(2) or m.group(3)]
    return f"{key[:m.start()]}.block_sparse_moe.{m.group(1) or ''}{local}.{key[m.end():]}"


def split_fused_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with fused ``experts.gate_up_proj`` / ``experts.down_proj`` tensors (a checkpoint
    saved from the fused layout) split into per-expert Linear weights."""
    out = {}
    for key, t in state.items():
        if key.endswith("experts.gate_up_proj") and t.dim() == 3:
            base, inter = key[: -len("gate_up_proj")], t.shape[1] // 2
            for j in range(t.shape[0]):
                out[f"{base}{j}.gate_proj.weight"], out[f"{base}{j}.up_proj.weight"] = t[j, :inter], t[j, inter:]
        elif key.endswith("experts.down_proj") and t.dim() == 3:
            base = key[: -len("down_proj")]
            for j in range(t.shape[0]):
                out[f"{base}{j}.down_proj.weight"] = t[j]
        else:
            out[key] = t
    return out


def is_expert(name: str) -> bool:
    """Whether the Linear ``name`` belongs to a routed expert."""
    return re.search(r"\.experts\.\d+\.", name) is not None


def is_router(name: str) -> bool:
    """Whether the Linear ``name`` is a router / expert gate (kept in float by every method)."""
    return re.search(r"\.(mlp|block_sparse_moe)\.(gate|shared_expert_gate)$", name) is not None
