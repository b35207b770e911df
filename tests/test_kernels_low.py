"""Matmul precision ``low``: the integer GEMV with activations rounded to int8 per block (one level).

The kernel rounds each row's blocks of up to 32 inputs to int8 codes (``max|x| / 127`` steps,
ties to even), multiplies them by the weight codes in integers and scales per block. The
reference rounds the activations the same way (``reference.round_activations_int8``) and
multiplies the dequantized weight in float32: only the order of the sums differs
(``1e-5 * |x| @ |W|.T``). A wrong block size, a lost level or a skipped input is off by far more.
"""

from __future__ import annotations

import pytest
import torch
from llmopt.core.errors import LlmoptError
from llmopt.formats.schemes import compute_qparams, dequantize, get_scheme, quantize
from llmopt.runtime.kernels import build, cpu_linear, reference
from test_kernels_linear import quantized_checkpoint, shared_kernel_cache  # noqa: F401  (the module's kernel cache)

pytestmark = [
    pytest.mark.skipif(not build.compiler_available(), reason="no C++ compiler: the kernels fall back to torch"),
    pytest.mark.usefixtures("one_thread"),
]
VECTOR_ISAS = [isa for isa in ("avx2", "avx512") if isa in cpu_linear.supported_isas()]


def weight_of(preset: str, group: int | None, n: int, k: int, seed: int):
    torch.manual_seed(seed)
    scheme = get_scheme(preset, group or 0)
    w = torch.randn(n, k) * 0.1
    scale, zp = compute_qparams(w, scheme, group)
    codes = quantize(w, scale, zp, scheme, group)
    return codes, scale, zp


def integer_gemv_runs(fmt: str, isa: str) -> bool:
    """Where the one-level integer GEMV applies (int8 and IQ4_NL bytes need VNNI)."""
    return fmt == "int4" or (fmt in ("int8", "nl4") and isa == "avx512")


