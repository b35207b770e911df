"""Quantization-aware distillation: a quantized checkpoint as the student.

The student is a compressed-tensors checkpoint made by ``llmopt quantize``. Its quantized
weights train as latent codes on their format's grid with scale multipliers
(:mod:`llmopt.quant.fake_quant`); every other tensor stays frozen. The result is written as the
same checkpoint with new codes and scales — same format, size and layout — so it loads, serves
and exports (GGUF exactly) like the checkpoint it came from.

Latent codes start on the stored codes, where a code moves only once its latent has travelled half a
step; ``code_start="teacher"`` starts them at the teacher's own weight in code units (kept within
half a step, so the starting checkpoint is unchanged), as quantization-aware training from the float
weights does: codes whose float value sat near a rounding edge move first.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from llmopt.checkpoints.model_card import command_line
from llmopt.checkpoints.rewrite import rewrite_tensors
from llmopt.core.errors import LlmoptError
from llmopt.formats.compressed import load_dequantized, quantized_tensors, read_compressed
from llmopt.quant.fake_quant import FakeQuantModel, attach

from llmopt.distillation.student import Student, check_vocab


def teacher_in_student_basis(teacher_w: torch.Tensor, student_w: torch.Tensor, rounds: int = 10) -> torch.Tensor:
    """The teacher's weight with its rows and columns rescaled to best match the student's
    (least squares, alternating): the per-channel scalings AWQ / SmoothQuant folded into the
    student — a consumer's columns times ``s``, a producer's rows divided by it."""
    t, w = teacher_w.float(), student_w.float()
    rows, cols = torch.ones(t.shape[0], 1), torch.ones(1, t.shape[1])
    tiny = torch.finfo(torch.float32).tiny
    for _ in range(rounds):
        scaled = t * rows
        cols = ((w * scaled).sum(0, keepdim=True) / scaled.pow(2).sum(0, keepdim=True).clamp(min=tiny))
        scaled = t * cols
        rows = ((w * scaled).sum(1, keepdim=True) / scaled.pow(2).sum(1, keepdim=True).clamp(min=tiny))
    return t * rows * cols


def start_from_teacher(fake: FakeQuantModel, teacher: nn.Module, fit: float = 0.5) -> dict:
    """Start each latent weight near the teacher's value (:meth:`FakeQuantWeight.start_near`) where
    the teacher's weight of the same name and shape, rescaled per channel
    (:func:`teacher_in_student_basis`), lies within ``fit`` code steps (RMS) of the stored codes —
    not where the student is in another basis (a rotated checkpoint) or was pruned."""
    teachers = dict(teacher.named_modules())
    started = moved = 0
    for name, weight in fake.weights.items():
        theirs = teachers.get(name)
        if theirs is None or getattr(theirs, "weight", None) is None or theirs.weight.shape != weight.latent.shape:
            continue
        ours = weight().detach()
        target = teacher_in_student_basis(theirs.weight.detach().cpu(), ours.cpu()).to(ours)
        unit = weight.scales.weight_scale(weight.scale).detach()
        if float(((target - ours) / unit.clamp(min=torch.finfo(unit.dtype).tiny)).pow(2).mean().sqrt()) > fit:
            continue
        moved += weight.start_near(target)
        started += 1
    return {"weights_started_near_teacher": started, "latents_moved": moved}


def quantized_student(spec: str, teacher, teacher_tokenizer, code_start: str = "stored") -> Student:
    """The quantized checkpoint ``spec`` with trainable codes and scales (refused in one line when
    it is not a weight-only compressed-tensors checkpoint whose weights are all module weights);
    ``code_start`` "teacher": the latent codes start near the teacher's weights
    (:func:`start_from_teacher`), else on the stored codes."""
    from transformers import AutoTokenizer

    from llmopt.checkpoints.models import resolve_model

    path = resolve_model(spec)
    try:
        weights, _ = read_compressed(path)
    except (KeyError, ValueError, OSError) as exc:
        raise LlmoptError(f"--quantized needs a checkpoint written by `llmopt quantize`: {exc}",
                          "quantize the model first (compressed-tensors output), then distil it with --quantized") from exc
    if not weights:
        raise LlmoptError(f"{path} holds no quantized weights", "pass a checkpoint written by `llmopt quantize`, or drop --quantized")
    with_activations = sorted({qw.scheme.name for qw in weights.values() if qw.scheme.activations is not None})
    if with_activations:
        raise LlmoptError(f"--quantized trains weight-only schemes; {', '.join(with_activations)} quantizes activations too",
                          "distil a W4A16 / W8A16 / AUTO / FP4A16 checkpoint")
    model = load_dequantized(path, None)
    model.float()
    tokenizer = AutoTokenizer.from_pretrained(path)
    check_vocab(teacher, teacher_tokenizer, model, tokenizer)
    try:
        fake = attach(model, weights)
    except ValueError as exc:  # e.g. MoE experts fused into 3-D tensors in memory
        raise LlmoptError(f"cannot train the codes of {path}: {exc}", "--quantized trains Linear and embedding weights only") from exc
    schemes = sorted({qw.scheme.name for qw in weights.values()})
    record = {"kind": "quantized", "spec": spec, "checkpoint": str(path), "layers": model.config.num_hidden_layers,
              "quantized_weights": len(weights), "schemes": schemes, "code_start": code_start}
    if code_start == "teacher":
        record.update(start_from_teacher(fake, teacher))
    return Student(model, tokenizer, None, record, fake_quant=fake)


def code_changes(fake: FakeQuantModel, trained: dict) -> dict:
    """How many codes training moved (of how many), against the codes each weight started from."""
    changed = total = 0
    for name, qw in trained.items():
        before = fake.weights[name].scales.original.codes
        changed += int((qw.codes.float() != before.float()).sum())
        total += before.numel()
    return {"codes_changed": changed, "codes": total}


def save_quantized(student: Student, record: dict, output: Path, overwrite: bool) -> None:
    """Write the student's checkpoint again with its trained codes and scales (everything else
    copied); ``record`` gets how many codes moved."""
    trained = student.fake_quant.trained_weights()
    record.update(code_changes(student.fake_quant, trained))  # reported by the caller too
    command = command_line()
    if command:
        record["command"] = command
    rewrite_tensors(Path(student.record["checkpoint"]), output, quantized_tensors(trained),
                    {"quantization_aware_distillation": record}, overwrite, card=True)
