"""Sampling parameters of one request, validated when built."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmopt.core.errors import LlmoptError


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy. ``top_k`` 0 or -1 disables top-k; ``top_p`` 1 and
    ``min_p`` 0 disable theirs. ``repetition_penalty`` > 1 discourages tokens already in the
    prompt or output (the CTRL rule transformers uses). ``seed`` makes one request's sampling
    reproducible whatever else runs beside it. ``stop`` strings end generation (the text is cut
    before them unless ``include_stop_str_in_output``); ``stop_token_ids`` end it on those
    tokens, as the model's EOS does unless ``ignore_eos``. ``logprobs`` N returns, per generated
    token, the log-probabilities (of the model's raw distribution) of the sampled token and the
    N most likely ones. ``presence_penalty`` / ``frequency_penalty`` (OpenAI's rule, -2..2)
    subtract, from the logits of tokens already generated, the penalty once / once per occurrence.
    ``prompt_logprobs`` N returns, per prompt token after the first, its log-probability given the
    tokens before it and the N most likely ones (such a request bypasses the prefix cache).
    ``stream_text`` decodes the text as it grows: every step's output carries its ``delta_text``
    (text that may still become a stop string is held back until it cannot).
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    prompt_logprobs: int | None = None
    stream_text: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    @classmethod
    def greedy(cls, **kwargs) -> SamplingParams:
        return cls(temperature=0.0, **kwargs)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_row_processing(self) -> bool:
        """Whether this request cannot take the batched greedy argmax fast path."""
        return (not self.is_greedy or self.repetition_penalty != 1.0 or self.logprobs is not None
                or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0)

    def _validate(self) -> None:
        rules = [
            (self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1), "max_tokens must be an integer >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1), "top_k must be -1, 0 (off) or a positive integer"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0), "logprobs must be None or an integer >= 0"),
            (self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= 0),
             "prompt_logprobs must be None or an integer >= 0"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative integers"),
            (self.seed is None or isinstance(self.seed, int), "seed must be an integer"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
        ]
        values = {
            "max_tokens": self.max_tokens, "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
            "min_p": self.min_p, "repetition_penalty": self.repetition_penalty, "logprobs": self.logprobs,
            "prompt_logprobs": self.prompt_logprobs,
            "stop": self.stop, "stop_token_ids": self.stop_token_ids, "seed": self.seed,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
        }
        for ok, rule in rules:
            if not ok:
                name = rule.split()[0]
                raise LlmoptError(f"invalid sampling parameter: {rule}, got {values.get(name)!r}", "fix the SamplingParams")
