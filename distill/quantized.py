"""Quantization-aware distillation: a quantized checkpoint as the student.

The student is a compressed-tensors checkpoint made by ``llmopt quantize``. Its quantized
weights train as latent codes on their format's grid with scale multipliers
(:mod:`llmopt.quant.fake_quant`); every other tensor stays frozen. The result is written as the
same checkpoint with new codes and scales — same format, size and layout — so it loads, serves
and exports (GGUF exactly) like the checkpoint it came from.
"""

from __future__ import annotations

from pathlib import Path

from llmopt.checkpoints.model_card import command_line
from llmopt.checkpoints.rewrite import rewrite_tensors
from llmopt.core.errors import LlmoptError
from llmopt.formats.compressed import load_dequantized, quantized_tensors, read_compressed
from llmopt.quant.fake_quant import FakeQuantModel, attach

from llmopt.distillation.student import Student, check_vocab


def quantized_student(spec: str, teacher, teacher_tokenizer) -> Student:
    """The quantized checkpoint ``spec`` with trainable codes and scales (refused in one line when
    it is not a weight-only compressed-tensors checkpoint whose weights are all module weights)."""
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
              "quantized_weights": len(weights), "schemes": schemes}
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
