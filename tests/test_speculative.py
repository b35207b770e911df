"""Speculative decoding: greedy output identical to plain decoding (prompt lookup and a draft
model, several sequences with different k, chunked prefill, prefix caching, preemption),
the accept / resample rule keeps the target's distribution (chi-square), settings and errors."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import save_model, tiny_llama
from llmopt.core.errors import LlmoptError
from llmopt.runtime import LLM, SamplingParams
from llmopt.runtime.speculative import adaptive, rejection
from llmopt.runtime.speculative.ngram import ngram_propose

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 259


def _perturbed(model, scale: float, seed: int):
    """A copy-like draft: the target's weights plus noise (partly agrees with the target)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    return {
        "target": save_model(tiny_llama(seed=11), root / "target"),
        "draft": save_model(_perturbed(tiny_llama(seed=11), 0.15, 1), root / "draft"),
        "small": save_model(tiny_llama(seed=12, vocab_size=8, num_hidden_layers=1), root / "small"),
        "small_draft": save_model(_perturbed(tiny_llama(seed=12, vocab_size=8, num_hidden_layers=1), 1.5, 2), root / "small_draft"),
        "other_vocab": save_model(tiny_llama(seed=13, vocab_size=200), root / "other_vocab"),
    }


def _prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts with repeated phrases (prompt lookup finds them) and a shared prefix (prefix cache)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(12)]
    prompts = []
    for i in range(n):
        phrase = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 8))]
        body = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 20))]
        prompts.append((shared if i % 2 else []) + phrase + body + phrase + body[:3] + phrase)
    return prompts


def _varied_k(monkeypatch):
    """Every sequence its own k (1..3 by request id), changing from step to step."""
    calls = {}

    def choose(self, seq, batch):
        calls[seq.request_id] = calls.get(seq.request_id, 0) + 1
        return 1 + (int(seq.request_id) + calls[seq.request_id]) % 3

    monkeypatch.setattr(adaptive.AdaptiveK, "choose", choose)


SETTINGS = {
    "plain": dict(block_size=4),
    "chunked+prefix+preempt": dict(block_size=4, max_num_batched_tokens=16, num_kv_blocks=40, max_num_seqs=6),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_identical_to_plain_decoding(models, monkeypatch, method, setting):
    _varied_k(monkeypatch)
    prompts = _prompts(8, seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=20 + 7 * i, ignore_eos=True) for i in range(len(prompts))]
    plain = LLM(models["target"], block_size=4).generate(prompts, params)
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft":
        spec["model"] = str(models["draft"])
    llm = LLM(models["target"], speculative_config=spec, **SETTINGS[setting])
    outs = llm.generate(prompts, params)
    assert len(outs) == len(plain)
    for i, (a, b) in enumerate(zip(outs, plain)):
        assert len(a.token_ids) == len(b.token_ids) == params[i].max_tokens, i
        assert a.token_ids == b.token_ids, f"request {i} differs"
    m = llm.metrics()
    assert m["spec_proposed_tokens"] > 0
    assert 0 < m["spec_accepted_tokens"] < m["spec_proposed_tokens"]  # both paths of the rule ran
    assert m["spec_mean_accepted_length"] > 1.0
    if setting != "plain":
        assert m["preemptions"] > 0 and m["prefix_cache_hit_tokens"] > 0
    llm.engine.block_manager.check()
    assert llm.engine.block_manager.num_used_blocks == 0
    if method == "draft":
        draft_blocks = llm.engine.spec.proposer.blocks
        draft_blocks.check()
        assert draft_blocks.num_used_blocks == 0 and not llm.engine.spec.proposer.shadows


def test_stop_tokens_and_logprobs_with_speculation(models):
    prompts = _prompts(3, seed=5)
    plain = LLM(models["target"], block_size=4).generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2))
    stop = plain[0].token_ids[9]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2, stop_token_ids=[stop])
    expected = LLM(models["target"], block_size=4).generate(prompts, params)
    llm = LLM(models["target"], block_size=4, speculative_config={"method": "draft", "model": str(models["target"]),
                                                                 "num_speculative_tokens": 4, "adaptive": False})
    outs = llm.generate(prompts, params)
    assert llm.metrics()["spec_acceptance_rate"] == 1.0  # the target as its own draft
    for a, b in zip(outs, expected):
        assert len(a.token_ids) == len(b.token_ids) and a.token_ids == b.token_ids
        assert len(a.logprobs) == len(b.logprobs)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            assert all(abs(x[t] - y[t]) < 1e-4 for t in x)


