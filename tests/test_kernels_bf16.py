"""Matmul precision ``medium``: the C++ panel with bfloat16 products (runtime/kernels/csrc/cpu_linear_bf16.h).

The kernel dequantizes exactly, rounds weights and activations to bfloat16 and sums their
products in float32. The reference rounds the dequantized weight and the input to bfloat16 and
multiplies in float64: products of two bfloat16 values are exact in float32, so only the order
of the sums differs (``1e-5 * |x| @ |W|.T``), plus a weight whose float32 dequantization (the
kernel's FMA against torch's multiply then add) rounds to the neighbouring bfloat16 value: one
bfloat16 step of that weight (``2^-8 * |x| @ |W|.T`` bounds all of them together, far below the
error of a wrong pairing or a skipped input). Rows up to 16 keep the exact integer GEMV.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from llmopt.cli.main import main
from llmopt.core.errors import LlmoptError
from llmopt.formats.schemes import compute_qparams, dequantize, get_scheme, quantize
from llmopt.runtime.kernels import build, cpu_linear
from test_kernels_linear import quantized_checkpoint, shared_kernel_cache  # noqa: F401  (the module's kernel cache)

pytestmark = [
    pytest.mark.skipif(not build.compiler_available(), reason="no C++ compiler: the kernels fall back to torch"),
    pytest.mark.usefixtures("one_thread"),
]
needs_bf16 = pytest.mark.skipif(not cpu_linear.bf16_supported(), reason="this CPU has no AVX512-BF16")


def bf16_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.to(torch.bfloat16).double() @ weight.to(torch.bfloat16).double().T).float()


@needs_bf16
@pytest.mark.parametrize("preset,group,k", [("W4A16", 32, 64), ("W4A16_ASYM", 64, 192), ("W4A16", None, 77),
                                            ("W8A16", None, 300), ("IQ4_NL", 32, 96), ("FP8", None, 40)])
def test_bf16_panel_matches_bfloat16_products(preset, group, k):
    torch.manual_seed(0)
    n = 37  # two whole tiles and a partial one
    scheme = get_scheme(preset, group or 0)
    w = torch.randn(n, k) * 0.1
    scale, zp = compute_qparams(w, scheme, group)
    codes = quantize(w, scale, zp, scheme, group)
    weight = dequantize(codes, scale, zp, group)
    packed = cpu_linear.pack(codes, scale, zp, group, None)
    assert packed is not None
    bias = torch.randn(n)
    for rows in (17, 33, 300):
        x = torch.randn(rows, k)
        out = torch.full((rows, n), float("nan"))
        got = cpu_linear.linear(x, packed, bias, out=out, bf16=True)
        assert got.shape == (rows, n) and not got.isnan().any()
        ref = bf16_reference(x, weight) + bias
        magnitude = x.abs() @ weight.abs().T
        excess = ((got - ref).abs() - (1e-5 + 2**-8) * magnitude - 1e-6).max().item()
        assert excess <= 0, f"{preset} M={rows}: beyond bfloat16 products by {excess:.3g}"
        exact = cpu_linear.linear(x, packed, bias)
        assert not torch.equal(got, exact), "bf16=True left the float32 panel in place"
        assert ((got - exact).abs() <= 2**-6 * magnitude + 1e-6).all()


@needs_bf16
def test_few_rows_stay_exact():
    """Up to 16 rows the integer GEMV runs whatever the precision: bit-identical outputs."""
    torch.manual_seed(1)
    scheme = get_scheme("W4A16", 32)
    w = torch.randn(40, 128) * 0.1
    scale, zp = compute_qparams(w, scheme, 32)
    packed = cpu_linear.pack(quantize(w, scale, zp, scheme, 32), scale, zp, 32, None)
    for rows in (1, 4, 16):
        x = torch.randn(rows, 128)
        assert torch.equal(cpu_linear.linear(x, packed, bf16=True), cpu_linear.linear(x, packed))


@needs_bf16
def test_engine_binds_medium_precision(tmp_path):
    from llmopt.runtime import LLM, SamplingParams

    path = quantized_checkpoint(tmp_path / "q", "W4A16", 32)
    x = torch.randn(48, 64)
    runs = {}
    for precision in ("highest", "medium"):
        llm = LLM(path, matmul_precision=precision)
        assert llm.engine.backend.matmul_precision == precision
        qkv = llm.engine.weights.layers[0].qkv
        runs[precision] = qkv.run(x[:, :qkv.packed.in_features])
        expected = cpu_linear.linear(x[:, :qkv.packed.in_features], qkv.packed, qkv.bias, bf16=precision == "medium")
        assert torch.equal(runs[precision], expected)
        out = llm.generate([[1, 40, 41, 42, 43]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        assert len(out[0].token_ids) == 5
    assert not torch.equal(runs["highest"], runs["medium"])


def test_medium_refused_where_it_cannot_run(tmp_path, monkeypatch):
    from llmopt.runtime import LLM

    path = quantized_checkpoint(tmp_path / "q", "W4A16", 32)
    with pytest.raises(LlmoptError, match="matmul_precision must be one of highest, medium"):
        LLM(path, matmul_precision="fast")
    with pytest.raises(LlmoptError, match="applies to the C\\+\\+ CPU kernels"):
        LLM(path, kernels="reference", matmul_precision="medium")
    monkeypatch.setattr(cpu_linear, "bf16_supported", lambda: False)
    with pytest.raises(LlmoptError, match="needs a CPU with AVX512-BF16"):
        LLM(path, matmul_precision="medium")


def test_cli_matmul_precision(tmp_path, monkeypatch):
    path = quantized_checkpoint(tmp_path / "q", "W4A16", 32)
    help_text = " ".join(CliRunner().invoke(main, ["serve", "--help"]).output.split())
    assert "--matmul-precision" in help_text and "bfloat16" in help_text
    result = CliRunner().invoke(main, ["generate", str(path), "hello", "--max-tokens", "4", "--ignore-eos",
                                       "--matmul-precision", "medium" if cpu_linear.bf16_supported() else "highest", "--json"])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["token_ids"]) == 4
    monkeypatch.setattr(cpu_linear, "bf16_supported", lambda: False)
    result = CliRunner().invoke(main, ["generate", str(path), "hello", "--matmul-precision", "medium"])
    assert result.exit_code != 0
    assert "AVX512-BF16" in result.output and "Traceback" not in result.output


@needs_bf16
@pytest.mark.parametrize("n,k", [(37, 64), (100, 577)])
def test_bf16_pairs_of_a_float_weight(n, k):
    """A float weight packed once as bfloat16 pairs (``pack_bf16``) runs the bfloat16 panel in place:
    bfloat16 products of the rounded weight and activations, float32 sums; odd widths and a
    partial tile pair included. Without bf16=True it is refused."""
    torch.manual_seed(n)
    weight = (torch.randn(n, k) * 0.05).half()
    packed = cpu_linear.pack_bf16(weight)
    assert packed.format == "bf16" and packed.data.shape == (-(-n // 32), -(-k // 2), 32)
    bias = torch.randn(n)
    for rows in (1, 17, 33, 300):
        x = torch.randn(rows, k)
        out = torch.full((rows, n), float("nan"))
        got = cpu_linear.linear(x, packed, bias, out=out, bf16=True)
        assert got.shape == (rows, n) and not got.isnan().any()
        magnitude = x.abs() @ weight.float().abs().T
        excess = ((got - bf16_reference(x, weight.float()) - bias).abs() - 1e-5 * magnitude - 1e-6).max().item()
        assert excess <= 0, f"M={rows}: beyond bfloat16 products by {excess:.3g}"
    with pytest.raises(RuntimeError, match="bfloat16 pairs run the bfloat16 panel only"):
        cpu_linear.linear(torch.randn(2, k), packed)


@needs_bf16
@pytest.mark.parametrize("precision", ["highest", "medium", "low"])
def test_float_head_keeps_bf16_pairs_for_many_rows(tmp_path, precision):
    """Under medium / low a float head keeps a bfloat16 pair copy for more than 16 rows (counted in
    its bytes); up to 16 rows, and always under highest, the exact float GEMV runs."""
    from llmopt.runtime import LLM
    from llmopt.runtime.backends.cpu import EXACT_HEAD_ROWS
    from llmopt.runtime.kernels import cpu_dense

    path = quantized_checkpoint(tmp_path / "q", "W4A16", 32)
    llm = LLM(path, matmul_precision=precision, lm_head="f16")
    head = llm.engine.weights.lm_head
    weight = head.weight
    assert weight.dtype == torch.float16
    few, many = torch.randn(EXACT_HEAD_ROWS, weight.shape[1]), torch.randn(EXACT_HEAD_ROWS + 1, weight.shape[1])
    assert torch.equal(head.run(few), cpu_dense.linear(few, weight, head.bias))
    if precision == "highest":
        assert head.extra is None
        assert torch.equal(head.run(many), cpu_dense.linear(many, weight, head.bias))
        return
    assert head.extra.format == "bf16" and head.nbytes() == weight.numel() * 2 + head.extra.nbytes()
    assert torch.equal(head.run(many), cpu_linear.linear(many, head.extra, head.bias, bf16=True))
    assert not torch.equal(head.run(many), cpu_dense.linear(many, weight, head.bias))
