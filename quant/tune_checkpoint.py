"""Tune a saved quantized checkpoint (:mod:`llmopt.quant.scale_tuning`).

The quantized checkpoint is read back (codes, scales and the dequantized model), the float
source model is loaded beside it as the teacher, and the tuned scales and norm weights are
returned by tensor name, for :func:`llmopt.checkpoints.rewrite.rewrite_tensors` to write.
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmopt.calibration import resolve_device
from llmopt.checkpoints.estimate import GIB, available_bytes
from llmopt.checkpoints.models import load_model
from llmopt.core.console import progress_task
from llmopt.core.errors import LlmoptError
from llmopt.formats.compressed import load_dequantized, read_compressed
from llmopt.quant.scale_tuning import TuneReport, TuneSettings, tune_scales

BYTES_PER_WEIGHT = 16  # float32 teacher, codes, rebuilt weights and their gradients


def check_tunable(weights: dict) -> None:
    """Refuse checkpoints whose quantized activations have no gradient to follow."""
    with_activations = sorted({qw.scheme.name for qw in weights.values() if qw.scheme.activations is not None})
    if with_activations:
        raise LlmoptError(f"scale tuning needs weight-only schemes; {', '.join(with_activations)} quantizes activations too",
                          "tune a W4A16 / W8A16 / IQ4_NL / AUTO checkpoint, or drop the tuning")


def _check_memory(weights: dict, device: torch.device | None) -> None:
    n = sum(qw.codes.numel() for qw in weights.values())
    need = BYTES_PER_WEIGHT * n
    free = available_bytes("cuda" if device is not None and device.type == "cuda" else "cpu")
    if need > free:
        raise LlmoptError(f"scale tuning needs about {need / GIB:.1f} GiB for {n / 1e6:.0f}M quantized weights "
                          f"but only {free / GIB:.1f} GiB is free", "drop the tuning, or run it on a machine with more memory")


def tune_checkpoint(quantized: Path, source: Path, ids: torch.Tensor, settings: TuneSettings,
                    device: str | None = None) -> tuple[dict[str, torch.Tensor], TuneReport]:
    """Tune ``quantized`` (made from the float ``source``) on the calibration windows ``ids``;
    returns the tensors to replace in it (tuned scales, norm weights) and the report."""
    weights, _ = read_compressed(Path(quantized))
    check_tunable(weights)
    where = resolve_device(device)
    _check_memory(weights, where)
    student = load_dequantized(Path(quantized), torch.float32).to(where)
    teacher, _ = load_model(source)
    teacher.to(where)
    with progress_task("tuning scales and norms", settings.steps) as advance:
        tuned, norms, report = tune_scales(student, teacher, weights, ids, settings, where, advance)
    replacements = {f"{name}.weight_scale": qw.scale for name, qw in tuned.items()}
    # float zero points (llama.cpp's mins) follow the tuned scales, so that the mins stay as they were
    replacements.update({f"{name}.weight_zero_point": qw.zero_point for name, qw in tuned.items()
                         if qw.scheme.float_zero and qw.zero_point is not None})
    replacements.update(norms)
    return replacements, report
