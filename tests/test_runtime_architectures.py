"""Native runtime architectures against transformers: Gemma 2, Gemma 3 (text), Phi-3, Mixtral,
Qwen2-MoE, Qwen3-MoE — tiny random models built from real configs, float and W4A16 (RTN)
checkpoints, greedy token-for-token parity (the tie rule of test_runtime), batched, with
prefix caching and chunked prefill, prompts longer than the sliding windows."""

from __future__ import annotations

import pytest
import torch
from conftest import byte_tokenizer, lazy_models, randomize
from test_runtime import assert_greedy_match, greedy, random_prompts

from llmopt.checkpoints.moe import canonical_key, unfuse_experts
from llmopt.formats.compressed import read_compressed
from llmopt.pipeline.stages.quantize import quantize_checkpoint
from llmopt.quant.request import make_request
from llmopt.runtime import LLM
from llmopt.runtime.layers import QuantLinear, SparseMoE

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 259
NATIVE = ["gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe"]


def config(kind: str):
    """A real transformers config of ``kind``, shrunk (2-3 layers, hidden 64, 4 heads / 2 KV heads)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=32)
    if kind == "gemma2":  # sandwich norms, soft-capped scores and logits, sliding layers alternating with global
        return tf.Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
                               attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    if kind == "gemma3":  # q/k norms, local/global RoPE bases, sliding window
        return tf.Gemma3TextConfig(**{**common, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    if kind == "phi3":  # fused qkv_proj / gate_up_proj, a sliding window
        return tf.Phi3Config(**common, sliding_window=9, tie_word_embeddings=False)
    if kind == "mixtral":
        return tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    if kind == "qwen2_moe":  # shared expert with a sigmoid gate, q/k/v biases; layer 1 dense (mlp_only_layers)
        return tf.Qwen2MoeConfig(**common, **moe, num_experts=4, shared_expert_intermediate_size=48, mlp_only_layers=[1],
                                 norm_topk_prob=False, tie_word_embeddings=False)
    if kind == "qwen3_moe":  # q/k norms, renormalised top-k
        return tf.Qwen3MoeConfig(**common, **moe, num_experts=4, head_dim=16, norm_topk_prob=True, tie_word_embeddings=False)
    raise ValueError(kind)


def tiny(kind: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return randomize(AutoModelForCausalLM.from_config(config(kind), dtype=torch.float32, attn_implementation="eager").eval())


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    return lazy_models(root, tiny)


@torch.no_grad()
def reference(model, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), [s[0].float() for s in out.scores]


def check_parity(model, path, label: str, n: int = 12, **settings) -> LLM:
    prompts = random_prompts(4, low=8, high=40)  # longer than the windows (6, 9)
    llm = LLM(path, **settings)
    llm.generate(prompts[:1], greedy(n))  # a finished request leaves its prefix cached
    outs = llm.generate(prompts, greedy(n, logprobs=0))
    assert len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs):
        ref, scores = reference(model, prompt, n)
        same = assert_greedy_match(out.token_ids, ref, scores, label)
        assert same >= 1
        # the chosen tokens' log-probabilities too (sensitive to what greedy tokens may hide:
        # a RoPE base, a soft cap); 2e-3 as test_architectures' runtime tolerance
        for i in range(same):
            want = float(torch.log_softmax(scores[i], -1)[ref[i]])
            assert abs(out.logprobs[i][ref[i]] - want) < 2e-3, f"{label} token {i}: logprob {out.logprobs[i][ref[i]]} vs {want}"
    return llm


@pytest.mark.parametrize("kind", NATIVE)
def test_float_greedy_matches_transformers(built, kind):
    model, path = built(kind)
    llm = check_parity(model, path, kind, block_size=4, max_num_batched_tokens=24)
    layers = llm.engine.weights.layers
    assert (layers[0].moe is not None) == (kind in ("mixtral", "qwen2_moe", "qwen3_moe"))
    if kind == "qwen2_moe":
        assert layers[0].moe.shared is not None and layers[1].moe is None  # mlp_only_layers=[1]: dense


def unfused_names(weights: dict) -> dict:
    """Quantized weights by the unfused transformers model's module names (Mixtral checkpoints
    store ``block_sparse_moe.experts.j.w1`` for ``mlp.experts.j.gate_proj``)."""
    return {canonical_key(f"{name}.weight").removesuffix(".weight"): qw for name, qw in weights.items()}


@pytest.mark.parametrize("kind", NATIVE)
def test_w4a16_greedy_matches_transformers(built, kind, tmp_path):
    """A W4A16 (RTN, group 32) checkpoint stays quantized in the runtime (experts included) and
    matches transformers running the dequantized weights."""
    w4a16_parity(built, kind, tmp_path)


def w4a16_parity(built, kind: str, tmp_path, **settings) -> LLM:
    _, path = built(kind)
    quantize_checkpoint(path, tmp_path / "w4", make_request("W4A16", "rtn", group_size=32), tokenizer=byte_tokenizer(),
                        progress=False)
    stored, _ = read_compressed(tmp_path / "w4")
    assert any(".block_sparse_moe.experts." in n for n in stored) == (kind == "mixtral")  # Mixtral's own names
    weights = unfused_names(stored)
    ref = tiny(kind)
    unfuse_experts(ref)
    modules = dict(ref.named_modules())
    for name, qw in weights.items():
        modules[name].weight.data = qw.dequantize(torch.float32)
    linears = [n for n, m in modules.items() if isinstance(m, torch.nn.Linear) and n != "lm_head"
               and not n.endswith(("mlp.gate", "shared_expert_gate"))]
    assert len(weights) == len(linears) and set(weights) == set(linears)
    llm = check_parity(ref, tmp_path / "w4", kind, block_size=4, max_num_batched_tokens=24, **settings)
    if settings.get("model_impl") == "transformers":
        return llm
    layer = llm.engine.weights.layers[0]
    assert isinstance(layer.qkv, QuantLinear)
    if layer.moe is not None:
        assert all(isinstance(e.down, QuantLinear) for e in layer.moe.experts)
    return llm
