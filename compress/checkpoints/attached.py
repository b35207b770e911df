"""What llmopt did to a model object in memory, kept on the model, and how such a model is saved.

A model quantized in memory holds dequantized weights (what it computes with); its exact codes
and scales, the ignore list and the provenance record ride along in a :class:`Compression` on the
model (attribute ``llmopt_compression``). :func:`save_model` writes them as the CLI writes a
quantized checkpoint (:func:`~llmopt.checkpoints.quantized_writer.write_in_memory`), atomically;
a model that was only pruned or distilled is written dense, as ``llmopt prune`` writes it. A
quantized model's ``save_pretrained`` is replaced by the same writer (as llm-compressor does), so
it never writes float weights for a model that is meant to be quantized.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmopt.core.errors import LlmoptError
from llmopt.formats.schemes import QuantizedWeight

ATTRIBUTE = "llmopt_compression"


@dataclass
class Compression:
    """The provenance record of the last stage (earlier stages under ``source_record``) and,
    once quantized, every quantized module's codes and scales and the modules kept in float."""

    record: dict
    weights: dict[str, QuantizedWeight] = field(default_factory=dict)
    ignore: list[str] = field(default_factory=list)

    @property
    def quantized(self) -> bool:
        return bool(self.weights)


def compression_of(model: nn.Module) -> Compression | None:
    """What llmopt did to ``model`` (None: nothing)."""
    found = getattr(model, ATTRIBUTE, None)
    return found if isinstance(found, Compression) else None


def describe(model: nn.Module) -> str:
    """A model object as provenance records name it."""
    origin = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    return f"in memory: {type(model).__name__}" + (f" from {origin}" if origin else "")


def attach(model: nn.Module, record: dict, weights: dict[str, QuantizedWeight] | None = None,
           ignore: list[str] | None = None) -> None:
    """Record a stage done on ``model`` (an earlier stage's record moves under ``source_record``);
    with ``weights`` the model is quantized and its ``save_pretrained`` writes them."""
    before = compression_of(model)
    if before is not None:
        record = {**record, "source_record": before.record}
    object.__setattr__(model, ATTRIBUTE, Compression(record, dict(weights or {}), list(ignore or [])))
    if weights:
        object.__setattr__(model, "save_pretrained", types.MethodType(_save_pretrained, model))


def refuse_quantized(model: nn.Module, verb: str) -> None:
    """Refuse to ``verb`` (e.g. "quantized again", "pruned") a model llmopt already quantized."""
    found = compression_of(model)
    if found is not None and found.quantized:
        raise LlmoptError(f"the model is already quantized ({found.record.get('scheme')}) and cannot be {verb}",
                          "start again from the float model")
    if getattr(model.config, "quantization_config", None) or getattr(model, "llmopt_dequantized", None):
        raise LlmoptError(f"the model was loaded from a quantized checkpoint and cannot be {verb}",
                          "load the float checkpoint")


def save_model(model: nn.Module, path: str | Path, tokenizer: Any = None, *, overwrite: bool = False,
               max_shard_bytes: int | None = None) -> Path:
    """Write ``model`` to ``path`` atomically: a compressed-tensors checkpoint with llmopt.json
    when llmopt quantized it, else its dense weights with llmopt.json; returns the path."""
    from llmopt.checkpoints.in_memory import check_model_object
    from llmopt.core.atomic import atomic_dir

    check_model_object(model, "saved")
    found = compression_of(model) or Compression({"source": describe(model)})
    path = Path(path)
    with atomic_dir(path, overwrite) as tmp:
        if found.quantized:
            _write_quantized(model, found, tmp, tokenizer, max_shard_bytes)
        else:
            _write_dense(model, found.record, tmp, tokenizer)
    return path


def _write_quantized(model: nn.Module, found: Compression, out: Path, tokenizer: Any, max_shard_bytes: int | None) -> None:
    from llmopt.checkpoints.in_memory import InMemoryModel
    from llmopt.checkpoints.quantized_writer import write_in_memory
    from llmopt.checkpoints.writer import DEFAULT_SHARD_BYTES

    check_unchanged(model, found.weights)
    write_in_memory(InMemoryModel(model), out, found.weights, found.ignore, tokenizer, found.record,
                    max_shard_bytes or DEFAULT_SHARD_BYTES)


def _write_dense(model: nn.Module, record: dict, out: Path, tokenizer: Any) -> None:
    from transformers import PreTrainedModel

    from llmopt.checkpoints.provenance import write_provenance

    PreTrainedModel.save_pretrained(model, out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    write_provenance(out, {**record, "weights_bytes": sum(f.stat().st_size for f in out.glob("*.safetensors"))})


def check_unchanged(model: nn.Module, weights: dict[str, QuantizedWeight]) -> None:
    """Refuse to write codes that no longer describe the model: a quantized module removed,
    reshaped, or whose weights moved off its codes (trained after quantizing)."""
    modules = dict(model.named_modules())
    for name, qw in weights.items():
        module = modules.get(name)
        weight = getattr(module, "weight", None)
        if weight is None or tuple(weight.shape) != tuple(qw.codes.shape):
            raise LlmoptError(f"{name} is not the module llmopt quantized any more", "quantize the model again")
        # the model holds the dequantized codes in its own dtype: equal up to that dtype's rounding
        expected = qw.dequantize(torch.float32)
        held = weight.detach().float().cpu()
        if not torch.allclose(held, expected, rtol=2**-7, atol=1e-6 * float(expected.abs().max() or 1)):
            raise LlmoptError(f"{name}'s weights changed after llmopt quantized them (its codes would not match)",
                              "quantize the model again after changing it")


SAVE_PRETRAINED_OPTIONS = {"safe_serialization", "max_shard_size", "is_main_process"}


def _save_pretrained(self: nn.Module, save_directory: str | Path, **kwargs: Any) -> None:
    """``save_pretrained`` of a model llmopt quantized: its compressed-tensors checkpoint
    (:func:`save_model`; no tokenizer, as transformers' own), into a new or empty folder."""
    unknown = sorted(set(kwargs) - SAVE_PRETRAINED_OPTIONS)
    if unknown or kwargs.get("safe_serialization") is False:
        what = ", ".join(unknown) or "safe_serialization=False"
        raise LlmoptError(f"save_pretrained({what}) is not supported on a model quantized by llmopt",
                          "call llmopt.save(model, path, tokenizer=tokenizer), then upload or copy the folder")
    if kwargs.get("is_main_process") is False:
        return
    path = Path(save_directory)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise LlmoptError(f"save_pretrained: {path} exists and is not an empty folder",
                          "pass a new folder, or llmopt.save(model, path, overwrite=True) to replace it")
    shard = kwargs.get("max_shard_size")
    if isinstance(shard, str):
        from transformers.utils.hub import convert_file_size_to_int

        shard = convert_file_size_to_int(shard)
    save_model(self, path, overwrite=path.exists(), max_shard_bytes=shard)
