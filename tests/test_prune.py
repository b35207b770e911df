"""Pruning: masks and N:M patterns, OWL profiles, magnitude / Wanda / SparseGPT layer errors,
the sequential engine driving them, drop-layers and width pruning, saving, inspecting,
quantizing a pruned model, and every CLI error path. Tiny random models, fresh random data."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import CORPORA, correlated_inputs, out_err, save_model, tiny_llama
from llmopt.calibration import linear_modules
from llmopt.linear_stats import LinearStats
from llmopt.cli.main import main
from llmopt.core.errors import LlmoptError
from llmopt.checkpoints.models import load_model
from llmopt.pruning.apply import PruneSettings, prune_model
from llmopt.pruning.magnitude import magnitude_mask
from llmopt.pruning.masks import (
    Pattern,
    nm_mask,
    nm_valid,
    outlier_ratio,
    owl_sparsities,
    parse_pattern,
    unstructured_mask,
)
from llmopt.pruning.sparsegpt import sparsegpt_prune_weight
from llmopt.pruning.sparsify import SparsifyOptions, sparsify_model
from llmopt.pruning.wanda import wanda_mask
from llmopt.pruning.width import choose_heads, plan_heads, prune_width
from transformers import AutoModelForCausalLM

CALIB = CORPORA / "gutenberg" / "persuasion.txt"
CALIB_ARGS = ["--calib", str(CALIB), "--calib-samples", "4", "--calib-seq-len", "32"]


def run_cli(*args: str):
    return CliRunner().invoke(main, list(args))


def prune(model_dir, out, *args: str):
    return run_cli("prune", str(model_dir), "-o", str(out), *CALIB_ARGS, "--json", *args)



def calib_ids(n: int = 8, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, 259, (n, seq))


# ---------------------------------------------------------------------------------------------
# masks


@pytest.mark.parametrize("sparsity", [0.1, 0.5, 0.7, 0.9])
def test_unstructured_mask_exact_per_row(sparsity: float) -> None:
    scores = torch.rand(24, 100)
    keep = unstructured_mask(scores, sparsity)
    assert (keep.sum(1) == 100 - round(100 * sparsity)).all()
    kept_min = torch.where(keep, scores, torch.inf).amin(1)
    pruned_max = torch.where(~keep, scores, -torch.inf).amax(1)
    assert (pruned_max <= kept_min).all()  # the lowest scores went


@pytest.mark.parametrize("text", ["2:4", "4:8", "1:4"])
def test_nm_mask_valid_and_keeps_largest(text: str) -> None:
    pattern = parse_pattern(text)
    scores = torch.rand(16, 64)
    keep = nm_mask(scores, pattern)
    groups = keep.reshape(16, -1, pattern.m)
    assert (groups.sum(-1) == pattern.n).all()
    assert nm_valid(scores * keep, pattern) and not nm_valid(scores, pattern)
    s = scores.reshape(16, -1, pattern.m)
    assert (torch.where(groups, s, torch.inf).amin(-1) >= torch.where(~groups, s, -torch.inf).amax(-1)).all()


@pytest.mark.parametrize("text", ["2-4", "4:2", "2:2", "0:4", "a:b", "2:4:8", ""])
def test_parse_pattern_refuses_malformed(text: str) -> None:
    with pytest.raises(ValueError, match="N:M|N < M"):
        parse_pattern(text)


def test_nm_mask_needs_divisible_inputs() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        nm_mask(torch.rand(4, 12), Pattern(4, 8))


def test_owl_profile_mean_range_and_order() -> None:
    ratios = [0.01, 0.05, 0.02, 0.08, 0.03]
    sparsities = owl_sparsities(ratios, 0.6, lam=0.08)
    assert sum(sparsities) / len(sparsities) == pytest.approx(0.6)
    assert max(sparsities) - min(sparsities) == pytest.approx(0.16)
    order = sorted(range(5), key=lambda i: ratios[i])
    assert [sparsities[i] for i in order] == sorted(sparsities, reverse=True)  # more outliers, less pruning
    assert owl_sparsities([0.02] * 3, 0.5) == pytest.approx([0.5] * 3)
    scores = torch.ones(10, 10)
    scores[0, :3] = 100.0
    assert outlier_ratio([scores], m=5.0) == pytest.approx(0.03)


# ---------------------------------------------------------------------------------------------
# the algorithms on one layer


@pytest.mark.parametrize("target", [0.5, "2:4", "4:8"])
def test_wanda_and_sparsegpt_beat_magnitude_on_correlated_inputs(target) -> None:
    torch.manual_seed(0)
    x = correlated_inputs(2048, 128)
    w = torch.randn(96, 128)
    h = 2 * x.T @ x / x.shape[0]
    sparsity, pattern = (target, None) if isinstance(target, float) else (None, parse_pattern(target))
    magnitude = w * magnitude_mask(w, sparsity, pattern)
    wanda = w * wanda_mask(w, x.pow(2).sum(0).sqrt(), sparsity, pattern)
    sgpt, keep = sparsegpt_prune_weight(w, h, sparsity, pattern, block_size=32)
    errors = {name: out_err(x, w, v) for name, v in [("magnitude", magnitude), ("wanda", wanda), ("sparsegpt", sgpt)]}
    assert errors["wanda"] < 0.8 * errors["magnitude"], errors
    assert errors["sparsegpt"] < 0.8 * errors["magnitude"], errors
    assert errors["sparsegpt"] < errors["wanda"], errors
    assert torch.equal(sgpt != 0, keep)
    if pattern is None:
        assert ((sgpt == 0).sum(1) == 64).all()  # exactly 50% of every row
    else:
        assert nm_valid(sgpt, pattern) and (sgpt == 0).float().mean() == pattern.sparsity


def test_sparsegpt_handles_dead_inputs_and_rejects_bad_requests() -> None:
    x = correlated_inputs(512, 64)
    x[:, 5] = 0.0
    w = torch.randn(16, 64)
    pruned, _ = sparsegpt_prune_weight(w, 2 * x.T @ x / 512, 0.5)
    assert torch.isfinite(pruned).all() and (pruned[:, 5] == 0).all() and ((pruned == 0).sum(1) == 32).all()
    with pytest.raises(ValueError, match="exactly one"):
        sparsegpt_prune_weight(w, torch.eye(64), 0.5, Pattern(2, 4))
    with pytest.raises(ValueError, match="multiple of 8"):
        sparsegpt_prune_weight(torch.randn(4, 12), torch.eye(12), pattern=Pattern(4, 8))


# ---------------------------------------------------------------------------------------------
# whole models through the sequential engine


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
@pytest.mark.parametrize("target", [0.5, "2:4"])
def test_sparsify_model_exact_sparsity(method: str, target) -> None:
    model = tiny_llama(seed=1)
    sparsity, pattern = (target, None) if isinstance(target, float) else (None, parse_pattern(target))
    sparsify_model(model, SparsifyOptions(method, sparsity, pattern), calib_ids(), show_progress=False)
    for layer in model.model.layers:
        for name, module in linear_modules(layer).items():
            w = module.weight
            assert ((w == 0).sum(1) == w.shape[1] // 2).all(), name
            if pattern is not None:
                assert nm_valid(w, pattern), name
    assert not (model.lm_head.weight == 0).any() and not (model.model.embed_tokens.weight == 0).any()


def test_wanda_scores_use_the_pruned_predecessors_inputs() -> None:
    """Layer 1 is scored on the outputs of the already-pruned layer 0 (the engine's promise)."""
    ids = calib_ids()
    reference = tiny_llama(seed=2)
    sparsify_model(reference, SparsifyOptions("wanda", 0.5), ids, show_progress=False)
    # prune layer 0 of a fresh copy, then score layer 1 by hand on the pruned model's hidden states
    manual = tiny_llama(seed=2)
    with LinearStats(linear_modules(manual.model.layers[0]), hessian=False, stop_early=False) as stats, torch.no_grad():
        manual(ids)
    for name, module in linear_modules(manual.model.layers[0]).items():
        module.weight.data.mul_(wanda_mask(module.weight, stats.l2_norm(name), 0.5))
    with LinearStats(linear_modules(manual.model.layers[1]), hessian=False, stop_early=False) as stats, torch.no_grad():
        manual(ids)
    q = manual.model.layers[1].self_attn.q_proj
    expected = q.weight * wanda_mask(q.weight, stats.l2_norm("self_attn.q_proj"), 0.5)
    torch.testing.assert_close(reference.model.layers[1].self_attn.q_proj.weight, expected)


def test_owl_profile_varies_layers_and_keeps_the_mean() -> None:
    model = tiny_llama(seed=3, num_hidden_layers=4)
    with torch.no_grad():  # give layer 2 strong outliers: it should be pruned least
        model.model.layers[2].mlp.down_proj.weight[:, :4] *= 40
    record = prune_model(model, PruneSettings("wanda", sparsity=0.5, profile="owl"), calib_ids())
    s = record["sparsity"]
    assert s["profile"] == "owl" and len(s["outlier_ratios"]) == 4
    assert sum(s["layer_targets"]) / 4 == pytest.approx(0.5, abs=1e-6)
    assert s["layer_targets"][2] == min(s["layer_targets"]) < 0.5
    assert s["layers"] == pytest.approx(s["layer_targets"], abs=0.01)


def test_owl_outlier_ratios_equal_a_direct_dense_measurement() -> None:
    """OWL's profile (one forward per layer, its outputs kept as the next inputs) gives the outlier
    ratios of Wanda scores from the dense model's own activations, taken by hooks on one plain
    forward of every calibration sequence."""
    from llmopt.pruning.sparsify import owl_outlier_ratios
    from llmopt.pruning.wanda import wanda_scores

    model = tiny_llama(seed=5, num_hidden_layers=3)
    ids = calib_ids()
    sums: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in name:
            def hook(m, args, _out, name=name):
                x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
                sums[name] = sums.get(name, 0) + x.pow(2).sum(0)
            hooks.append(mod.register_forward_hook(hook))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    want = []
    for i, layer in enumerate(model.model.layers):
        scores = [wanda_scores(m.weight, sums[f"model.layers.{i}.{n}"].sqrt().float())
                  for n, m in linear_modules(layer).items()]
        want.append(outlier_ratio(scores, 5.0))
    got = owl_outlier_ratios(model, ids, 5.0, batch_size=4, compute_dtype=None, show_progress=False)
    assert len(got) == 3 and len(want) == 3
    assert got == pytest.approx(want, abs=2e-3)
    assert max(want) > 0


# ---------------------------------------------------------------------------------------------
# structured: width and depth


def test_plan_heads_keeps_gqa_uniform() -> None:
    assert plan_heads(9, 3, 1 / 3).mode == "kv-groups" and plan_heads(9, 3, 1 / 3).kv_heads == 2
    plan = plan_heads(9, 3, 1 / 3, "query-heads")
    assert (plan.heads, plan.kv_heads) == (6, 3)
    assert plan_heads(8, 8, 0.25) == plan_heads(8, 8, 0.25, "kv-groups")  # MHA: every head its own group
    for ratio, mode in [(0.2, "auto"), (0.5, "auto"), (1 / 3, "nope"), (1.0, "auto"), (0.05, "auto")]:
        with pytest.raises(LlmoptError):
            plan_heads(9, 3, ratio, mode)
    importance = torch.tensor([5.0, 1.0, 3.0, 0.5, 0.2, 9.0])  # 3 KV heads × 2 query heads
    assert choose_heads(importance, 3, plan_heads(6, 3, 1 / 3)) == ([0, 1, 4, 5], [0, 2])
    assert choose_heads(importance, 3, plan_heads(6, 3, 0.5, "query-heads")) == ([0, 2, 5], [0, 1, 2])


def test_width_removes_dead_channels_and_groups_exactly() -> None:
    """Channels and a KV group that contribute nothing rank last; removing them keeps the function."""
    model = tiny_llama(seed=4)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.up_proj.weight[:48] = 0.0  # 48 of 192 channels output zero
            layer.self_attn.v_proj.weight[16:32] = 0.0  # KV head 1 → its query heads 2, 3 output zero
    ids = calib_ids()
    with torch.no_grad():
        expected = model(ids).logits
    before = model.num_parameters()
    result = prune_width(model, ids, ffn_ratio=0.25, heads_ratio=0.5, show_progress=False)
    assert result.kept_heads == [[0, 1]] * 2 and all(min(c) == 48 for c in result.kept_channels)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)
    hidden, head_dim = 64, 16
    removed = 2 * (3 * hidden * 48 + 2 * hidden * head_dim * 2 + 2 * hidden * head_dim)  # per layer: MLP, q+o, k+v
    assert before - model.num_parameters() == removed == result.parameters[0] - result.parameters[1]


