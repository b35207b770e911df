"""The runtime against transformers: greedy parity (tiny random models and the demo model),
batching / prefix caching / preemption invariance, block accounting, sampling, errors, CLI."""

from __future__ import annotations

import json
import random
import shutil
import statistics
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import byte_tokenizer, lazy_models, save_model, tiny_llama
from llmopt.cli.main import main
from llmopt.core.errors import LlmoptError
from llmopt.formats.compressed import save_compressed
from llmopt.formats.registry import FORMATS
from llmopt.formats.schemes import (
    QuantizedWeight,
    compute_qparams,
    effective_group_size,
    fake_quantize_activations,
    get_scheme,
)
from llmopt.runtime import LLM, LLMEngine, SamplingParams
from llmopt.runtime.bench import make_workload
from llmopt.runtime.layers import QuantLinear
from llmopt.runtime.sampler import filter_logits
from llmopt.runtime.sequence import Sequence

GAP = 1e-4  # a greedy mismatch is acceptable only where the reference's top two logits are this close
VOCAB = 259


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------
# Tiny models and the transformers reference


def _randomize(model):
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif p.dim() == 1 and p.shape[0] <= 64:  # norms and biases: away from their trivial init
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def tiny(kind: str, seed: int = 0):
    """A random tiny model of one of the supported families (or RoPE variants)."""
    from transformers import (
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        return tiny_llama(seed)
    if kind.startswith("llama-"):  # RoPE variants
        rope = {
            "llama-linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            "llama-llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64, "rope_theta": 500000.0},
            "llama-yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
            "llama-dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        }[kind]
        extra = {"max_position_embeddings": 40} if kind == "llama-dynamic" else {}
        return tiny_llama(seed, rope_parameters=rope, **extra)
    if kind == "qwen3":
        return _randomize(Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)))
    if kind == "qwen2":
        return _randomize(Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True)))
    if kind == "mistral":
        return _randomize(MistralForCausalLM(MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)))
    raise ValueError(kind)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """name -> (transformers model, checkpoint directory), built lazily once per module."""
    root = tmp_path_factory.mktemp("runtime_models")
    return lazy_models(root, tiny)


def random_prompts(n: int, low: int = 2, high: int = 60, seed: int | None = None) -> list[list[int]]:
    rng = random.Random(seed if seed is not None else random.randrange(1 << 30))
    return [[1] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(low, high) - 1)] for _ in range(n)]


@torch.no_grad()
def reference(model, prompt: list[int], n: int, **kwargs) -> tuple[list[int], list[torch.Tensor]]:
    """transformers greedy tokens (EOS ignored) and the scores each was chosen from."""
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0, **kwargs)
    return out.sequences[0, len(prompt):].tolist(), [s[0].float() for s in out.scores]


@torch.no_grad()
def reference_batch(model, prompts: list[list[int]], n: int) -> list[tuple[list[int], list[torch.Tensor]]]:
    """:func:`reference` for several prompts in one left-padded transformers batch."""
    model.generation_config.eos_token_id = None
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0)
    return [(out.sequences[i, width:].tolist(), [s[i].float() for s in out.scores]) for i in range(len(prompts))]


