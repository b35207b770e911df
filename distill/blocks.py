"""The block-wise phase of quantization-aware distillation (EfficientQAT's Block-AP).

Before the end-to-end phase trains every code against the teacher's logits, each decoder layer of
the quantized student is trained on its own, in order: its input is what the already-trained
student layers before it produce, its target is what the teacher's layer computes on the
teacher's own hidden states, and its loss is the mean squared difference relative to the
target's mean square. Only that layer's latent codes and scale multipliers move, so one layer's
activations are held at a time and each step costs one layer's forward and backward.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from llmopt.calibration import call_layer, capture_layer_inputs, decoder_layers
from llmopt.quant.fake_quant import FakeQuantModel, FakeQuantWeight


@dataclass
class BlockSettings:
    """How long and how fast each decoder layer trains."""

    steps: int  # optimizer steps per decoder layer (one mini-batch each, cycling through the windows)
    lr: float  # Adam's step on the scale multipliers (a cosine to 0 within each layer)
    code_lr: float  # Adam's step on the latent codes, in code units
    batch_size: int = 4
    seed: int = 0


def _layer_weights(layer: nn.Module, fake: FakeQuantModel) -> list[FakeQuantWeight]:
    inside = {id(m) for m in layer.modules()}
    return [w for w in fake.weights.values() if id(w) in inside]


def _relative_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target.float()).pow(2).mean() / target.float().pow(2).mean().clamp(min=1e-12)


def train_blocks(student: nn.Module, teacher: nn.Module, fake: FakeQuantModel, ids: torch.Tensor, settings: BlockSettings,
                 advance: Callable[[int], None] | None = None) -> dict:
    """Train ``student``'s decoder layers one at a time on the windows ``ids`` ``[n, seq]`` (see
    the module docstring); returns the per-layer relative MSE before and after, and the time."""
    if settings.steps < 1:
        raise ValueError("the block phase needs at least one step per layer")
    start = time.perf_counter()
    student.eval()
    teacher.eval()
    with torch.no_grad():
        s_in = capture_layer_inputs(student, ids, settings.batch_size)
        t_in = capture_layer_inputs(teacher, ids, settings.batch_size)
    batches = len(s_in.hidden)
    order = torch.randperm(batches, generator=torch.Generator().manual_seed(settings.seed))
    layers = []
    for index, (s_layer, t_layer) in enumerate(zip(decoder_layers(student), decoder_layers(teacher))):
        weights = _layer_weights(s_layer, fake)
        with torch.no_grad():
            targets = [call_layer(t_layer, h, kw) for h, kw in zip(t_in.hidden, t_in.kwargs)]

            def loss_now() -> float:
                return sum(float(_relative_mse(call_layer(s_layer, h, kw), t))
                           for h, kw, t in zip(s_in.hidden, s_in.kwargs, targets)) / batches

            before = loss_now()
        if weights:
            optimizer = torch.optim.Adam([{"params": [w.latent for w in weights], "lr": settings.code_lr},
                                          {"params": [w.log_multiplier for w in weights], "lr": settings.lr}])
            schedule = torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / settings.steps)))
            for step in range(settings.steps):
                b = int(order[step % batches])
                loss = _relative_mse(call_layer(s_layer, s_in.hidden[b], s_in.kwargs[b]), targets[b])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
                for w in weights:
                    w.clamp_()
        with torch.no_grad():
            after = loss_now()
            s_in.hidden[:] = [call_layer(s_layer, h, kw) for h, kw in zip(s_in.hidden, s_in.kwargs)]
            t_in.hidden[:] = targets
        layers.append({"layer": index, "mse_before": round(before, 6), "mse_after": round(after, 6)})
        if advance is not None:
            advance(1)
    for w in fake.weights.values():
        w.zero_grad(set_to_none=True)
    return {"settings": asdict(settings), "windows": int(ids.shape[0]), "layers": layers,
            "seconds": round(time.perf_counter() - start, 1)}
