"""OpenAI-compatible request / response shapes (the subset ``llmopt serve`` implements) and
the OpenAI error body."""

from __future__ import annotations

import difflib
import logging
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

SEED_MIN, SEED_MAX = -2**63, 2**63 - 1  # torch.long, as vLLM; the n choices use seed, seed + 1, … (a generator takes < 2**64)


log = logging.getLogger("llmopt.serve")
NEAR_MISS_CUTOFF = 0.8  # difflib ratio from which an unknown field is taken for a typo of a known one
# OpenAI's and vLLM's fields that would change the answer but llmopt does not implement: refused
# (400) unless set to a value that asks for nothing (null, false, empty, best_of 1, tool_choice "none" …)
UNSUPPORTED_FIELDS = frozenset("""
    allowed_token_ids audio bad_words best_of chat_template chat_template_kwargs continue_final_message function_call
    functions guided_choice guided_grammar guided_json guided_regex length_penalty logit_bias min_tokens modalities
    prediction reasoning_effort response_format spaces_between_special_tokens structured_outputs suffix tool_choice tools
    truncate_prompt_tokens use_beam_search""".split())
INERT_VALUES = {"best_of": (1,), "tool_choice": ("none",), "response_format": ({"type": "text"},), "min_tokens": (0,),
                "length_penalty": (1, 1.0), "spaces_between_special_tokens": (True,)}
# fields that change nothing in the answer (bookkeeping, or another endpoint's): ignored with a warning
IGNORED_FIELDS = frozenset("""
    add_generation_prompt add_special_tokens echo max_completion_tokens messages metadata parallel_tool_calls priority
    prompt prompt_logprobs request_id service_tier store top_logprobs""".split())


def _asks_for_nothing(name: str, value: Any) -> bool:
    return value is None or value is False or value in ([], {}, "") or value in INERT_VALUES.get(name, ())


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    """A request body. Unknown top-level fields are ignored with a warning (vLLM's behaviour),
    unless one is a near-miss of a known field (``max_token``, ``temprature``): that is a 400."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _unknown_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = set(cls.model_fields)
        unknown = [name for name in data if name not in known]
        for name in unknown:
            if name in UNSUPPORTED_FIELDS and not _asks_for_nothing(name, data[name]):
                raise PydanticCustomError("unsupported_field", "'{param}' is not supported by this server: leave it out",
                                          {"param": name})
            if name in UNSUPPORTED_FIELDS or name in IGNORED_FIELDS:
                continue
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=NEAR_MISS_CUTOFF)
            if close:
                raise PydanticCustomError("unknown_field", "unknown field '{param}': did you mean '{suggestion}'?",
                                          {"param": name, "suggestion": close[0]})
        if unknown:
            shown = ", ".join(ascii(name[:64]) for name in unknown[:10])  # ascii: a lone surrogate cannot be logged
            more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
            log.warning("%s: ignoring unknown field%s %s%s", cls.__name__, "s" if len(unknown) > 1 else "", shown, more)
        return data


class _Sampling(_Request):
    """Fields shared by both endpoints; ``top_k``, ``min_p``, ``repetition_penalty`` and
    ``ignore_eos`` are extensions (vLLM's names). ``seed`` is a 64-bit signed integer, as vLLM
    takes it; ``n`` and the stop strings are further limited by the server's
    :class:`~llmopt.serve.settings.ServeLimits` (checked by the app)."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, ge=1e-3, le=1e3)  # beyond: float32 logits overflow (NaN sampling)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        items = [value] if isinstance(value, str) else list(value or [])
        if any(not s for s in items):
            raise ValueError("stop sequences must be non-empty")
        return items

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False  # the prompt before each choice's text (and, with logprobs, its tokens' log-probabilities)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("no prompt: pass a string, a list of token ids, or a list of either")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts (a batch: each gets ``n`` choices, in order)."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _parts(cls, value):
        if isinstance(value, list):
            for part in value:
                if part.get("type") != "text":
                    raise ValueError("only text content parts are supported")
                if not isinstance(part.get("text"), str):
                    raise ValueError("a text content part needs 'text': a string")
        return value

    def text(self) -> str:
        """The message's text (its text parts joined)."""
        if isinstance(self.content, list):
            return "".join(part["text"] for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class TokenizeRequest(_Request):
    """``/tokenize``: a ``prompt``, or chat ``messages`` put through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("invalid_request", "send either 'prompt' or 'messages'", {"param": "prompt"})
        return self


class DetokenizeRequest(_Request):
    """``/detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[int]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_exceeded", 500: "internal_server_error",
               503: "service_unavailable"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
