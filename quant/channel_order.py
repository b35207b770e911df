"""Channel order for llama.cpp: an MLP's intermediate channels arranged for its int8 input blocks.

llama.cpp rounds the input of a quantized matmul to int8 in blocks (256 values for the k-quants), each
block's step set by its largest |x| (:mod:`llmopt.formats.llama_cpp_inputs`): one channel of large
activations coarsens the rounding of the 255 others in its block. A down projection's input channels
— the gated intermediate channels — can be reordered freely (the gate's and up projection's rows with
the down projection's columns), leaving the float model unchanged, so channels of large activations
can share blocks instead of each widening a block of its own.

The weight's groups lie along the same axis, so an order that helps the inputs can hurt the weights
(k-quants with minima, Q5_K / Q4_K, lost more than the inputs gained on the demo model). Each
candidate order — the stored one, by mean square input, by largest input — is therefore priced as the
output error it leaves: llama.cpp's input rounding simulated on the sampled calibration rows plus the
weight's round-to-nearest error in its own format, weighted by the input Hessian; the cheapest is kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import nn

from llmopt.formats.schemes import QuantScheme
from llmopt.linear_stats import LinearStats
from llmopt.quant.method import GroupSizes, QuantMethod, ScaleTransform, Schemes
from llmopt.quant.rounding_cost import SAMPLE_EVERY, activation_block, activation_rounding_error, weight_rounding_error

STORED = "stored"


@dataclass
class ChannelOrderResult:
    """The order chosen for one MLP (costs: summed output error, as the AWQ records)."""

    name: str
    order: str  # STORED or the statistic sorted by
    cost_stored: float
    cost: float


def mlp_triples(linears: Mapping[str, nn.Linear]) -> list[tuple[str, str, str]]:
    """``(gate, up, down)`` names of each gated MLP (dense or one expert) among ``linears``."""
    found = []
    for name in linears:
        if not name.endswith("down_proj"):
            continue
        parent = name[: -len("down_proj")]
        gate, up = f"{parent}gate_proj", f"{parent}up_proj"
        if gate in linears and up in linears:
            width = linears[name].in_features
            if linears[gate].out_features == width == linears[up].out_features:
                found.append((gate, up, name))
    return found


def candidate_orders(hessian: torch.Tensor, samples: torch.Tensor) -> dict[str, torch.Tensor]:
    """Channel orders to price: by mean square input (the Hessian's diagonal) and by largest sampled
    input, largest first (GPTQ's activation order then follows the stored order)."""
    return {"mean square": torch.argsort(hessian.diagonal(), descending=True, stable=True),
            "largest": torch.argsort(samples.abs().amax(0), descending=True, stable=True)}


def choose_order(w: torch.Tensor, hessian: torch.Tensor, samples: torch.Tensor, scheme: QuantScheme,
                 group_size: int | None, block: int) -> tuple[str, torch.Tensor | None, float, float]:
    """The cheapest of the stored order and :func:`candidate_orders` for a consumer ``w``:
    ``(label, permutation or None for the stored order, cost of the stored order, cost)``."""
    def cost(perm: torch.Tensor | None) -> float:
        ws, h, x = (w, hessian, samples) if perm is None else (w[:, perm], hessian[perm][:, perm], samples[:, perm])
        return activation_rounding_error(ws, x, block) + weight_rounding_error(ws, h.double(), scheme, group_size)

    stored = best = cost(None)
    label, chosen = STORED, None
    for name, perm in candidate_orders(hessian, samples).items():
        value = cost(perm)
        if value < best:
            label, chosen, best = name, perm, value
    return label, chosen, stored, best


@torch.no_grad()
def permute_mlp(gate: nn.Linear, up: nn.Linear, down: nn.Linear, perm: torch.Tensor) -> None:
    """Reorder the intermediate channels: rows of ``gate`` and ``up`` (and biases), columns of ``down``."""
    for producer in (gate, up):
        producer.weight.data = producer.weight.data[perm.to(producer.weight.device)].contiguous()
        if producer.bias is not None:
            producer.bias.data = producer.bias.data[perm.to(producer.bias.device)].contiguous()
    down.weight.data = down.weight.data[:, perm.to(down.weight.device)].contiguous()


def order_mlp_channels(stats: LinearStats, scheme: QuantScheme, schemes: Schemes, group_sizes: GroupSizes,
                       calibrated: Mapping[str, nn.Linear]) -> list[ChannelOrderResult]:
    """Choose and apply each calibrated MLP's channel order (:func:`choose_order`), keeping
    ``stats`` consistent; MLPs whose down projection llama.cpp would not round are left alone."""
    results = []
    for gate, up, down in mlp_triples(calibrated):
        samples = stats.samples(down) if stats.has(down) else None
        own = schemes.get(down, scheme)
        block = activation_block(own, calibrated[down].in_features, group_sizes[down])
        if samples is None or block is None:
            continue
        w = calibrated[down].weight.detach().float().cpu()
        label, perm, stored, best = choose_order(w, stats.hessian(down).cpu(), samples, own, group_sizes[down], block)
        if perm is not None:
            permute_mlp(calibrated[gate], calibrated[up], calibrated[down], perm)
            stats.permute_inputs([down], perm)
        results.append(ChannelOrderResult(down[: -len("down_proj")].rstrip("."), label, stored, best))
    return results


@dataclass(frozen=True)
class ChannelOrder(ScaleTransform):
    """Orders each MLP's intermediate channels for llama.cpp's int8 input blocks
    (:func:`order_mlp_channels`); the transform a method without one gets for llama.cpp."""

    name: ClassVar[str] = "order"
    needs_hessian: ClassVar[bool] = True

    @property
    def sample_every(self) -> int:
        return SAMPLE_EVERY

    def check(self, scheme: QuantScheme) -> None:
        if scheme.activations is not None:
            raise ValueError(f"channel order is for llama.cpp's weight-only types, not {scheme.name}")

    def apply(self, mappings: list, stats: LinearStats, scheme: QuantScheme, schemes: Schemes,
              group_sizes: GroupSizes, calibrated: Mapping[str, nn.Linear]) -> list[ChannelOrderResult]:
        return order_mlp_channels(stats, scheme, schemes, group_sizes, calibrated)


def for_llama_cpp(method: QuantMethod) -> QuantMethod:
    """``method`` for a checkpoint llama.cpp will run: its transform told so
    (:meth:`ScaleTransform.for_llama_cpp`), or, for a calibrated quantizer without one, the channel
    order first."""
    if method.transform is not None:
        return replace(method, transform=method.transform.for_llama_cpp())
    if method.quantizer.calibrated:
        return replace(method, transform=ChannelOrder())
    return method