def assert_greedy_match(ours: list[int], ref: list[int], scores: list[torch.Tensor], label: str = "") -> int:
    """Tokens equal up to the end, or up to a first mismatch where the reference's top two
    scores differ by less than GAP (after it the continuations legitimately diverge).
    Returns how many tokens were compared equal."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = torch.topk(scores[i], 2).values
            gap = float(top2[0] - top2[1])
            assert gap < GAP, f"{label} token {i}: ours {a}, reference {b}, reference top-2 gap {gap:.3g} >= {GAP}"
            return i
    assert len(ours) == len(ref), f"{label}: {len(ours)} tokens, reference {len(ref)}"
    return len(ref)


def greedy(n: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kwargs)


# ---------------------------------------------------------------------------------------------
# Parity with transformers


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2", "mistral", "llama-linear", "llama-llama3", "llama-yarn", "llama-dynamic"])
def test_greedy_matches_transformers(models, kind):
    model, path = models(kind)
    n = 16
    high = 30 if kind == "llama-dynamic" else 60  # dynamic NTK: the sequences grow past the original 40
    prompts = random_prompts(4, high=high)
    if kind == "llama-dynamic":
        prompts[0] = prompts[0] + [5] * (34 - len(prompts[0])) if len(prompts[0]) < 34 else prompts[0]
    outs = LLM(path, max_num_batched_tokens=64).generate(prompts, greedy(n))
    for prompt, out in zip(prompts, outs):
        ref, scores = reference(model, prompt, n)
        assert_greedy_match(out.token_ids, ref, scores, kind)


def test_tie_rule_rejects_a_real_mismatch():
    scores = [torch.tensor([0.0, 5.0, 1.0]), torch.tensor([3.0, 3.00001, 0.0])]
    assert assert_greedy_match([1, 0], [1, 1], scores) == 1  # near tie at position 1: accepted
    with pytest.raises(AssertionError, match="gap"):
        assert_greedy_match([2, 1], [1, 1], scores)  # clear winner at position 0: rejected


def test_same_tokens_alone_batched_cached_chunked_and_preempted(models):
    model, path = models("llama")
    rng = random.Random(random.getrandbits(64))
    shared = [1] + [rng.randrange(3, VOCAB) for _ in range(23)]
    prompts = [shared + p[1:] for p in random_prompts(3, 2, 20)] + random_prompts(3, 2, 40) + [list(shared)]
    n = 20
    refs = [reference(model, p, n) for p in prompts]

    def check(outs, label):
        for (ref, scores), out in zip(refs, outs):
            assert_greedy_match(out.token_ids, ref, scores, label)

    alone = LLM(path, enable_prefix_caching=False)
    check([alone.generate([p], greedy(n))[0] for p in prompts], "alone")
    for label, settings in {
        "batched + prefix cache": dict(block_size=4),
        "batched, no prefix cache": dict(block_size=4, enable_prefix_caching=False),
        "chunked prefill": dict(block_size=4, max_num_batched_tokens=7),
        "preempted": dict(block_size=4, num_kv_blocks=20, max_num_batched_tokens=16),
    }.items():
        llm = LLM(path, **settings)
        llm.generate(prompts[:1], greedy(n))  # a finished request leaves its prefix cached
        check(llm.generate(prompts, greedy(n)), label)
        stats = llm.metrics()
        assert stats["kv_blocks_used"] == 0
        if label == "preempted":
            assert stats["preemptions"] > 0
        if label == "batched + prefix cache":
            assert stats["prefix_cache_hit_tokens"] >= 2 * 24  # the shared 24-token prefix, several times


@pytest.mark.parametrize("preset,group", [("W4A16", 32), ("W4A16_ASYM", 32), ("W8A16", None), ("W8A8", None), ("W4A8", 32),
                                          ("FP8", None), ("FP8_DYNAMIC", None), ("int4m", 32), ("int5m", 32)])
def test_quantized_checkpoints_stay_quantized_and_match(tmp_path, preset, group):
    """Presets, and formats with float zero points (llama.cpp's mins: int4m, int5m)."""
    model = tiny_llama(seed=1, tie_word_embeddings=False)
    scheme = FORMATS[preset].scheme(group) if preset in FORMATS else get_scheme(preset, group if group is not None else 0)
    weights = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            gs = effective_group_size(module.in_features, scheme.group_size)
            scale, zp = compute_qparams(module.weight.data, scheme, gs)
            weights[name] = QuantizedWeight.from_weight(module.weight.data, scheme, gs, scale, zp)
    save_compressed(model, byte_tokenizer(), tmp_path / "q", weights, ["lm_head"])
    hooks = []
    for name, module in model.named_modules():  # the reference: dequantized weights (+ activation QDQ)
        if name in weights:
            module.weight.data = weights[name].dequantize()
            if scheme.activations:
                hooks.append(module.register_forward_pre_hook(lambda m, a: (fake_quantize_activations(a[0], scheme.activations),)))
    llm = LLM(tmp_path / "q")
    layer = llm.engine.weights.layers[0]
    assert isinstance(layer.qkv, QuantLinear) and isinstance(layer.down, QuantLinear)
    assert layer.qkv.codes.dtype in (torch.int8, torch.float8_e4m3fn)
    prompts = random_prompts(3)
    for prompt, out in zip(prompts, llm.generate(prompts, greedy(12))):
        ref, scores = reference(model, prompt, 12)
        assert_greedy_match(out.token_ids, ref, scores, preset)
    for h in hooks:
        h.remove()


def _rounded_head(w: torch.Tensor, head: str) -> torch.Tensor:
    """What ``lm_head=head`` makes of the float head ``w``, computed independently."""
    if head in ("bf16", "f16"):
        return w.to(torch.bfloat16 if head == "bf16" else torch.float16).float()
    scale = w.abs().amax(1, keepdim=True) / 127
    return torch.round(w / scale).clamp(-128, 127) * scale


@pytest.mark.parametrize("kind", ["llama", "qwen3"])  # tied and untied heads
@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("head", ["bf16", "f16", "int8"])
def test_smaller_head_matches_a_reference_with_that_head(models, tmp_path, kind, kernels, head):
    """``lm_head="bf16"`` (the head rounded to bfloat16) and ``"int8"`` (quantized per output
    channel, scale = max|w| / 127, codes rounded to nearest) give transformers' tokens for the
    model whose head is that rounded matrix, while embedding lookups keep the float table."""
    import copy

    model, path = models(kind)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        if ref.config.tie_word_embeddings:  # untie: the reference head alone is rounded
            ref.config.tie_word_embeddings = False
            ref.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        ref.lm_head.weight.copy_(_rounded_head(ref.lm_head.weight, head))
    assert not torch.equal(ref.lm_head.weight, model.lm_head.weight)
    assert torch.equal(ref.get_input_embeddings().weight, model.get_input_embeddings().weight)
    llm = LLM(path, lm_head=head, kernels=kernels)
    weights = llm.engine.weights
    assert weights.head_kind == head
    if head == "int8":
        assert isinstance(weights.lm_head, QuantLinear) and weights.lm_head.codes.dtype == torch.int8
        assert (weights.lm_head.packed is not None) == (kernels == "auto")
    else:
        assert weights.lm_head.full_weight().dtype == (torch.bfloat16 if head == "bf16" else torch.float16)
    assert weights.embed.dtype == torch.float32
    float_bytes = LLMEngine(path, kernels=kernels).weights.nbytes()
    if kind == "qwen3":  # untied: the head's bytes shrink (the tied float table stays for lookups)
        assert weights.nbytes() < float_bytes
    prompts = random_prompts(3)
    for prompt, out in zip(prompts, llm.generate(prompts, greedy(12))):
        want, scores = reference(ref, prompt, 12)
        assert_greedy_match(out.token_ids, want, scores, f"{kind} {head} head")


def test_lm_head_setting_is_validated(models):
    _, path = models("llama")
    with pytest.raises(LlmoptError, match="lm_head must be one of auto, bf16, f16, int8"):
        LLMEngine(path, lm_head="int4")
    result = CliRunner().invoke(main, ["generate", str(path), "hi", "--lm-head", "int4"])
    assert result.exit_code == 2 and "int4" in result.output


# ---------------------------------------------------------------------------------------------
# Block manager and scheduler


def test_block_accounting_after_1000_requests_with_aborts(tmp_path):
    path = save_model(tiny_llama(seed=2, num_hidden_layers=1), tmp_path / "one_layer")
    engine = LLMEngine(path, block_size=4, num_kv_blocks=48, max_num_seqs=16, max_num_batched_tokens=48)
    rng = random.Random(random.getrandbits(64))
    stems = random_prompts(5, 4, 24)
    live: list[str] = []
    finals: dict[str, str] = {}
    submitted = 0
    while submitted < 1000 or engine.has_unfinished():
        for _ in range(min(rng.randint(0, 12), 1000 - submitted)):
            prompt = rng.choice(stems)[: rng.randint(1, 24)] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 8))]
            params = SamplingParams(max_tokens=rng.randint(1, 8), temperature=rng.choice([0.0, 1.0]), seed=rng.choice([None, 7]),
                                    top_k=rng.choice([0, 5]), ignore_eos=rng.random() < 0.5)
            live.append(engine.add_request(prompt, params))
            submitted += 1
        if live and rng.random() < 0.3:  # abort a random request: waiting, running or already done
            engine.abort(rng.choice(live))
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals, "a request finished twice"
                finals[out.request_id] = out.finish_reason
        engine.block_manager.check()
    bm = engine.block_manager
    assert len(finals) == 1000
    assert {"abort", "length"} <= set(finals.values())
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.metrics()["prefix_cache_hit_tokens"] > 0


