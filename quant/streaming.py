"""Quantize a checkpoint on disk into a compressed-tensors checkpoint, one decoder layer at a time.

The same algorithms as :func:`~llmopt.quant.apply.quantize_model` (it *is* that function, run on
a :class:`~llmopt.checkpoints.streaming.StreamedModel`): each layer is read from the memory
map in float32, calibrated on the outputs of the already-quantized layers before it, and its
quantized tensors and remaining float tensors are written to the output shards before the next
layer is read. Embeddings, final norm and head are copied in their stored dtype, or quantized
(``head`` / ``embedding``: float, int8, int4; see :mod:`llmopt.quant.outer`). Peak memory
follows one layer (see :mod:`llmopt.checkpoints.estimate`), and the output is tensor-for-tensor
what ``quantize_model`` + ``save_compressed`` write for a float32 checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmopt.calibration import resolve_device
from llmopt.checkpoints.estimate import MemoryEstimate, check_fits, estimate_memory, process_rss
from llmopt.checkpoints.models import read_config
from llmopt.checkpoints.streaming import StreamedModel
from llmopt.checkpoints.writer import DEFAULT_SHARD_BYTES, ShardedWriter
from llmopt.core.atomic import atomic_dir
from llmopt.formats.compressed import final_quantization_config, quantized_tensors, write_side_files
from llmopt.formats.schemes import QuantizedWeight
from llmopt.quant.apply import DEFAULT_IGNORE, QuantizeResult, quantize_model
from llmopt.quant.outer import HEAD_GPTQ_NOTICE, head_inputs, quantize_outer

Provenance = Callable[[QuantizeResult, MemoryEstimate], dict]


def quantize_estimate(source: Path, method: str, calib_ids: torch.Tensor | None, batch_size: int = 8,
                      clip_search: bool | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES,
                      float_targets: bool = False) -> MemoryEstimate:
    """The memory bound of quantizing ``source`` with ``method`` (see :mod:`~llmopt.checkpoints.estimate`)."""
    from llmopt.checkpoints.lazy import LazyCheckpoint

    with LazyCheckpoint(source) as ckpt:
        size = ckpt.floating_dtype().itemsize
        total = ckpt.total_bytes()
    calibrated = method != "rtn"
    hessian = "gptq" in method or "awq" in method or (calibrated and clip_search is not False)
    n, seq = (calib_ids.shape if calib_ids is not None else (0, 0))
    return estimate_memory(read_config(source), size, hessian=hessian, n_samples=int(n), seq_len=int(seq),
                           batch_size=batch_size, output_bytes=total, shard_bytes=shard_bytes, baseline=process_rss(),
                           one_pass=method in ("gptq", "awq+gptq"), reference="gptq" in method and bool(float_targets))


def quantize_streaming(
    source: Path,
    output: Path,
    scheme_name: str,
    method: str = "rtn",
    group_size: int | None = None,
    calib_ids: torch.Tensor | None = None,
    ignore: Iterable[str] = DEFAULT_IGNORE,
    strict_groups: bool = False,
    *,
    tokenizer: Any = None,
    provenance: Provenance | None = None,
    overwrite: bool = False,
    device: str | torch.device | None = "cpu",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    check_memory: bool = True,
    announce: Callable[[str], None] | None = None,
    head: str = "float",
    embedding: str = "float",
    **options: Any,
) -> QuantizeResult:
    """Quantize the checkpoint directory ``source`` into ``output`` layer by layer.

    ``options`` are :func:`~llmopt.quant.apply.quantize_model`'s keyword options (``act_order``,
    ``damp``, ``progress`` …). ``device``: cpu / cuda / auto. Before any work the memory bound
    is computed and printed through ``announce`` and, with ``check_memory``, a job that does not
    fit the free memory is refused (:class:`~llmopt.core.errors.LlmoptError`); after the first
    layer the total time is estimated. ``provenance(result, estimate)`` gives the
    ``llmopt.json`` record (written last).
    """
    target = resolve_device(device) or torch.device("cpu")
    ignore = list(ignore)
    estimate = quantize_estimate(Path(source), method, calib_ids, options.get("batch_size", 8),
                                 options.get("clip_search"), max_shard_bytes, bool(options.get("float_targets")))
    if announce is not None:
        announce(estimate.describe())
    if check_memory:
        check_fits(estimate, target.type)
    stream = StreamedModel(source)
    stream.announce = announce
    try:
        with atomic_dir(Path(output), overwrite) as tmp:
            writer = ShardedWriter(tmp, max_shard_bytes)
            quantized: set[str] = set()

            def write_weights(weights: dict[str, QuantizedWeight]) -> None:
                writer.add_all({stream.stored_name(k): v for k, v in quantized_tensors(weights).items()})
                quantized.update(weights)

            def write_layer(index: int, prefix: str, layer: nn.Module) -> None:
                for key, tensor in layer.state_dict().items():
                    full = f"{prefix}{key}"
                    module, _, local = full.rpartition(".")
                    if local == "weight" and module in quantized:
                        continue
                    name = stream.stored_name(full)
                    writer.add(name, tensor.to(stream.stored_dtype_of(name)) if tensor.is_floating_point() else tensor)

            stream.sink = write_layer
            calibrated_head = head != "float" and calib_ids is not None and method != "rtn"
            result = quantize_model(stream.model, scheme_name, method, group_size, calib_ids, ignore, strict_groups,
                                    lifecycle=stream, device=target, sink=write_weights,
                                    keep_final_hidden=calibrated_head, **options)
            outer = stream.outer_tensors()
            if head != "float" or embedding != "float":
                inputs = None
                if result.final_hidden is not None:
                    inputs = head_inputs(stream.model, outer, result.final_hidden)
                    result.final_hidden = None
                    result.notices.append(HEAD_GPTQ_NOTICE if inputs is not None
                                          else "no final norm found: the output head was quantized without calibration (RTN)")
                done = quantize_outer(outer, stream.tied_head(), head, embedding, head_inputs=inputs,
                                      refit=options.get("scale_refit", True))
                for name in done.weights:
                    outer.pop(f"{name}.weight", None)
                outer.update(done.floats)
                write_weights(done.weights)
                result.weights.update({n: QuantizedWeight(torch.empty(0), torch.empty(0), None, qw.scheme, qw.group_size)
                                       for n, qw in done.weights.items()})
                result.notices.extend(done.notices)
                if done.untie:
                    _untie(stream.model)
            writer.add_all(outer)
            writer.close()
            qconfig = _stored_names(final_quantization_config(stream.model, result.weights, ignore), stream)
            record = provenance(result, estimate) if provenance is not None else {}
            write_side_files(stream.model, tokenizer, tmp, qconfig, record)
    finally:
        stream.close()
    return result



def _stored_names(qconfig: dict, stream: StreamedModel) -> dict:
    """``qconfig`` with its module names (ignore list, per-name targets) as the checkpoint stores them."""
    def stored(name: str) -> str:
        return stream.stored_name(f"{name}.weight").removesuffix(".weight")

    qconfig["ignore"] = [stored(n) for n in qconfig.get("ignore") or []]
    for group in (qconfig.get("config_groups") or {}).values():
        group["targets"] = [stored(t) for t in group.get("targets") or []]
    return qconfig


def _untie(model: nn.Module) -> None:
    """Mark ``model``'s config untied (the head and the embedding are saved apart)."""
    config = model.config
    text = getattr(config, "get_text_config", lambda: config)()
    for c in {id(config): config, id(text): text}.values():
        c.tie_word_embeddings = False
