"""The distillation training loop, on ``accelerate``.

One optimizer step = ``grad_accum`` micro batches of ``batch_size`` sequences on every process
(data parallel when started by ``torchrun``/``accelerate launch``). Each process draws its own
samples from the seeded :class:`~llmopt.distillation.data.DataOrder`, so the stream — and with it
the result — depends only on the seed and the step, which makes ``resume`` exact.

Ctrl-C asks the loop to stop: it finishes the current step, saves a checkpoint and returns
(a second Ctrl-C aborts at once).
"""

from __future__ import annotations

import hashlib
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from llmopt.core.errors import LlmoptError
from llmopt.quant.fake_quant import CODE_PARAMETER

from llmopt.distillation import checkpoint
from llmopt.distillation.data import DataOrder, PackedText
from llmopt.distillation.display import Progress, TrainDisplay
from llmopt.distillation.hidden import capture_hidden
from llmopt.distillation.losses import KINDS, cross_entropy, hidden_mse, kd_loss
from llmopt.distillation.precision import resolve_precision
from llmopt.distillation.teacher_cache import TeacherCache


@dataclass
class TrainSettings:
    """Optimization and loss settings of one run (all but the last group change its result)."""

    steps: int
    batch_size: int = 4
    grad_accum: int = 1
    lr: float = 2e-4
    warmup: int = 0
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    loss: str = "fkl"
    temperature: float = 1.0
    beta: float = 0.5
    kd_weight: float = 1.0
    ce_weight: float = 0.0
    hidden_weight: float | None = 0.0  # None: chosen by the run (see run.resolve_hidden_weight)
    seed: int = 0
    precision: str = "auto"
    teacher_top_k: int = 0
    code_lr: float = 0.0  # quantized students: Adam's step on the latent codes, in code units (0: not one)
    block_steps: int = 0  # quantized students: steps per decoder layer of the block-wise phase first (0: none)
    block_windows: int = 32  # training windows the block-wise phase reads
    # bookkeeping only: no effect on the weights
    save_every: int = 0
    eval_every: int = 0
    val_samples: int = 16
    log_every: int = 10

    BOOKKEEPING = ("save_every", "eval_every", "val_samples", "log_every")

    def validate(self) -> None:
        """Refuse settings that cannot work, naming the option to change."""
        hidden = self.hidden_weight or 0.0
        checks = [
            (self.steps >= 1, f"--steps {self.steps}", "train for at least 1 step"),
            (self.batch_size >= 1, f"--batch-size {self.batch_size}", "use at least 1"),
            (self.grad_accum >= 1, f"--grad-accum {self.grad_accum}", "use at least 1"),
            (self.lr > 0, f"--lr {self.lr}", "use a positive learning rate, e.g. 2e-4"),
            (self.code_lr >= 0, f"--code-lr {self.code_lr}", "use a positive step in code units, e.g. 5e-3"),
            (self.block_steps >= 0, f"--block-steps {self.block_steps}", "use 0 (no block-wise phase) or more"),
            (self.block_windows >= 1, f"--block-windows {self.block_windows}", "use at least 1"),
            (0 <= self.warmup <= self.steps, f"--warmup {self.warmup}", f"use 0 to {self.steps} steps"),
            (0 <= self.min_lr_ratio <= 1, f"min lr ratio {self.min_lr_ratio}", "use a value in [0, 1]"),
            (self.max_grad_norm > 0, f"--max-grad-norm {self.max_grad_norm}", "use a positive norm, e.g. 1.0"),
            (self.loss in KINDS, f"--loss {self.loss}", f"use one of {', '.join(KINDS)}"),
            (self.temperature > 0, f"--temperature {self.temperature}", "use a temperature above 0"),
            (0 < self.beta < 1, f"--beta {self.beta}", "use a JSD beta strictly between 0 and 1"),
            (min(self.kd_weight, self.ce_weight, hidden) >= 0, "a negative loss weight", "use weights of 0 or more"),
            (self.kd_weight + self.ce_weight + hidden > 0 or self.hidden_weight is None, "all loss weights are 0", "give --kd-weight, --ce-weight or --hidden-weight a positive value"),
            (min(self.save_every, self.eval_every, self.teacher_top_k) >= 0, "a negative interval or top-k", "use 0 (off) or a positive number"),
        ]
        for ok, what, fix in checks:
            if not ok:
                raise LlmoptError(f"invalid setting: {what}", fix)
        if self.teacher_top_k and hidden > 0:
            raise LlmoptError(
                "the teacher cache holds logits only, but the hidden-state loss needs the teacher's hidden states",
                "drop --teacher-top-k or set --hidden-weight 0",
            )

    def result_settings(self) -> dict:
        """The settings that determine the trained weights (compared on resume)."""
        return {k: v for k, v in asdict(self).items() if k not in self.BOOKKEEPING}


