"""Scale mappings of a Llama-family decoder layer: an op whose output channels can absorb a
per-channel scale (a norm, or a Linear's rows) and the Linears that consume those channels.

Dividing the op's output channel ``j`` by ``s_j`` and multiplying the consumers' input column
``j`` by ``s_j`` leaves the layer's function unchanged (used by AWQ and SmoothQuant). With
grouped-query attention ``v_proj`` has ``kv_heads * head_dim`` outputs while ``o_proj`` has
``heads * head_dim`` inputs; each v channel feeds ``heads / kv_heads`` o columns, so the scale
is repeated per query-head group.

In a mixture-of-experts layer the post-attention norm feeds every expert's gate/up (and a shared
expert's), and the router: the router is a *follower* — its columns take the scale too, so its
logits (and the routing) are unchanged — but it is never part of a scale search. Each expert's
up → down is a mapping of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class ScaleMapping:
    """One foldable (producer → consumers) pair."""

    name: str
    prev: nn.Module  # RMSNorm-like (``weight`` [C]) or nn.Linear (rows = channels)
    linears: dict[str, nn.Linear]  # full name → consumer
    repeat: int = 1  # consumer columns per producer channel (GQA: heads // kv_heads)
    head_dim: int = 1
    followers: dict[str, nn.Module] = field(default_factory=dict)  # float consumers (routers): rescaled only
    offset: float = 0.0  # a norm that scales by (offset + weight), as Gemma's (1 + w)

    @property
    def consumers(self) -> list[str]:
        """Every module whose inputs the fold rescales (Linears, then followers)."""
        return [*self.linears, *self.followers]

    @property
    def channels(self) -> int:
        return self.prev.weight.shape[0]

    def expand(self, s: torch.Tensor) -> torch.Tensor:
        """Producer-channel values → consumer input columns."""
        if self.repeat == 1:
            return s
        kv = s.numel() // self.head_dim
        return s.reshape(kv, 1, self.head_dim).expand(kv, self.repeat, self.head_dim).reshape(-1)

    def reduce(self, v: torch.Tensor, how: str = "mean") -> torch.Tensor:
        """Consumer input columns → producer channels (mean or max over the repeats)."""
        if self.repeat == 1:
            return v
        kv = v.numel() // (self.repeat * self.head_dim)
        v = v.reshape(kv, self.repeat, self.head_dim)
        return (v.mean(1) if how == "mean" else v.amax(1)).reshape(-1)

    @torch.no_grad()
    def fold(self, s: torch.Tensor) -> None:
        """Divide the producer's channels by ``s`` and multiply the consumers' columns by it."""
        w = self.prev.weight
        if w.dim() == 1:
            w.add_(self.offset).div_(s.to(w.dtype)).sub_(self.offset)
        else:
            w.div_(s.to(w.dtype).unsqueeze(1))
        bias = getattr(self.prev, "bias", None)
        if bias is not None:
            bias.div_(s.to(bias.dtype))
        se = self.expand(s)
        for lin in (*self.linears.values(), *self.followers.values()):
            lin.weight.mul_(se.to(lin.weight.dtype).unsqueeze(0))


def layer_mappings(layer: nn.Module, prefix: str = "") -> tuple[list[ScaleMapping], list[str]]:
    """The standard mappings of a Llama-family layer, and notices for those that were skipped.

    input_layernorm → q/k/v; v_proj → o_proj (GQA-aware); the norm before the MLP
    (``pre_feedforward_layernorm`` where the layer has one, as Gemma 2/3, whose
    ``post_attention_layernorm`` normalises the attention output instead) → gate/up;
    up_proj → down_proj. A norm is folded only when it is seen to scale by ``w`` or ``1 + w``.
    """
    mappings: list[ScaleMapping] = []
    notices: list[str] = []
    attn = getattr(layer, "self_attn", None)
    mlp = getattr(layer, "mlp", None)

    def lin(owner: nn.Module | None, *names: str) -> dict[str, nn.Linear] | None:
        found = {}
        for n in names:
            m = getattr(owner, n, None) if owner is not None else None
            if not isinstance(m, nn.Linear):
                return None
            found[n] = m
        return found

    def full(owner: str, mods: dict[str, nn.Linear]) -> dict[str, nn.Linear]:
        return {f"{prefix}{owner}.{n}": m for n, m in mods.items()}

    norm1 = getattr(layer, "input_layernorm", None)
    qkv = lin(attn, "q_proj", "k_proj", "v_proj")
    if norm1 is not None and qkv is not None:
        mappings.extend(_norm_mapping("input_layernorm→q/k/v", norm1, full("self_attn", qkv), notices, prefix))
    vo = lin(attn, "v_proj", "o_proj")
    if vo is not None:
        v, o = vo["v_proj"], vo["o_proj"]
        head_dim = getattr(attn, "head_dim", None)
        if v.out_features == o.in_features:
            mappings.append(ScaleMapping("v_proj→o_proj", v, full("self_attn", {"o_proj": o})))
        elif head_dim and o.in_features % v.out_features == 0 and v.out_features % head_dim == 0:
            mappings.append(
                ScaleMapping(
                    "v_proj→o_proj", v, full("self_attn", {"o_proj": o}),
                    repeat=o.in_features // v.out_features, head_dim=head_dim,
                )
            )
        else:
            notices.append(f"{prefix}self_attn: v_proj→o_proj shapes do not allow scaling; skipped")
    norm2_name = "pre_feedforward_layernorm" if hasattr(layer, "pre_feedforward_layernorm") else "post_attention_layernorm"
    norm2 = getattr(layer, norm2_name, None)
    gu = lin(mlp, "gate_proj", "up_proj")
    if norm2 is not None and gu is not None:
        mappings.extend(_norm_mapping(f"{norm2_name}→gate/up", norm2, full("mlp", gu), notices, prefix))
    ud = lin(mlp, "up_proj", "down_proj")
    if ud is not None and ud["up_proj"].out_features == ud["down_proj"].in_features:
        mappings.append(
            ScaleMapping("up_proj→down_proj", ud["up_proj"], full("mlp", {"down_proj": ud["down_proj"]}))
        )
    experts = getattr(mlp, "experts", None)
    if experts is not None:
        found, moe_notice = _expert_mappings(mlp, norm2, norm2_name, prefix)
        mappings.extend(found)
        notices.extend(moe_notice)
    if not mappings:
        notices.append(f"{prefix or 'layer'}: no scale mappings found (not a Llama-family layer?)")
    return mappings, notices


def norm_offset(norm: nn.Module) -> float | None:
    """0 for a norm computing ``x̂ · w``, 1 for ``x̂ · (1 + w)`` (Gemma), None for anything else
    (found by running it on a constant input, whose normalised value is 1 in every channel)."""
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1:
        return None
    try:
        with torch.no_grad():
            out = norm(torch.ones(1, w.shape[0], dtype=w.dtype, device=w.device)).float().reshape(-1)
    except Exception:  # not a norm we can call on its own
        return None
    for offset in (0.0, 1.0):
        if torch.allclose(out, w.float() + offset, rtol=1e-3, atol=1e-3):
            return offset
    return None


def _norm_mapping(name: str, norm: nn.Module, linears: dict[str, nn.Linear], notices: list[str], prefix: str,
                  followers: dict[str, nn.Module] | None = None) -> list[ScaleMapping]:
    """The mapping ``norm → linears`` when the norm's scaling is known; otherwise a notice."""
    offset = norm_offset(norm)
    if offset is None:
        notices.append(f"{prefix}{name}: the norm does not scale by its weight (or 1 + weight); not rescaled")
        return []
    return [ScaleMapping(name, norm, linears, followers=followers or {}, offset=offset)]


