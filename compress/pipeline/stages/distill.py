"""The distill stage: teacher → student with logit and hidden-state losses, resumable."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from llmopt.core.errors import LlmoptError
from llmopt.pipeline.stages.base import option

DEFAULT_CODE_LR = 5e-3  # --quantized: about 100 consistent steps move a code by one


@dataclass
class DistillConfig:
    """Everything ``llmopt distill`` / a recipe's distill stage takes."""

    teacher: str = option(help="Teacher: 'demo', a Hugging Face directory, a .gguf file or a Hub id.", metavar="MODEL")
    output: str = option(help="Output checkpoint directory.", short="-o", runner_owned=True)
    steps: int = option(help="Optimizer steps.")
    student: str | None = option(None, "Student model (must share the teacher's tokenizer).", metavar="MODEL")
    student_from: str | None = option(None, "Make the student from this model (usually the teacher) with --drop-layers or --width.", metavar="MODEL")
    drop_layers: int | None = option(None, "Drop the N least important decoder blocks (block influence on calibration text).", metavar="N")
    width: str | None = option(None, "Width-prune the student: ffn=RATIO,heads=RATIO (fractions of MLP channels / attention heads to remove).", metavar="SPEC")
    layer_method: str = option("block-influence", "How blocks are ranked for --drop-layers.", choices=("block-influence", "perplexity"))
    calib: str = option("austen", "Calibration text for ranking blocks.")
    data: str = option("gutenberg", "Training text: corpus name, text file, folder of .txt files, hf:NAME[:CONFIG[:SPLIT]], or "
                       "generated:CORPUS[:N] (the teacher's own greedy answers to N chat requests about passages of CORPUS, "
                       "written once by the runtime: what a speculative-decoding draft must predict).")
    validation: str = option("heldout", "Held-out text for validation perplexity ('none' to skip).")
    seq_len: int = option(256, "Tokens per packed training sequence.")
    batch_size: int = option(4, "Sequences per micro batch, per process.")
    grad_accum: int = option(1, "Micro batches per optimizer step.")
    lr: float = option(2e-4, "Peak learning rate (AdamW).")
    warmup: int | None = option(None, "Linear warmup steps before the cosine decay [default: 5% of --steps, at most 100].")
    weight_decay: float = option(0.0, "AdamW weight decay.")
    max_grad_norm: float = option(1.0, "Gradient clipping norm.")
    loss: str = option("fkl", "Logit loss: forward KL, reverse KL or generalized JSD.", choices=("fkl", "rkl", "jsd"), aliases=("loss_kind",))
    temperature: float = option(1.0, "Softmax temperature of the logit loss (scaled by T²).")
    beta: float = option(0.5, "JSD interpolation weight.")
    kd_weight: float = option(1.0, "Weight of the logit loss.")
    hidden_weight: float | None = option(None, "Weight of the normalized hidden-state MSE [default: 1 for students made by --drop-layers/--width (exact layer map), else 0].")
    ce_weight: float = option(0.0, "Weight of cross-entropy on the data.")
    teacher_top_k: int = option(0, "Cache the teacher's top-k log-probs on disk and reuse them (0: compute on the fly).")
    precision: str = option("auto", "Mixed precision (auto: bf16 where the hardware has it).", choices=("auto", "bf16", "fp16", "no"))
    save_every: int = option(0, "Checkpoint every N steps (0: only on Ctrl-C).")
    eval_every: int = option(0, "Validation perplexity every N steps (0: never).")
    val_samples: int = option(16, "Held-out sequences scored at each validation.")
    quantized: bool = option(False, "Quantization-aware distillation: --student is a checkpoint made by `llmopt quantize`; its codes "
                             "(latent, on the format's grid, straight-through) and scales train against the teacher, and it is "
                             "saved in the same format (--lr: the scale multipliers' step).")
    code_lr: float | None = option(None, "With --quantized: Adam's step on the latent codes, in code units [default: 5e-3].")
    code_start: str = option("stored", "With --quantized: where the latent codes start — on the stored codes, or near the teacher's "
                                       "weights in code units (within half a step: the same checkpoint at step 0, codes near a rounding "
                                       "edge move first).", choices=("stored", "teacher"))
    block_steps: int = option(0, "With --quantized: first train each decoder layer alone for N steps against the teacher's layer "
                                 "output (block-wise phase), then end to end.", metavar="N")
    block_windows: int = option(32, "With --block-steps: training windows the block-wise phase reads.", metavar="N")
    seed: int = option(0, "Seed for data order, initialization and block ranking.")
    resume: bool = option(False, "Continue from the last checkpoint of this output.")
    checkpoint_dir: str | None = option(None, "Where checkpoints go [default: OUTPUT.checkpoints].")
    overwrite: bool = option(False, "Replace an existing output (and its checkpoints).", runner_owned=True)

    def request(self, show_progress: bool = True):
        """The distillation request this config describes."""
        from llmopt.distillation.run import DistillRequest
        from llmopt.distillation.student import StudentRequest
        from llmopt.distillation.trainer import TrainSettings

        warmup = self.warmup if self.warmup is not None else min(100, max(self.steps, 0) // 20)
        settings = TrainSettings(
            steps=self.steps, batch_size=self.batch_size, grad_accum=self.grad_accum, lr=self.lr, warmup=warmup,
            weight_decay=self.weight_decay, max_grad_norm=self.max_grad_norm, loss=self.loss, temperature=self.temperature,
            beta=self.beta, kd_weight=self.kd_weight, ce_weight=self.ce_weight, hidden_weight=self.hidden_weight, seed=self.seed,
            precision=self.precision, teacher_top_k=self.teacher_top_k, code_lr=self._code_lr(), block_steps=self.block_steps, block_windows=self.block_windows,
            save_every=self.save_every,
            eval_every=self.eval_every, val_samples=self.val_samples,
        )
        return DistillRequest(
            teacher=self.teacher, output=Path(self.output),
            student=StudentRequest(student=self.student, student_from=self.student_from, drop_layers=self.drop_layers,
                                   width=self.width, layer_method=self.layer_method, calib=self.calib, seed=self.seed,
                                   quantized=self.quantized, code_start=self.code_start),
            settings=settings, data=self.data, validation=None if self.validation.lower() == "none" else self.validation,
            seq_len=self.seq_len, resume=self.resume, overwrite=self.overwrite,
            checkpoint_dir=Path(self.checkpoint_dir) if self.checkpoint_dir else None, show_progress=show_progress,
        )

    def _code_lr(self) -> float:
        """The codes' step of a quantized student (0 otherwise); the quantized-only options are
        refused without ``--quantized``."""
        defaults = {f.name: f.default for f in fields(self)}
        for name in ("code_lr", "code_start", "block_steps", "block_windows"):
            if getattr(self, name) != defaults[name] and not self.quantized:
                flag = "--" + name.replace("_", "-")
                raise LlmoptError(f"{flag} applies only with --quantized", f"add --quantized (and a quantized --student), or drop {flag}")
        return (DEFAULT_CODE_LR if self.code_lr is None else self.code_lr) if self.quantized else 0.0

    def check(self) -> None:
        request = self.request()
        request.settings.validate()
        request.student.validate()


def run_distill_stage(config: DistillConfig, progress=None, show_progress: bool = True):
    """Distil and save; returns the run's outcome (record, whether it was interrupted)."""
    from llmopt.distillation.run import run_distill

    return run_distill(config.request(show_progress))
