"""``speculative_config``: vLLM's shape, ``{"method": "ngram" | "draft", "model": DRAFT,
"num_speculative_tokens": k, ...}``."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from llmopt.core.errors import LlmoptError

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Settings of speculative decoding.

    ``method``: ``ngram`` (prompt lookup: the tokens that followed the latest earlier occurrence
    of the sequence's last ``prompt_lookup_max`` … ``prompt_lookup_min`` tokens) or ``draft`` (a
    small model, ``model``, sharing the target's tokenizer, with its own paged KV cache).
    ``num_speculative_tokens``: the most tokens proposed per sequence and step. ``adaptive``:
    each sequence's k follows its measured acceptance and the measured costs (k = 0, plain
    decoding, when speculation would not pay); ``False`` always proposes k.
    """

    method: str
    num_speculative_tokens: int = 4
    model: str | None = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    adaptive: bool = True

    @classmethod
    def parse(cls, value: dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """Validated settings from a mapping; a bad one is one clear ``LlmoptError``."""
        if isinstance(value, SpeculativeConfig):
            config = value
        else:
            if not isinstance(value, dict):
                raise LlmoptError(f"speculative_config must be a mapping, not {type(value).__name__}",
                                  'pass e.g. {"method": "ngram", "num_speculative_tokens": 4}')
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise LlmoptError(f"unknown speculative_config key '{unknown[0]}'", f"known keys: {', '.join(sorted(known))}")
            if "method" not in value:
                method = "draft" if value.get("model") else None
                if method is None:
                    raise LlmoptError("speculative_config needs a method", f"set method to one of {', '.join(METHODS)}")
                value = {**value, "method": method}
            config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        k = self.num_speculative_tokens
        checks = [
            (self.method in METHODS, f"speculative method must be one of {', '.join(METHODS)}, not {self.method!r}",
             f"use {' or '.join(METHODS)}"),
            (isinstance(k, int) and 1 <= k <= 16, f"num_speculative_tokens must be an integer from 1 to 16, not {k!r}",
             "use e.g. 4"),
            (self.method != "draft" or bool(self.model), "speculative method 'draft' needs a draft model",
             "pass --draft MODEL (speculative_config model)"),
            (self.method != "ngram" or self.model is None, "speculative method 'ngram' takes no draft model",
             "drop --draft, or use --speculative-method draft"),
            (1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
             f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max (got {self.prompt_lookup_min}, {self.prompt_lookup_max})",
             "fix the n-gram sizes"),
        ]
        for ok, problem, fix in checks:
            if not ok:
                raise LlmoptError(f"invalid speculative_config: {problem}", fix)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