class WarmupCosine:
    """LR factor: linear warmup over ``warmup`` steps, then cosine decay to ``min_ratio``."""

    def __init__(self, warmup: int, total: int, min_ratio: float = 0.0) -> None:
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class TrainResult:
    """What a run did: its loss and validation curves, how far it got, and how long it took."""

    steps_done: int
    interrupted: bool
    history: list[dict] = field(default_factory=list)
    validation: list[dict] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    world_size: int = 1
    precision: str = "no"
    checkpoint: str | None = None
    shards: list[dict] = field(default_factory=list)
    resumed_from: int = 0  # the checkpoint step this run continued from (0: a fresh start)


def make_accelerator(settings: TrainSettings):
    """An ``Accelerator`` for these settings (resetting the per-run part of accelerate's global state)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    cpu = not torch.cuda.is_available()
    precision = resolve_precision(settings.precision, cpu)
    if hasattr(AcceleratorState, "_reset_state"):  # several runs in one process may differ in precision
        AcceleratorState._reset_state(reset_partial_state=False)
    return Accelerator(mixed_precision=precision, gradient_accumulation_steps=settings.grad_accum, cpu=cpu)


def build_optimizer(model: torch.nn.Module, settings: TrainSettings):
    """AdamW (weight decay on matrices only) and its warmup + cosine LambdaLR schedule."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    codes = [p for name, p in trainable if name.rpartition(".")[2] == CODE_PARAMETER]
    matrices = [p for name, p in trainable if p.dim() >= 2 and name.rpartition(".")[2] != CODE_PARAMETER]
    others = [p for name, p in trainable if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": settings.weight_decay}, {"params": others, "weight_decay": 0.0}]
    if codes:  # a quantized student's latent codes: their own step (code units), never decayed
        if not settings.code_lr > 0:
            raise LlmoptError("a quantized student's codes need a step size", "set --code-lr, e.g. 5e-3")
        groups.append({"params": codes, "weight_decay": 0.0, "lr": settings.code_lr})
    optimizer = torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.95), eps=1e-8)
    schedule = WarmupCosine(settings.warmup, settings.steps, settings.min_lr_ratio)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def weights_sha256(model: torch.nn.Module) -> str:
    """A hash of every parameter and buffer, to compare processes' or runs' weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


class _StopRequest:
    """Turns the first Ctrl-C into a request to stop at the end of the step; the second aborts."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> _StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


