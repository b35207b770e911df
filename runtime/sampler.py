"""Next-token choice per request: greedy, temperature, top-k, top-p, min-p, repetition penalty,
per-request seeds, and optional log-probabilities."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .sampling_params import SamplingParams
from .sequence import Sequence


@dataclass
class SampleResult:
    token_id: int
    logprobs: dict[int, float] | None = None  # sampled token and the top-N, when asked
    error: str | None = None


def apply_repetition_penalty(logits: torch.Tensor, token_ids: list[int], penalty: float) -> torch.Tensor:
    """Divide positive / multiply negative logits of tokens already seen (transformers' rule)."""
    seen = torch.tensor(sorted(set(token_ids)), dtype=torch.long)
    picked = logits.index_select(0, seen)
    logits = logits.clone()
    logits.index_copy_(0, seen, torch.where(picked > 0, picked / penalty, picked * penalty))
    return logits


def apply_openai_penalties(logits: torch.Tensor, output_ids: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's presence / frequency penalties over the generated tokens:
    ``logit - presence * (count > 0) - frequency * count``."""
    if not output_ids:
        return logits
    ids, counts = torch.tensor(output_ids, dtype=torch.long).unique(return_counts=True)
    logits = logits.clone()
    logits.index_add_(0, ids, -(presence + frequency * counts.to(logits.dtype)))
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Scale by temperature and mask (-inf) tokens excluded by top-k, top-p and min-p."""
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        probs, order = torch.sort(torch.softmax(logits, -1), descending=True)
        outside = (torch.cumsum(probs, -1) - probs) > params.top_p  # mass before a token already exceeds p
        logits = logits.masked_fill(torch.zeros_like(outside).scatter_(0, order, outside), float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(logits, -1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


class Sampler:
    """Samples one token per row of logits; requests without a seed share the engine's generator.
    A batch of greedy rows takes ``argmax`` (the backend's: torch's choice, ties and NaN
    included); other rows are processed one by one on the CPU."""

    def __init__(self, seed: int = 0, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.argmax = argmax or (lambda logits: logits.argmax(-1))

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult]:
        if not any(s.params.needs_row_processing for s in seqs):
            return [SampleResult(t) for t in self.argmax(logits).tolist()]
        logits = logits.cpu()
        results = []
        for row, seq in zip(logits, seqs):
            try:
                results.append(self._sample_row(row, seq))
            except (RuntimeError, ValueError) as exc:  # one bad request must not stop the others
                results.append(SampleResult(-1, error=f"sampling failed: {exc}"))
        return results

    def _sample_row(self, row: torch.Tensor, seq: Sequence) -> SampleResult:
        params = seq.params
        logits = row
        if params.repetition_penalty != 1.0:
            logits = apply_repetition_penalty(logits, seq.token_ids, params.repetition_penalty)
        if params.presence_penalty or params.frequency_penalty:
            logits = apply_openai_penalties(logits, seq.output_token_ids, params.presence_penalty, params.frequency_penalty)
        if params.is_greedy:
            token = int(logits.argmax())
        else:
            probs = torch.softmax(filter_logits(logits, params), -1)
            token = int(torch.multinomial(probs, 1, generator=seq.generator or self.generator))
        logprobs = None
        if params.logprobs is not None:
            logp = torch.log_softmax(row.float(), -1)
            logprobs = {token: float(logp[token])}
            if params.logprobs:
                values, ids = torch.topk(logp, params.logprobs)
                logprobs.update(zip(ids.tolist(), values.tolist()))
        return SampleResult(token, logprobs)
