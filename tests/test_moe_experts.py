"""Mixture-of-experts checkpoints beyond quantization: expert pruning by measured routing frequency
(``prune --method drop-experts``) and the tensor names llmopt writes for Mixtral (transformers
must load what the streaming prune / quantize write). Tiny random models with an expert the
router never picks (test_moe_compression.starved_model)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from click.testing import CliRunner
from conftest import CORPORA, save_model
from test_moe_compression import DEAD, starved_model
from test_runtime import assert_greedy_match, greedy, random_prompts
from test_runtime_architectures import reference

from llmopt.checkpoints.lazy import LazyCheckpoint
from llmopt.cli.main import main
from llmopt.core.errors import LlmoptError
from llmopt.pruning.apply import PruneSettings, prune_model
from llmopt.runtime import LLM

pytestmark = pytest.mark.usefixtures("one_thread")

CALIB = torch.randint(3, 259, (4, 32), generator=torch.Generator().manual_seed(0))


def expert_count(model) -> int:
    return getattr(model.config, "num_local_experts", None) or model.config.num_experts


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_drop_experts_removes_the_least_routed(kind, tmp_path):
    """The never-routed expert is the one dropped in every layer; with top-k weights renormalised
    (both models here) routing over the remaining experts is unchanged, so the logits are too;
    the saved checkpoint loads in transformers and runs in the runtime token for token."""
    from transformers import AutoModelForCausalLM

    model, original = starved_model(kind), starved_model(kind)
    ids = CALIB[:2]
    with torch.no_grad():
        want = original(ids).logits
    record = prune_model(model, PruneSettings("drop-experts", num=1, batch_size=2), CALIB, show_progress=False)
    experts = record["experts"]
    assert experts["experts"] == [5, 4] and experts["dropped"] == [[DEAD], [DEAD]]
    assert len(experts["tokens_per_expert"]) == 2
    for counts in experts["tokens_per_expert"]:  # top-2 of 5 on every calibration token
        assert len(counts) == 5 and counts[DEAD] == 0 and min(c for e, c in enumerate(counts) if e != DEAD) > 0
        assert sum(counts) == 2 * CALIB.numel()
    assert expert_count(model) == 4
    with torch.no_grad():
        got = model(ids).logits
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    path = save_model(model, tmp_path / "dropped")
    loaded, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, want, rtol=1e-4, atol=1e-4)
    llm = LLM(path, block_size=4)
    assert len(llm.engine.weights.layers[0].moe.experts) == 4
    prompts = random_prompts(2, low=8, high=24)
    for prompt, out in zip(prompts, llm.generate(prompts, greedy(8))):
        tokens, scores = reference(loaded, prompt, 8)
        assert len(out.token_ids) == len(tokens) == 8
        assert_greedy_match(out.token_ids, tokens, scores, kind)


def test_drop_experts_keeps_the_most_routed_and_the_shared_expert():
    """Qwen2-MoE (shared expert, top-k not renormalised, layer 1 dense): the counts are the
    router's choices counted independently, the dropped experts the least-routed ones, and the
    shared expert and the dense layer are kept."""
    from test_runtime_architectures import tiny

    model = tiny("qwen2_moe")
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    assert len(gates) == 1  # mlp_only_layers=[1]
    counts = torch.zeros(4, dtype=torch.long)

    def count(module, args, out) -> None:
        counts.add_(torch.bincount(out[2].reshape(-1), minlength=4))

    handle = gates[0].register_forward_hook(count)
    with torch.no_grad():
        model(CALIB[:2]), model(CALIB[2:])
    handle.remove()
    record = prune_model(model, PruneSettings("drop-experts", num=2, batch_size=2), CALIB, show_progress=False)
    assert record["experts"]["tokens_per_expert"] == [counts.tolist()]
    order = sorted(range(4), key=lambda e: int(counts[e]))
    if counts[order[1]] != counts[order[2]]:  # no tie at the cut: the counts alone decide
        assert record["experts"]["dropped"] == [sorted(order[:2])]
    layer = model.model.layers[0].mlp
    assert expert_count(model) == 2 and layer.gate.weight.shape[0] == 2 and layer.experts.gate_up_proj.shape[0] == 2
    assert layer.shared_expert is not None and not hasattr(model.model.layers[1].mlp, "gate")
    with torch.no_grad():
        assert torch.isfinite(model(CALIB[:1]).logits).all()


def test_drop_experts_refusals():
    moe = {"model_type": "mixtral", "num_local_experts": 5, "num_experts_per_tok": 2}
    PruneSettings("drop-experts", num=3).validate(moe)
    with pytest.raises(LlmoptError, match="fewer than the 2"):
        PruneSettings("drop-experts", num=4).validate(moe)
    with pytest.raises(LlmoptError, match="needs a mixture-of-experts"):
        PruneSettings("drop-experts", num=1).validate({"model_type": "llama", "num_hidden_layers": 2})
    with pytest.raises(LlmoptError, match="needs --num"):
        PruneSettings("drop-experts").validate(moe)
    with pytest.raises(LlmoptError, match="--ranking does not apply"):
        PruneSettings("drop-experts", num=1, ranking="perplexity").validate(moe)


def test_prune_cli_drop_experts(tmp_path):
    source = save_model(starved_model("mixtral"), tmp_path / "float")
    out = tmp_path / "dropped"
    argv = ["prune", str(source), "--method", "drop-experts", "--num", "1", "--calib", str(CORPORA / "gutenberg" / "persuasion.txt"),
            "--calib-samples", "4", "--calib-seq-len", "32", "-o", str(out)]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 0, (result.output, result.exception)
    record = json.loads((out / "llmopt.json").read_text())
    assert record["experts"]["dropped"] == [[DEAD], [DEAD]]
    assert json.loads((out / "config.json").read_text())["num_local_experts"] == 4
    bad = CliRunner().invoke(main, argv[:-1] + [str(tmp_path / "bad"), "--sparsity", "0.5"])
    assert bad.exit_code == 2 and "--sparsity does not apply to --method drop-experts" in bad.stderr


def test_streamed_mixtral_checkpoints_use_mixtral_names(tmp_path):
    """A Wanda-pruned Mixtral written layer by layer stores experts and router as Mixtral's own
    checkpoints do (``block_sparse_moe.experts.j.w1``), so transformers loads every expert: the
    loaded model equals the model pruned in memory."""
    from transformers import AutoModelForCausalLM

    from llmopt.pruning.streaming import prune_streaming

    source = save_model(starved_model("mixtral"), tmp_path / "float")
    settings = PruneSettings("wanda", sparsity=0.5, batch_size=2)
    prune_streaming(source, tmp_path / "wanda", settings, CALIB, show_progress=False)
    with LazyCheckpoint(tmp_path / "wanda") as ckpt:
        keys = list(ckpt.keys())
    assert len([k for k in keys if ".block_sparse_moe.experts." in k]) == 2 * 5 * 3
    assert not any(".mlp." in k for k in keys) and sum(k.endswith("block_sparse_moe.gate.weight") for k in keys) == 2
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "wanda", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    in_memory = starved_model("mixtral")
    prune_model(in_memory, settings, CALIB, show_progress=False)
    with torch.no_grad():
        want, got = in_memory(CALIB[:2]).logits, loaded(CALIB[:2]).logits
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def dequantized_reference(kind: str, path, in_scale_dtype: bool = False):
    """transformers on the checkpoint at ``path``: its dense tensors (norms a method rescaled
    included) and its quantized Linears dequantized, experts unfused; ``in_scale_dtype``:
    dequantized in the stored scales' dtype (bfloat16), as compressed-tensors computes them."""
    from llmopt.checkpoints.moe import canonical_key, unfuse_experts
    from llmopt.formats.compressed import read_compressed
    from test_runtime_architectures import unfused_names

    ref = starved_model(kind)
    unfuse_experts(ref)
    weights = unfused_names(read_compressed(path)[0])
    with LazyCheckpoint(path) as ckpt:
        dense = {canonical_key(k): ckpt.get(k).float() for k in ckpt.keys() if canonical_key(k).rpartition(".")[0] not in weights}
    state = ref.state_dict()
    assert set(dense) <= set(state)
    ref.load_state_dict(dense, strict=False)
    modules = dict(ref.named_modules())
    for name, qw in weights.items():
        modules[name].weight.data = qw.dequantize(qw.scheme.stored_scale_dtype if in_scale_dtype else torch.float32).float()
    return ref, weights


