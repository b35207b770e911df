"""Structured width pruning (Minitron-style): remove MLP channels and attention heads.

Importance is activation-based, measured on calibration data through the sequential engine
(each layer sees the outputs of the already-pruned layers before it):

- an MLP channel: the L2 norm, over all calibration tokens, of its activation
  ``act(gate_j(x)) · up_j(x)`` (the input of ``down_proj`` at channel ``j``);
- an attention head: the L2 norm, over tokens and the head's dimensions, of its attention
  output (the input of ``o_proj`` in that head's slice); a KV group scores the norm of all its
  query heads together.

Grouped-query attention stays valid: either whole KV groups (a key/value head with all of its
query heads) are removed, or the same number of query heads is removed from every group so the
query-per-KV ratio stays uniform. Every layer loses the same number of channels and heads (the
choice of which is per layer), so the config describes every layer and transformers loads the
result unchanged; ``head_dim`` is written explicitly since it no longer equals
``hidden_size / num_attention_heads``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from llmopt.calibration import decoder_layers, run_sequential
from llmopt.linear_stats import LinearStats
from llmopt.core.errors import LlmoptError
from torch import nn

HEAD_MODES = ("auto", "kv-groups", "query-heads")


@dataclass
class HeadPlan:
    """How many heads remain and how they are removed (``none``, ``kv-groups`` or ``query-heads``)."""

    mode: str
    heads: int
    kv_heads: int
    removed: int = 0


def _valid_ratios(n_heads: int, n_kv: int) -> str:
    group = n_heads // n_kv
    counts = sorted({k for k in range(1, n_heads) if k % group == 0 or k % n_kv == 0})
    return ", ".join(f"{k / n_heads:.3g}" for k in counts) or "none (keep all heads)"


def plan_heads(n_heads: int, n_kv: int, ratio: float, mode: str = "auto") -> HeadPlan:
    """Which head removal ``ratio`` (fraction of query heads) means for GQA with ``n_kv`` KV heads.

    ``kv-groups`` removes whole KV groups; ``query-heads`` removes the same number of query heads
    from every group; ``auto`` prefers whole groups. Refuses ratios that cannot keep GQA uniform.
    """
    if mode not in HEAD_MODES:
        raise LlmoptError(f"unknown heads mode '{mode}'", f"use one of {', '.join(HEAD_MODES)}")
    if not 0 <= ratio < 1:
        raise LlmoptError(f"--heads-ratio {ratio} is outside [0, 1)", "pass the fraction of attention heads to remove, e.g. 0.25")
    if n_kv <= 0 or n_heads % n_kv:
        raise LlmoptError(f"{n_heads} attention heads do not split into {n_kv} KV groups", "width-prune heads only in standard MHA/GQA models")
    if ratio == 0:
        return HeadPlan("none", n_heads, n_kv)
    removed = round(ratio * n_heads)
    group = n_heads // n_kv
    layout = f"{n_kv} KV heads × {group} query heads"
    if removed == 0 or removed >= n_heads:
        raise LlmoptError(
            f"--heads-ratio {ratio} removes {removed} of the model's {n_heads} attention heads",
            f"use one of {_valid_ratios(n_heads, n_kv)} ({layout})",
        )
    by_groups, by_queries = removed % group == 0, removed % n_kv == 0
    if mode in ("auto", "kv-groups") and by_groups:
        return HeadPlan("kv-groups", n_heads - removed, n_kv - removed // group, removed)
    if mode in ("auto", "query-heads") and by_queries:
        return HeadPlan("query-heads", n_heads - removed, n_kv, removed)
    how = {"auto": "whole KV groups or the same number of query heads per group",
           "kv-groups": "whole KV groups", "query-heads": "the same number of query heads per group"}[mode]
    raise LlmoptError(
        f"--heads-ratio {ratio} removes {removed} of {n_heads} attention heads, which breaks grouped-query attention ({layout})",
        f"remove {how}: use a ratio such as {_valid_ratios(n_heads, n_kv)}",
    )


def check_ffn_ratio(ratio: float, intermediate: int) -> int:
    """Channels kept by an MLP removal ``ratio``; refuses a ratio outside [0, 1) or keeping none."""
    if not 0 <= ratio < 1:
        raise LlmoptError(f"--ffn-ratio {ratio} is outside [0, 1)", "pass the fraction of MLP channels to remove, e.g. 0.25")
    kept = intermediate - round(ratio * intermediate)
    if kept < 1:
        raise LlmoptError(f"--ffn-ratio {ratio} leaves no MLP channel of {intermediate}", "use a smaller ratio")
    return kept


@dataclass
class WidthPruneResult:
    """What :func:`prune_width` did: sizes before/after, per-layer kept indices, time."""

    intermediate: tuple[int, int]
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    head_mode: str
    parameters: tuple[int, int]
    kept_channels: list[list[int]] = field(default_factory=list)
    kept_heads: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def _attention(layer: nn.Module) -> nn.Module:
    attn = getattr(layer, "self_attn", None)
    if attn is None or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
        raise LlmoptError(f"{type(layer).__name__} has no q/k/v/o attention projections", "width-prune a Llama-family model")
    return attn


def _mlp(layer: nn.Module) -> nn.Module:
    mlp = getattr(layer, "mlp", None)
    if mlp is None or not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
        raise LlmoptError(f"{type(layer).__name__} has no gate/up/down MLP", "width-prune a Llama-family model")
    return mlp


def _slice_linear(linear: nn.Linear, index: torch.Tensor, dim: int) -> None:
    """Keep rows (``dim=0``: outputs, and the bias) or columns (``dim=1``: inputs) ``index``."""
    linear.weight = nn.Parameter(linear.weight.data.index_select(dim, index).contiguous(), requires_grad=linear.weight.requires_grad)
    if dim == 0:
        linear.out_features = len(index)
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias.data.index_select(0, index).contiguous(), requires_grad=linear.bias.requires_grad)
    else:
        linear.in_features = len(index)


def slice_mlp(mlp: nn.Module, keep: torch.Tensor) -> None:
    """Keep MLP channels ``keep`` (rows of gate/up, columns of down)."""
    _slice_linear(mlp.gate_proj, keep, 0)
    _slice_linear(mlp.up_proj, keep, 0)
    _slice_linear(mlp.down_proj, keep, 1)
    if hasattr(mlp, "intermediate_size"):
        mlp.intermediate_size = len(keep)


def _head_rows(heads: list[int], head_dim: int) -> torch.Tensor:
    return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in heads])


def slice_attention(attn: nn.Module, keep_heads: list[int], keep_kv: list[int], head_dim: int) -> None:
    """Keep query heads ``keep_heads`` (q rows, o columns) and KV heads ``keep_kv`` (k/v rows).

    The kept query heads must be ordered by KV group, the same number per kept group.
    """
    q_rows, kv_rows = _head_rows(keep_heads, head_dim), _head_rows(keep_kv, head_dim)
    _slice_linear(attn.q_proj, q_rows, 0)
    _slice_linear(attn.k_proj, kv_rows, 0)
    _slice_linear(attn.v_proj, kv_rows, 0)
    _slice_linear(attn.o_proj, q_rows, 1)
    for name, value in (("num_heads", len(keep_heads)), ("num_key_value_heads", len(keep_kv)),
                        ("num_key_value_groups", len(keep_heads) // len(keep_kv))):
        if hasattr(attn, name):
            setattr(attn, name, value)


def choose_heads(importance: torch.Tensor, n_kv: int, plan: HeadPlan) -> tuple[list[int], list[int]]:
    """Kept query heads (grouped by KV head, in order) and kept KV heads, given per-query-head
    importance (squared L2 norms) and a plan."""
    n_heads = importance.numel()
    group = n_heads // n_kv
    per_group = importance.reshape(n_kv, group)
    if plan.mode == "kv-groups":
        kv = sorted(per_group.sum(1).argsort(descending=True, stable=True)[: plan.kv_heads].tolist())
        return [g * group + j for g in kv for j in range(group)], kv
    if plan.mode == "query-heads":
        keep = plan.heads // n_kv
        chosen = per_group.argsort(dim=1, descending=True, stable=True)[:, :keep].sort(dim=1).values
        return [g * group + int(j) for g in range(n_kv) for j in chosen[g]], list(range(n_kv))
    return list(range(n_heads)), list(range(n_kv))


def prune_width(
    model: nn.Module,
    calib_ids: torch.Tensor,
    ffn_ratio: float = 0.0,
    heads_ratio: float = 0.0,
    heads_mode: str = "auto",
    *,
    batch_size: int = 8,
    progress: Any = None,
    show_progress: bool = True,
) -> WidthPruneResult:
    """Remove the least important ``ffn_ratio`` of MLP channels and ``heads_ratio`` of attention
    heads from every decoder layer of ``model`` (in place), and update its config."""
    start = time.perf_counter()
    config = model.config
    decoder_layers(model)  # refuses models without Llama-style layers
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    inter = config.intermediate_size
    kept_inter = check_ffn_ratio(ffn_ratio, inter)
    plan = plan_heads(n_heads, n_kv, heads_ratio, heads_mode)
    if kept_inter == inter and plan.mode == "none":
        raise LlmoptError("width pruning with nothing to remove", "pass --ffn-ratio and/or --heads-ratio above 0")
    before = sum(p.numel() for p in model.parameters())
    result = WidthPruneResult((inter, kept_inter), (n_heads, plan.heads), (n_kv, plan.kv_heads), plan.mode, (before, before))

    def layer_fn(index: int, layer: nn.Module, run_layer: Any) -> None:
        attn, mlp = _attention(layer), _mlp(layer)
        with LinearStats({"o": attn.o_proj, "down": mlp.down_proj}, hessian=False, channel=True) as stats:
            run_layer()
        if kept_inter < inter:
            channel = stats.stats("down").sq_sum
            keep = channel.argsort(descending=True, stable=True)[:kept_inter].sort().values
            slice_mlp(mlp, keep)
            result.kept_channels.append(keep.tolist())
        if plan.mode != "none":
            heads = stats.stats("o").sq_sum.reshape(n_heads, head_dim).sum(1)
            keep_heads, keep_kv = choose_heads(heads, n_kv, plan)
            slice_attention(attn, keep_heads, keep_kv, head_dim)
            result.kept_heads.append(keep_heads)

    run_sequential(model, calib_ids, layer_fn, batch_size=batch_size, progress=progress,
                   description="width importance", show_progress=show_progress)
    config.head_dim = head_dim
    config.intermediate_size = kept_inter
    config.num_attention_heads = plan.heads
    config.num_key_value_heads = plan.kv_heads
    result.parameters = (before, sum(p.numel() for p in model.parameters()))
    result.seconds = time.perf_counter() - start
    return result
