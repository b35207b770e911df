"""The quantize core's shape: methods are objects read by name in one parser only, one request
goes down, quant/ writes no file, and the method objects behave as their options say."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from torch import nn

from llmopt.quant.apply import quantize_model
from llmopt.quant.method import QuantMethod
from llmopt.quant.registry import METHODS, build_method, method_names
from llmopt.quant.request import make_request
from llmopt.quant.streaming import quantize_streaming
from code_shape import FILE_WRITES, file_writes, method_name_tests

ROOT = Path(__file__).resolve().parents[1]
CHECKED = [*sorted((ROOT / "quant").glob("*.py")), *sorted((ROOT / "compress/pipeline/stages").glob("*.py"))]
PARSER = ROOT / "quant/registry.py"


def test_method_names_are_read_by_the_parser_only() -> None:
    files = [f for f in CHECKED if f != PARSER]
    assert len(files) > 20
    found = {str(f.relative_to(ROOT)): method_name_tests(f.read_text()) for f in files}
    assert {f: lines for f, lines in found.items() if lines} == {}


def test_the_counter_finds_string_tests_of_method_names() -> None:
    source = '''
if method == "rtn": pass
if "gptq" in method: pass
if config.method.startswith("awq"): pass
if m in ("gptq", "awq+gptq"): pass
if self.method != "smoothquant+gptq": pass
if kind == "drop-layers": pass
'''
    assert method_name_tests(source) == [2, 3, 4, 5, 6]


def test_quant_writes_no_file() -> None:
    files = sorted((ROOT / "quant").glob("*.py"))
    assert len(files) > 20
    assert {str(f.relative_to(ROOT)): file_writes(f.read_text()) for f in files if file_writes(f.read_text())} == {}
    assert file_writes("from pathlib import Path\nPath('x').write_text('y')\nopen('z', 'wb')\nopen('r')\n") == [2, 3]
    assert "save_file" in FILE_WRITES


@pytest.mark.parametrize("function", [quantize_model, quantize_streaming])
def test_entry_points_take_at_most_six_parameters(function) -> None:
    assert len(inspect.signature(function).parameters) <= 6


def test_no_options_record_is_rebuilt() -> None:
    text = (ROOT / "quant/apply.py").read_text()
    assert "_Options" not in text and "**options" not in text


def test_every_registered_name_parses_and_composes() -> None:
    names = method_names()
    assert {"rtn", "gptq", "hqq", "awq", "smoothquant", "awq+gptq", "smoothquant+gptq"} <= set(names)
    for name in names:
        method = build_method(name)
        assert isinstance(method, QuantMethod) and method.name in (name, f"{name}+rtn")
    assert set(METHODS) <= set(names)
    awq_gptq = build_method("awq+gptq")
    assert awq_gptq.transform.name == "awq" and awq_gptq.quantizer.name == "gptq" and awq_gptq.one_pass


@pytest.mark.parametrize("spec, options, message", [
    ("awq", {"float_targets": True}, "--float-targets does not apply to method awq: it is an option of gptq"),
    ("rtn", {"damp": 0.02}, "--damp does not apply to method rtn"),
    ("gptq", {"alpha": 0.3}, "it is an option of smoothquant"),
    ("gptq+awq", {}, "not a transform then a quantizer"),
    ("rtn+gptq", {}, "not a transform then a quantizer"),
    ("awq+smoothquant", {}, "not a transform then a quantizer"),
    ("gptx", {}, "unknown method 'gptx'"),
])
def test_bad_specs_and_options_are_refused(spec, options, message) -> None:
    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        build_method(spec, options)


def test_defaults_follow_the_method() -> None:
    assert build_method("rtn").quantizer.clip_search is False
    assert build_method("awq").quantizer.clip_search is True  # calibrated: the search weighs the output error
    assert build_method("rtn", {"clip_search": True}).quantizer.clip_search is True
    gptq = build_method("gptq", {"damp": 0.05, "act_order": False})
    assert (gptq.quantizer.damp, gptq.quantizer.act_order, gptq.quantizer.scale_refit) == (0.05, False, True)
    assert build_method("smoothquant", {"alpha": 0.8}).transform.alpha == 0.8


def test_methods_refuse_schemes_they_cannot_make() -> None:
    with pytest.raises(ValueError, match="needs scheme W8A8"):
        make_request("W4A16", "smoothquant").method.check(make_request("W4A16").scheme, True)
    with pytest.raises(ValueError, match="AWQ optimizes weight-only"):
        build_method("awq").check(make_request("W8A8").scheme, True)
    with pytest.raises(ValueError, match="hqq quantizes plain integer weights"):
        build_method("hqq").check(make_request("FP8").scheme, True)
    with pytest.raises(ValueError, match="needs calibration data"):
        build_method("gptq").check(make_request("W4A16").scheme, False)


class _TwoLayers(nn.Module):
    """A minimal decoder shape (model.model.layers) for the engine."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64)) for _ in range(2)])


@torch.no_grad()
def test_hqq_through_the_engine_equals_the_algorithm() -> None:
    from llmopt.quant.hqq import hqq_quantize_weight

    torch.manual_seed(0)
    model = _TwoLayers()
    original = {n: m.weight.clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    request = make_request("W4A16_ASYM", "hqq", group_size=32, ignore=())
    result = quantize_model(model, request, progress=False)
    assert len(result.weights) == 4
    for name, qw in result.weights.items():
        expected = hqq_quantize_weight(original[name], request.scheme, 32)
        assert torch.equal(qw.codes, expected.codes) and torch.equal(qw.scale, expected.scale)
        assert torch.equal(qw.zero_point, expected.zero_point)
        module = dict(model.named_modules())[name]
        torch.testing.assert_close(module.weight, expected.dequantize(module.weight.dtype), rtol=0, atol=0)


@pytest.mark.parametrize("dtype, expected", [(torch.float32, "BF16"), (torch.bfloat16, "BF16"), (torch.float16, "F16")],
                         ids=["float32", "bfloat16", "float16"])
def test_scales_are_written_in_the_sources_16_bit_dtype(tmp_path, dtype, expected) -> None:
    import json

    from click.testing import CliRunner
    from conftest import save_model, tiny_llama

    from llmopt.cli.main import main

    source = save_model(tiny_llama(seed=0).to(dtype), tmp_path / "source")
    out = tmp_path / "w4"
    result = CliRunner().invoke(main, ["quantize", str(source), "--scheme", "W4A16", "--group-size", "32", "--head", "int8",
                                       "-o", str(out)])
    assert result.exit_code == 0, result.output
    raw = (out / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    scales = {k: v["dtype"] for k, v in header.items() if k.endswith("weight_scale")}
    assert len(scales) == 2 * 7 + 1  # every Linear of both layers, and the tied embedding/head
    assert set(scales.values()) == {expected}
    assert json.loads((out / "llmopt.json").read_text())["scale_dtype"] == expected.replace("BF16", "bfloat16").replace("F16", "float16")