# ---------------------------------------------------------------------------------------------
# The sampling rule keeps the target's distribution


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum()
    keep = probs * counts.sum() >= 5  # pool cells too small for the test
    observed = np.append(counts[keep], counts[~keep].sum())
    expected = np.append(probs[keep], probs[~keep].sum()) * counts.sum()
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    expected = expected * observed.sum() / expected.sum()
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def _rule_pvalues(trials: int = 6000) -> list[float]:
    """p-values that the 1st and 2nd emitted tokens of ``rejection.verify`` follow the target's
    rows (2nd given the 1st was the accepted proposal), drafts drawn from a different q."""
    gen = torch.Generator().manual_seed(0)
    vocab = 6
    rows = torch.randn(3, vocab, generator=gen) * 1.5
    q = [torch.softmax(torch.randn(vocab, generator=gen) * 1.5, -1) for _ in range(2)]
    p = torch.softmax(rows, -1)
    seq = type("S", (), {})()
    seq.params, seq.token_ids, seq.num_prompt_tokens = SamplingParams(temperature=1.0), [1, 2], 2
    first, second = np.zeros(vocab), np.zeros(vocab)
    for _ in range(trials):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        verdict = rejection.verify(rows, seq, drafts, q, gen)
        assert 1 <= len(verdict.tokens) <= 3 and verdict.accepted == len(verdict.tokens) - 1
        first[verdict.tokens[0]] += 1
        if verdict.accepted >= 1:
            second[verdict.tokens[1]] += 1
    return [_chi2_pvalue(first, p[0].numpy()), _chi2_pvalue(second, p[1].numpy())]


def test_accept_resample_rule_keeps_the_target_distribution():
    assert min(_rule_pvalues()) > 1e-3


def test_a_wrong_rule_fails_the_same_check(monkeypatch):
    monkeypatch.setattr(rejection, "residual", lambda p, q, d: p)  # resample from p instead of max(p - q, 0)
    assert min(_rule_pvalues()) < 1e-3


def test_engine_sampling_matches_the_target_distribution(models):
    """End to end: the 2nd and 3rd generated tokens (from verification steps with a draft that
    often disagrees) against their exact marginals computed with transformers."""
    from transformers import AutoModelForCausalLM

    prompt = [3, 5, 1, 4]
    n = 3000
    llm = LLM(models["small"], max_num_seqs=256, speculative_config={"method": "draft", "model": str(models["small_draft"]),
                                                                      "num_speculative_tokens": 2, "adaptive": False})
    outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, max_tokens=3, seed=i, ignore_eos=True) for i in range(n)])
    m = llm.metrics()
    assert 0.2 < m["spec_acceptance_rate"] < 0.95, m["spec_acceptance_rate"]
    assert all(len(o.token_ids) == 3 for o in outs)
    model = AutoModelForCausalLM.from_pretrained(models["small"]).eval()
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
        ids2 = torch.tensor([prompt + [a] for a in range(8)])
        p2 = torch.softmax(model(ids2).logits[:, -1], -1)  # [a, b]
        ids3 = torch.tensor([prompt + [a, b] for a in range(8) for b in range(8)])
        p3 = torch.softmax(model(ids3).logits[:, -1], -1).view(8, 8, 8)
    joint12 = p1[:, None] * p2
    marg2 = joint12.sum(0)
    marg3 = (joint12[:, :, None] * p3).sum((0, 1))
    for pos, marg in ((1, marg2), (2, marg3)):
        counts = np.bincount([o.token_ids[pos] for o in outs], minlength=8)
        assert _chi2_pvalue(counts, marg.double().numpy()) > 1e-3, pos


# ---------------------------------------------------------------------------------------------
# Pieces, settings and errors