@pytest.mark.parametrize("args, heads, kv, inter", [
    (["--ffn-ratio", "0.25"], 4, 2, 144),
    (["--heads-ratio", "0.5"], 2, 1, 192),
    (["--ffn-ratio", "0.5", "--heads-ratio", "0.5", "--heads-mode", "query-heads"], 2, 2, 96),
])
def test_width_cli_output_loads_in_transformers(tmp_path, args, heads, kv, inter) -> None:
    source = save_model(tiny_llama(seed=5), tmp_path / "m")
    result = prune(source, tmp_path / "w", "--method", "width", *args)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    config = json.loads((tmp_path / "w" / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"], config["head_dim"]) == (heads, kv, inter, 16)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "w")
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert attn.q_proj.weight.shape == (heads * 16, 64) and attn.k_proj.weight.shape == (kv * 16, 64)
    assert attn.o_proj.weight.shape == (64, heads * 16) and mlp.down_proj.weight.shape == (64, inter)
    assert model.num_parameters() == record["parameters"]["after"] < record["parameters"]["before"]
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)  # KV cache shapes fine
    assert out.shape == (1, 7)
    source_bytes = sum(f.stat().st_size for f in source.glob("*.safetensors"))
    assert record["weights_bytes"] < source_bytes


@pytest.mark.parametrize("ranking", ["block-influence", "perplexity"])
def test_drop_layers_cli_output_loads_in_transformers(tmp_path, ranking) -> None:
    source = save_model(tiny_llama(seed=6, num_hidden_layers=4), tmp_path / "m")
    result = prune(source, tmp_path / "d", "--method", "drop-layers", "--num", "2", "--ranking", ranking)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    depth = record["depth"]
    assert depth["layers"] == [4, 2] and len(depth["dropped"]) == 2 and depth["ranking"]["method"] == ranking
    assert sorted(depth["dropped"] + depth["kept"]) == [0, 1, 2, 3]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "d")
    assert model.config.num_hidden_layers == 2 and len(model.model.layers) == 2
    original = AutoModelForCausalLM.from_pretrained(source)
    for new, old in enumerate(depth["kept"]):
        assert torch.equal(model.model.layers[new].mlp.up_proj.weight, original.model.layers[old].mlp.up_proj.weight)
    assert model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False).shape == (1, 6)
    # the ranking is cached: a second run with another count reuses it
    again = json.loads(prune(source, tmp_path / "d1", "--method", "drop-layers", "--num", "1", "--ranking", ranking).stdout)
    assert again["depth"]["ranking"] == depth["ranking"] and again["depth"]["dropped"][0] in depth["dropped"]
    assert record["ranking_cached"] is False and again["ranking_cached"] is True
    assert again["ranking_seconds"] == record["ranking_seconds"] > 0


