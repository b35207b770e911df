"""One distillation run end to end: load the teacher, build the student, pack the data, train,
and save an ordinary Hugging Face checkpoint with ``llmopt.json`` (settings, loss curve).

The same function runs in every process of a ``torchrun`` launch: the main process ranks the
teacher's blocks and writes the output; the others follow its choices.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from llmopt.core.atomic import atomic_dir, check_output
from llmopt.core.errors import LlmoptError

from llmopt.distillation import checkpoint
from llmopt.distillation.data import DEFAULT_TRAIN, DEFAULT_VALIDATION, PackedText, pack_text, spread
from llmopt.distillation.generated import generated_corpus, is_generated
from llmopt.distillation.display import TrainDisplay
from llmopt.distillation.precision import resolve_precision
from llmopt.distillation.student import Student, StudentRequest, build_student
from llmopt.distillation.trainer import Trainer, TrainResult, TrainSettings
from llmopt.checkpoints.provenance import write_provenance


@dataclass
class DistillRequest:
    """Everything ``llmopt distill`` takes."""

    teacher: str
    output: Path
    student: StudentRequest
    settings: TrainSettings
    data: str = DEFAULT_TRAIN
    validation: str | None = DEFAULT_VALIDATION
    seq_len: int = 256
    resume: bool = False
    overwrite: bool = False
    checkpoint_dir: Path | None = None
    show_progress: bool = True

    @property
    def checkpoints(self) -> Path:
        """Where training checkpoints go (default: ``OUTPUT.checkpoints`` beside the output)."""
        return Path(self.checkpoint_dir or f"{self.output}.checkpoints")


@dataclass
class DistillOutcome:
    """The run's provenance record, and whether it finished or stopped early (Ctrl-C)."""

    record: dict
    result: TrainResult
    output: Path | None = None
    interrupted: bool = False


def _check_request(request: DistillRequest) -> None:
    request.settings.validate()
    request.student.validate()
    if request.seq_len < 8:
        raise LlmoptError(f"--seq-len {request.seq_len} is too short", "use 256-1024 tokens")
    check_output(request.output, request.overwrite)
    if not request.resume and checkpoint.latest(request.checkpoints) is not None and not request.overwrite:
        raise LlmoptError(
            f"{request.checkpoints} holds checkpoints of an earlier run",
            "pass --resume to continue it, or --overwrite to start over",
        )


def _student(request: DistillRequest, teacher, tokenizer, state, bf16: bool) -> Student:
    """Build the student on the main process; the others drop the same blocks it chose."""
    from accelerate.utils import broadcast_object_list

    if request.student.quantized:  # every process loads the same checkpoint
        from llmopt.distillation.quantized import quantized_student

        return quantized_student(request.student.student, teacher, tokenizer, request.student.code_start)
    if state.num_processes == 1:
        return build_student(request.student, teacher, tokenizer, request.teacher, bf16)
    shared = [None]
    if state.is_main_process:
        student = build_student(request.student, teacher, tokenizer, request.teacher, bf16)
        shared = [{"record": student.record, "layer_map": student.layer_map}]
    broadcast_object_list(shared, from_process=0)
    if state.is_main_process:
        return student
    chosen = shared[0]
    follower = StudentRequest(**{**asdict(request.student), "drop_indices": chosen["record"].get("dropped")})
    student = build_student(follower, teacher, tokenizer, request.teacher, bf16)
    return Student(student.model, student.tokenizer, chosen["layer_map"], chosen["record"])


AUTO_HIDDEN_WEIGHT = 1.0


def resolve_hidden_weight(settings: TrainSettings, student: Student) -> None:
    """``hidden_weight=None`` means: use the hidden-state loss (weight 1) when the student was made
    from the teacher by pruning, so its layer map is exact, and the teacher is not cached; else 0."""
    if settings.hidden_weight is None:
        derived = student.record.get("kind") in ("drop-layers", "width") and bool(student.layer_map)
        settings.hidden_weight = AUTO_HIDDEN_WEIGHT if derived and not settings.teacher_top_k else 0.0
        settings.validate()


