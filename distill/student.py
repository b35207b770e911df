"""Students for distillation: a given model, or the teacher with its least important blocks
dropped (:mod:`llmopt.pruning.depth`), or width-pruned (:mod:`llmopt.pruning.width`, where present).

Every student must share the teacher's vocabulary; :func:`check_vocab` refuses otherwise.
The result carries the hidden-state layer map (student block → teacher block) when one follows
from how the student was made.
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass, field

import torch
from llmopt.core.errors import LlmoptError
from llmopt.pruning.depth import (
    METHODS,
    DepthPruneResult,
    LayerRanking,
    decoder_layers,
    drop_layers,
    kept_layers,
    prune_depth,
)
from torch import nn

from llmopt.distillation.hidden import layer_map_from_kept, uniform_layer_map


@dataclass
class StudentRequest:
    """How to obtain the student: exactly one of ``student`` / ``student_from`` (+ ``drop_layers`` or ``width``)."""

    student: str | None = None
    student_from: str | None = None
    drop_layers: int | None = None
    width: str | None = None
    layer_method: str = "block-influence"
    calib: str = "austen"
    calib_samples: int = 16
    calib_seq_len: int = 256
    seed: int = 0
    drop_indices: list[int] | None = None  # drop these blocks instead of ranking them
    quantized: bool = False  # the student is a quantized checkpoint whose codes and scales train
    code_start: str = "stored"  # quantized: latent codes start on the stored codes, or near the teacher's weights

    def validate(self) -> None:
        """Refuse incomplete or contradictory requests before anything is loaded."""
        if (self.student is None) == (self.student_from is None):
            raise LlmoptError("give exactly one of --student and --student-from", "e.g. --student-from demo --drop-layers 8, or --student DIR")
        if self.quantized and self.student is None:
            raise LlmoptError("--quantized trains a quantized checkpoint's codes", "give it as --student DIR (made by `llmopt quantize`)")
        if self.student is not None and (self.drop_layers is not None or self.width is not None):
            raise LlmoptError("--drop-layers and --width make a student from a model", "use them with --student-from, not --student")
        if self.student_from is not None:
            if (self.drop_layers is None) == (self.width is None):
                raise LlmoptError("--student-from needs one of --drop-layers N or --width SPEC", "e.g. --student-from demo --drop-layers 8")
            if self.drop_layers is not None and self.drop_layers < 1:
                raise LlmoptError(f"--drop-layers {self.drop_layers} drops nothing", "drop at least one layer")
            if self.width is not None:
                parse_width(self.width)
                width_pruning()
        if self.layer_method not in METHODS:
            raise LlmoptError(f"unknown layer-importance method '{self.layer_method}'", f"use one of {', '.join(METHODS)}")


@dataclass
class Student:
    """The student model and tokenizer, its hidden-state layer map and how it was made."""

    model: nn.Module
    tokenizer: object
    layer_map: list[tuple[int, int]] | None
    record: dict = field(default_factory=dict)
    fake_quant: object | None = None  # a quantized student's trainable codes (llmopt.quant.fake_quant.FakeQuantModel)


def width_pruning():
    """The width-pruning entry point of :mod:`llmopt.pruning`, or a clear refusal while it does not exist."""
    if importlib.util.find_spec("llmopt.pruning.width") is not None:
        module = importlib.import_module("llmopt.pruning.width")
        if hasattr(module, "prune_width"):
            return module.prune_width
    raise LlmoptError("width pruning (--width) is not available yet", "make the student with --student-from MODEL --drop-layers N, or pass --student DIR")


WIDTH_KEYS = {"ffn": "ffn_ratio", "heads": "heads_ratio", "heads-mode": "heads_mode"}


def parse_width(spec: str) -> dict:
    """``ffn=0.5,heads=0.25[,heads-mode=kv-groups]`` → keyword arguments of ``prune_width``."""
    options: dict = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, _, value = part.partition("=")
        if key.strip() not in WIDTH_KEYS or not value:
            raise LlmoptError(f"cannot read --width '{spec}'", "write it as ffn=RATIO,heads=RATIO (fractions to remove), e.g. ffn=0.25")
        name = WIDTH_KEYS[key.strip()]
        if name == "heads_mode":
            options[name] = value.strip()
            continue
        try:
            options[name] = float(value)
        except ValueError as exc:
            raise LlmoptError(f"--width {key}={value} is not a number", "use a fraction such as 0.25") from exc
    if not options.get("ffn_ratio") and not options.get("heads_ratio"):
        raise LlmoptError(f"--width '{spec}' removes nothing", "give ffn=RATIO and/or heads=RATIO above 0")
    return options


def check_vocab(teacher: nn.Module, teacher_tokenizer, student: nn.Module, student_tokenizer) -> None:
    """Refuse a student whose vocabulary (size or token ids) differs from the teacher's."""
    t_size, s_size = teacher.config.vocab_size, student.config.vocab_size
    if t_size != s_size:
        raise LlmoptError(
            f"the student's vocabulary ({s_size} tokens) differs from the teacher's ({t_size})",
            "distillation needs a shared tokenizer: use a student of the teacher's family, or --student-from TEACHER --drop-layers N",
        )
    if teacher_tokenizer.get_vocab() != student_tokenizer.get_vocab():
        raise LlmoptError(
            "the student's tokenizer maps tokens to different ids than the teacher's",
            "distillation needs a shared tokenizer: use a student saved with the teacher's tokenizer",
        )