def test_prefix_hits_are_counted(models):
    model, path = models("llama")
    a = random_prompts(1, 50, 50)[0]
    b = a[:48] + [7, 8, 9, 10, 11]
    llm = LLM(path)
    first = llm.generate([a], greedy(4))[0]
    assert first.num_cached_tokens == 0
    out_b, out_a = llm.generate([b, a], greedy(8))
    assert out_b.num_cached_tokens == 48  # three full blocks of 16
    assert out_a.num_cached_tokens == 48  # the whole prompt is cached but its last token is recomputed
    stats = llm.metrics()
    assert stats["prefix_cache_hit_tokens"] == 96
    assert stats["prefix_cache_hit_rate"] == pytest.approx(96 / (50 + 53 + 50))
    for prompt, out in ((b, out_b), (a, out_a)):
        ref, scores = reference(model, prompt, 8)
        assert_greedy_match(out.token_ids, ref, scores)
    off = LLM(path, enable_prefix_caching=False)
    off.generate([a], greedy(2))
    assert off.generate([a], greedy(2))[0].num_cached_tokens == 0


def test_prefix_cache_checks_tokens_not_only_hashes(models, monkeypatch):
    model, path = models("llama")
    monkeypatch.setattr(Sequence, "block_hash", lambda self, i, bs: b"every block collides")
    llm = LLM(path)
    a, b = random_prompts(2, 40, 40)
    llm.generate([a], greedy(2))
    out = llm.generate([b], greedy(8))[0]
    assert out.num_cached_tokens == 0
    ref, scores = reference(model, b, 8)
    assert_greedy_match(out.token_ids, ref, scores)


