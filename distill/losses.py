"""Distillation losses: divergences between teacher and student next-token distributions,
hidden-state MSE, and cross-entropy on the data.

Divergences take temperature-scaled logits (``logits / T``) and are multiplied by ``T²`` so
their gradients keep the same scale as the temperature changes (Hinton et al., 2015). They
are averaged over tokens. The teacher is either dense logits ``[..., vocab]`` or a
:class:`TopK` (its ``k`` most likely tokens' log-probabilities at temperature ``T``, e.g. from
the disk cache); then both distributions are coarsened to ``k + 1`` buckets — the teacher's
top ``k`` tokens and "everything else" — and the divergence is exact on those buckets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from llmopt.core.errors import LlmoptError

KINDS = ("fkl", "rkl", "jsd")


@dataclass
class TopK:
    """The teacher's top-k tokens per position: ids ``[..., k]`` and log-probs at temperature ``T``."""

    indices: torch.Tensor
    log_probs: torch.Tensor
    temperature: float


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """Per-position KL(p || q) from log-probabilities over the last dimension."""
    p = p_log.exp()
    return (p * (p_log - q_log)).sum(-1)


def _with_rest(log_probs: torch.Tensor) -> torch.Tensor:
    """Append the log of the mass not covered by ``log_probs`` as one extra bucket."""
    rest = (1.0 - log_probs.exp().sum(-1, keepdim=True)).clamp(min=1e-12)
    return torch.cat([log_probs, rest.log()], dim=-1)


def _pair(student_logits: torch.Tensor, teacher: torch.Tensor | TopK, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher and student log-probabilities over the same support, at ``temperature``."""
    student_log = F.log_softmax(student_logits.float() / temperature, dim=-1)
    if isinstance(teacher, TopK):
        if not math.isclose(teacher.temperature, temperature):
            raise LlmoptError(
                f"cached teacher log-probs are at temperature {teacher.temperature}, the loss asks for {temperature}",
                "use the same --temperature as the cache or a fresh cache",
            )
        student_top = student_log.gather(-1, teacher.indices.long())
        return _with_rest(teacher.log_probs.float()), _with_rest(student_top)
    if teacher.shape != student_logits.shape:
        raise LlmoptError(
            f"teacher logits {tuple(teacher.shape)} and student logits {tuple(student_logits.shape)} differ",
            "distill into a student with the teacher's vocabulary",
        )
    return F.log_softmax(teacher.float() / temperature, dim=-1), student_log


def forward_kl(student_logits, teacher, temperature: float = 1.0) -> torch.Tensor:
    """KL(teacher || student), mean over positions, times ``T²`` (mass-covering)."""
    p_log, q_log = _pair(student_logits, teacher, temperature)
    return _kl(p_log, q_log).mean() * temperature**2


def reverse_kl(student_logits, teacher, temperature: float = 1.0) -> torch.Tensor:
    """KL(student || teacher), mean over positions, times ``T²`` (mode-seeking)."""
    p_log, q_log = _pair(student_logits, teacher, temperature)
    return _kl(q_log, p_log).mean() * temperature**2


def generalized_jsd(student_logits, teacher, temperature: float = 1.0, beta: float = 0.5) -> torch.Tensor:
    """``β·KL(P||M) + (1-β)·KL(Q||M)`` with ``M = β·P + (1-β)·Q`` (P teacher, Q student), times ``T²``.

    Symmetric in P and Q at ``β = 0.5`` (the Jensen-Shannon divergence); ``0 < β < 1``.
    """
    if not 0.0 < beta < 1.0:
        raise LlmoptError(f"JSD beta {beta} is outside (0, 1)", "use a beta strictly between 0 and 1, e.g. 0.5")
    p_log, q_log = _pair(student_logits, teacher, temperature)
    m_log = torch.logsumexp(torch.stack([p_log + math.log(beta), q_log + math.log(1.0 - beta)]), dim=0)
    jsd = beta * _kl(p_log, m_log) + (1.0 - beta) * _kl(q_log, m_log)
    return jsd.mean() * temperature**2


def kd_loss(student_logits, teacher, kind: str = "fkl", temperature: float = 1.0, beta: float = 0.5) -> torch.Tensor:
    """The logit-distillation loss named ``kind`` (``fkl``, ``rkl`` or ``jsd``)."""
    if temperature <= 0:
        raise LlmoptError(f"temperature {temperature} is not positive", "use a temperature above 0 (1.0 is plain)")
    if kind == "fkl":
        return forward_kl(student_logits, teacher, temperature)
    if kind == "rkl":
        return reverse_kl(student_logits, teacher, temperature)
    if kind == "jsd":
        return generalized_jsd(student_logits, teacher, temperature, beta)
    raise LlmoptError(f"unknown distillation loss '{kind}'", f"use one of {', '.join(KINDS)}")


def hidden_mse(student_hidden: list[torch.Tensor], teacher_hidden: list[torch.Tensor], layer_map: list[tuple[int, int]]) -> torch.Tensor:
    """Mean over the pairs ``(s, t)`` of ``layer_map`` of MSE(student[s], teacher[t]) / mean(teacher[t]²).

    Dividing by the teacher's mean square makes layers with large activations count no more
    than others (residual streams grow with depth).
    """
    if not layer_map:
        raise LlmoptError("the hidden-state loss has an empty layer map", "set --hidden-weight 0 or give a student with matching layers")
    terms = []
    for s, t in layer_map:
        target = teacher_hidden[t].float()
        scale = target.pow(2).mean().clamp(min=1e-12)
        terms.append(F.mse_loss(student_hidden[s].float(), target) / scale)
    return torch.stack(terms).mean()


def cross_entropy(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``logits [batch, seq, vocab]`` on ``input_ids [batch, seq]``."""
    shifted = logits[:, :-1].float()
    return F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), input_ids[:, 1:].reshape(-1))
