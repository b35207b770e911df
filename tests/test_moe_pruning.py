"""Wanda / SparseGPT on mixture-of-experts models: every expert projection is pruned on the tokens
routed to it, an expert that no calibration token reaches is pruned by magnitude (weights alone,
reported), routers stay dense, and the pruned model is exactly the masked one (zeros where
pruned, finite logits)."""

from __future__ import annotations

import pytest
import torch
from test_moe_compression import DEAD, starved_model

from llmopt.checkpoints.moe import is_expert, is_router
from llmopt.pruning.magnitude import magnitude_mask
from llmopt.pruning.sparsify import MIN_EXPERT_TOKENS, SparsifyOptions, sparsify_model, sparsity_report

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_moe_pruning_with_a_starved_expert(kind, method):
    model = starved_model(kind)
    routers = {n: m.weight.detach().clone() for n, m in model.named_modules() if is_router(n)}
    assert len(routers) == 2
    calib = torch.randint(3, 259, (4, 32), generator=torch.Generator().manual_seed(0))
    result = sparsify_model(model, SparsifyOptions(method, sparsity=0.5, batch_size=2), calib, show_progress=False)
    experts = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and is_expert(n)}
    assert len(experts) == 2 * 5 * 3  # unfused: one Linear per expert projection
    # every expert projection is half zeros, the never-routed ones included
    for name, module in experts.items():
        zeros = int((module.weight == 0).sum())
        assert zeros == module.weight.numel() // 2, f"{name}: {zeros} zeros"
    dead = {n for n in experts if f".experts.{DEAD}." in n}
    assert len(result.starved_experts) == len(dead) == 6 and all(v == 0 for v in result.starved_experts.values())
    assert any(str(MIN_EXPERT_TOKENS) in notice for notice in result.notices)
    # starved experts: exactly magnitude pruning of their weights (kept weights unchanged)
    fresh = starved_model(kind)
    from llmopt.checkpoints.moe import unfuse_experts

    unfuse_experts(fresh)
    original = dict(fresh.named_modules())
    for name in dead:
        w = original[name].weight.detach()
        assert torch.equal(experts[name].weight.detach(), w * magnitude_mask(w, 0.5, None))
    # routers untouched and dense
    for name, weight in routers.items():
        assert torch.equal(dict(model.named_modules())[name].weight, weight)
    report = sparsity_report(model)
    assert not any(is_router(f".{n}") or n.endswith("mlp.gate") for n in report["modules"])
    logits = model(torch.randint(3, 259, (1, 16))).logits
    assert torch.isfinite(logits).all()
