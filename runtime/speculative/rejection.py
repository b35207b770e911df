"""Verification of proposed tokens against the target's logits.

Greedy: proposed tokens are kept while each equals the target's argmax after the tokens before
it; the target's argmax at the first mismatch (or after the last proposal) follows, so the
output is exactly plain greedy decoding. Sampling (the standard rule of speculative sampling,
Leviathan et al. 2023 / Chen et al. 2023): a proposed token ``d`` drawn from the draft's
distribution ``q`` is kept with probability ``min(1, p(d) / q(d))``, ``p`` the target's (after
the request's penalties, temperature, top-k / top-p / min-p); at the first rejection a token is
drawn from ``max(p - q, 0)`` normalised, and when every proposal is kept one more is drawn from
the target's next distribution, so every emitted token is distributed as the target's. Prompt
lookup proposes deterministically: ``q`` is one-hot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampler import apply_openai_penalties, apply_repetition_penalty, filter_logits


@dataclass
class Verdict:
    """The tokens to append (accepted proposals, then the target's own token) and their log-probs."""

    tokens: list[int]
    accepted: int
    logprobs: list[dict[int, float]] | None = None


def greedy_accept(targets: list[int], drafts: list[int]) -> Verdict:
    """``targets``: the target's argmax per verified row (``len(drafts) + 1`` of them)."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return Verdict(drafts[:a] + [targets[a]], a)


def penalised(logits: torch.Tensor, params, context: list[int], num_prompt: int) -> torch.Tensor:
    """The request's repetition / presence / frequency penalties given the tokens so far."""
    if params.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, context, params.repetition_penalty)
    if params.presence_penalty or params.frequency_penalty:
        logits = apply_openai_penalties(logits, context[num_prompt:], params.presence_penalty, params.frequency_penalty)
    return logits


def distribution(logits: torch.Tensor, params) -> torch.Tensor:
    """The sampling distribution of a (penalised) row: temperature, top-k, top-p, min-p."""
    return torch.softmax(filter_logits(logits, params), -1)


def verify(rows: torch.Tensor, seq, drafts: list[int], draft_probs: list[torch.Tensor] | None,
           generator: torch.Generator) -> Verdict:
    """Accept / resample ``drafts`` of ``seq`` against ``rows`` (``[len(drafts) + 1, vocab]``
    target logits on the CPU, row i predicting the token after ``drafts[:i]``)."""
    params = seq.params
    context = list(seq.token_ids)
    tokens: list[int] = []
    logprobs = [] if params.logprobs is not None else None
    accepted = 0
    for i in range(len(drafts) + 1):
        logits = penalised(rows[i], params, context, seq.num_prompt_tokens)
        last = i == len(drafts)
        if params.is_greedy:
            token = int(logits.argmax())
            keep = not last and token == drafts[i]
        else:
            p = distribution(logits, params)
            if last:
                token, keep = int(torch.multinomial(p, 1, generator=generator)), False
            else:
                d = drafts[i]
                q = None if draft_probs is None else draft_probs[i]
                q_d = 1.0 if q is None else float(q[d])
                keep = q_d > 0 and float(torch.rand((), generator=generator)) * q_d < float(p[d])
                if keep:
                    token = d
                else:
                    token = int(torch.multinomial(residual(p, q, d), 1, generator=generator))
        if logprobs is not None:
            logprobs.append(_logprobs(rows[i], token, params.logprobs))
        tokens.append(token)
        context.append(token)
        if not keep:
            break
        accepted += 1
    return Verdict(tokens, accepted, logprobs)


def residual(p: torch.Tensor, q: torch.Tensor | None, d: int) -> torch.Tensor:
    """What to sample from after rejecting ``d``: ``max(p - q, 0)`` (unnormalised), ``q`` one-hot
    at ``d`` when None."""
    if q is None:
        out = p.clone()
        out[d] = 0.0
    else:
        out = (p - q.to(p.dtype)).clamp_(min=0.0)
    return out if float(out.sum()) > 0.0 else p  # rounding: p and q agree everywhere


def _logprobs(row: torch.Tensor, token: int, top: int) -> dict[int, float]:
    logp = torch.log_softmax(row.float(), -1)
    out = {token: float(logp[token])}
    if top:
        values, ids = torch.topk(logp, top)
        out.update(zip(ids.tolist(), values.tolist()))
    return out
