"""Quantize a checkpoint on disk one decoder layer at a time, with memory bounded by a layer.

The same algorithms as :func:`~llmopt.quant.apply.quantize_model` (it *is* that function, run on
a :class:`~llmopt.checkpoints.streaming.StreamedModel`): each layer is read from the memory map
in float32, calibrated on the outputs of the already-quantized layers before it, and handed to
the stream's output (the stage's writer) before the next layer is read. The embedding and head
are then quantized as the request asks (float, int8, int4 …; see :mod:`llmopt.quant.outer`), and
everything outside the decoder layers is returned for the writer: nothing here writes a file.
:func:`quantize_source` is that path for any layer source: a model object in memory takes it too
(:mod:`llmopt.quant.in_memory`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from llmopt.calibration import resolve_device
from llmopt.checkpoints.estimate import MemoryEstimate, estimate_memory, process_rss
from llmopt.checkpoints.models import read_config
from llmopt.checkpoints.streaming import StreamedModel
from llmopt.checkpoints.writer import DEFAULT_SHARD_BYTES
from llmopt.quant.apply import QuantizeResult, quantize_model
from llmopt.quant.outer import HEAD_GPTQ_NOTICE, head_inputs, quantize_outer
from llmopt.quant.request import QuantizeRequest


@dataclass
class StreamedQuantization:
    """What :func:`quantize_streaming` returns: the layers' result (their codes went to the
    stream's output), the tensors outside the decoder layers to write (float tensors as stored;
    a quantized embedding / head was handed to the output too) and whether the head was untied."""

    result: QuantizeResult
    outer: dict[str, torch.Tensor] = field(default_factory=dict)
    untied: bool = False
    outer_modules: list[str] = field(default_factory=list)  # the embedding / head, where quantized


class LayerSource(Protocol):
    """What :func:`quantize_source` reads: the engine's lifecycle over ``model``'s layers, plus the
    tensors outside them (:class:`~llmopt.checkpoints.streaming.StreamedModel`,
    :class:`~llmopt.checkpoints.in_memory.InMemoryModel`)."""

    model: nn.Module

    def outer_tensors(self) -> dict[str, torch.Tensor]: ...

    def tied_head(self) -> bool: ...


def quantize_estimate(source: Path, request: QuantizeRequest, calibration: torch.Tensor | None,
                      shard_bytes: int = DEFAULT_SHARD_BYTES) -> MemoryEstimate:
    """The memory bound of quantizing ``source`` as ``request`` asks (see :mod:`~llmopt.checkpoints.estimate`)."""
    from llmopt.checkpoints.lazy import LazyCheckpoint

    with LazyCheckpoint(source) as ckpt:
        size = ckpt.floating_dtype().itemsize
        total = ckpt.total_bytes()
    method = request.method
    n, seq = (calibration.shape if calibration is not None else (0, 0))
    return estimate_memory(read_config(source), size, hessian=method.calibrated and method.needs_hessian,
                           n_samples=int(n), seq_len=int(seq), batch_size=request.batch_size, output_bytes=total,
                           shard_bytes=shard_bytes, baseline=process_rss(), one_pass=method.one_pass,
                           reference=method.quantizer.uses_float_reference)


def quantize_streaming(stream: StreamedModel, request: QuantizeRequest, calibration: torch.Tensor | None = None, *,
                       progress=None) -> StreamedQuantization:
    """Quantize the checkpoint behind ``stream`` layer by layer; each layer's codes and float
    tensors go to the stream's output as the layer finishes. ``progress`` as for
    :func:`~llmopt.quant.apply.quantize_model`."""
    return quantize_source(stream, request, calibration, progress=progress)


def quantize_source(source: LayerSource, request: QuantizeRequest, calibration: torch.Tensor | None = None, *,
                    progress=None) -> StreamedQuantization:
    """Quantize the decoder layers of ``source`` (a streamed checkpoint, or a model in memory),
    then its embedding and head as the request asks. ``request.device`` None: the CPU."""
    target = resolve_device(request.device) or torch.device("cpu")
    request = replace(request, device=str(target))
    result = quantize_model(source.model, request, calibration, lifecycle=source, progress=progress)
    outer = source.outer_tensors()
    done = StreamedQuantization(result, outer)
    if request.head == "float" and request.embedding == "float":
        return done
    inputs = None
    if result.final_hidden is not None:
        inputs = head_inputs(source.model, outer, result.final_hidden)
        result.final_hidden = None
        result.notices.append(HEAD_GPTQ_NOTICE if inputs is not None
                              else "no final norm found: the output head was quantized without calibration (RTN)")
    quantized = quantize_outer(outer, source.tied_head(), request.head, request.embedding, head_inputs=inputs,
                               refit=request.method.quantizer.head_refit, scale_dtype=request.scale_dtype)
    for name in quantized.weights:
        outer.pop(f"{name}.weight", None)
    outer.update(quantized.floats)
    result.store(quantized.weights, source)
    result.notices.extend(quantized.notices)
    done.outer_modules = list(quantized.weights)
    if quantized.untie:
        _untie(source.model)
        done.untied = True
    return done


def _untie(model: nn.Module) -> None:
    """Mark ``model``'s config untied (the head and the embedding are saved apart)."""
    config = model.config
    text = getattr(config, "get_text_config", lambda: config)()
    for c in {id(config): config, id(text): text}.values():
        c.tie_word_embeddings = False

