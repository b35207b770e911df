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
from conftest import byte_tokenizer, randomize, save_model
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


def moe_model(kind: str, experts: int, hidden: int = 64, width: int = 96, expert_width: int = 32, seed: int = 0):
    """A random transformers MoE model of ``kind`` (mixtral, qwen2_moe, qwen3_moe): 2 layers, 4
    heads / 2 KV heads, top-2 of ``experts``, untied; Mixtral's experts are ``width`` wide, the
    Qwen ones' ``expert_width`` (Qwen2-MoE's shared expert ``width``)."""
    import transformers as tf

    common = dict(vocab_size=259, hidden_size=hidden, intermediate_size=width, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  num_experts_per_tok=2, tie_word_embeddings=False)
    qwen = dict(num_experts=experts, moe_intermediate_size=expert_width, head_dim=hidden // 4)
    if kind == "mixtral":
        cfg = tf.MixtralConfig(**common, num_local_experts=experts)
    elif kind == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**common, **qwen, shared_expert_intermediate_size=width, norm_topk_prob=False)
    else:
        cfg = tf.Qwen3MoeConfig(**common, **qwen, norm_topk_prob=True)
    torch.manual_seed(seed)
    return randomize(tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval())


def starved_model(kind: str):
    """A tiny MoE model with 5 experts, top-2, whose router never picks expert ``DEAD`` in any
    layer: rows (w, -w), (u, -u) give every token two positive logits, the dead expert's row is
    zero (logit 0), so it is never among the top two."""
    model = moe_model(kind, 5)
    with torch.no_grad():
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
    stored, qconfig = read_compressed(out)
    weights = unfused_names(stored)
    assert len([n for n in weights if is_expert(n)]) == 2 * 5 * 3
    # routers stay float and are named in the ignore list (as stored): vLLM builds Qwen3-MoE's router
    # as a Linear layer, which the "Linear" target would otherwise claim as quantized
    block = "block_sparse_moe" if kind == "mixtral" else "mlp"
    routers = [f"model.layers.{i}.{block}.gate" for i in range(2)]
    assert [r for r in routers if r in qconfig["ignore"]] == routers
    assert not [n for n in stored if n.endswith(".gate")]
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


# --scheme AUTO on MoE models: experts 256 wide on hidden 128 (on hidden 64 the safetensors header
# entries alone cost about half a bit per weight, and no plan of the tiny models fits 4.85 bits)
TARGET = 4.85
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def wide_moe(kind: str, seed: int = 0):
    """A tiny MoE model of ``kind`` with 4 experts 256 wide on hidden 128 (2 layers)."""
    return moe_model(kind, 4, hidden=128, width=256, expert_width=256, seed=seed)


def _auto(source, out, **budget) -> dict:
    """The plan record of ``--scheme AUTO`` (RTN, 4 calibration windows of 64 tokens) on ``source``."""
    from conftest import CORPORA

    from llmopt.pipeline.stages.quantize import QuantizeConfig, run_quantize

    config = QuantizeConfig(model=str(source), output=str(out), scheme="AUTO", method="rtn", calib_samples=4,
                            calib_seq_len=64, calib=str(CORPORA / "gutenberg" / "persuasion.txt"), **budget)
    return run_quantize(config)["plan"]


def _expert_formats(formats: dict, layer: int, projections=PROJECTIONS) -> set[str]:
    return {f for n, f in formats.items() if re.search(rf"\.layers\.{layer}\.mlp\.experts\.\d+\.({'|'.join(projections)})$", n)}