@pytest.mark.parametrize("method,scheme", [("awq", "W4A16"), ("smoothquant", "W8A8")])
def test_awq_and_smoothquant_on_moe_with_a_starved_expert(tmp_path, method, scheme):
    """AWQ / SmoothQuant on a Mixtral whose expert 4 never gets a token: every expert Linear is
    quantized (the starved ones from their weights alone, after the scales are folded), the
    experts are rescaled (the norm → all experts' gate/up with the router following, each
    calibrated expert's up → down), routers stay in float; the checkpoint runs in the runtime
    (W4A16: token for token like transformers on the dequantized weights)."""
    from llmopt.checkpoints.moe import is_expert
    from llmopt.pipeline.stages.quantize import quantize_checkpoint
    from llmopt.quant.request import make_request
    from llmopt.runtime.layers import DenseLinear, QuantLinear
    from conftest import byte_tokenizer

    source = save_model(starved_model("mixtral"), tmp_path / "float")
    request = make_request(scheme, method, group_size=32 if scheme == "W4A16" else None, batch_size=2)
    result = quantize_checkpoint(source, tmp_path / "q", request, CALIB, tokenizer=byte_tokenizer(), progress=False).result
    ref, weights = dequantized_reference("mixtral", tmp_path / "q")
    experts = [n for n, m in ref.named_modules() if isinstance(m, torch.nn.Linear) and is_expert(n)]
    assert len(experts) == 2 * 5 * 3 and set(experts) <= set(weights)
    assert {n for n in result.starved_experts} == {n for n in experts if f".experts.{DEAD}." in n}
    assert not any("without AWQ / SmoothQuant scaling" in line for line in result.notices)
    kinds = {re.sub(r"^model\.layers\.\d+\.", "", m.name) for m in result.mappings}
    calibrated = {f"experts.{j}.up_proj→down_proj" for j in range(5) if j != DEAD}  # nothing to measure for the dead one
    assert kinds == {"input_layernorm→q/k/v", "v_proj→o_proj", "post_attention_layernorm→experts"} | calibrated
    llm = LLM(tmp_path / "q", block_size=4)
    moe = llm.engine.weights.layers[0].moe
    assert isinstance(moe.router, DenseLinear) and all(isinstance(e.down, QuantLinear) for e in moe.experts)
    prompts = random_prompts(2, low=8, high=24)
    outs = llm.generate(prompts, greedy(8, logprobs=0))
    assert [len(o.token_ids) for o in outs] == [8, 8]
    assert all(v == v and abs(v) < 1e9 for o in outs for lp in o.logprobs for v in lp.values())  # finite
    if scheme == "W4A16":
        for prompt, out in zip(prompts, outs):
            tokens, scores = reference(ref, prompt, 8)
            assert_greedy_match(out.token_ids, tokens, scores, method)


