"""End-to-end tuning of a quantized model's float parameters against the float model.

GPTQ and its scale refit fit each Linear to its own output, one layer at a time. Once every
code is chosen, the parameters that stay float — each group's scale and each norm's weight —
can still be moved together to bring the whole model's next-token distributions closer to the
float model's. This module does that by gradient descent on the mean KL divergence
``KL(float ‖ quantized)`` over calibration windows, codes held fixed (as EfficientQAT's
end-to-end step-size training):

- a group scale ``s`` becomes ``s · exp(u)`` with one trainable ``u`` per group, or per
  super-block of 256 features where the scales are ``k · d`` multiples of one float16 ``d``
  (IQ4_XS, Q6_K): there ``d`` moves and the integers ``k`` stay (``per="row"``: one ``u`` for
  all the scales of an output row);
- a norm's weight moves additively (RMSNorm, LayerNorm and Gemma's ``1 + w`` alike).

Tuned scales are rounded to their stored 16-bit dtype (float16 when stored in float32, as the
GGUF blocks store them), so a ``--type auto`` export
still carries the checkpoint's weights exactly. The codes, zero points and every other tensor
are unchanged, so the tuned checkpoint has the same format, size and speed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from llmopt.formats.registry import format_of
from llmopt.formats.schemes import SUPERBLOCK, QuantizedWeight, round_scales, superblock_factors

CHECK_WINDOWS = 4  # calibration windows held out of the tuning, on which the KLD is reported before and after
CHECK_EVERY = 16  # steps between checks on the held-out windows; the best state seen is the one kept
DEFAULT_LR = 1e-3  # Adam's peak step when none is given, for checkpoints at least REFERENCE_KLD from the float model
REFERENCE_KLD = 0.01  # below it, the default step shrinks in proportion (to a tenth at most): see default_lr


@dataclass
class TuneSettings:
    """How long and how fast to tune."""

    steps: int  # optimizer steps, one calibration window each (cycling through them in a seeded order)
    lr: float | None = None  # Adam's step on the log-scales and the norm weights: a linear warm-up, then a cosine to 0 (None: default_lr)
    warmup: float = 0.1  # fraction of the steps spent warming up
    norms: bool = False  # tune the norms' weights too (on the demo model they fitted the calibration text, not others)
    per: str = "group"  # one multiplier per scale ("group"; per super-block for k·d scales), or per output row ("row")
    seed: int = 0


@dataclass
class TuneReport:
    """What tuning did: steps, time, the calibration KLD before and after, how far the scales moved."""

    steps: int
    seconds: float
    check_windows: int
    kld_before: float
    kld_after: float
    scales_tuned: int
    norm_weights_tuned: int
    scale_change_mean: float  # mean |log(new / old)| over the tuned scales
    scale_change_max: float
    settings: dict
    best_step: int = 0  # the step whose state was kept (0: the untuned scales)
    kept: bool = True  # False: no tuned state beat the untuned scales on the held-out windows, which stay as they were

    def to_dict(self) -> dict:
        return asdict(self)


def _superblock_structure(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(d, k)`` when ``qw``'s scales are ``k · d`` per super-block (IQ4_XS / Q6_K / Q3_K): its
    registered weight format says (for a checkpoint read back, which names no such scales, from
    the values, as the GGUF exporter recognizes them)."""
    steps = format_of(qw).scale_steps
    return None if steps is None else superblock_factors(qw.scale.float(), qw.group_size or qw.codes.shape[1], steps)


