"""The bytes of a written file beyond its tensors' data, so that a plan's bits per weight are the
file's: a safetensors header's entry per tensor, and a GGUF file's header, metadata (the
tokenizer: tens of thousands of strings), tensor index and alignment padding.

The source checkpoint's stored dtypes (what its float tensors are written in) come from here too.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

SAFETENSORS_FIXED = 8 + len('{"__metadata__":{"format":"pt"}}') + 8  # length prefix, metadata, padding to 8 (at most)
GGUF_ALIGNMENT = 32  # bytes each GGUF tensor's data is aligned to
_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int32: "I32",
                torch.int64: "I64", torch.int8: "I8", torch.float8_e4m3fn: "F8_E4M3"}


def safetensors_entry_bytes(key: str, dtype: torch.dtype, shape: tuple[int, ...], offset_digits: int = 9) -> int:
    """Bytes of one tensor's entry in a safetensors header (compact JSON, offsets of ``offset_digits``)."""
    entry = {key: {"dtype": _DTYPE_NAMES.get(dtype, "F32"), "shape": list(shape), "data_offsets": [10**(offset_digits - 1)] * 2}}
    return len(json.dumps(entry, separators=(",", ":"))) - 2 + 1  # without the braces, with a comma


def gguf_data_bytes(nbytes: int) -> int:
    """Bytes a GGUF tensor of ``nbytes`` data takes, its alignment padding included."""
    return -(-nbytes // GGUF_ALIGNMENT) * GGUF_ALIGNMENT


def gguf_index_bytes(name: str, ndim: int) -> int:
    """Bytes of one tensor's entry in a GGUF file's tensor index (name, dims, type, offset)."""
    return 8 + len(name.encode()) + 4 + 8 * ndim + 4 + 8


@dataclass
class SourceLayout:
    """What the sizes of a written file depend on in the source checkpoint: each tensor's stored
    dtype, the GGUF name each tensor is written under, and the GGUF file's bytes before its
    first tensor (header, metadata and tokenizer, tensor index; None: not exportable)."""

    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    gguf_names: dict[str, str] = field(default_factory=dict)
    gguf_fixed_bytes: int | None = None

    def stored_bits(self, key: str, fallback: torch.dtype) -> int:
        return self.dtypes.get(key, fallback).itemsize * 8


def source_layout(path: Path | str | None) -> SourceLayout:
    """The :class:`SourceLayout` of the checkpoint directory ``path`` (empty when it is not one)."""
    from llmopt.checkpoints.lazy import LazyCheckpoint, safetensors_files

    if path is None or not Path(path).is_dir() or not safetensors_files(Path(path)):
        return SourceLayout()
    with LazyCheckpoint(path) as ckpt:
        dtypes = {k: ckpt.dtype(k) for k in ckpt.keys()}
        shapes = {k: tuple(ckpt.shape(k)) for k in ckpt.keys()}
    layout = SourceLayout(dtypes)
    try:
        layout.gguf_names, layout.gguf_fixed_bytes = _gguf_fixed(Path(path), shapes)
    except Exception:  # noqa: BLE001 - an architecture GGUF cannot export: GGUF sizes are not counted
        pass
    return layout


def _gguf_fixed(path: Path, shapes: dict[str, tuple[int, ...]]) -> tuple[dict[str, str], int]:
    """(GGUF name per source key, bytes before the tensor data) of a ``--type auto`` export of ``path``,
    measured by writing the header, metadata and tensor index to a scratch file."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from transformers import AutoTokenizer

    from llmopt.checkpoints.models import read_config
    from llmopt.formats.gguf_arch import TensorNames, write_metadata
    from llmopt.formats.gguf_source import Source, check_architecture, read_layout
    from llmopt.formats.gguf_vocab import build_vocab, write_vocab

    config = read_config(path)
    arch = check_architecture(config)
    source = Source(path, config, {k: torch.empty(s, device="meta") for k, s in shapes.items()}, {}, "dense")
    layout = read_layout(source)
    to_gguf = TensorNames(arch, layout, bool(config.get("tie_word_embeddings", False)))
    names = {k: n for k in shapes if (n := to_gguf(k))}
    stacked: dict[str, tuple[int, ...]] = {}  # experts share one tensor: [experts, rows, cols]
    for key, name in names.items():
        if to_gguf.expert(key) is None:
            stacked[name] = shapes[key]
        else:
            stacked[name] = (stacked[name][0] + 1 if name in stacked else 1, *shapes[key])
    vocab = build_vocab(AutoTokenizer.from_pretrained(path), layout.vocab, path)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "fixed.gguf"
        writer = GGUFWriter(str(out), arch.gguf)
        write_metadata(writer, source, layout, GGMLQuantizationType.F16, arch)
        write_vocab(writer, vocab)
        for name, shape in stacked.items():
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 0, GGMLQuantizationType.F32)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        return names, out.stat().st_size