def test_abort_frees_blocks_and_reports(models):
    _, path = models("llama")
    engine = LLMEngine(path, block_size=4)
    ids = [engine.add_request(p, greedy(30)) for p in random_prompts(3, 10, 20)]
    engine.step()
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    assert engine.abort(ids[1]) and not engine.abort(ids[1]) and not engine.abort("nope")
    outs = {o.request_id: o for o in engine.step()}
    assert outs[ids[1]].finished and outs[ids[1]].finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# ---------------------------------------------------------------------------------------------
# Sampling and stopping


def test_stop_token_ids_and_stop_strings(models):
    _, path = models("llama")
    llm = LLM(path)
    prompt = random_prompts(1, 10, 20)[0]
    base = llm.generate([prompt], greedy(40))[0]
    stop_id = base.token_ids[5]
    out = llm.generate([prompt], greedy(40, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)

    text = base.text
    k = next((i for i in range(3, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isprintable()), None)
    assert k is not None, f"no printable pair in {text!r}"
    stop = text[k:k + 2]
    cut = text.find(stop)
    out = llm.generate([prompt], greedy(40, stop=[stop, "never appears \x01"]))[0]
    assert out.text == text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < len(base.token_ids)
    kept = llm.generate([prompt], greedy(40, stop=stop, include_stop_str_in_output=True))[0]
    assert kept.text == text[:cut + 2]


def test_eos_stops_unless_ignored(models):
    _, path = models("llama")
    llm = LLM(path)
    prompt = random_prompts(1)[0]
    base = llm.generate([prompt], greedy(30))[0]
    engine = llm.engine
    engine.eos_token_ids = {base.token_ids[3]}
    stopped = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30))[0]
    assert stopped.token_ids == base.token_ids[: base.token_ids.index(base.token_ids[3]) + 1]
    assert stopped.finish_reason == "stop"
    assert llm.generate([prompt], greedy(30))[0].token_ids == base.token_ids


def test_seeded_sampling_is_reproducible_in_any_batch(models):
    _, path = models("llama")
    llm = LLM(path)
    prompt = random_prompts(1)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([prompt], params)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=10), SamplingParams(temperature=0.7, seed=5, max_tokens=30)]
    batched = llm.generate(random_prompts(2) + [prompt], others + [params])[2].token_ids
    assert batched == alone
    other_seed = llm.generate([prompt], SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=24, ignore_eos=True))[0]
    assert other_seed.token_ids != alone


def test_degenerate_filters_equal_greedy(models):
    _, path = models("llama")
    llm = LLM(path)
    prompts = random_prompts(3)
    want = [o.token_ids for o in llm.generate(prompts, greedy(12))]
    for params in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        got = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, **params))
        assert [o.token_ids for o in got] == want, params


