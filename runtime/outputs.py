"""What the engine hands back for a request after a step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmopt.core.errors import LlmoptError

from .metrics import RequestMetrics


class RequestFailedError(LlmoptError):
    """A request finished with ``finish_reason="error"`` (a failed forward or sampling step).
    Not the user's input, so the CLI exits with 1, still with one line."""

    exit_code = 1


@dataclass
class RequestOutput:
    """A request's state after a step. ``token_ids`` are the generated tokens only; ``text`` is
    their decoded text (computed on first access), cut before a matched stop string.
    ``new_token_ids`` are the tokens added by this step; ``delta_text`` is the text they added
    when the request asked for ``stream_text`` (or has stop strings)."""

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
    prompt_logprobs: list[dict[int, float] | None] | None = None  # per prompt token (None for the first)
    delta_text: str = ""
    _decode: Any = field(default=None, repr=False)
    _text: str | None = field(default=None, repr=False)

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self._decode() if self._decode is not None else ""
        return self._text


def raise_if_failed(output: RequestOutput | None, what: str = "request") -> RequestOutput:
    """``output`` unchanged, or a ``RequestFailedError`` naming the failure when the request
    errored or no output came back (figures from it would be meaningless)."""
    if output is None:
        raise RequestFailedError(f"{what} produced no output", "report this as a bug (llmopt --debug shows more)")
    if output.finish_reason == "error":
        raise RequestFailedError(f"{what} failed: {output.error or 'unknown error'}",
                                 "try --kernels reference to rule out the compiled kernels, and report the bug")
    return output
