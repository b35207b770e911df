"""Semi-structured N:M sparsity as a weight format: the pattern, parsing it, checking a weight."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Pattern:
    """Semi-structured N:M sparsity: at most ``n`` nonzeros in every ``m`` consecutive inputs."""

    n: int
    m: int

    def __str__(self) -> str:
        return f"{self.n}:{self.m}"

    @property
    def sparsity(self) -> float:
        return 1.0 - self.n / self.m


PATTERN = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


def parse_pattern(text: str) -> Pattern:
    """``"2:4"`` → ``Pattern(2, 4)``; ``ValueError`` unless ``0 < N < M``."""
    match = PATTERN.match(str(text))
    if not match:
        raise ValueError(f"malformed N:M pattern '{text}': write it as two integers N:M with N < M, e.g. 2:4 or 4:8")
    n, m = int(match.group(1)), int(match.group(2))
    if not 0 < n < m:
        raise ValueError(f"N:M pattern '{text}' needs 0 < N < M (e.g. 2:4 or 4:8)")
    return Pattern(n, m)


def nm_valid(weight: torch.Tensor, pattern: Pattern) -> bool:
    """Whether every group of ``m`` consecutive inputs of every row has at most ``n`` nonzeros."""
    if weight.dim() != 2 or weight.shape[1] % pattern.m:
        return False
    nonzero = (weight != 0).reshape(weight.shape[0], -1, pattern.m).sum(-1)
    return bool((nonzero <= pattern.n).all())
