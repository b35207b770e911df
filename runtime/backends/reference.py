"""Plain torch on any device: the composites of :class:`.base.Backend`, with nothing overridden."""

from __future__ import annotations

import torch

from .base import Backend


def unavailable_reason(device: torch.device) -> str | None:
    return None


class ReferenceBackend(Backend):
    """The readable baseline the other backends are tested against (and the fallback)."""

    name = "reference"


BACKEND = ReferenceBackend
