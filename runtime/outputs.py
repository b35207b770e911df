"""What the engine hands back for a request after a step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .metrics import RequestMetrics


@dataclass
class RequestOutput:
    """A request's state after a step. ``token_ids`` are the generated tokens only; ``text`` is
    their decoded text (computed on first access), cut before a matched stop string.
    ``new_token_ids`` are the tokens added by this step; ``delta_text`` is filled by streaming."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None
    logprobs: list[dict[int, float]] | None
    cumulative_logprob: float | None
    num_cached_tokens: int
    metrics: RequestMetrics
    error: str | None = None
    delta_text: str = ""
    _decode: Any = field(default=None, repr=False)
    _text: str | None = field(default=None, repr=False)

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self._decode() if self._decode is not None else ""
        return self._text
