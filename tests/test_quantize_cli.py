"""`llmopt quantize` end to end on tiny models: outputs, provenance, inspect, and every error path."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from conftest import CORPORA, save_model, tiny_llama
from llmopt.cli.main import main
from llmopt.checkpoints.models import load_model
from llmopt.formats.compressed import read_compressed
from transformers import AutoModelForCausalLM

CALIB = CORPORA / "gutenberg" / "persuasion.txt"


def run_cli(*args: str):
    return CliRunner().invoke(main, list(args))


def quantize(model_dir, out, *extra: str):
    """`llmopt quantize --json`; calibrated methods get a small calibration set (RTN refuses one)."""
    method = extra[extra.index("--method") + 1] if "--method" in extra else "rtn"
    scheme = extra[extra.index("--scheme") + 1] if "--scheme" in extra else ""
    calib = [] if method == "rtn" or scheme.upper() == "NF4" else ["--calib", str(CALIB), "--calib-samples", "4", "--calib-seq-len", "32"]
    return run_cli("quantize", str(model_dir), "-o", str(out), *calib, "--json", *extra)


@torch.no_grad()
def check_w8a8_activation_rules(model, out, weights, ids, logits, expected) -> None:
    """Each loader equals the same float model under its own per-token activation rule."""
    from test_compressed import ct_fake_quant
    from transformers import CompressedTensorsConfig

    from llmopt.formats.schemes import fake_quantize_activations

    modules = dict(model.named_modules())
    assert all(modules[name]._forward_pre_hooks for name in weights)  # our loader quantizes those inputs
    for name in weights:
        modules[name]._forward_pre_hooks.clear()
    plain = model(ids).logits
    # weights, norms (SmoothQuant moved scales into them) and biases agree without activation QDQ
    # (compressed-tensors dequantizes in the stored scales' dtype, bfloat16: our weights rounded alike)
    dequantized = AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(dequantize=True))
    full = {name: modules[name].weight.data for name in weights}
    for name, qw in weights.items():
        modules[name].weight.data = qw.dequantize(qw.scheme.stored_scale_dtype).float()
    rounded = model(ids).logits
    for name, w in full.items():
        modules[name].weight.data = w
    torch.testing.assert_close(dequantized(ids).logits, rounded, rtol=1e-4, atol=1e-4)

    def with_rule(rule):
        hooks = [modules[n].register_forward_pre_hook(lambda m, a: (rule(a[0], "int8"), *a[1:])) for n in weights]
        try:
            return model(ids).logits
        finally:
            for h in hooks:
                h.remove()

    assert (logits - plain).abs().max() > 1e-4  # the activation QDQ is visible
    torch.testing.assert_close(logits, with_rule(fake_quantize_activations), rtol=0, atol=1e-5)
    torch.testing.assert_close(expected, with_rule(ct_fake_quant), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "scheme, method, group",
    [("W4A16", "rtn", "32"), ("W4A16", "gptq", "64"), ("W4A16", "awq", "32"), ("W8A16", "rtn", None),
     ("W8A8", "smoothquant", None), ("W4A8", "gptq", "32"), ("FP8", "rtn", None), ("IQ4_NL", "gptq", None)],
)
def test_quantize_writes_loadable_checkpoint(tmp_path, tiny_model_dir, scheme, method, group):
    out = tmp_path / "q"
    args = ["--scheme", scheme, "--method", method] + (["--group-size", group] if group else [])
    result = quantize(tiny_model_dir, out, *args)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["scheme"] == scheme and record["method"] == method
    assert json.loads((out / "llmopt.json").read_text())["method"] == method
    if method != "rtn":
        assert record["calibration"]["samples"] == 4 and record["calibration"]["seq_len"] == 32
    weights, qconfig = read_compressed(out)
    assert qconfig["quant_method"] == "compressed-tensors"
    assert len(weights) == 2 * 7 and not any("lm_head" in n for n in weights)
    if scheme == "IQ4_NL":  # int8 codes, all on the grid, groups of 32
        from llmopt.formats.schemes import IQ4_NL_GRID

        for qw in weights.values():
            assert qw.scheme.num_bits == 8 and qw.group_size == 32
            assert set(qw.codes.unique().tolist()) <= set(IQ4_NL_GRID)

    # our loader and plain transformers (with compressed-tensors) compute the same function
    model, _ = load_model(str(out))
    reference = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, 259, (1, 24))
    with torch.no_grad():
        logits, expected = model(ids).logits, reference(ids).logits
    if scheme in ("W8A8", "W4A8"):  # compressed-tensors rounds activations on a 127.5 grid, we (and vLLM) on 127
        check_w8a8_activation_rules(model, out, weights, ids, logits, expected)
    else:
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)

    info = json.loads(run_cli("inspect", str(out), "--json").stdout)
    q_proj = next(m for m in info["modules"] if m["name"].endswith("layers.0.self_attn.q_proj"))
    expected_format = {"W4A16": "int4", "W8A16": "int8", "W8A8": "int8", "W4A8": "int4", "FP8": "fp8", "IQ4_NL": "int8"}[scheme]
    assert q_proj["format"] == expected_format
    if group:
        assert q_proj["group_size"] == int(group)


def test_mixed_group_sizes_are_recorded(tmp_path, wide_model_dir):
    result = quantize(wide_model_dir, tmp_path / "q", "--scheme", "W4A16", "--group-size", "128")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["group_sizes"] == {"128": 12, "64": 2}
    assert any("down_proj" in n and "192" in n for n in record["notices"])
    weights, _ = read_compressed(tmp_path / "q")
    assert weights["model.layers.0.mlp.down_proj"].group_size == 64
    assert weights["model.layers.0.mlp.up_proj"].group_size == 128
    info = json.loads(run_cli("inspect", str(tmp_path / "q"), "--json").stdout)
    sizes = {m["name"].split(".")[-1]: m["group_size"] for m in info["modules"]}
    assert sizes["down_proj"] == 64 and sizes["q_proj"] == 128


@pytest.fixture
def wide_model_dir(tmp_path):
    """hidden 128, intermediate 192: group 128 fits every Linear but down_proj (which takes 64)."""
    return save_model(tiny_llama(hidden_size=128, intermediate_size=192, num_attention_heads=4), tmp_path / "wide")


def _one_line_error(result, expected: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], result.stderr


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--scheme", "W3A16"], "unknown scheme 'W3A16'"),
        (["--scheme", "Q9_K"], "choose one of W4A16, W4A16_ASYM"),  # every accepted name, llama.cpp's too
        (["--scheme", "Q9_K"], "NF4, AUTO, Q2_K, Q3_K_S, Q3_K_M"),
        (["--scheme", "W4A16", "--method", "magic"], "unknown method 'magic'"),
        (["--scheme", "W4A16", "--method", "smoothquant"], "needs scheme W8A8"),
        (["--scheme", "W8A16", "--group-size", "32"], "takes no group size"),
        (["--scheme", "W4A16", "--group-size", "128", "--strict-groups"], "does not divide the 192 input features"),
        (["--scheme", "W4A16", "--method", "gptq", "--calib-samples", "100000"], "windows of 32 tokens"),
        (["--scheme", "NF4", "--method", "gptq"], "NF4"),
    ],
)
def test_quantize_errors(tmp_path, wide_model_dir, args, expected):
    out = tmp_path / "q"
    _one_line_error(quantize(wide_model_dir, out, *args), expected)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".q")]  # nothing half-written
    if "strict" in " ".join(args):
        assert "down_proj" in expected or "down_proj" in quantize(wide_model_dir, out, *args).stderr


def test_quantize_refuses_existing_output_and_quantized_input(tmp_path, tiny_model_dir):
    out = tmp_path / "q"
    assert quantize(tiny_model_dir, out, "--scheme", "W8A16").exit_code == 0
    _one_line_error(quantize(tiny_model_dir, out, "--scheme", "W8A16"), "already exists")
    assert quantize(tiny_model_dir, out, "--scheme", "W8A16", "--overwrite").exit_code == 0
    _one_line_error(quantize(out, tmp_path / "again", "--scheme", "W4A16"), "already quantized")


def test_quantize_keeps_pruned_zeros(tmp_path):
    model = tiny_llama()
    with torch.no_grad():
        for layer in model.model.layers:
            for module in (layer.mlp.up_proj, layer.self_attn.q_proj):
                keep = torch.rand_like(module.weight) > 0.5
                module.weight.mul_(keep)
    source = save_model(model, tmp_path / "pruned")
    out = tmp_path / "q"
    assert quantize(source, out, "--scheme", "W4A16", "--group-size", "32", "--method", "gptq").exit_code == 0
    weights, _ = read_compressed(out)
    for i, layer in enumerate(model.model.layers):
        for kind, module in (("mlp.up_proj", layer.mlp.up_proj), ("self_attn.q_proj", layer.self_attn.q_proj)):
            zeros = module.weight == 0
            deq = weights[f"model.layers.{i}.{kind}"].dequantize()
            assert (deq[zeros] == 0).all()


@pytest.mark.parametrize("pattern", ["self_attn", r"re:.*self_attn\.", r"re:model\.layers\.\d+\.self_attn"])
def test_ignore_patterns_in_both_forms(tmp_path, tiny_model_dir, pattern):
    """--ignore takes a regular expression found in the name or compressed-tensors' 're:' form
    (matched from the name's start); the matched Linears stay float and transformers loads the
    output with them as plain Linears."""
    from llmopt.formats.compressed import read_compressed
    from transformers import AutoModelForCausalLM

    out = tmp_path / "q"
    result = quantize(tiny_model_dir, out, "--scheme", "W8A16", "--ignore", pattern)
    assert result.exit_code == 0, result.output
    weights, _ = read_compressed(out)
    assert len(weights) > 0
    assert not [n for n in weights if "self_attn" in n] and [n for n in weights if "mlp" in n]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    source = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj) is torch.nn.Linear
    assert torch.equal(q_proj.weight, source.model.layers[0].self_attn.q_proj.weight)


def test_nf4_ignore_pattern_found_in_name(tmp_path, tiny_model_dir):
    """NF4 reads --ignore as the compressed-tensors schemes do: 'self_attn' keeps every attention Linear float."""
    import json

    out = tmp_path / "nf4"
    result = quantize(tiny_model_dir, out, "--scheme", "NF4", "--ignore", "self_attn")
    assert result.exit_code == 0, result.output
    skipped = json.loads((out / "config.json").read_text())["quantization_config"]["llm_int8_skip_modules"]
    attention = [s for s in skipped if "self_attn" in s]
    assert len(attention) == 4 * 2  # q, k, v, o in both layers of the tiny model
    assert not [s for s in skipped if "mlp" in s]
