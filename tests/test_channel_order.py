"""Channel order for llama.cpp: an MLP's intermediate channels reordered for its int8 input blocks."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType
from torch import nn

from llmopt.formats.llama_cpp_inputs import rounded_to_int8_blocks
from llmopt.formats.registry import FORMATS
from llmopt.linear_stats import LinearStats
from llmopt.quant.llama_mixtures import scheme_of
from llmopt.quant.channel_order import STORED, choose_order, mlp_triples, order_mlp_channels, permute_mlp
from llmopt.quant.rounding_cost import activation_rounding_error, weight_rounding_error
from tests.conftest import tiny_llama


def spiky_inputs(n: int, d: int, spikes: list[int], seed: int) -> torch.Tensor:
    """Inputs whose ``spikes`` channels run 50× larger than the rest, now and then."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    x[:, spikes] *= 50 * (torch.rand(n, len(spikes), generator=g) < 0.3)
    return x


def test_triples_are_gated_mlps_of_matching_width():
    """Dense and expert MLPs are found by their projections; an MLP without a gate or of mismatched
    widths is not."""
    lin = {"m.mlp.gate_proj": nn.Linear(8, 16), "m.mlp.up_proj": nn.Linear(8, 16), "m.mlp.down_proj": nn.Linear(16, 8),
           "m.mlp.experts.0.gate_proj": nn.Linear(8, 4), "m.mlp.experts.0.up_proj": nn.Linear(8, 4),
           "m.mlp.experts.0.down_proj": nn.Linear(4, 8), "n.mlp.up_proj": nn.Linear(8, 16), "n.mlp.down_proj": nn.Linear(16, 8),
           "k.mlp.gate_proj": nn.Linear(8, 12), "k.mlp.up_proj": nn.Linear(8, 16), "k.mlp.down_proj": nn.Linear(16, 8)}
    assert mlp_triples(lin) == [("m.mlp.gate_proj", "m.mlp.up_proj", "m.mlp.down_proj"),
                                ("m.mlp.experts.0.gate_proj", "m.mlp.experts.0.up_proj", "m.mlp.experts.0.down_proj")]


def test_sorting_spread_spikes_into_one_block_lowers_the_cost():
    """Large channels spread over four 256-blocks widen every block's step; an order that puts them
    in one block lowers the input rounding and the total cost, and is what is chosen (Q6_K: symmetric
    groups, whose error the order hardly changes)."""
    x = spiky_inputs(600, 1024, [5, 300, 600, 900], seed=0)
    w = torch.randn(64, 1024, generator=torch.Generator().manual_seed(1)) / 32
    h = 2 * x.double().T @ x.double() / x.shape[0]
    scheme = FORMATS["int6"].scheme(16)
    label, perm, stored, best = choose_order(w, h, x, scheme, 16, 256)
    assert label != STORED and perm is not None and perm.shape == (1024,)
    assert sorted(perm.tolist()) == list(range(1024))
    assert set(perm[:256].tolist()) >= {5, 300, 600, 900}  # the spikes share the first block
    assert best < 0.9 * stored
    assert activation_rounding_error(w[:, perm], x[:, perm], 256) < 0.85 * activation_rounding_error(w, x, 256)
    expected = activation_rounding_error(w[:, perm], x[:, perm], 256) + weight_rounding_error(
        w[:, perm], h[perm][:, perm], scheme, 16)
    assert abs(best - expected) <= 1e-6 * expected


def test_stored_order_is_kept_when_nothing_is_cheaper():
    """With the spikes already in one block, no candidate beats the stored order by the cost: it is kept."""
    x = spiky_inputs(600, 512, [0, 1, 2, 3], seed=2)
    w = torch.randn(32, 512, generator=torch.Generator().manual_seed(3)) / 32
    h = 2 * x.double().T @ x.double() / x.shape[0]
    label, perm, stored, best = choose_order(w, h, x, FORMATS["int6"].scheme(16), 16, 256)
    assert best <= stored
    if label == STORED:
        assert perm is None and best == stored


def test_ordering_leaves_the_float_model_and_keeps_the_statistics_true():
    """Ordering a tiny Llama's MLPs (256-wide inputs to the down projections, k-quant blocks) leaves
    its logits unchanged, and the statistics it reordered equal those gathered again afterwards."""
    model = tiny_llama(seed=0, hidden_size=64, intermediate_size=512, num_hidden_layers=1)
    with torch.no_grad():  # a few intermediate channels far larger than the rest, in different blocks
        model.model.layers[0].mlp.up_proj.weight[[3, 260, 400]] *= 30
    ids = torch.randint(0, 259, (4, 64), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = model(ids).logits
    layer = model.model.layers[0]
    linears = {f"mlp.{n}": getattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")}
    with LinearStats(linears, hessian=True, channel=True, sample_every=3) as stats:
        with torch.no_grad():
            model(ids)
    scheme = scheme_of(GGMLQuantizationType.Q6_K)  # as a llama.cpp mixture asks for it
    results = order_mlp_channels(stats, scheme, {}, {n: scheme.group_size for n in linears}, linears)
    assert len(results) == 1 and results[0].name == "mlp" and results[0].order != STORED
    assert results[0].cost < results[0].cost_stored
    with torch.no_grad():
        after = model(ids).logits
    assert after.shape == before.shape
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    with LinearStats(linears, hessian=True, channel=True, sample_every=3) as again:
        with torch.no_grad():
            model(ids)
    down = "mlp.down_proj"
    torch.testing.assert_close(stats.hessian(down), again.hessian(down), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(stats.abs_mean(down), again.abs_mean(down), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats.samples(down), again.samples(down), atol=1e-5, rtol=1e-5)


def test_permuting_reorders_producers_rows_and_consumer_columns():
    """Gate and up rows (with their biases) and down columns move together: the MLP's output is unchanged."""
    g = torch.Generator().manual_seed(5)
    gate, up, down = nn.Linear(8, 32), nn.Linear(8, 32), nn.Linear(32, 8)
    x = torch.randn(10, 8, generator=g)

    def mlp() -> torch.Tensor:
        return down(torch.nn.functional.silu(gate(x)) * up(x))

    with torch.no_grad():
        before = mlp()
        perm = torch.randperm(32, generator=g)
        weight = up.weight.clone()
        permute_mlp(gate, up, down, perm)
        torch.testing.assert_close(up.weight, weight[perm])
        torch.testing.assert_close(mlp(), before, atol=1e-6, rtol=1e-6)


def test_rounding_matches_the_simulation():
    """The cost's input term is the direct rounding error of the sampled rows."""
    x = spiky_inputs(100, 512, [9], seed=6)
    w = torch.randn(16, 512, generator=torch.Generator().manual_seed(7))
    direct = 2 * float(((rounded_to_int8_blocks(x, 256) - x) @ w.T).pow(2).sum(1).mean())
    assert abs(activation_rounding_error(w, x, 256) - direct) <= 1e-6 * direct