def test_ngram_lookup_takes_the_latest_longest_match():
    tokens = [5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6]
    assert ngram_propose(tokens, 3, 1, 4) == [9, 2, 5]  # "5 6" last seen before 9 2
    assert ngram_propose(tokens, 3, 3, 4) == []  # "2 5 6" never seen before
    assert ngram_propose([1, 2, 3, 1, 2], 5, 2, 2) == [3, 1, 2]
    assert ngram_propose([1, 2, 3, 1, 2], 0, 1, 4) == []


def test_adaptive_k_turns_speculation_off_when_it_cannot_pay():
    ak = adaptive.AdaptiveK(4)
    for rows in (1, 2, 3, 5) * 10:
        ak.observe_step(rows, 0.010 + 0.001 * rows)  # a = 10 ms, b = 1 ms
    ak.observe_draft(10, 0.005)  # a draft token costs half a target step
    assert ak.best_k(0.05, 1) == 0
    assert ak.best_k(0.95, 1) >= 2
    ak_free = adaptive.AdaptiveK(4)
    for rows in (1, 2, 3, 5) * 10:
        ak_free.observe_step(rows, 0.010 + 0.001 * rows)
    assert ak_free.best_k(0.5, 1) >= 1  # prompt lookup: proposing is nearly free


@pytest.mark.parametrize("setting, message", [
    ({"method": "medusa"}, "speculative method must be one of"),
    ({"method": "draft"}, "needs a draft model"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "k": 3}, "unknown speculative_config key 'k'"),
])
def test_bad_settings_are_one_clear_error(models, setting, message):
    with pytest.raises(LlmoptError, match=message):
        LLM(models["target"], speculative_config=setting)


def test_a_draft_with_another_vocabulary_is_refused(models):
    with pytest.raises(LlmoptError, match="does not share the target's tokenizer"):
        LLM(models["target"], speculative_config={"method": "draft", "model": str(models["other_vocab"])})


def test_cli_generate_with_prompt_lookup_and_a_bad_draft(models):
    from llmopt.cli.main import main

    runner = CliRunner()
    plain = runner.invoke(main, ["generate", str(models["target"]), "abcabcabcabc", "--max-tokens", "24", "--temperature", "0"])
    spec = runner.invoke(main, ["generate", str(models["target"]), "abcabcabcabc", "--max-tokens", "24", "--temperature", "0",
                                "--speculative-method", "ngram", "--spec-tokens", "3"])
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output

    def text(output: str) -> list[str]:  # the generated text, without the timing line (TTFT varies run to run)
        return [line for line in output.splitlines() if "TTFT" not in line]

    assert len(text(spec.output)) == len(text(plain.output)) > 0
    assert text(spec.output) == text(plain.output)
    bad = runner.invoke(main, ["generate", str(models["target"]), "abc", "--speculative-method", "draft",
                               "--draft", str(models["other_vocab"])])
    assert bad.exit_code == 2 and "does not share the target's tokenizer" in bad.output
    assert "Traceback" not in bad.output


def test_a_checkpoints_saved_runtime_settings_turn_speculation_on(models, tmp_path):
    """A recipe's ``runtime: {speculative_config: ...}`` block (saved in llmopt.json) is the engine's default."""
    import json
    import shutil

    from llmopt.runtime import LLMEngine

    path = tmp_path / "with-spec"
    shutil.copytree(models["target"], path)
    (path / "llmopt.json").write_text(json.dumps({"runtime": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}}))
    engine = LLMEngine(path, block_size=4)
    assert engine.spec is not None and engine.spec.config.num_speculative_tokens == 2
    assert LLMEngine(path, block_size=4, speculative_config=None).spec is None


def _run_adaptive(ak: "adaptive.AdaptiveK", seq, steps: int, accepts) -> list[int]:
    """k chosen at each of ``steps`` steps for one sequence whose proposals ``accepts(k)`` accepts."""
    ks = []
    for _ in range(steps):
        k = ak.choose(seq, 1)
        ks.append(k)
        if k:
            ak.observe_acceptance(seq, k, accepts(k))
    return ks


