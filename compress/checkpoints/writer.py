"""Sharded safetensors output written as tensors arrive, with bounded memory.

Tensors are buffered until the next one would push the buffer past ``max_shard_bytes``; the
buffer is then written as a shard and dropped. :meth:`ShardedWriter.close` writes the last
shard, names the shards ``model-0000i-of-0000n.safetensors`` with the usual
``model.safetensors.index.json`` (or one ``model.safetensors`` when a single shard suffices,
as ``save_pretrained`` does). Memory held: at most one shard's buffer, twice while it is
written (``save_file`` serializes it to bytes first).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from llmopt.checkpoints.lazy import INDEX_NAME, SINGLE_NAME

DEFAULT_SHARD_BYTES = 512 * 1024**2  # safetensors' save_file copies a shard once more while writing it


class ShardedWriter:
    """Collects tensors and writes them to ``out_dir`` in shards of at most ``max_shard_bytes``."""

    def __init__(self, out_dir: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffered = 0
        self._shards: list[tuple[str, list[str]]] = []  # temporary file name, keys
        self.total_bytes = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        if key in self._buffer or any(key in keys for _, keys in self._shards):
            raise ValueError(f"tensor {key} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffered + nbytes > self.max_shard_bytes:
            self.flush()
        self._buffer[key] = tensor.detach().cpu().contiguous()
        self._buffered += nbytes
        self.total_bytes += nbytes

    def add_all(self, tensors: dict[str, torch.Tensor]) -> None:
        for key in sorted(tensors):
            self.add(key, tensors[key])

    def flush(self) -> None:
        """Write the buffered tensors as one shard and drop them."""
        if not self._buffer:
            return
        from safetensors.torch import save_file

        name = f".shard-{len(self._shards):05d}.tmp"
        save_file(self._buffer, str(self.out_dir / name), metadata={"format": "pt"})
        self._shards.append((name, sorted(self._buffer)))
        self._buffer, self._buffered = {}, 0

    def close(self) -> list[str]:
        """Write what is left and give the shards their final names; returns the file names."""
        self.flush()
        if len(self._shards) == 1:
            (self.out_dir / self._shards[0][0]).rename(self.out_dir / SINGLE_NAME)
            return [SINGLE_NAME]
        weight_map: dict[str, str] = {}
        names = []
        for i, (tmp, keys) in enumerate(self._shards, 1):
            final = f"model-{i:05d}-of-{len(self._shards):05d}.safetensors"
            (self.out_dir / tmp).rename(self.out_dir / final)
            weight_map.update({k: final for k in keys})
            names.append(final)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))
        return names