def test_filters_match_transformers_warpers():
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(VOCAB) * 3
    for params, warper in (
        (SamplingParams(temperature=1.0, top_k=7), TopKLogitsWarper(7)),
        (SamplingParams(temperature=1.0, top_p=0.8), TopPLogitsWarper(0.8)),
        (SamplingParams(temperature=1.0, min_p=0.05), MinPLogitsWarper(0.05)),
    ):
        ours = torch.isfinite(filter_logits(logits, params))
        theirs = torch.isfinite(warper(None, logits[None].clone())[0])
        assert torch.equal(ours, theirs), params
    scaled = filter_logits(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(scaled, logits / 0.5)


def test_repetition_penalty_matches_transformers(models):
    model, path = models("llama")
    llm = LLM(path)
    prompts = random_prompts(3)
    for prompt, out in zip(prompts, llm.generate(prompts, greedy(20, repetition_penalty=1.5))):
        ref, scores = reference(model, prompt, 20, repetition_penalty=1.5)
        assert_greedy_match(out.token_ids, ref, scores)


def test_logprobs_match_transformers(models):
    model, path = models("qwen3")
    prompt = random_prompts(1)[0]
    out = LLM(path).generate([prompt], greedy(10, logprobs=3))[0]
    ref, scores = reference(model, prompt, 10)
    compared = assert_greedy_match(out.token_ids, ref, scores)
    for i in range(compared):
        logp = torch.log_softmax(scores[i], -1)
        got = out.logprobs[i]
        assert got[out.token_ids[i]] == pytest.approx(float(logp[out.token_ids[i]]), abs=1e-4)
        assert set(torch.topk(logp, 3).indices.tolist()) <= set(got)
    assert out.cumulative_logprob == pytest.approx(sum(lp[t] for lp, t in zip(out.logprobs, out.token_ids)))


def test_streaming_deltas_add_up(models):
    _, path = models("llama")
    llm = LLM(path)
    prompt = random_prompts(1)[0]
    chunks = list(llm.stream(prompt, greedy(15)))
    assert len(chunks) == 15 and chunks[-1].finished
    assert "".join(c.delta_text for c in chunks) == chunks[-1].text == llm.generate([prompt], greedy(15))[0].text
    assert sum(len(c.new_token_ids) for c in chunks) == 15


def test_request_and_run_metrics(models):
    _, path = models("llama")
    llm = LLM(path, block_size=8)
    outs = llm.generate(random_prompts(4, 10, 30), greedy(6))
    for out in outs:
        m = out.metrics
        assert 0 < m.ttft <= m.e2e and m.tpot > 0 and m.num_output_tokens == 6
    stats = llm.metrics()
    engine = llm.engine
    assert stats["generated_tokens"] == 24 and stats["finished_requests"] == 4
    assert stats["kv_bytes_allocated"] == engine.cache.nbytes == engine.block_manager.num_blocks * engine.bytes_per_block
    assert 0 < stats["kv_blocks_peak"] <= sum(-(-(len(o.prompt_token_ids) + 6) // 8) for o in outs)
    assert stats["kv_bytes_peak_in_use"] == stats["kv_blocks_peak"] * engine.bytes_per_block
    assert stats["generation_tok_s"] > 0 and stats["kv_blocks_used"] == 0


def test_serving_workload_and_bfloat16(models):
    from llmopt.runtime.bench import make_workload, serving

    _, path = models("llama")
    work = make_workload(5, (4, 30), (2, 6), VOCAB, seed=3, rate=50.0)
    assert work == make_workload(5, (4, 30), (2, 6), VOCAB, seed=3, rate=50.0)
    assert [w.arrival for w in work] == sorted(w.arrival for w in work) and work[-1].arrival > 0
    result = serving(LLMEngine(path, dtype="bfloat16"), work)
    assert result["requests"] == 5 and result["output_tokens"] == sum(w.max_tokens for w in work)
    assert result["ttft_p50_s"] > 0 and result["duration_s"] >= work[-1].arrival


# ---------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=2),
                                 dict(repetition_penalty=0), dict(max_tokens=0), dict(logprobs=-1), dict(stop=[""])])
def test_invalid_sampling_params(bad):
    with pytest.raises(LlmoptError, match="invalid sampling parameter"):
        SamplingParams(**bad)


def test_bad_requests_are_clear_errors_and_leave_the_engine_working(models):
    _, path = models("llama")
    engine = LLMEngine(path, max_model_len=64, block_size=4, num_kv_blocks=8)
    cases = [
        (list(range(3, 70)), greedy(2), "model length is 64"),
        ([], greedy(2), "empty"),
        ([1, VOCAB + 5], greedy(2), "outside the vocabulary"),
        ([1, 5, 6], greedy(40), "KV cache holds 32 tokens"),
        ("text", "not params", "SamplingParams"),
    ]
    for prompt, params, message in cases:
        with pytest.raises(LlmoptError, match=message):
            engine.add_request(prompt, params)
    engine.add_request([1, 5, 6], greedy(5), request_id="x")
    with pytest.raises(LlmoptError, match="already in use"):
        engine.add_request([1, 5, 6], greedy(5), request_id="x")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finished and len(outs[-1].token_ids) == 5
    with pytest.raises(LlmoptError, match="prompt 1"):
        LLM(path, max_model_len=64).generate([[1, 2, 3], list(range(3, 70))], greedy(2))


def test_one_failing_request_does_not_stop_the_others(models, monkeypatch):
    _, path = models("llama")
    llm = LLM(path)
    sampler = llm.engine.sampler
    original = sampler._sample_row

    def flaky(row, seq):
        if seq.params.seed == 666:
            raise RuntimeError("boom")
        return original(row, seq)

    monkeypatch.setattr(sampler, "_sample_row", flaky)
    prompts = random_prompts(3)
    outs = llm.generate(prompts, [greedy(8), SamplingParams(temperature=1.0, seed=666, max_tokens=8), greedy(8)])
    assert outs[1].finish_reason == "error" and "boom" in outs[1].error
    assert [len(o.token_ids) for o in (outs[0], outs[2])] == [8, 8]
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_an_error_mid_generate_frees_every_request(models, monkeypatch):
    """An exception escaping a step (not a failed forward, which fails its requests) leaves no
    request or KV block behind in the engine: the next generate runs as if nothing happened."""
    _, path = models("llama")
    llm = LLM(path)
    engine, real = llm.engine, llm.engine.step
    calls = []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real()

    monkeypatch.setattr(engine, "step", failing_step)
    prompts = random_prompts(3, seed=1)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, greedy(8))
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    outs = llm.generate(prompts, greedy(8))
    assert [len(o.token_ids) for o in outs] == [8, 8, 8]


