"""Importance matrices in llama.cpp's format (``llama-imatrix``'s GGUF file): read one a llama.cpp
user brings (``quantize --imatrix``), write one from llmopt's calibration (``--save-imatrix``).

The file holds, per GGUF weight (``blk.0.attn_k.weight``), the sum of squares of the inputs of
that matrix over the calibration tokens (``<name>.in_sum2``, one value per input column) and the
token count (``<name>.counts``). Hugging Face module names map to the GGUF names through gguf's
own :class:`gguf.TensorNameMap` for the model's architecture.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

SUM2, COUNTS = ".in_sum2", ".counts"


def gguf_names(config: dict, linears: list[str]) -> dict[str, str]:
    """Hugging Face Linear name → GGUF weight name (``blk.N.attn_k.weight``) for ``config``'s
    architecture; names gguf does not map are left out."""
    import gguf

    from llmopt.formats.gguf_source import check_architecture

    arch_name = check_architecture(config).gguf
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    layers = int((config.get("text_config") or config).get("num_hidden_layers") or 0)
    table = gguf.get_tensor_name_map(arch, layers)
    out = {}
    for name in linears:
        found = table.get_name(name)
        if found is not None:
            out[name] = f"{found}.weight"
    return out


def read_imatrix(path: str | Path) -> dict[str, torch.Tensor]:
    """GGUF weight name → mean squared input per column (``in_sum2 / counts``) of an imatrix file."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a llama.cpp imatrix file ({exc})") from exc
    kind = reader.fields.get("general.type")
    if kind is None or kind.contents() != "imatrix":
        raise ValueError(f"{path} is not a llama.cpp imatrix file (general.type is not 'imatrix'; the legacy .dat "
                         "format is not read: convert it with llama-imatrix --in-file OLD -o NEW.gguf)")
    tensors = {t.name: np.asarray(t.data, dtype=np.float32) for t in reader.tensors}
    out = {}
    for name, sums in tensors.items():
        if not name.endswith(SUM2):
            continue
        weight = name[: -len(SUM2)]
        counts = tensors.get(weight + COUNTS)
        if counts is None or counts.size != 1 or counts[0] <= 0:
            continue  # per-expert matrices (several counts) are not used here
        out[weight] = torch.from_numpy(sums.reshape(-1) / counts[0])
    return out


def write_imatrix(path: str | Path, entries: dict[str, tuple[torch.Tensor, int]], dataset: str, chunks: int,
                  chunk_size: int) -> None:
    """Write ``entries`` (GGUF weight name → (sum of squared inputs per column, tokens)) as an imatrix
    file llama-quantize reads (``--imatrix``)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch="imatrix")
    writer.add_type("imatrix")
    writer.add_array("imatrix.datasets", [dataset])
    writer.add_uint32("imatrix.chunk_count", chunks)
    writer.add_uint32("imatrix.chunk_size", chunk_size)
    for name in sorted(entries):
        sums, count = entries[name]
        writer.add_tensor(name + SUM2, sums.double().numpy().astype(np.float32))
        writer.add_tensor(name + COUNTS, np.array([count], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


class ImatrixStats:
    """Input statistics from an imatrix, as a quantizer reads calibration statistics: a diagonal
    Hessian ``2 · mean x²`` per Linear (RTN's clipping search weighs each column by it)."""

    def __init__(self, mean_sq: dict[str, torch.Tensor]) -> None:
        self.mean_sq = mean_sq

    def has(self, name: str) -> bool:
        return name in self.mean_sq

    def hessian(self, name: str) -> torch.Tensor:
        return torch.diag(2.0 * self.mean_sq[name].double()).float()