# ---------------------------------------------------------------------------------------------
# save, inspect, quantize


def test_sparse_checkpoint_keeps_zeros_through_save_inspect_and_gptq(tmp_path) -> None:
    source = save_model(tiny_llama(seed=7), tmp_path / "m")
    result = prune(source, tmp_path / "p", "--method", "sparsegpt", "--pattern", "2:4")
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "p" / "llmopt.json").read_text())
    s = record["sparsity"]
    assert s["pattern"] == "2:4" and s["pattern_valid"] and s["overall"] == 0.5
    assert len(s["layers"]) == 2 and len(s["modules"]) == 14 and record["calibration"]["samples"] == 4
    pruned = AutoModelForCausalLM.from_pretrained(tmp_path / "p")
    for name, module in linear_modules(pruned.model.layers).items():
        assert nm_valid(module.weight, Pattern(2, 4)) and (module.weight == 0).float().mean() == 0.5, name

    info = json.loads(run_cli("inspect", str(tmp_path / "p"), "--json").stdout)
    dense = [m for m in info["modules"] if ".layers." in m["name"]]
    assert all(m["pattern"] == "2:4" and m["pattern_valid"] and m["pattern_2_4"] for m in dense)
    assert info["pruning"]["sparsity"]["pattern"] == "2:4" and "modules" not in info["pruning"]["sparsity"]
    table = run_cli("inspect", str(tmp_path / "p")).stdout
    assert "(2:4)" in table and "sparsegpt" in table

    quantized = run_cli("quantize", str(tmp_path / "p"), "-o", str(tmp_path / "q"), "--scheme", "W4A16",
                        "--group-size", "32", "--method", "gptq", *CALIB_ARGS)
    assert quantized.exit_code == 0, quantized.output
    model, _ = load_model(tmp_path / "q")
    for name, module in linear_modules(model.model.layers).items():
        before = linear_modules(pruned.model.layers)[name].weight
        assert (module.weight[before == 0] == 0).all(), name  # GPTQ kept the mask
        assert nm_valid(module.weight, Pattern(2, 4)), name
    # compressed-tensors' sparsity config beside the quantization config records the structure (no
    # targets: vLLM 0.32 refuses a sparsity config that targets layers)
    qconfig = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    sparsity = qconfig["sparsity_config"]
    assert sparsity["sparsity_structure"] == "2:4" and sparsity["format"] == "dense" and sparsity["global_sparsity"] == 0.5
    assert sparsity["targets"] == [] and sparsity["ignore"] == qconfig["ignore"] and "lm_head" in sparsity["ignore"]
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "q")  # transformers reads both configs
    ids = torch.tensor([[1, 5, 9, 30, 44, 2, 7]])
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, model(ids).logits, rtol=0, atol=1e-4)
    # a dense (unpruned) source gets no sparsity config
    dense_q = run_cli("quantize", str(source), "-o", str(tmp_path / "dq"), "--scheme", "W4A16", "--group-size", "32")
    assert dense_q.exit_code == 0, dense_q.output
    assert "sparsity_config" not in json.loads((tmp_path / "dq" / "config.json").read_text())["quantization_config"]


