"""Prune a checkpoint on disk (magnitude, Wanda, SparseGPT; N:M too) one decoder layer at a time.

It runs :func:`~llmopt.pruning.apply.prune_model` on a
:class:`~llmopt.checkpoints.streaming.StreamedModel`: each layer is read in float32, pruned on the
outputs of the already-pruned layers before it, and written in its stored dtype before the next
is read; everything outside the layers is copied as stored. OWL's first, read-only pass streams
the layers without writing. Drop-layers and width change the model's shape and keep the
whole-model path (``llmopt.pipeline.stages.prune``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmopt.calibration import LayerLifecycle
from llmopt.checkpoints.provenance import write_provenance
from llmopt.checkpoints.streaming import StreamedModel
from llmopt.checkpoints.writer import DEFAULT_SHARD_BYTES, ShardedWriter
from llmopt.core.atomic import atomic_dir
from llmopt.pruning.apply import PruneSettings, prune_model


class _ReadOnly(LayerLifecycle):
    """The stream's layers materialized and freed, nothing written (OWL's observation pass)."""

    def __init__(self, stream: StreamedModel) -> None:
        self.stream = stream

    def open_embeddings(self) -> None:
        self.stream.open_embeddings()

    def close_embeddings(self) -> None:
        self.stream.close_embeddings()

    def before(self, index: int, layer: nn.Module) -> None:
        self.stream.materialize(index, layer)

    def after(self, index: int, layer: nn.Module) -> None:
        layer.to("meta")
        self.stream.ckpt.close()


def prune_streaming(
    source: Path,
    output: Path,
    settings: PruneSettings,
    calib_ids: torch.Tensor | None = None,
    *,
    tokenizer: Any = None,
    provenance: Callable[[dict], dict] | None = None,
    overwrite: bool = False,
    device: str | torch.device | None = "cpu",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    **run: Any,
) -> dict:
    """Prune ``source`` into ``output`` layer by layer; returns prune_model's record.
    ``provenance(record)`` gives the ``llmopt.json`` contents (default: the record)."""
    stream = StreamedModel(source)
    try:
        with atomic_dir(Path(output), overwrite) as tmp:
            writer = ShardedWriter(tmp, max_shard_bytes)

            def write_layer(index: int, prefix: str, layer: nn.Module) -> None:
                for key, tensor in layer.state_dict().items():
                    full = f"{prefix}{key}"
                    name = stream.stored_name(full)
                    writer.add(name, tensor.to(stream.stored_dtype_of(name)) if tensor.is_floating_point() else tensor)

            stream.sink = write_layer
            record = prune_model(stream.model, settings, calib_ids, lifecycle=stream,
                                 observe_lifecycle=_ReadOnly(stream), device=device, **run)
            writer.add_all(stream.outer_tensors())
            writer.close()
            config = stream.model.config
            config.architectures = [type(stream.model).__name__]
            config.save_pretrained(tmp)
            gen = getattr(stream.model, "generation_config", None)
            if gen is not None and (Path(source) / "generation_config.json").is_file():
                gen.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            record["weights_bytes"] = sum(f.stat().st_size for f in tmp.glob("*.safetensors"))
            record = provenance(record) if provenance is not None else record
            write_provenance(tmp, record)
    finally:
        stream.close()
    return record