class TunableScales:
    """One quantized weight with trainable log-multipliers on its scales."""

    def __init__(self, qw: QuantizedWeight, device: torch.device | None = None, per: str = "group") -> None:
        self.original = qw
        rows, cols = qw.codes.shape
        self.group = qw.group_size or cols
        codes = qw.codes.float()
        # float zero points (llama.cpp's mins) stay fixed as offsets: w = s · (q + 2^(bits-1)) − min
        self.offset = None
        if qw.scheme.float_zero and qw.zero_point is not None:
            codes = codes + 2 ** (qw.scheme.num_bits - 1)
            self.offset = qw.mins().repeat_interleave(self.group, dim=1).to(device)
        elif qw.zero_point is not None:
            codes = codes - qw.zero_point.float().repeat_interleave(self.group, dim=1)
        self.codes = codes.to(device)
        self.scale = qw.scale.float().to(device)
        self.factors = _superblock_structure(qw) if cols % SUPERBLOCK == 0 else None
        self.per_unit = SUPERBLOCK // self.group if self.factors is not None else 1
        units = 1 if per == "row" else self.scale.shape[1] // self.per_unit
        self.log_multiplier = torch.zeros(rows, units, device=device, requires_grad=True)

    def _expanded(self, multiplier: torch.Tensor) -> torch.Tensor:
        """``multiplier`` per group: one per row broadcasts, one per super-block repeats."""
        return multiplier if multiplier.shape[1] == 1 else multiplier.repeat_interleave(self.per_unit, dim=1)

    def weight_scale(self, base: torch.Tensor | None = None) -> torch.Tensor:
        """Each weight's scale ``[out, in]`` at the current multipliers (differentiable in them);
        ``base``: the stored scales to multiply (default: this object's copy; a module passes its
        own buffer, which follows it across devices)."""
        scale = (self.scale if base is None else base) * self._expanded(self.log_multiplier.exp())
        return scale.repeat_interleave(self.group, dim=1)

    def weight(self) -> torch.Tensor:
        """The dequantized weight at the current multipliers (differentiable in them)."""
        return self.offset_applied(self.codes * self.weight_scale())

    def offset_applied(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` less the fixed mins of float zero points (unchanged otherwise)."""
        return w if self.offset is None else w - self.offset.to(w.device)

    def tuned(self, codes: torch.Tensor | None = None) -> QuantizedWeight:
        """The weight with its tuned scales, rounded as they are stored (``codes``: new codes in
        the stored dtype, zero points included; None keeps the original ones)."""
        qw = self.original
        multiplier = self.log_multiplier.detach().exp().cpu()
        if self.factors is not None:  # a new float16 d per super-block; the integer multiples stay
            d, k = self.factors
            scale = k * (d * multiplier).to(torch.float16).float().repeat_interleave(self.per_unit, dim=1)
        else:
            scale = qw.scale.float() * self._expanded(multiplier)
            if qw.scheme.stored_scale_dtype != torch.float32:  # rounded as they are written (16-bit)
                scale = round_scales(scale, qw.scheme)
            elif not qw.scheme.is_float:  # float32 integer scales: float16, as their GGUF blocks hold them
                scale = scale.to(torch.float16).float()
        zero = qw.zero_point
        if self.offset is not None:  # the mins stay; their zero points follow the scales
            zero = qw.mins() / scale - 2 ** (qw.scheme.num_bits - 1)
        return QuantizedWeight(qw.codes if codes is None else codes, scale, zero, qw.scheme, qw.group_size)


def norm_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's normalization layers that have a weight."""
    return {name: m for name, m in model.named_modules()
            if "norm" in type(m).__name__.lower() and isinstance(getattr(m, "weight", None), torch.Tensor)}


def kl_divergence(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher ‖ student), computed in float32."""
    teacher_log = teacher_logits.float().log_softmax(-1)
    student_log = student_logits.float().log_softmax(-1)
    return (teacher_log.exp() * (teacher_log - student_log)).sum(-1).mean()


class _Student:
    """The quantized model with its quantized weights rebuilt from tunable scales at each step."""

    def __init__(self, model: nn.Module, weights: dict[str, QuantizedWeight], device: torch.device | None, per: str) -> None:
        self.model = model
        self.modules = dict(model.named_modules())
        missing = [name for name in weights if name not in self.modules]
        if missing:
            raise ValueError(f"quantized weights without a module in the model: {missing[:3]}")
        self.tunable = {name: TunableScales(qw, device, per) for name, qw in weights.items()}
        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
        # a tied head that is not quantized on its own reads the embedding's tuned weight
        self.shared_head = None
        if head is not None and head.weight is embedding.weight:
            names = {m: n for n, m in self.modules.items()}
            if names[embedding] in weights and names[head] not in weights:
                self.shared_head = (names[embedding], head)
        for p in model.parameters():
            p.requires_grad_(False)
        for name in weights:
            del self.modules[name]._parameters["weight"]
        if self.shared_head is not None:
            del self.shared_head[1]._parameters["weight"]

    def materialize(self) -> None:
        for name, t in self.tunable.items():
            w = t.weight()
            self.modules[name].weight = w
            if self.shared_head is not None and name == self.shared_head[0]:
                self.shared_head[1].weight = w


def default_lr(kld_before: float) -> float:
    """Adam's peak step for a checkpoint whose held-out calibration KLD starts at ``kld_before``:
    ``DEFAULT_LR``, times ``kld_before / REFERENCE_KLD`` when that is below one (at least a tenth).
    Adam moves every multiplier by about its step whatever the gradient's size, so a checkpoint
    already close to the float model needs smaller moves: on the demo model, Q5_K_M (KLD 0.005)
    tuned at 1e-3 never beat its untuned scales and gained 2.4× at 1e-4, while Q4_K_M / Q3_K_M
    (0.02 / 0.05) gain at 1e-3."""
    return DEFAULT_LR * min(1.0, max(0.1, kld_before / REFERENCE_KLD))


def _lr_factor(step: int, settings: TuneSettings) -> float:
    warm = max(1, round(settings.warmup * settings.steps))
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, settings.steps - warm)))


def _check_kld(teacher: nn.Module, student: nn.Module, ids: torch.Tensor, device: torch.device | None) -> float:
    with torch.no_grad():
        total = 0.0
        for window in ids:
            x = window.unsqueeze(0).to(device)
            total += float(kl_divergence(teacher(x).logits, student(x).logits))
    return total / len(ids)


def tune_scales(
    student: nn.Module,
    teacher: nn.Module,
    weights: dict[str, QuantizedWeight],
    ids: torch.Tensor,
    settings: TuneSettings,
    device: torch.device | None = None,
    advance: Callable[[int], None] | None = None,
) -> tuple[dict[str, QuantizedWeight], dict[str, torch.Tensor], TuneReport]:
    """Tune ``weights``' scales (and the norms of ``student``, a float model holding their
    dequantized values) to minimize the KLD to ``teacher`` on the windows ``ids`` ``[n, seq]``.

    Every ``CHECK_EVERY`` steps the KLD on held-out calibration windows is measured and the best
    state so far remembered; that state is returned, and the untuned scales when no step beat them
    (``report.kept`` False). Returns the tuned weights, the tuned norm weights
    (``{"<module>.weight": tensor}``, empty when ``settings.norms`` is off) and a report.
    ``student`` is modified in place.
    """
    if settings.steps < 1:
        raise ValueError("scale tuning needs at least one step")
    start = time.perf_counter()
    teacher.eval()
    student.eval()  # no dropout: the gradients follow the inference-time model
    state = _Student(student, weights, device, settings.per)
    if len(ids) < 2:
        raise ValueError("scale tuning needs at least 2 calibration windows (one is held out to check it)")
    held = min(CHECK_WINDOWS, len(ids) // 4 or 1)  # held out: the report's KLD is measured on windows it never trained on
    check, train = ids[:held], ids[held:]
    state.materialize()
    before = _check_kld(teacher, student, check, device)
    if settings.lr is None:
        settings = replace(settings, lr=default_lr(before))
    norms = norm_modules(student) if settings.norms else {}
    for m in norms.values():
        m.weight.requires_grad_(True)
    groups = [{"params": [t.log_multiplier for t in state.tunable.values()]}]
    if norms:
        groups.append({"params": [m.weight for m in norms.values()]})
    optimizer = torch.optim.Adam(groups, lr=settings.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, settings))
    params = [p for group in groups for p in group["params"]]
    initial = [p.detach().clone() for p in params]
    best, best_step, best_params = before, 0, initial
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(settings.seed))
    for step in range(settings.steps):
        x = train[order[step % len(train)]].unsqueeze(0).to(device)
        with torch.no_grad():
            target = teacher(x).logits
        state.materialize()
        loss = kl_divergence(target, student(x).logits)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if (step + 1) % CHECK_EVERY == 0 or step + 1 == settings.steps:
            state.materialize()
            now = _check_kld(teacher, student, check, device)
            if now < best:  # early stopping on the held-out windows: a step that overfits is not kept
                best, best_step, best_params = now, step + 1, [p.detach().clone() for p in params]
        if advance is not None:
            advance(1)
    with torch.no_grad():
        for p, value in zip(params, best_params):
            p.copy_(value)
        tuned = {name: t.tuned() for name, t in state.tunable.items()}
        for name, t in state.tunable.items():  # the stored (rounded) weights, for the check below
            w = tuned[name].dequantize().to(device)
            state.modules[name].weight = w
            if state.shared_head is not None and name == state.shared_head[0]:
                state.shared_head[1].weight = w
        after = _check_kld(teacher, student, check, device)
        kept = best_step > 0 and after < before
        if not kept:  # the untuned checkpoint stays as it was
            tuned, after, best_step = dict(weights), before, 0
            for p, value in zip(params, initial):
                p.copy_(value)
        change = torch.cat([(tuned[n].scale / w.scale).abs().log().flatten() for n, w in weights.items()
                            if w.scale.numel()]).abs()
        change = change[torch.isfinite(change)]
    norm_state = {f"{name}.weight": m.weight.detach().cpu().clone() for name, m in norms.items()}
    report = TuneReport(
        steps=settings.steps, seconds=round(time.perf_counter() - start, 1), check_windows=len(check),
        kld_before=before, kld_after=after, scales_tuned=sum(t.log_multiplier.numel() for t in state.tunable.values()),
        norm_weights_tuned=sum(m.weight.numel() for m in norms.values()),
        scale_change_mean=float(change.mean()) if change.numel() else 0.0,
        scale_change_max=float(change.max()) if change.numel() else 0.0, settings=asdict(settings), best_step=best_step,
        kept=kept)
    return tuned, norm_state, report