def test_unsupported_architecture_and_kv_budget(models, tmp_path):
    _, path = models("llama")
    other = Path(shutil.copytree(path, tmp_path / "gpt2ish"))
    config = json.loads((other / "config.json").read_text())
    config["model_type"] = "gpt2"
    (other / "config.json").write_text(json.dumps(config))
    # gpt2 runs through the generic path now: a checkpoint that does not fit its config is one clear error
    with pytest.raises(LlmoptError, match="has no tensor 'transformer.h.0.*does not fit its config.json"):
        LLMEngine(other)
    with pytest.raises(LlmoptError, match="does not support architecture 'gpt2' natively"):
        LLMEngine(other, model_impl="native")
    with pytest.raises(LlmoptError, match="holds no block"):
        LLMEngine(path, kv_cache_gib=1e-9)
    with pytest.raises(LlmoptError, match="unknown engine setting"):
        LLMEngine(path, max_num_sequences=3)


# ---------------------------------------------------------------------------------------------
# CLI


def test_cli_generate_and_bench(models):
    _, path = models("llama")
    runner = CliRunner()
    result = runner.invoke(main, ["generate", str(path), "hello", "--max-tokens", "5", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    int8_head = runner.invoke(main, ["generate", str(path), "hello", "--max-tokens", "5", "--lm-head", "int8", "--json"])
    assert int8_head.exit_code == 0 and len(json.loads(int8_head.stdout)["token_ids"]) == 5, int8_head.output
    assert len(payload["token_ids"]) == 5 and payload["finish_reason"] == "length"
    streamed = runner.invoke(main, ["generate", str(path), "hello", "--max-tokens", "5", "--stream"])
    assert streamed.exit_code == 0 and streamed.stdout.rstrip("\n") == payload["text"]
    result = runner.invoke(main, ["bench", str(path), "--pp", "16", "--tg", "4", "-r", "2", "-n", "3",
                                  "--prompt-len", "4:20", "--output-len", "2:5", "--lm-head", "int8", "--json"])
    assert result.exit_code == 0, result.output
    bench = json.loads(result.stdout)
    assert bench["lm_head"] == bench["lm_head_runs_as"] == "int8"
    # the figures are the tokens actually processed / produced over the measured seconds
    assert bench["pp_tokens"] == [16, 16] and bench["tg_tokens"] == [4, 4]
    assert len(bench["pp_seconds"]) == len(bench["tg_seconds"]) == 2 and min(bench["pp_seconds"] + bench["tg_seconds"]) > 0
    assert bench["pp16_tok_s"] == pytest.approx(statistics.median(16 / t for t in bench["pp_seconds"]))
    assert bench["tg4_tok_s"] == pytest.approx(statistics.median(4 / t for t in bench["tg_seconds"]))
    serving = bench["serving"]
    expected = make_workload(3, (4, 20), (2, 5), VOCAB, seed=0)
    assert serving["requests"] == 3 and serving["output_tokens"] == sum(w.max_tokens for w in expected)
    assert serving["prompt_tokens"] == sum(len(w.prompt_token_ids) for w in expected)
    assert serving["output_tok_s"] == pytest.approx(serving["output_tokens"] / serving["duration_s"])
    assert 0 < serving["ttft_p50_s"] <= serving["ttft_p99_s"] <= serving["e2e_p99_s"] <= serving["duration_s"]
    for args, message in ((["generate", str(path), "hi", "--chat"], "no chat template"),
                          (["generate", str(path), "hi", "--top-p", "2"], "top_p"),
                          (["bench", str(path), "--prompt-len", "9:3"], "not a valid range")):
        result = runner.invoke(main, args)
        assert result.exit_code == 2 and message in result.output, result.output


def _failing_forward(monkeypatch):
    from llmopt.runtime.model_runner import ModelRunner

    def broken(self, items, *rest):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(ModelRunner, "run", broken)


@pytest.mark.parametrize("args", [["bench", "--pp", "8", "--tg", "2", "-r", "1", "-n", "2", "--json"],
                                  ["bench", "--pp", "8", "--tg", "2", "-r", "1", "-n", "2", "--no-single", "--json"],
                                  ["generate", "hi", "--max-tokens", "3", "--json"],
                                  ["generate", "hi", "--max-tokens", "3"],
                                  ["generate", "hi", "--max-tokens", "3", "--stream"]])
def test_failed_forward_fails_the_command_with_one_line(models, monkeypatch, args):
    """A failing forward turns requests into finish_reason="error"; bench must not report a speed
    from them, and generate must not print empty text with exit 0."""
    _, path = models("llama")
    _failing_forward(monkeypatch)
    result = CliRunner().invoke(main, [args[0], str(path), *args[1:]])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "failed: forward failed: RuntimeError: kernel exploded" in lines[0], result.stderr
    assert "Traceback" not in result.output and "{" not in result.stdout


def test_bench_functions_raise_on_a_failed_request(models, monkeypatch):
    from llmopt.runtime.bench import make_workload, serving, single_stream
    from llmopt.runtime.outputs import RequestFailedError

    _, path = models("llama")
    engine = LLMEngine(path)
    _failing_forward(monkeypatch)
    with pytest.raises(RequestFailedError, match="kernel exploded"):
        single_stream(engine, pp=8, tg=2, repetitions=1)
    with pytest.raises(RequestFailedError, match="kernel exploded"):
        serving(engine, make_workload(2, (4, 8), (2, 3), VOCAB))


# ---------------------------------------------------------------------------------------------
# The demo model


@pytest.mark.demo
def test_demo_greedy_matches_transformers(demo_cache):
    from llmopt.checkpoints.models import load_model

    model, tokenizer = load_model("demo")
    texts = ["The capital of France is", "def quicksort(arr):", "Once upon a time, a fox", "Water boils at",
             "The three primary colors are", "import numpy as np\n", "In 1492, Columbus", "My favourite recipe for soup is"]
    prompts = [tokenizer(t).input_ids for t in texts]
    outs = LLM("demo").generate(prompts, greedy(64))
    compared = 0
    for prompt, out, (ref, scores) in zip(prompts, outs, reference_batch(model, prompts, 64)):
        compared += assert_greedy_match(out.token_ids, ref, scores, repr(tokenizer.decode(prompt)))
    assert compared > 0