def test_round_activations_int8():
    torch.manual_seed(0)
    x = torch.randn(5, 70) * torch.logspace(-3, 2, 70)
    x[2, 32:64] = 0.0  # a block of zeros stays zeros
    got = reference.round_activations_int8(x, 32)
    assert got.shape == x.shape and got.dtype == x.dtype
    blocks = torch.nn.functional.pad(x, (0, 26)).view(5, 3, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    err = (torch.nn.functional.pad(got - x, (0, 26)).view(5, 3, 32)).abs()
    assert (err <= step / 2 * (1 + 1e-6)).all()
    codes = torch.nn.functional.pad(got, (0, 26)).view(5, 3, 32) / step.clamp(min=1e-30)
    assert (codes - codes.round()).abs().max() < 1e-3 and codes.abs().max() <= 127 + 1e-3
    assert torch.equal(got[2, 32:64], torch.zeros(32))
    assert [reference.int8_activation_block(g, k, v) for g, k, v in [(32, 96, 8), (128, 256, 8), (None, 96, 8), (None, 77, 8),
                                                                      (None, 100, 4), (12, 60, 4)]] == [32, 32, 32, 16, 4, 4]


@pytest.mark.parametrize("preset,group,k", [("W4A16", 32, 96), ("W4A16_ASYM", 64, 192), ("W4A16", None, 77), ("W4A16", 128, 256),
                                            ("W4A16", 32, 1600), ("W8A16", None, 100), ("IQ4_NL", 32, 64), ("FP8", None, 40)])
def test_low_matches_rounded_activations(preset, group, k):
    n = 37  # two whole tiles and a partial one
    codes, scale, zp = weight_of(preset, group, n, k, seed=k)
    packed = cpu_linear.pack(codes, scale, zp, group, None)
    assert packed is not None
    weight = dequantize(codes, scale, zp, group)
    block = reference.int8_activation_block(group, k, 8 if packed.format in ("int4", "nl4") else 4)
    bias = torch.randn(n)
    for rows in (1, 3, 16, 17, 33, 300):
        x = torch.randn(rows, k) * 2
        exact = cpu_linear.linear(x, packed, bias)
        rounded = reference.round_activations_int8(x, block)
        ref = torch.nn.functional.linear(rounded.double(), weight.double(), bias.double()).float()
        magnitude = rounded.abs() @ weight.abs().T
        for isa in VECTOR_ISAS:
            out = torch.full((rows, n), float("nan"))
            got = cpu_linear.linear(x, packed, bias, isa=isa, out=out, levels=1)
            assert got.shape == (rows, n) and not got.isnan().any(), f"{isa} M={rows}: unwritten outputs"
            if integer_gemv_runs(packed.format, isa):
                excess = ((got - ref).abs() - 1e-5 * magnitude - 1e-6).max().item()
                assert excess <= 0, f"{preset} {isa} M={rows}: beyond int8-rounded activations by {excess:.3g}"
                assert not torch.equal(got, cpu_linear.linear(x, packed, bias, isa=isa)), "levels=1 left the exact path in place"
            else:  # no integer GEMV for this format here: the exact paths, unchanged
                assert torch.equal(got, cpu_linear.linear(x, packed, bias, isa=isa)), f"{preset} {isa} M={rows}"
        assert ((exact - ref).abs() <= 0.02 * magnitude + 1e-5).all()  # int8 activations stay close to exact


@pytest.mark.parametrize("preset,group", [("W4A16", 32), ("W8A16", None)])
def test_exact_integer_gemv_over_input_ranges(preset, group):
    """Past a few rows the integer GEMV takes long inputs in ranges (each range over every row
    block, the output written then added to): the exact path still matches the reference."""
    from test_kernels_linear import tolerance

    k, n = 1600, 37
    codes, scale, zp = weight_of(preset, group, n, k, seed=3)
    packed = cpu_linear.pack(codes, scale, zp, group, None)
    weight, bias = dequantize(codes, scale, zp, group), torch.randn(n)
    for rows in (5, 16, 40):
        x = torch.randn(rows, k)
        ref = reference.quant_linear(x, codes, scale, zp, group, None, bias)
        for isa in VECTOR_ISAS:
            if not integer_gemv_runs(packed.format, isa):
                continue
            got = cpu_linear.linear(x, packed, bias, isa=isa, path="gemv")
            excess = ((got - ref).abs() - tolerance(x, weight, None)).max().item()
            assert excess <= 0, f"{preset} {isa} M={rows}: error beyond tolerance by {excess:.3g}"


def test_levels_refused():
    codes, scale, zp = weight_of("W4A16", 32, 16, 64, seed=0)
    packed = cpu_linear.pack(codes, scale, zp, 32, None)
    with pytest.raises(LlmoptError, match="levels must be 1 or 3"):
        cpu_linear.linear(torch.randn(2, 64), packed, levels=2)


@pytest.mark.skipif(not VECTOR_ISAS, reason="no AVX2: matmul precision low is refused here")
def test_engine_binds_low_precision(tmp_path):
    from llmopt.runtime import LLM, SamplingParams

    path = quantized_checkpoint(tmp_path / "q", "W4A16", 32)
    llm = LLM(path, matmul_precision="low")
    assert llm.engine.backend.matmul_precision == "low"
    qkv = llm.engine.weights.layers[0].qkv
    x = torch.randn(5, qkv.packed.in_features)
    expected = cpu_linear.linear(x, qkv.packed, qkv.bias, bf16=cpu_linear.bf16_supported(), levels=1)
    assert torch.equal(qkv.run(x), expected)
    assert not torch.equal(expected, cpu_linear.linear(x, qkv.packed, qkv.bias))
    out = llm.generate([[1, 40, 41, 42, 43]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 5


def test_low_refused_without_vector_kernels(tmp_path, monkeypatch):
    from llmopt.runtime import LLM

    path = quantized_checkpoint(tmp_path / "q", "W4A16", 32)
    with pytest.raises(LlmoptError, match="applies to the C\\+\\+ CPU kernels"):
        LLM(path, kernels="reference", matmul_precision="low")
    monkeypatch.setattr(cpu_linear, "running_isa", lambda: "scalar")
    with pytest.raises(LlmoptError, match="matmul_precision=low needs the AVX2 or AVX-512 kernels"):
        LLM(path, matmul_precision="low")