def run_distill(request: DistillRequest, on_step=None) -> DistillOutcome:
    """Distil and save; returns the record written to ``OUTPUT/llmopt.json``."""
    from accelerate import PartialState
    from llmopt.core.console import err
    from llmopt.accuracy import check_seq_len
    from llmopt.checkpoints.provenance import model_fingerprint
    from llmopt.checkpoints.models import load_model, resolve_model

    _check_request(request)
    cpu = not torch.cuda.is_available()
    state = PartialState(cpu=cpu)  # picks up torchrun / accelerate launch processes (gloo on the CPU)
    if request.overwrite and not request.resume and state.is_main_process:
        shutil.rmtree(request.checkpoints, ignore_errors=True)
    start = time.perf_counter()
    teacher_path = resolve_model(request.teacher)
    teacher, tokenizer = load_model(teacher_path)
    check_seq_len(teacher, request.seq_len)
    bf16_ranking = cpu and resolve_precision(request.settings.precision, cpu) == "bf16"
    student = _student(request, teacher, tokenizer, state, bf16_ranking)
    resolve_hidden_weight(request.settings, student)
    with state.main_process_first():
        data = request.data
        if is_generated(data):  # the teacher writes it first (once; cached)
            data = generated_corpus(data, teacher_path, tokenizer, seed=request.settings.seed,
                                    show_progress=request.show_progress and state.is_main_process)
        train = pack_text(tokenizer, data, request.seq_len)
        if data != request.data:
            train.record["generated"] = request.data
        val = pack_text(tokenizer, request.validation, request.seq_len) if request.validation else None
    val_ids = spread(val, request.settings.val_samples) if val is not None else None
    cache = None
    if request.settings.teacher_top_k:
        from llmopt.distillation.teacher_cache import TeacherCache

        cache = TeacherCache.for_run(model_fingerprint(teacher_path), train.ids, request.settings.teacher_top_k,
                                     request.settings.temperature, resolve_precision(request.settings.precision, cpu))
    blocks = _block_phase(request, student, teacher, train)
    display = TrainDisplay(err, enabled=request.show_progress and state.is_main_process, log_every=request.settings.log_every)
    trainer = Trainer(student.model, teacher, train, request.settings, request.checkpoints, val_ids,
                      student.layer_map, cache, display, on_step)
    with display:
        result = trainer.run(resume=request.resume)
    record = {"source": str(teacher_path), "teacher": request.teacher,
              **training_record(student, request.settings, request.seq_len, train, val, val_ids, result),
              "teacher_cache": None if cache is None else str(cache.root)}
    if blocks is not None:
        record["block_phase"] = blocks
    if result.interrupted:
        return DistillOutcome(record, result, interrupted=True)
    record["total_seconds"] = round(time.perf_counter() - start, 1)
    if state.is_main_process:
        _save(student, record, request)
        shutil.rmtree(request.checkpoints, ignore_errors=True)
    state.wait_for_everyone()
    return DistillOutcome(record, result, output=request.output)


def _block_phase(request: DistillRequest, student: Student, teacher, train: PackedText) -> dict | None:
    """A quantized student's block-wise phase (:mod:`llmopt.distillation.blocks`), before the
    end-to-end training; skipped when resuming from a checkpoint (it holds the trained codes)."""
    s = request.settings
    if student.fake_quant is None or not s.block_steps:
        return None
    if request.resume and checkpoint.latest(request.checkpoints) is not None:
        return {"skipped": "resumed from a checkpoint of the end-to-end phase"}
    from llmopt.core.console import progress_task
    from llmopt.distillation.blocks import BlockSettings, train_blocks

    settings = BlockSettings(s.block_steps, s.lr, s.code_lr, s.batch_size, s.seed)
    layers = student.model.config.num_hidden_layers
    with progress_task("block-wise phase (one decoder layer at a time)", layers) as advance:
        return train_blocks(student.model, teacher, student.fake_quant, spread(train, s.block_windows), settings, advance)


def training_record(student: Student, settings: TrainSettings, seq_len: int, train: PackedText, val: PackedText | None,
                    val_ids: torch.Tensor | None, result: TrainResult) -> dict:
    """What a run trained and how it went, for the provenance record."""
    from llmopt.checkpoints.provenance import versions

    return {
        "student": student.record, "layer_map": student.layer_map, "settings": asdict(settings), "seq_len": seq_len,
        "data": train.record, "validation_data": None if val is None else {**val.record, "samples": len(val_ids)},
        "steps": result.steps_done, "resumed_from_step": result.resumed_from, "tokens": result.tokens,
        "train_seconds": round(result.seconds, 1), "world_size": result.world_size, "precision": result.precision,
        "shards": result.shards, "loss_curve": result.history, "validation_curve": result.validation, "versions": versions(),
    }


def _save(student: Student, record: dict, request: DistillRequest) -> None:
    if student.fake_quant is not None:  # the quantized checkpoint again, with its trained codes and scales
        from llmopt.distillation.quantized import save_quantized

        save_quantized(student, record, request.output, request.overwrite)
        return
    model = student.model
    model.config.use_cache = True
    with atomic_dir(request.output, overwrite=request.overwrite) as tmp:
        model.save_pretrained(tmp)
        student.tokenizer.save_pretrained(tmp)
        write_provenance(tmp, {"stage": "distill", **record})