def _kld(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    p, q = torch.log_softmax(ref_logits.float(), -1), torch.log_softmax(logits.float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_auto_plans_every_expert(tmp_path, kind):
    """``--scheme AUTO --target-bpw 4.85`` on an MoE model: each expert projection priced on its
    routed tokens, one format per projection of a layer's experts, every expert quantized; the
    checkpoint holds at most 4.85 bits per weight, loads in transformers with the float model's
    logits on the dequantized weights, far closer to the float model than another random one."""
    from llmopt.checkpoints.models import load_model
    from llmopt.quant.sensitivity import format_scheme

    model = wide_moe(kind)
    source = save_model(model, tmp_path / "float")
    plan = _auto(source, tmp_path / "q", target_bpw=TARGET)
    ref = _unfused(model)
    experts = [n for n, m in ref.named_modules() if isinstance(m, torch.nn.Linear) and is_expert(n)]
    assert len(experts) == 2 * 4 * 3
    priced = plan["sensitivity"]["tensors"]
    assert all(priced[n]["costs"]["int4_g128"] > priced[n]["costs"]["int8"] > 0 for n in experts)
    for layer in range(2):
        for projection in PROJECTIONS:
            assert len(_expert_formats(plan["formats"], layer, (projection,))) == 1
    weights = unfused_names(read_compressed(tmp_path / "q")[0])
    for name in experts:
        fmt, qw = plan["formats"][name], weights[name]
        scheme = format_scheme(fmt, qw.codes.shape[1])
        assert (qw.scheme.num_bits, qw.group_size, qw.scheme.symmetric) == (scheme.num_bits, scheme.group_size, scheme.symmetric)
    assert not any(re.search(r"\.(gate|shared_expert_gate)$", n) for n in weights)  # routers stay in float
    params = sum(p.numel() for p in model.parameters())
    written = sum(f.stat().st_size for f in (tmp_path / "q").glob("*.safetensors")) * 8 / params
    assert written <= TARGET and plan["bpw"] <= TARGET and abs(plan["bpw"] - written) < 0.01 * written, (plan["bpw"], written)
    modules = dict(ref.named_modules())
    for name, qw in weights.items():
        modules[name].weight.data = qw.dequantize(torch.float32)
    ours, _ = load_model(tmp_path / "q")
    ids = torch.randint(3, 259, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got, float_logits, other = ref(ids).logits, ours(ids).logits, model(ids).logits, wide_moe(kind, seed=1)(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=2e-4)
    assert _kld(float_logits, got) < 0.1 * _kld(float_logits, other), (_kld(float_logits, got), _kld(float_logits, other))


def test_auto_kld_target_for_vllm_ties_a_layers_experts(tmp_path):
    """``--target-kld`` with ``--for vllm``: the plan meets the KLD target in vLLM's formats, and all
    of a layer's experts (gate, up and down of every expert) share one format."""
    from llmopt.quant.consumers import VLLM_EXPERTS, VLLM_LINEAR, allows, refused

    source = save_model(wide_moe("qwen3_moe"), tmp_path / "float")
    plan = _auto(source, tmp_path / "q", target_kld=0.1, for_consumer="vllm")
    assert plan["predicted_kld"] <= 0.1
    for layer in range(2):
        assert len(_expert_formats(plan["formats"], layer)) == 1
        assert _expert_formats(plan["formats"], layer) <= {*VLLM_EXPERTS, "float"}  # vLLM's CPU MoE kernel: no groups of 32
    assert allows("vllm", "int4_g32", "linear", 256) and not allows("vllm", "int4_g32", "linear", 256, expert=True)
    shapes = {n: [256, 256] for n in plan["formats"]}
    assert not refused(plan["formats"], {}, shapes, "vllm")
    saved = {n: "int4_g32" if is_expert(n) else f for n, f in plan["formats"].items()}  # experts in groups of 32: refused
    assert len(refused(saved, {}, shapes, "vllm")) == len([n for n in saved if is_expert(n)])
    assert set(plan["formats"].values()) <= {*VLLM_LINEAR, "float"} and set(plan["formats"].values()) & set(VLLM_LINEAR)
    weights = unfused_names(read_compressed(tmp_path / "q")[0])
    assert all(n in weights for n, f in plan["formats"].items() if is_expert(n) and f != "float")


def test_expert_costs_are_per_token_of_the_model():
    """An expert is priced on the tokens routed to it, weighted by how often it runs: in the last
    layer (no routing after it to flip) each expert projection's predicted int4 cost sums to the
    true KLD of quantizing it alone; an expert no token reaches costs nothing."""
    from llmopt.formats.schemes import compute_qparams, fake_quantize
    from llmopt.quant.sensitivity import format_scheme, measure_sensitivity

    model = starved_model("qwen3_moe")
    ids = torch.randint(3, 259, (8, 64), generator=torch.Generator().manual_seed(1))
    sens = {t.name: t for t in measure_sensitivity(model, ids).tensors}  # unfuses the model's experts
    assert all(set(sens[n].costs.values()) == {0.0} for n in sens if f".experts.{DEAD}." in n)
    with torch.no_grad():
        ref = model(ids).logits
    predicted, true = 0.0, 0.0
    for name in (n for n in sens if ".layers.1.mlp.experts." in n and f".experts.{DEAD}." not in n):
        module = model.get_submodule(name)
        w = module.weight.data.clone()
        scheme = format_scheme("int4_g32", w.shape[1])
        scale, zp = compute_qparams(w, scheme, scheme.group_size)
        module.weight.data = fake_quantize(w, scale, zp, scheme, scheme.group_size)
        with torch.no_grad():
            true += _kld(ref, model(ids).logits)
        module.weight.data = w
        predicted += sens[name].costs["int4_g32"]
    assert 0.8 < predicted / true < 1.25, (predicted, true)


def test_bad_auto_target_on_moe_is_one_line(tmp_path):
    """A bits target below every plan of an MoE model: one line, no traceback, no output."""
    from click.testing import CliRunner
    from conftest import CORPORA

    from llmopt.cli.main import main

    source = save_model(wide_moe("mixtral"), tmp_path / "float")
    result = CliRunner().invoke(main, ["quantize", str(source), "-o", str(tmp_path / "q"), "--scheme", "AUTO", "--target-bpw",
                                       "3", "--method", "rtn", "--calib", str(CORPORA / "gutenberg" / "persuasion.txt"),
                                       "--calib-samples", "4", "--calib-seq-len", "64"])
    assert result.exit_code != 0 and "below the smallest plan" in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "q").exists()
