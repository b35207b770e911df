"""Distil into a student model object in memory: the distill stage's config and training
settings, the same trainer (:class:`~llmopt.distillation.trainer.Trainer`), the student trained
in place. Its checkpoints (written only on Ctrl-C) go to a temporary folder, so runs do not resume."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from torch import nn

from llmopt.core.errors import LlmoptError
from llmopt.pipeline.objects.common import IN_MEMORY, finish, prepare


def _given(value: Any) -> bool:
    """Whether an option was given a value (not left unset, off or zero)."""
    return value not in (None, False, 0)


MAKE_STUDENT = "prune the model object first (llmopt.prune(model, method='drop-layers', num=N) or 'width'), then distil it"
REFUSALS = (
    ("student", _given, "student= names a checkpoint; the model object is the student", "drop student="),
    *((name, _given, f"{name}= makes a student from a checkpoint; the model object is the student", MAKE_STUDENT)
      for name in ("student_from", "drop_layers", "width")),
    *((name, _given, f"{name}= continues runs from checkpoints on disk", "distil checkpoints by path to use it")
      for name in ("resume", "checkpoint_dir", "save_every")),
    ("teacher_top_k", _given, "the teacher cache is kept per teacher checkpoint on disk", "drop teacher_top_k"),
    *((name, _given, f"{name}= trains a quantized checkpoint's codes, read from disk",
       "distil the checkpoint by path: llmopt.distill(teacher_path, student=quantized_path, quantized=True, ...)")
      for name in ("quantized", "code_lr", "block_steps")),
    ("code_start", lambda v: v not in (None, "stored"), "code_start= starts a quantized checkpoint's codes, read from disk",
     "distil the checkpoint by path: llmopt.distill(teacher_path, student=quantized_path, quantized=True, code_start='teacher')"),
    ("data", lambda v: str(v).startswith("generated:"), "generated data is written by the runtime from a teacher checkpoint",
     "pass a corpus or texts, or distil checkpoints by path"),
)


def distill_object(student: nn.Module, tokenizer: Any, teacher: Any, values: dict, dataset: Any = None) -> nn.Module:
    """Train ``student`` in place towards ``teacher`` (a model object or a path) with the options
    ``values`` (as ``llmopt distill`` takes them) on ``dataset`` (else the ``data`` corpus);
    returns it (written to ``values['output']`` too if given)."""
    from llmopt.checkpoints.attached import describe
    from llmopt.pipeline.stages.distill import DistillConfig

    config: DistillConfig = prepare(student, DistillConfig, values, REFUSALS, "distilled", "trained",
                                    placeholders={"teacher": IN_MEMORY, "student": IN_MEMORY})
    if tokenizer is None:
        raise LlmoptError("distillation reads text through the model's tokenizer", "pass it: llmopt.distill(model, tokenizer, ...)")
    start = time.perf_counter()
    teacher_model, teacher_name = _teacher(teacher, student, tokenizer)
    made = _student(student, tokenizer, teacher_model)
    outcome = _train(made, teacher_model, tokenizer, config, dataset)
    return finish(student, {"source": describe(student), "teacher": teacher_name, **outcome}, start, config, values, tokenizer)


def _teacher(teacher: Any, student: nn.Module, tokenizer: Any) -> tuple[nn.Module, str]:
    """The teacher model (loaded when a path) and how the record names it."""
    from llmopt.checkpoints.attached import describe
    from llmopt.checkpoints.in_memory import check_model_object
    from llmopt.distillation.student import check_vocab

    if teacher is None:
        raise LlmoptError("distillation needs a teacher", "pass teacher= a model object or a model path")
    if isinstance(teacher, (str, Path)):
        from llmopt.checkpoints.models import load_model

        model, own_tokenizer = load_model(teacher)
        check_vocab(model, own_tokenizer, student, tokenizer)
        return model, str(teacher)
    check_model_object(teacher, "a teacher")
    if teacher is student:
        raise LlmoptError("the student is its own teacher", "pass a copy of the original model as teacher=")
    return teacher, describe(teacher)


def _student(model: nn.Module, tokenizer: Any, teacher: nn.Module) -> Any:
    """The student with its hidden-state layer map: exact when llmopt pruned it in memory from a
    model shaped as the teacher (drop-layers, width), spread evenly otherwise, none across widths."""
    from llmopt.calibration import decoder_layers
    from llmopt.checkpoints.attached import compression_of, describe
    from llmopt.distillation.hidden import layer_map_from_kept, uniform_layer_map
    from llmopt.distillation.student import Student

    n, n_teacher = len(decoder_layers(model)), len(decoder_layers(teacher))
    found = compression_of(model)
    pruned = found.record if found is not None else {}
    same_width = model.config.hidden_size == teacher.config.hidden_size
    depth = pruned.get("depth") or {}
    if depth.get("layers", [None])[0] == n_teacher and same_width:
        return Student(model, tokenizer, layer_map_from_kept(depth["kept"], n_teacher), {"kind": "drop-layers", "layers": n})
    if "width" in pruned and n == n_teacher:
        return Student(model, tokenizer, [(i, i) for i in range(n)], {"kind": "width", "layers": n})
    layer_map = uniform_layer_map(n, n_teacher) if same_width else None
    return Student(model, tokenizer, layer_map, {"kind": "given", "spec": describe(model), "layers": n})


def _train(student: Any, teacher: nn.Module, tokenizer: Any, config: Any, dataset: Any) -> dict:
    """Run the trainer on the student in place (back on its device, in eval mode, afterwards)."""
    from llmopt.core.console import err
    from llmopt.distillation.data import pack_text, spread
    from llmopt.distillation.display import TrainDisplay
    from llmopt.distillation.run import resolve_hidden_weight, training_record
    from llmopt.distillation.trainer import Trainer

    settings = config.request().settings
    resolve_hidden_weight(settings, student)
    train = _training_data(dataset, tokenizer, config)
    val = pack_text(tokenizer, config.validation, config.seq_len) if config.eval_every and config.validation.lower() != "none" else None
    val_ids = spread(val, settings.val_samples) if val is not None else None
    homes = [(m, next(m.parameters()).device, [p.requires_grad for p in m.parameters()]) for m in (student.model, teacher)]
    forward = student.model.__dict__.get("forward")  # (an instance's own forward, rarely any)
    folder = Path(tempfile.mkdtemp(prefix="llmopt-distill-"))
    display = TrainDisplay(err, log_every=settings.log_every)
    trainer = Trainer(student.model, teacher, train, settings, folder, val_ids, student.layer_map, None, display)
    try:
        with display:
            result = trainer.run()
    finally:
        _unwrap(trainer.accelerator, student.model, forward)
        for model, device, grads in homes:
            model.to(device).eval()
            for p, g in zip(model.parameters(), grads):
                p.requires_grad_(g)
        shutil.rmtree(folder, ignore_errors=True)
    if result.interrupted:
        raise KeyboardInterrupt
    return training_record(student, settings, config.seq_len, train, val, val_ids, result)


def _unwrap(accelerator: Any, model: nn.Module, forward: Any) -> None:
    """Take accelerate's mixed-precision wrapper off the student and give it back the ``forward``
    it had (accelerate's own unwrapping would leave the undecorated function of its class)."""
    accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    model.__dict__.pop("forward", None)
    if forward is not None:
        model.__dict__["forward"] = forward


def _training_data(dataset: Any, tokenizer: Any, config: Any) -> Any:
    """Packed training sequences: ``dataset`` in any calibration form, else the ``data`` corpus."""
    from llmopt.core.calibration_data import packed_windows
    from llmopt.distillation.data import PackedText, pack_text

    if dataset is None or isinstance(dataset, str):
        return pack_text(tokenizer, dataset or config.data, config.seq_len)
    return PackedText(*packed_windows(dataset, tokenizer, config.seq_len))