def _qwen2_moe():
    import transformers as tf

    cfg = tf.Qwen2MoeConfig(vocab_size=259, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=256)
    torch.manual_seed(3)
    return tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_moe_scale_mappings_fold_exactly(kind):
    """Folding random scales into every mapping of a mixture-of-experts layer (norm → all experts'
    gate/up with the router following, a shared expert and its gate included; each expert's
    up → down) leaves the routing and the logits unchanged."""
    from llmopt.checkpoints.moe import unfuse_experts
    from llmopt.quant.mappings import layer_mappings

    model = _qwen2_moe() if kind == "qwen2_moe" else starved_model(kind)
    unfuse_experts(model)
    ids = torch.randint(3, 259, (2, 24), generator=torch.Generator().manual_seed(5))
    routed = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: routed.append(out[-1] if isinstance(out, tuple) else out))
             for layer in model.model.layers]
    with torch.no_grad():
        before = model(ids).logits
    experts = len(model.model.layers[0].mlp.experts)
    names = set()
    gen = torch.Generator().manual_seed(6)
    for i, layer in enumerate(model.model.layers):
        mappings, notices = layer_mappings(layer, f"model.layers.{i}.")
        assert notices == []
        names |= {m.name for m in mappings}
        for m in mappings:
            m.fold(torch.rand(m.channels, generator=gen) * 3 + 0.25)
    with torch.no_grad():
        after = model(ids).logits
    for h in hooks:
        h.remove()
    expected = {"input_layernorm→q/k/v", "v_proj→o_proj", "post_attention_layernorm→experts",
                *(f"experts.{j}.up_proj→down_proj" for j in range(experts))}
    if kind == "qwen2_moe":
        expected.add("shared_expert.up_proj→down_proj")
        assert "model.layers.0.mlp.shared_expert_gate" in next(m for m in layer_mappings(model.model.layers[0], "model.layers.0.")[0]
                                                                if m.name.endswith("experts")).followers
    assert names == expected
    assert len(routed) == 2 * len(model.model.layers)
    half = len(model.model.layers)
    for a, b in zip(routed[:half], routed[half:]):
        assert torch.equal(a, b)  # the same experts for every token
    assert torch.allclose(before, after, atol=1e-4, rtol=1e-4)


def test_quantized_mixtral_loads_in_transformers(tmp_path):
    """A W4A16 AWQ Mixtral written by llmopt (experts as ``block_sparse_moe.experts.j.w1`` …,
    compressed-tensors) loads in transformers with every tensor used, and computes the logits of
    the dequantized checkpoint."""
    from transformers import AutoModelForCausalLM

    from llmopt.pipeline.stages.quantize import quantize_checkpoint
    from llmopt.quant.request import make_request
    from conftest import byte_tokenizer

    source = save_model(starved_model("mixtral"), tmp_path / "float")
    quantize_checkpoint(source, tmp_path / "q", make_request("W4A16", "awq", group_size=32, batch_size=2), CALIB,
                        tokenizer=byte_tokenizer(), progress=False)
    with LazyCheckpoint(tmp_path / "q") as ckpt:
        keys = list(ckpt.keys())
    assert sum(k.endswith("weight_packed") and ".block_sparse_moe.experts." in k for k in keys) == 2 * 5 * 3
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ref, _ = dequantized_reference("mixtral", tmp_path / "q", in_scale_dtype=True)
    with torch.no_grad():
        want, got = ref(CALIB[:2]).logits, loaded(CALIB[:2]).logits
    assert got.shape == want.shape == (2, CALIB.shape[1], 259)
    # transformers keeps the decompressed experts in the scales' dtype (bfloat16) and multiplies in it:
    # logits agree to bfloat16's precision (8 significant bits), the predictions alike
    experts = [p for n, p in loaded.named_parameters() if ".experts." in n]
    assert experts and all(p.dtype == torch.bfloat16 for p in experts)
    torch.testing.assert_close(got, want, rtol=2 ** -6, atol=0.1)
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.98