def test_unstructured_checkpoint_records_exact_sparsity(tmp_path) -> None:
    source = save_model(tiny_llama(seed=8), tmp_path / "m")
    record = json.loads(prune(source, tmp_path / "p", "--method", "wanda", "--sparsity", "0.6").stdout)
    assert record["sparsity"]["pattern"] is None and record["sparsity"]["overall"] == pytest.approx(0.6, abs=0.01)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "p")
    for name, module in linear_modules(model.model.layers).items():  # every row: round(0.6 × inputs)
        w = module.weight
        assert ((w == 0).sum(1) == round(0.6 * w.shape[1])).all(), name
        assert record["sparsity"]["modules"][f"model.layers.{name}"] == pytest.approx(round(0.6 * w.shape[1]) / w.shape[1], abs=1e-6)


# ---------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("args, expected", [
    (["--method", "wanda", "--sparsity", "1.5"], "outside (0, 1)"),
    (["--method", "magnitude", "--sparsity", "0"], "outside (0, 1)"),
    (["--method", "sparsegpt", "--pattern", "4:2"], "N:M pattern '4:2'"),
    (["--method", "wanda", "--pattern", "2-4"], "malformed N:M pattern"),
    (["--method", "wanda", "--pattern", "2:4", "--sparsity", "0.5"], "exactly one of --sparsity"),
    (["--method", "wanda"], "exactly one of --sparsity"),
    (["--method", "wanda", "--pattern", "2:4", "--profile", "owl"], "does not apply to N:M"),
    (["--method", "drop-layers", "--num", "2"], "cannot drop 2 of the model's 2 layers"),
    (["--method", "drop-layers"], "needs --num"),
    (["--method", "drop-layers", "--num", "1", "--sparsity", "0.5"], "--sparsity does not apply"),
    (["--method", "width", "--heads-ratio", "0.25"], "breaks grouped-query attention"),
    (["--method", "width", "--ffn-ratio", "1.0"], "outside [0, 1)"),
    (["--method", "width"], "needs --ffn-ratio and/or --heads-ratio"),
    (["--method", "lottery", "--sparsity", "0.5"], "unknown pruning method"),
])
def test_cli_errors_are_one_line_exit_2(tmp_path, tiny_model_dir, args, expected) -> None:
    result = run_cli("prune", str(tiny_model_dir), "-o", str(tmp_path / "out"), *args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], lines
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_cli_refuses_quantized_input_and_existing_output(tmp_path, tiny_model_dir) -> None:
    quantized = tmp_path / "q"
    assert run_cli("quantize", str(tiny_model_dir), "-o", str(quantized), "--scheme", "W8A16").exit_code == 0
    result = run_cli("prune", str(quantized), "-o", str(tmp_path / "p"), "--method", "magnitude", "--sparsity", "0.5")
    assert result.exit_code == 2 and "quantized" in result.stderr
    result = run_cli("prune", str(tiny_model_dir), "-o", str(quantized), "--method", "magnitude", "--sparsity", "0.5")
    assert result.exit_code == 2 and "already exists" in result.stderr
