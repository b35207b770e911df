"""Expert pruning: drop the ``num`` experts of every mixture-of-experts layer that its router uses
least, by routing frequency measured on calibration data (tokens routed to each expert; ties
broken by the summed routing weight, then the lower index).

An expert's rows of the router and its weights are removed (fused 3-D experts sliced, unfused
ones dropped from their list) and the config's expert count lowered, so the result is an
ordinary smaller checkpoint of the same architecture: transformers and llmopt's runtime load it
as they load the original. The router keeps its top-k over the experts that remain. Shared
experts (Qwen2-MoE) and dense layers are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from llmopt.core.errors import LlmoptError
from torch import nn

from llmopt.checkpoints.moe import UnfusedExperts, is_fused_experts

EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts")  # Mixtral's, Qwen-MoE's


def expert_count(config: dict) -> tuple[str, int] | None:
    """``(key, number of routed experts)`` of a model's ``config.json`` (None: not a mixture of experts)."""
    for key in EXPERT_COUNT_KEYS:
        if int(config.get(key) or 0) > 0:
            return key, int(config[key])
    return None


def check_expert_drop(config: dict, num: int) -> None:
    """Refuse a request the model cannot satisfy: not a mixture of experts, or fewer experts left than top-k."""
    found = expert_count(config)
    if found is None:
        raise LlmoptError(f"drop-experts needs a mixture-of-experts model; '{config.get('model_type')}' has no experts",
                          "use drop-layers or width on dense models")
    top_k = int(config.get("num_experts_per_tok") or 1)
    if found[1] - num < top_k:
        raise LlmoptError(f"--num {num} would leave {found[1] - num} of {found[1]} experts, fewer than the {top_k} every token uses",
                          f"drop at most {found[1] - top_k}")


@dataclass
class MoeBlock:
    name: str
    module: nn.Module  # its ``gate`` (the router, ``weight`` [experts, hidden]) and ``experts`` (fused or UnfusedExperts)

    @property
    def router(self) -> nn.Module:
        return self.module.gate

    @property
    def experts(self) -> nn.Module:
        return self.module.experts


def moe_blocks(model: nn.Module) -> list[MoeBlock]:
    """Every mixture-of-experts block (a ``gate`` router beside an ``experts`` module), in order."""
    found = []
    for name, module in model.named_modules():
        experts, router = getattr(module, "experts", None), getattr(module, "gate", None)
        if (isinstance(experts, UnfusedExperts) or (experts is not None and is_fused_experts(experts))) \
                and isinstance(getattr(router, "weight", None), torch.Tensor):
            found.append(MoeBlock(name, module))
    return found


@dataclass
class ExpertUsage:
    """Per MoE block: tokens routed to each expert and their summed routing weight."""

    counts: list[torch.Tensor]
    weights: list[torch.Tensor]
    tokens: int

    def least_used(self, num: int) -> list[list[int]]:
        """The ``num`` least-used experts of every block (ascending index)."""
        dropped = []
        for counts, weights in zip(self.counts, self.weights):
            order = sorted(range(len(counts)), key=lambda e: (int(counts[e]), float(weights[e]), e))
            dropped.append(sorted(order[:num]))
        return dropped


@torch.no_grad()
def measure_usage(model: nn.Module, calib_ids: torch.Tensor, batch_size: int = 8) -> ExpertUsage:
    """Run the calibration windows through ``model`` and count, per block, the tokens its router
    sends to each expert (what the experts module receives as ``top_k_index`` / ``top_k_weights``)."""
    blocks = moe_blocks(model)
    if not blocks:
        raise LlmoptError("drop-experts found no mixture-of-experts layer in the model", "use a Mixtral / Qwen-MoE style model")
    n = [b.router.weight.shape[0] for b in blocks]
    counts = [torch.zeros(k, dtype=torch.long) for k in n]
    weights = [torch.zeros(k, dtype=torch.float64) for k in n]

    def hook(i: int):
        def record(module, args, kwargs):
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            weight = args[2] if len(args) > 2 else kwargs["top_k_weights"]
            flat = index.reshape(-1).cpu()
            counts[i] += torch.bincount(flat, minlength=n[i])[: n[i]]
            weights[i].index_add_(0, flat, weight.reshape(-1).double().cpu())
        return record

    handles = [b.experts.register_forward_pre_hook(hook(i), with_kwargs=True) for i, b in enumerate(blocks)]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for start in range(0, calib_ids.shape[0], batch_size):
            model(input_ids=calib_ids[start:start + batch_size].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return ExpertUsage(counts, weights, int(calib_ids.numel()))


@torch.no_grad()
def drop_experts(model: nn.Module, dropped: list[list[int]]) -> None:
    """Remove expert ``dropped[i]`` of MoE block ``i`` (router rows and weights); every block must
    drop the same number (the config holds one expert count)."""
    blocks = moe_blocks(model)
    sizes = {len(d) for d in dropped}
    if len(dropped) != len(blocks) or len(sizes) != 1:
        raise ValueError("drop_experts needs one list of the same length per MoE block")
    before = blocks[0].router.weight.shape[0]
    after = before - sizes.pop()
    for block, drop in zip(blocks, dropped):
        keep = torch.tensor([e for e in range(before) if e not in set(drop)])
        _slice_rows(block.router, keep, before)
        if isinstance(block.experts, UnfusedExperts):
            block.module.experts = UnfusedExperts([block.experts[int(e)] for e in keep])
        else:
            _slice_rows(block.experts, keep, before)
    for module in model.modules():  # routers, experts and aux-loss counters that hold the count
        if getattr(module, "num_experts", None) == before:
            module.num_experts = after
    text = getattr(model.config, "get_text_config", lambda: model.config)()
    for config in {id(model.config): model.config, id(text): text}.values():
        for key in EXPERT_COUNT_KEYS:
            if getattr(config, key, None) == before:
                setattr(config, key, after)


def _slice_rows(module: nn.Module, keep: torch.Tensor, before: int) -> None:
    """Keep rows ``keep`` of every direct parameter / buffer of ``module`` with ``before`` rows."""
    for name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
        if tensor.dim() >= 1 and tensor.shape[0] == before:
            sliced = tensor.detach().index_select(0, keep.to(tensor.device)).contiguous()
            if isinstance(tensor, nn.Parameter):
                setattr(module, name, nn.Parameter(sliced, requires_grad=tensor.requires_grad))
            else:
                setattr(module, name, sliced)
