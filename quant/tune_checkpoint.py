"""Tune a saved quantized checkpoint (:mod:`llmopt.quant.scale_tuning`) and write the result.

The quantized checkpoint is read back (codes, scales and the dequantized model), the float
source model is loaded beside it as the teacher, and the tuned scales and norm weights replace
the old ones tensor for tensor in a copy of the checkpoint: every other file and tensor is
copied unchanged, and the copy appears at ``output`` only once it is complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from llmopt.calibration import resolve_device
from llmopt.checkpoints.estimate import GIB, available_bytes
from llmopt.checkpoints.lazy import safetensors_files
from llmopt.checkpoints.models import load_model
from llmopt.core.atomic import atomic_dir
from llmopt.core.console import progress_task
from llmopt.core.errors import LlmoptError
from llmopt.formats.compressed import load_dequantized, read_compressed
from llmopt.quant.scale_tuning import TuneReport, TuneSettings, tune_scales

RECORD = "llmopt.json"
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


def rewrite_tensors(checkpoint: Path, output: Path, replacements: dict[str, torch.Tensor], record: dict,
                    overwrite: bool = False) -> None:
    """Copy ``checkpoint`` to ``output`` with the tensors named in ``replacements`` replaced
    (each cast to its stored dtype, shapes checked) and ``record`` merged into its llmopt.json."""
    from safetensors.torch import load_file, save_file

    left = dict(replacements)
    with atomic_dir(output, overwrite) as tmp:
        shards = set(safetensors_files(checkpoint))
        for file in checkpoint.iterdir():
            if file.is_file() and file.name not in shards:
                shutil.copy2(file, tmp / file.name)
        for name in shards:
            tensors = load_file(checkpoint / name)
            for key in [k for k in tensors if k in left]:
                new = left.pop(key)
                if new.shape != tensors[key].shape:
                    raise ValueError(f"{key}: tuned shape {tuple(new.shape)} differs from the stored {tuple(tensors[key].shape)}")
                tensors[key] = new.to(tensors[key].dtype).contiguous()
            save_file(tensors, tmp / name, metadata={"format": "pt"})
        if left:
            raise ValueError(f"tuned tensors missing from the checkpoint: {sorted(left)[:3]}")
        path = tmp / RECORD
        previous = json.loads(path.read_text()) if path.is_file() else {}
        path.write_text(json.dumps({**previous, **record}, indent=2))


def tune_checkpoint(quantized: Path, source: Path, output: Path, ids: torch.Tensor, settings: TuneSettings,
                    device: str | None = None, overwrite: bool = False) -> TuneReport:
    """Tune ``quantized`` (made from the float ``source``) on the calibration windows ``ids`` and
    write the tuned checkpoint to ``output``."""
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
    replacements.update(norms)
    rewrite_tensors(Path(quantized), Path(output), replacements, {"scale_tuning": report.to_dict()}, overwrite)
    return report