class Trainer:
    """Distil ``teacher`` into ``student`` on packed ``train`` data (see the module docstring)."""

    def __init__(
        self,
        student: torch.nn.Module,
        teacher: torch.nn.Module | None,
        train: PackedText,
        settings: TrainSettings,
        checkpoint_dir: Path,
        val_ids: torch.Tensor | None = None,
        layer_map: list[tuple[int, int]] | None = None,
        teacher_cache: TeacherCache | None = None,
        display: TrainDisplay | None = None,
        on_step: Callable[[int, dict], None] | None = None,
    ) -> None:
        settings.validate()
        if settings.hidden_weight is None:
            raise ValueError("resolve hidden_weight before training (run.resolve_hidden_weight)")
        if (settings.kd_weight > 0 or settings.hidden_weight > 0) and teacher is None:
            raise LlmoptError("the distillation losses need a teacher", "pass a teacher or train with --ce-weight only")
        if settings.hidden_weight > 0 and not layer_map:
            raise LlmoptError(
                "the hidden-state loss needs a layer map and the student's hidden size must match the teacher's",
                "set --hidden-weight 0, or make the student with --student-from TEACHER --drop-layers N",
            )
        self.settings = settings
        self.student = student
        self.teacher = teacher
        self.train = train
        self.val_ids = val_ids
        self.layer_map = layer_map or []
        self.cache = teacher_cache
        self.checkpoint_dir = Path(checkpoint_dir)
        self.display = display
        self.on_step = on_step
        self.accelerator = make_accelerator(settings)
        self.order = DataOrder(len(train), settings.seed)
        self._committing = False

    # -- one step -------------------------------------------------------------------------

    def _teacher_outputs(self, batch: torch.Tensor, samples: list[int]):
        """Teacher logits (dense, or top-k from the cache) and the hidden states the map needs."""
        s = self.settings
        if s.kd_weight == 0 and s.hidden_weight == 0:
            return None, {}
        if self.cache is not None and self.cache.has_all(samples):
            top = self.cache.load(samples)
            top.indices, top.log_probs = top.indices.to(batch.device), top.log_probs.to(batch.device)
            return top, {}
        wanted = {t for _, t in self.layer_map} if s.hidden_weight > 0 else set()
        with torch.no_grad(), self.accelerator.autocast(), capture_hidden(self.teacher, wanted) as hidden:
            logits = self.teacher(input_ids=batch, use_cache=False).logits
        if self.cache is not None:
            return self.cache.store(samples, logits), {}
        return logits, dict(hidden)

    def _loss(self, batch: torch.Tensor, samples: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
        s = self.settings
        teacher_logits, teacher_hidden = self._teacher_outputs(batch, samples)
        wanted = {i for i, _ in self.layer_map} if s.hidden_weight > 0 else set()
        with capture_hidden(self.accelerator.unwrap_model(self.model), wanted) as student_hidden:
            logits = self.model(input_ids=batch, use_cache=False).logits
        total = torch.zeros((), device=batch.device)
        terms: dict[str, float] = {}
        if s.kd_weight > 0:
            kd = kd_loss(logits, teacher_logits, s.loss, s.temperature, s.beta)
            total = total + s.kd_weight * kd
            terms[s.loss] = float(kd.detach())
        if s.ce_weight > 0:
            ce = cross_entropy(logits, batch)
            total = total + s.ce_weight * ce
            terms["ce"] = float(ce.detach())
        if s.hidden_weight > 0:
            hidden = hidden_mse(student_hidden, teacher_hidden, self.layer_map)
            total = total + s.hidden_weight * hidden
            terms["hidden"] = float(hidden.detach())
        terms = {"loss": float(total.detach()), **terms}
        return total, terms

    # -- validation -----------------------------------------------------------------------

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Student perplexity on the held-out windows and KL(teacher || student), over all processes."""
        acc = self.accelerator
        model = acc.unwrap_model(self.model)  # no DDP wrapper: processes may score different counts
        model.eval()
        sums = torch.zeros(4, dtype=torch.float64)
        rows = self.val_ids[acc.process_index :: acc.num_processes]
        for start in range(0, len(rows), self.settings.batch_size):
            batch = rows[start : start + self.settings.batch_size].to(acc.device)
            with acc.autocast():
                logits = model(input_ids=batch, use_cache=False).logits.float()
            targets = batch[:, 1:]
            sums[0] += float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="sum"))
            sums[1] += targets.numel()
            if self.teacher is not None:
                with acc.autocast():
                    t_logits = self.teacher(input_ids=batch, use_cache=False).logits.float()
                sums[2] += float(kd_loss(logits, t_logits, "fkl")) * batch.shape[0] * batch.shape[1]
                sums[3] += batch.shape[0] * batch.shape[1]
        model.train()
        sums = acc.reduce(sums.to(acc.device), "sum").cpu()
        result = {"ppl": math.exp(sums[0] / max(sums[1], 1))}
        if sums[3] > 0:
            result["kl"] = float(sums[2] / sums[3])
        return result

    # -- the loop -------------------------------------------------------------------------

    def _state(self, step: int) -> dict:
        return {
            "step": step, "samples_seen": step * self._global_batch, "history": self.history,
            "validation": self.val_history, "settings": self.settings.result_settings(),
            "world_size": self.accelerator.num_processes,
        }

    def _save(self, step: int) -> Path:
        return checkpoint.save(self.checkpoint_dir, self.accelerator, self.model, self.optimizer, self.scheduler, self._state(step))

    def _resume(self) -> int:
        path = checkpoint.latest(self.checkpoint_dir)
        if path is None:
            self._note(f"no checkpoint in {self.checkpoint_dir}: starting from step 0")
            return 0
        state = checkpoint.read_state(path)
        saved, now = state["settings"], self.settings.result_settings()
        changed = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        if changed:
            raise LlmoptError(
                f"cannot resume from {path}: settings changed ({', '.join(f'{k}: {saved.get(k)} → {now.get(k)}' for k in changed)})",
                "resume with the original settings, or start over with --overwrite",
            )
        if state.get("world_size", 1) != self.accelerator.num_processes:
            raise LlmoptError(
                f"cannot resume from {path}: it was saved by {state.get('world_size')} processes, this run has {self.accelerator.num_processes}",
                "resume with the same number of processes",
            )
        checkpoint.load(path, self.accelerator, self.model, self.optimizer, self.scheduler)
        self.history, self.val_history = state["history"], state["validation"]
        self._note(f"resumed from {path} (step {state['step']})")
        return int(state["step"])

    def _note(self, message: str) -> None:
        if self.display is not None and self.accelerator.is_main_process:
            self.display.note(message)

    def run(self, resume: bool = False) -> TrainResult:
        """Train to ``settings.steps`` (or until Ctrl-C), from the last checkpoint when ``resume``."""
        from accelerate.utils import set_seed

        s, acc = self.settings, self.accelerator
        set_seed(s.seed)
        self.student.train()
        if self.teacher is not None:
            self.teacher.eval().requires_grad_(False)
            self.teacher.to(acc.device)
        optimizer, scheduler = build_optimizer(self.student, s)
        bounded = [m for m in self.student.modules() if hasattr(m, "clamp_")]  # keep their parameters in range
        if bounded:
            optimizer.register_step_post_hook(lambda *_: [m.clamp_() for m in bounded])
        self.model, self.optimizer = acc.prepare(self.student, optimizer)
        self.scheduler = scheduler  # stepped by hand, once per optimizer step, on every process
        self.history: list[dict] = []
        self.val_history: list[dict] = []
        self._global_batch = s.batch_size * s.grad_accum * acc.num_processes
        start_step = self._resume() if resume else 0
        shard = {"rank": acc.process_index, "first_samples": [], "samples_seen": 0}
        shard_hash = hashlib.sha256()
        tokens_per_step = self._global_batch * self.train.ids.shape[1]
        result = TrainResult(start_step, False, world_size=acc.num_processes, precision=acc.mixed_precision,
                             resumed_from=start_step)
        began = time.perf_counter()
        if s.eval_every and start_step == 0 and self.val_ids is not None:
            self.val_history.append({"step": 0, **self.validate()})
        completed = start_step
        with _StopRequest() as stop:
            try:
                for step in range(start_step, s.steps):
                    sums: dict[str, float] = {}
                    for micro in range(s.grad_accum):
                        samples = self.order.micro_batch(step, micro, acc.process_index, acc.num_processes, s.batch_size, s.grad_accum)
                        batch = self.train.ids[samples].to(acc.device)
                        with acc.accumulate(self.model):
                            loss, terms = self._loss(batch, samples)
                            acc.backward(loss)
                            if acc.sync_gradients:
                                acc.clip_grad_norm_(self.model.parameters(), s.max_grad_norm)
                                self._committing = True  # from here until `completed` moves, the weights are mid-update
                            self.optimizer.step()
                            self.optimizer.zero_grad(set_to_none=True)
                        for k, v in terms.items():
                            sums[k] = sums.get(k, 0.0) + v / s.grad_accum
                        if len(shard["first_samples"]) < 16:
                            shard["first_samples"] += samples[: 16 - len(shard["first_samples"])]
                        shard["samples_seen"] += len(samples)
                        shard_hash.update(repr(samples).encode())
                    lr = self.scheduler.get_last_lr()[0]
                    self.scheduler.step()
                    stats = torch.tensor([*sums.values(), float(stop.requested)], dtype=torch.float64)
                    stats = acc.reduce(stats.to(acc.device), "sum").cpu()
                    terms = {k: float(v) / acc.num_processes for k, v in zip(sums, stats)}
                    self.history.append({"step": step + 1, **{k: round(v, 6) for k, v in terms.items()}, "lr": lr})
                    completed = step + 1
                    self._committing = False
                    validation = {}
                    if s.eval_every and completed % s.eval_every == 0 and self.val_ids is not None:
                        validation = self.validate()
                        self.val_history.append({"step": completed, **validation})
                    self._show(completed, terms, lr, began, start_step, tokens_per_step, validation)
                    if self.on_step is not None:
                        self.on_step(completed, terms)
                    if float(stats[-1]) > 0 or (acc.num_processes == 1 and stop.requested):
                        result.checkpoint = str(self._save(completed))
                        result.interrupted = True
                        break
                    if s.save_every and completed % s.save_every == 0 and completed < s.steps:
                        result.checkpoint = str(self._save(completed))
            except KeyboardInterrupt:
                if acc.num_processes > 1 or self._committing:
                    raise  # other processes cannot join a save now / the weights are half-updated
                result.checkpoint = str(self._save(completed))
                result.interrupted = True
        result.steps_done = completed
        result.history, result.validation = self.history, self.val_history
        result.seconds = time.perf_counter() - began
        result.tokens = (result.steps_done - start_step) * tokens_per_step
        shard["samples_sha256"] = shard_hash.hexdigest()[:16]
        shard["weights_sha256"] = weights_sha256(acc.unwrap_model(self.model))[:16]
        result.shards = _gather(acc, shard)
        return result

    def _show(self, step: int, terms: dict, lr: float, began: float, start_step: int, tokens_per_step: int, validation: dict) -> None:
        if self.display is None or not self.accelerator.is_main_process:
            return
        elapsed = time.perf_counter() - began
        done = step - start_step
        rate = elapsed / max(done, 1)
        last_val = validation or (self.val_history[-1] if self.val_history else {})
        shown = {k: v for k, v in last_val.items() if k != "step"}
        self.display.update(Progress(step, self.settings.steps, terms, lr, done * tokens_per_step / max(elapsed, 1e-9),
                                     rate * (self.settings.steps - step), shown), force=bool(validation))


def _gather(accelerator, shard: dict) -> list[dict]:
    if accelerator.num_processes == 1:
        return [shard]
    from accelerate.utils import gather_object

    return gather_object([shard])
