"""Mixture-of-experts compression: experts are quantized one Linear per projection, calibrated
on the tokens routed to them; an expert that gets no (or too few) calibration tokens is
quantized from its weights alone (never left in float, never a crash); routers stay in float;
the quantized checkpoint runs in llmopt's runtime token-for-token like transformers on the
same dequantized weights."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import byte_tokenizer, save_model
from test_runtime import assert_greedy_match, greedy, random_prompts
from test_runtime_architectures import reference, tiny, unfused_names

from llmopt.checkpoints.moe import is_expert, unfuse_experts
from llmopt.formats.compressed import read_compressed
from llmopt.pipeline.stages.quantize import quantize_checkpoint
from llmopt.quant.apply import MIN_EXPERT_TOKENS
from llmopt.quant.request import make_request
from llmopt.runtime import LLM
from llmopt.runtime.layers import DenseLinear, QuantLinear

pytestmark = pytest.mark.usefixtures("one_thread")

DEAD = 4  # the expert no token is ever routed to


def starved_model(kind: str):
    """A tiny MoE model with 5 experts, top-2, whose router never picks expert ``DEAD`` in any
    layer: rows (w, -w), (u, -u) give every token two positive logits, the dead expert's row is
    zero (logit 0), so it is never among the top two."""
    import transformers as tf

    common = dict(vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  num_experts_per_tok=2, tie_word_embeddings=False)
    if kind == "mixtral":
        cfg = tf.MixtralConfig(**common, num_local_experts=5)
    else:
        cfg = tf.Qwen3MoeConfig(**common, num_experts=5, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
            else:
                p.add_(torch.randn_like(p) * 0.1)
        for layer in model.model.layers:
            router = layer.mlp.gate.weight
            router[1], router[3], router[DEAD] = -router[0], -router[2], 0.0
    return model


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_gptq_w4a16_moe_with_a_starved_expert(tmp_path, kind):
    model = starved_model(kind)
    source = save_model(model, tmp_path / "float")
    calib = torch.randint(3, 259, (4, 32), generator=torch.Generator().manual_seed(0))
    request = make_request("W4A16", "gptq", group_size=32, batch_size=2)
    result = quantize_checkpoint(source, tmp_path / "w4", request, calib, tokenizer=byte_tokenizer(), progress=False).result
    # every expert Linear of every layer quantized, the dead ones from their weights alone
    experts = [n for n, m in _unfused(model).named_modules() if isinstance(m, torch.nn.Linear) and is_expert(n)]
    assert len(experts) == 2 * 5 * 3
    stored, _ = read_compressed(tmp_path / "w4")
    assert any(".block_sparse_moe.experts." in n for n in stored) == (kind == "mixtral")  # Mixtral's own names
    weights = unfused_names(stored)
    assert set(experts) <= set(weights)
    dead = {n for n in experts if f".experts.{DEAD}." in n}
    assert set(result.starved_experts) == dead and all(v == 0 for v in result.starved_experts.values())
    assert MIN_EXPERT_TOKENS > 0
    assert not any(re.search(r"\.gate$", n) for n in weights)  # routers stay in float
    assert any("weights alone" in line for line in result.notices)
    # the reference: transformers on the dequantized weights (routers as they were)
    ref = starved_model(kind)
    unfuse_experts(ref)
    modules = dict(ref.named_modules())
    for name, qw in weights.items():
        modules[name].weight.data = qw.dequantize(torch.float32)
    prompts = random_prompts(3, low=8, high=30)
    llm = LLM(tmp_path / "w4", block_size=4)
    layer = llm.engine.weights.layers[0]
    assert isinstance(layer.moe.router, DenseLinear)
    assert all(isinstance(lin, QuantLinear) for e in layer.moe.experts for lin in (e.gate_up, e.down))
    logits = ref(torch.tensor([prompts[0]])).logits
    assert torch.isfinite(logits).all()
    for prompt, out in zip(prompts, llm.generate(prompts, greedy(10))):
        tokens, scores = reference(ref, prompt, 10)
        assert_greedy_match(out.token_ids, tokens, scores, kind)


def _unfused(model):
    import copy

    m = copy.deepcopy(model)
    unfuse_experts(m)
    return m



@pytest.mark.parametrize("scheme", ["W4A16", "W8A8"])
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_quantized_moe_loads_evaluates_and_compares(tmp_path, kind, scheme):
    """A quantized MoE checkpoint stores one tensor set per expert while transformers 5 holds the
    experts fused (and Mixtral's under other names): ``load_model`` and ``eval --baseline`` read it through transformers' own conversions and give the logits of the float
    model with the dequantized weights (activations quantized per token for W8A8)."""
    from click.testing import CliRunner
    from conftest import CORPORA

    from llmopt.checkpoints.models import load_model
    from llmopt.cli.main import main
    from llmopt.formats.schemes import fake_quantize_activations

    source = save_model(starved_model(kind), tmp_path / "float")
    out = tmp_path / "q"
    quantize_checkpoint(source, out, make_request(scheme, "rtn", group_size=32 if scheme == "W4A16" else None),
                        tokenizer=byte_tokenizer(), progress=False)
    stored, _ = read_compressed(out)
    weights = unfused_names(stored)
    assert len([n for n in weights if is_expert(n)]) == 2 * 5 * 3
    ref = _unfused(starved_model(kind))
    modules = dict(ref.named_modules())
    for name, qw in weights.items():
        modules[name].weight.data = qw.dequantize(torch.float32)
        if qw.scheme.activations:
            modules[name].register_forward_pre_hook(
                lambda module, args, kind=qw.scheme.activations: (fake_quantize_activations(args[0], kind), *args[1:]))
    ours, _ = load_model(out)
    ids = torch.tensor([random_prompts(1, low=24, high=25)[0]])
    with torch.no_grad():
        want, got = ref(ids).logits, ours(ids).logits
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=2e-4)
    wiki = str(CORPORA / "wikitext-2-raw" / "wiki.test.raw")
    runner = CliRunner()
    result = runner.invoke(main, ["eval", str(out), "--baseline", str(source), "--dataset", wiki, "--seq-len", "64",
                                  "--max-windows", "2", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    assert 0 < figures["kld_mean"] < 1 and 0 <= figures["top1_agreement"] <= 1
