"""The draft path's acceptance counters are what they claim: a replay of the verify rule on the
target's own greedy output, with the draft's proposals made by plain decoding of the draft
model, gives the engine's proposed / accepted / verify-step counts exactly."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import save_model, tiny_llama
from llmopt.runtime import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
K = 3


def _noisy(model, scale: float, seed: int):
    """The target's weights plus noise: a draft that agrees with it part of the time."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    return model


def _replay(target_out: list[int], prompt: list[int], max_tokens: int, draft: LLM) -> tuple[int, int, int]:
    """(proposed, accepted, verify steps) of one greedy request with fixed k = K: after the first
    token (the prefill's), each step proposes min(K, tokens left - 1) draft tokens from the
    accepted text, accepts their longest prefix equal to the target's output, and adds that
    prefix plus the target's own next token."""
    proposed = accepted = steps = 0
    done = 1
    while done < max_tokens:
        k = min(K, max_tokens - done - 1)
        if k == 0:
            done += 1
            continue
        guess = draft.generate([prompt + target_out[:done]], SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True))[0].token_ids
        assert len(guess) == k
        match = 0
        while match < k and guess[match] == target_out[done + match]:
            match += 1
        proposed, accepted, steps = proposed + k, accepted + match, steps + 1
        done += match + 1
    return proposed, accepted, steps


def test_draft_counters_equal_a_replay_of_the_rule(tmp_path):
    target = save_model(tiny_llama(seed=21), tmp_path / "target")
    draft = save_model(_noisy(tiny_llama(seed=21), 0.2, 4), tmp_path / "draft")
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randint(4, 24))] for _ in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=18 + 5 * i, ignore_eos=True) for i in range(len(prompts))]
    plain = LLM(target).generate(prompts, params)
    llm = LLM(target, speculative_config={"method": "draft", "model": str(draft), "num_speculative_tokens": K, "adaptive": False})
    outs = llm.generate(prompts, params)
    assert len(outs) == len(plain) == len(prompts)
    for a, b, p in zip(outs, plain, params):
        assert len(a.token_ids) == len(b.token_ids) == p.max_tokens and a.token_ids == b.token_ids

    drafter = LLM(draft)
    replays = [_replay(b.token_ids, prompt, p.max_tokens, drafter) for b, prompt, p in zip(plain, prompts, params)]
    proposed, accepted, verified = (sum(r[i] for r in replays) for i in range(3))
    m = llm.metrics()
    assert 0 < accepted < proposed  # the draft is right part of the time: both branches ran
    assert (m["spec_proposed_tokens"], m["spec_accepted_tokens"]) == (proposed, accepted)
    assert m["spec_acceptance_rate"] == pytest.approx(accepted / proposed)
    # tokens per verified sequence-step: its accepted proposals plus the target's own token
    assert m["spec_mean_accepted_length"] == pytest.approx((accepted + verified) / verified)
    # engine steps verify the batch's sequences together
    assert max(r[2] for r in replays) <= m["spec_verify_steps"] <= verified
