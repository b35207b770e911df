"""``llmopt export``: one checkpoint, three output formats.

* ``gguf``: one file for llama.cpp (see :mod:`llmopt.formats.gguf_export`);
* ``hf``: a plain float safetensors checkpoint (quantized weights dequantized), for tools that
  read only dense checkpoints;
* ``compressed-tensors``: our default save, re-written from a compressed-tensors checkpoint with
  its integer codes unchanged (e.g. to merge shards or drop extra files).

Every format is written to a temporary sibling and renamed into place when complete.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llmopt.core.atomic import atomic_dir, check_output
from llmopt.core.errors import LlmoptError
from llmopt.checkpoints.models import read_config, resolve_model
from llmopt.checkpoints.provenance import read_provenance, write_provenance
from llmopt.checkpoints.remote_code import remote_code_kwargs

FORMATS = ("gguf", "hf", "compressed-tensors")
DTYPES = ("float32", "float16", "bfloat16")


@dataclass
class DirExportReport:
    """What ``--format hf`` / ``compressed-tensors`` wrote."""

    output: str
    format: str
    source: str
    source_kind: str
    dtype: str | None
    bytes: int
    seconds: float
    notes: list[str]

    def to_dict(self) -> dict:
        return asdict(self)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _provenance(source: Path, fmt: str, extra: dict | None = None) -> dict:
    return {"source": str(source), "exported_from": str(source), "export_format": fmt, **(extra or {})}


def _quant_method(config: dict) -> str | None:
    return (config.get("quantization_config") or {}).get("quant_method")


def float_model(path: Path, dtype: Any) -> tuple[Any, str]:
    """The checkpoint as a plain float model (quantized weights dequantized) and what it was."""
    from llmopt.formats.gguf_source import read_source, source_model

    config = read_config(path)
    method = _quant_method(config)
    if method is None:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval(), "dense"
    source = read_source(path)  # refuses quantization methods we cannot dequantize
    return source_model(source, fold_online=True).to(dtype), method


def export_hf(model: str | Path, output: str | Path, dtype: str = "auto", overwrite: bool = False) -> DirExportReport:
    """Write MODEL as a dense float safetensors checkpoint (``config.json`` without quantization)."""
    from transformers import AutoTokenizer

    start = time.perf_counter()
    output = Path(output)
    check_output(output, overwrite)
    path = resolve_model(model)
    config = read_config(path)
    if dtype == "auto":
        stored = str(config.get("dtype") or config.get("torch_dtype") or "float32")
        dtype = stored if stored in DTYPES else "float32"
    if dtype not in DTYPES:
        raise LlmoptError(f"unknown dtype '{dtype}'", f"use one of auto, {', '.join(DTYPES)}")
    import torch

    net, kind = float_model(path, getattr(torch, dtype))
    tokenizer = AutoTokenizer.from_pretrained(path, **remote_code_kwargs())
    if hasattr(net.config, "quantization_config"):
        del net.config.quantization_config
    net.config.dtype = getattr(torch, dtype)
    notes = [] if kind == "dense" else [f"{kind} weights dequantized to {dtype}"]
    with atomic_dir(output, overwrite) as tmp:
        net.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_provenance(tmp, _provenance(path, "hf", {"dequantized_from": kind}))
    return DirExportReport(str(output), "hf", str(path), kind, dtype, _dir_bytes(output),
                           round(time.perf_counter() - start, 2), notes)


def export_compressed_tensors(model: str | Path, output: str | Path, overwrite: bool = False) -> DirExportReport:
    """Re-write a compressed-tensors checkpoint (codes and scales bit for bit) to ``output``."""
    from llmopt.formats.compressed import (
        load_dequantized,
        read_compressed,
        save_compressed,
    )
    from transformers import AutoTokenizer

    start = time.perf_counter()
    output = Path(output)
    check_output(output, overwrite)
    path = resolve_model(model)
    method = _quant_method(read_config(path))
    if method != "compressed-tensors":
        what = "a dense checkpoint" if method is None else f"quantized with '{method}'"
        raise LlmoptError(
            f"{model} is {what}; compressed-tensors export re-writes checkpoints llmopt quantized",
            "quantize it first (llmopt quantize … writes compressed-tensors) or use --format hf",
        )
    weights, qconfig = read_compressed(path)
    net = load_dequantized(path)
    tokenizer = AutoTokenizer.from_pretrained(path, **remote_code_kwargs())
    record = read_provenance(path)
    record.update(_provenance(path, "compressed-tensors"))
    save_compressed(net, tokenizer, output, weights, list(qconfig.get("ignore") or []), record, overwrite=overwrite)
    return DirExportReport(str(output), "compressed-tensors", str(path), "compressed-tensors", None,
                           _dir_bytes(output), round(time.perf_counter() - start, 2), [])


def export_model(model: str | Path, output: str | Path, fmt: str = "gguf", **options: Any):
    """Dispatch to the exporter for ``fmt``; returns its report (``to_dict()`` for JSON)."""
    if fmt == "gguf":
        from llmopt.formats.gguf_export import export_gguf

        return export_gguf(model, output, **options)
    if fmt == "hf":
        return export_hf(model, output, dtype=options.get("dtype", "auto"), overwrite=options.get("overwrite", False))
    if fmt == "compressed-tensors":
        return export_compressed_tensors(model, output, overwrite=options.get("overwrite", False))
    raise LlmoptError(f"unknown export format '{fmt}'", f"use one of {', '.join(FORMATS)}")
