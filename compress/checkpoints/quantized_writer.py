"""Write a streamed quantization as a compressed-tensors checkpoint, layer by layer.

:class:`QuantizedCheckpointWriter` attaches to a :class:`~llmopt.checkpoints.streaming.StreamedModel`:
each layer's quantized weights are written in their compressed-tensors form as soon as they
exist, the layer's other tensors (norms, biases, routers, float Linears) in their stored dtype
when the layer is done; :meth:`~QuantizedCheckpointWriter.finish` writes the tensors outside the
decoder layers, the last shard and the side files (config.json with its ``quantization_config``,
generation config, tokenizer, llmopt.json). Names are written as the source checkpoint stores them.
:func:`write_in_memory` writes a model quantized in memory through the same writer, replaying
its layers in order, so both routes write the same tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmopt.calibration import decoder_layers
from llmopt.checkpoints.in_memory import InMemoryModel
from llmopt.checkpoints.streaming import StreamedModel
from llmopt.checkpoints.writer import DEFAULT_SHARD_BYTES, ShardedWriter
from llmopt.formats.compressed import final_quantization_config, quantized_tensors, sparsity_config, write_side_files
from llmopt.formats.hadamard import OnlineHadamard, transform_config
from llmopt.formats.schemes import QuantizedWeight


class QuantizedCheckpointWriter:
    """The output of one streamed quantization (or of a model quantized in memory) into
    ``out_dir`` (a temporary folder)."""

    def __init__(self, stream: StreamedModel | InMemoryModel, out_dir: Path,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        self.stream = stream
        self.out_dir = Path(out_dir)
        self.shards = ShardedWriter(self.out_dir, max_shard_bytes)
        self.quantized: set[str] = set()
        stream.output = self
        stream.sink = self.write_layer

    def keep(self, weights: dict[str, QuantizedWeight]) -> None:
        """Write quantized weights (module name → codes and scales)."""
        self.shards.add_all({self.stream.stored_name(k): v for k, v in quantized_tensors(weights).items()})
        self.quantized.update(weights)

    def write_layer(self, index: int, prefix: str, layer: nn.Module) -> None:
        """Write a finished layer's tensors that were not quantized, in their stored dtype."""
        for key, tensor in layer.state_dict().items():
            full = f"{prefix}{key}"
            module, _, local = full.rpartition(".")
            if local == "weight" and module in self.quantized:
                continue
            name = self.stream.stored_name(full)
            self.shards.add(name, tensor.to(self.stream.stored_dtype_of(name)) if tensor.is_floating_point() else tensor)

    def finish(self, outer: dict[str, torch.Tensor], weights: dict[str, QuantizedWeight], ignore: list[str],
               tokenizer: Any, record: dict) -> None:
        """Write the tensors outside the decoder layers, the last shard and the side files;
        ``weights``: every quantized module's scheme and group size (for the config)."""
        self.shards.add_all(outer)
        self.shards.close()
        qconfig = self._stored_names(final_quantization_config(self.stream.model, weights, ignore))
        pruned = record.get("source_sparsity")
        if pruned:  # the source was pruned to an N:M pattern that quantization keeps (zeros stay code 0)
            qconfig["sparsity_config"] = sparsity_config(pruned["pattern"], pruned["overall"], qconfig["ignore"])
        online = OnlineHadamard.of_provenance(record)
        if online:  # online Hadamards fused into the weights: consumers apply them to the inputs
            qconfig["transform_config"] = transform_config(online)
        write_side_files(self.stream.model, tokenizer, self.out_dir, qconfig, record)

    def _stored_names(self, qconfig: dict) -> dict:
        """``qconfig`` with its module names (ignore list, per-name targets) as the checkpoint stores them."""
        def stored(name: str) -> str:
            return self.stream.stored_name(f"{name}.weight").removesuffix(".weight")

        qconfig["ignore"] = [stored(n) for n in qconfig.get("ignore") or []]
        for group in (qconfig.get("config_groups") or {}).values():
            group["targets"] = [stored(t) for t in group.get("targets") or []]
        return qconfig


def write_in_memory(source: InMemoryModel, out_dir: Path, weights: dict[str, QuantizedWeight], ignore: list[str],
                    tokenizer: Any, record: dict, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Write the model of ``source``, quantized in memory (``weights``: every quantized module's
    codes and scales), into ``out_dir`` as :class:`QuantizedCheckpointWriter` writes a streamed
    quantization: each layer's codes, then its other tensors, then everything outside the layers."""
    writer = QuantizedCheckpointWriter(source, out_dir, max_shard_bytes)
    layers = decoder_layers(source.model)
    for index, prefix in enumerate(source.prefixes):
        writer.keep({n: w for n, w in weights.items() if n.startswith(prefix)})
        writer.write_layer(index, prefix, layers[index])
    outer = {n: w for n, w in weights.items() if not n.startswith(tuple(source.prefixes))}
    writer.keep(outer)
    floats = {k: v for k, v in source.outer_tensors().items() if k.removesuffix(".weight") not in outer}
    writer.finish(floats, weights, ignore, tokenizer, record)