def _expert_mappings(mlp: nn.Module, norm: nn.Module | None, norm_name: str, prefix: str) -> tuple[list[ScaleMapping], list[str]]:
    """norm → every expert's (and the shared expert's) gate/up, the router following; each
    expert's up → down. Experts must be unfused (one Linear per projection)."""
    experts = mlp.experts
    pairs = [(f"experts.{j}", e) for j, e in enumerate(experts)] if isinstance(experts, nn.ModuleList) else []
    shared = getattr(mlp, "shared_expert", None)
    if shared is not None:
        pairs.append(("shared_expert", shared))
    projections = [(name, getattr(e, "gate_proj", None), getattr(e, "up_proj", None), getattr(e, "down_proj", None))
                   for name, e in pairs]
    if not pairs or any(not all(isinstance(m, nn.Linear) for m in ms) for _, *ms in projections):
        return [], [f"{prefix}mlp: mixture-of-experts MLP without one Linear per expert projection: experts are "
                    "quantized without AWQ / SmoothQuant scaling"]
    mappings: list[ScaleMapping] = []
    notices: list[str] = []
    followers = {f"{prefix}mlp.{n}": m for n in ("gate", "shared_expert_gate")
                 if isinstance(m := getattr(mlp, n, None), nn.Module) and getattr(m, "weight", None) is not None
                 and m.weight.dim() == 2}
    if norm is not None and all(f.weight.shape[1] == norm.weight.shape[0] for f in followers.values()):
        consumers = {f"{prefix}mlp.{name}.{p}": m for name, gate, up, _ in projections for p, m in (("gate_proj", gate), ("up_proj", up))}
        mappings.extend(_norm_mapping(f"{norm_name}→experts", norm, consumers, notices, prefix, followers))
    for name, _, up, down in projections:
        if up.out_features == down.in_features:
            mappings.append(ScaleMapping(f"{name}.up_proj→down_proj", up, {f"{prefix}mlp.{name}.down_proj": down}))
    return mappings, notices