def build_student(request: StudentRequest, teacher: nn.Module, teacher_tokenizer, teacher_spec: str, bf16: bool = False) -> Student:
    """Load or derive the student described by ``request`` (the teacher is left untouched).

    ``bf16`` ranks blocks under bfloat16 autocast (much faster on CPUs with native bf16).
    """
    from llmopt.checkpoints.models import load_model

    request.validate()
    n_teacher = len(decoder_layers(teacher))
    if request.student is not None:
        model, tokenizer = load_model(request.student)
        check_vocab(teacher, teacher_tokenizer, model, tokenizer)
        n_student = len(decoder_layers(model))
        same_width = model.config.hidden_size == teacher.config.hidden_size
        layer_map = uniform_layer_map(n_student, n_teacher) if same_width else None
        return Student(model, tokenizer, layer_map, {"kind": "given", "spec": request.student, "layers": n_student})
    if request.student_from == teacher_spec:
        model, tokenizer = copy.deepcopy(teacher), teacher_tokenizer
    else:
        model, tokenizer = load_model(request.student_from)
        check_vocab(teacher, teacher_tokenizer, model, tokenizer)
    if request.width is not None:
        return _width(request, model, tokenizer, n_teacher, bf16)
    return _drop_layers(request, model, tokenizer, n_teacher, bf16)


def _width(request: StudentRequest, model: nn.Module, tokenizer, n_teacher: int, bf16: bool) -> Student:
    from llmopt.core.data import calibration_ids

    ids, calib_record = calibration_ids(tokenizer, request.calib, request.calib_samples, request.calib_seq_len, request.seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        result = width_pruning()(model, ids, **parse_width(request.width), show_progress=False)
    n_layers = len(decoder_layers(model))
    layer_map = [(i, i) for i in range(n_layers)] if n_layers == n_teacher else None
    record = {"kind": "width", "spec": request.student_from, "width": request.width, "layers": n_layers,
              "calibration": calib_record, **{k: v for k, v in result.to_dict().items() if not k.startswith("kept_")}}
    return Student(model, tokenizer, layer_map, record)


def _drop_layers(request: StudentRequest, model: nn.Module, tokenizer, n_teacher: int, bf16: bool) -> Student:
    from llmopt.core.data import calibration_ids

    n_layers = len(decoder_layers(model))
    if request.drop_layers >= n_layers:
        raise LlmoptError(f"cannot drop {request.drop_layers} of the model's {n_layers} layers", f"drop at most {n_layers - 1}")
    if request.drop_indices is not None:
        drop_layers(model, request.drop_indices)
        result = DepthPruneResult(LayerRanking("given", []), sorted(request.drop_indices), kept_layers(n_layers, request.drop_indices))
        calib_record = None
    else:
        ids, calib_record = calibration_ids(tokenizer, request.calib, request.calib_samples, request.calib_seq_len, request.seed)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            result = prune_depth(model, ids, request.drop_layers, request.layer_method)
    layer_map = layer_map_from_kept(result.kept, n_teacher) if n_layers == n_teacher else None
    record = {"kind": "drop-layers", "spec": request.student_from, "layers": len(result.kept), "calibration": calib_record, **result.to_dict()}
    return Student(model, tokenizer, layer_map, record)