def test_adaptive_k_gives_up_on_a_draft_that_never_agrees_and_returns_when_it_does():
    class Seq:
        spec_state = None

    ak = adaptive.AdaptiveK(4)
    for rows in (1, 2, 3, 5) * 10:
        ak.observe_step(rows, 0.010 + 0.001 * rows)
    ak.observe_draft(10, 0.001)  # a cheap draft: k = 4 pays at the prior acceptance
    seq = Seq()
    ks = _run_adaptive(ak, seq, 1000, lambda k: 0)
    assert len(ks) == 1000
    assert ks[0] == 4 and ks[1] < 4  # one rejected round already lowers k
    assert 0 < ks.index(0) <= 5  # ... and a few turn speculation off
    probes = [i for i, k in enumerate(ks) if k]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[-1] == adaptive.PROBE_MAX and all(g <= adaptive.PROBE_MAX for g in gaps)
    assert sorted(gaps) == gaps and gaps.count(adaptive.PROBE_MAX) >= 10  # the waits only grow, to the cap
    off = ks.index(0)
    assert sum(ks[off:]) <= 2 + 1000 // adaptive.PROBE_MAX  # then one token per PROBE_MAX steps (two shorter waits first)
    later = Seq()  # a new request starts from the engine's recent acceptance, not the fixed prior
    assert ak.state(later).rate < 0.1 and _run_adaptive(ak, later, 1, lambda k: 0) == [0]
    ks = _run_adaptive(ak, seq, 200, lambda k: k)  # the text turns copyable: every proposal accepted
    assert ks.index(1) <= adaptive.PROBE_MAX and ks[-1] == 4


def test_adaptive_k_waits_for_a_timed_step_and_never_probes_where_nothing_could_pay():
    class Seq:
        spec_state = None

    ak = adaptive.AdaptiveK(4, draft_cost_ratio=0.3)
    seq = Seq()
    assert ak.choose(seq, 1) == 0  # no decode step timed yet: plain decoding
    for rows in (1, 2, 4, 8, 16, 32) * 10:
        ak.observe_step(rows, 0.015 + 0.004 * rows)  # a = 15 ms, b = 4 ms a row
    # before any draft token is timed, a proposed token costs 0.3 one-row target steps (5.7 ms)
    assert ak.best_k(1.0, 1, certain=True) == 4 and ak.best_k(1.0, 32, certain=True) == 0
    ks = _run_adaptive(ak, seq, 200, lambda k: 0)  # batch 1: the draft never agrees, probes go on
    assert len(ks) == 200 and 0 < sum(ks) <= 4 + 3 + 4 + 200 // adaptive.PROBE_EVERY
    big = Seq()
    ks = []
    for _ in range(300):  # batch 32: even an always-right draft would not pay, so no probe at all
        ks.append(ak.choose(big, 32))
    assert len(ks) == 300 and set(ks) == {0}
    assert ak.choose(big, 1) == 1  # the batch shrinks: the overdue probe is made at once
    cheap = adaptive.AdaptiveK(4, draft_cost_ratio=0.3)
    for rows in (1, 2, 4, 8, 16, 32) * 10:
        cheap.observe_step(rows, 0.015 + 0.004 * rows)
    cheap.observe_draft(10, 0.001)  # measured: 0.1 ms a token, which replaces the prior
    assert cheap.best_k(1.0, 32, certain=True) > 0


@pytest.mark.parametrize("runs", [True, False])
def test_adaptive_k_models_acceptance_runs_per_position(runs):
    """Half the first tokens accepted either way; in runs (a copied passage: once right, right to
    the end) k = 4 pays, while independent tokens at the same first-token rate call for a short k."""
    import random

    class Seq:
        spec_state = None

    ak = adaptive.AdaptiveK(4)
    for rows in (1, 2, 3, 5) * 10:
        ak.observe_step(rows, 0.010 + 0.002 * rows)  # a = 10 ms, b = 2 ms
    ak.observe_draft(100, 0.001)
    seq, rng = Seq(), random.Random(0)
    for _ in range(400):
        if runs:
            accepted = 4 * rng.randint(0, 1)
        else:
            accepted = 0
            while accepted < 4 and rng.random() < 0.5:
                accepted += 1
        ak.observe_acceptance(seq, 4, accepted)
    conditionals = [ak.conditional(j) for j in range(1, 4)]
    assert len(conditionals) == 3
    if runs:
        assert min(conditionals) > 0.95 and ak.best_k(0.5, 1) == 4
    else:
        assert max(abs(c - 0.5) for c in conditionals) < 0.2 and ak.best_k(0.5, 1) == 2
