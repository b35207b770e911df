"""One lazy reader for a checkpoint directory's safetensors files (single file or sharded).

Files are memory-mapped (``safetensors.safe_open``); a tensor is read only when asked for and
comes back in its stored dtype, so a bf16 checkpoint costs page cache, not process memory,
until a layer is materialized. Shapes and dtypes come from the headers without reading data::

    with LazyCheckpoint(path) as ckpt:
        w = ckpt.get("model.layers.0.mlp.up_proj.weight")       # bf16 if stored as bf16
        layer = ckpt.subset("model.layers.0.", strip=True)      # {"mlp.up_proj.weight": …}
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from llmopt.core.errors import LlmoptError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def safetensors_files(path: Path) -> list[str]:
    """The checkpoint's safetensors file names: from the index when sharded, else every file."""
    index = path / INDEX_NAME
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if (path / SINGLE_NAME).is_file():
        return [SINGLE_NAME]
    return sorted(p.name for p in path.glob("*.safetensors"))


def _header(file: Path) -> dict[str, Any]:
    with file.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return header


class LazyCheckpoint:
    """Memory-mapped, read-on-demand access to every tensor of a checkpoint directory."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        files = safetensors_files(self.path)
        if not files:
            raise LlmoptError(f"{self.path} has no safetensors weights", "pass a checkpoint saved as safetensors")
        self._where: dict[str, str] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        for name in files:
            for key, info in _header(self.path / name).items():
                self._where[key] = name
                self._meta[key] = info
        self._handles: dict[str, Any] = {}

    # -- context management (the mmaps live as long as the handles) -----------------------------
    def __enter__(self) -> LazyCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._handles.clear()

    def _handle(self, fname: str) -> Any:
        handle = self._handles.get(fname)
        if handle is None:
            from safetensors import safe_open

            handle = safe_open(str(self.path / fname), framework="pt")
            self._handles[fname] = handle
        return handle

    # -- queries ---------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._meta[key]["shape"])

    def dtype(self, key: str) -> torch.dtype:
        return _DTYPES[self._meta[key]["dtype"]]

    def nbytes(self, key: str) -> int:
        start, end = self._meta[key]["data_offsets"]
        return int(end - start)

    def total_bytes(self, prefix: str = "") -> int:
        return sum(self.nbytes(k) for k in self._where if k.startswith(prefix))

    def get(self, key: str) -> torch.Tensor:
        """One tensor in its stored dtype (read from the memory map)."""
        if key not in self._where:
            raise KeyError(f"{key} is not in {self.path}")
        return self._handle(self._where[key]).get_tensor(key)

    def subset(self, prefix: str, strip: bool = False) -> dict[str, torch.Tensor]:
        """Every tensor whose name starts with ``prefix`` (names without it when ``strip``)."""
        return {(k[len(prefix):] if strip else k): self.get(k) for k in self._where if k.startswith(prefix)}

    def load_all(self) -> dict[str, torch.Tensor]:
        """Every tensor of the checkpoint (what the whole-file readers need)."""
        return {k: self.get(k) for k in self._where}

    def floating_dtype(self) -> torch.dtype:
        """The stored dtype of the floating-point tensors (the most common one by bytes)."""
        sizes: dict[torch.dtype, int] = {}
        for key in self._where:
            dt = self.dtype(key)
            if dt.is_floating_point:
                sizes[dt] = sizes.get(dt, 0) + self.nbytes(key)
        return max(sizes, key=sizes.get) if sizes else torch.float32


def read_tensors(path: Path | str) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory in their stored dtypes."""
    with LazyCheckpoint(path) as ckpt:
        return ckpt.load_all()
