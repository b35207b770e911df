"""Quantize a transformers model that is already in memory, in place.

The same path as a checkpoint streamed from disk (:func:`~llmopt.quant.streaming.quantize_source`
on an :class:`~llmopt.checkpoints.in_memory.InMemoryModel`): the same engine, quantizers and
embedding / head formats, each layer computed in float32 as a streamed layer is, so a model
object and a checkpoint of it give the same codes and scales. The model keeps the dequantized
weights (the format's grid, in its own dtypes) and generates at once; the returned
:class:`~llmopt.quant.streaming.StreamedQuantization` holds every quantized module's codes and
scales for a writer. Nothing here writes a file.
"""

from __future__ import annotations

import torch
from torch import nn

from llmopt.checkpoints.in_memory import InMemoryModel
from llmopt.quant.request import QuantizeRequest
from llmopt.quant.streaming import StreamedQuantization, quantize_source


def quantize_in_memory(model: nn.Module, request: QuantizeRequest, calibration: torch.Tensor | None = None, *,
                       progress=None) -> StreamedQuantization:
    """Quantize ``model`` in place as ``request`` says (``request.device``: where each layer is
    calibrated, None for the CPU); the result keeps every quantized module's codes and scales."""
    done = quantize_source(InMemoryModel(model), request, calibration, progress=progress)
    _write_outer(model, done)
    return done


def _write_outer(model: nn.Module, done: StreamedQuantization) -> None:
    """Give the model its quantized embedding / head (dequantized), untying them first where the
    checkpoint holds both (the head keeps its float values when only the embedding is quantized)."""
    if done.untied:
        head = model.get_output_embeddings()
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
    with torch.no_grad():
        for name in done.outer_modules:
            weight = model.get_submodule(name).weight
            weight.copy_(done.result.weights[name].dequantize(weight.dtype).to(weight.device))
