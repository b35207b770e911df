"""HQQ (half-quadratic) calibration-free quantization: RTN's storage layout, exact dequantization,
lower error than min-max RTN on heavy-tailed weights, determinism and degenerate groups."""

from __future__ import annotations

import pytest
import torch

from llmopt.formats.schemes import (
    PRESETS,
    QuantizedWeight,
    _grouped,
    get_scheme,
    grid_scheme,
    int_weight_scheme,
    quantize,
)
from llmopt.quant.hqq import hqq_quantize_weight
from llmopt.quant.rtn import rtn_quantize_weight

pytestmark = pytest.mark.usefixtures("one_thread")

ASYM_SCHEMES = {
    "w4a_g32": get_scheme("W4A16_ASYM", 32),
    "w4a_g128": get_scheme("W4A16_ASYM", 128),
    "w4a_channel": get_scheme("W4A16_ASYM", 0),
    "w3a_g64": int_weight_scheme(3, 64, symmetric=False),
}
SYM_SCHEMES = {
    "w4_g128": get_scheme("W4A16", 128),
    "w8_channel": int_weight_scheme(8, None),
}


def student_t(rows: int, cols: int, seed: int = 0, df: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    normal = torch.randn(rows, cols, generator=gen)
    chi2 = 2 * torch._standard_gamma(torch.full((rows, cols), df / 2), generator=gen)
    return 0.02 * normal / (chi2 / df).sqrt()


def errors(w: torch.Tensor, qw: QuantizedWeight, p: float = 0.7) -> tuple[float, float]:
    d = w.float() - qw.dequantize()
    return float(d.square().mean()), float(d.abs().pow(p).mean())


@pytest.mark.parametrize("key", [*ASYM_SCHEMES, *SYM_SCHEMES])
def test_layout_matches_rtn(key: str) -> None:
    scheme = {**ASYM_SCHEMES, **SYM_SCHEMES}[key]
    w = student_t(48, 256, seed=1)
    ref = rtn_quantize_weight(w, scheme, scheme.group_size)
    qw = hqq_quantize_weight(w, scheme, scheme.group_size)
    assert qw.codes.shape == ref.codes.shape == w.shape
    assert qw.scale.shape == ref.scale.shape
    assert qw.codes.dtype == ref.codes.dtype == torch.int8
    assert qw.scale.dtype == ref.scale.dtype == torch.float32
    assert (qw.zero_point is None) == (ref.zero_point is None) == scheme.symmetric
    if ref.zero_point is not None:
        assert qw.zero_point.shape == ref.zero_point.shape
        assert qw.zero_point.dtype == ref.zero_point.dtype == torch.int32
        assert int(qw.zero_point.min()) >= scheme.qmin and int(qw.zero_point.max()) <= scheme.qmax
    assert qw.scheme == scheme and qw.group_size == ref.group_size
    assert int(qw.codes.min()) >= scheme.qmin and int(qw.codes.max()) <= scheme.qmax
    assert bool(torch.isfinite(qw.scale).all()) and bool((qw.scale > 0).all())


@pytest.mark.parametrize("key", ["w4a_g32", "w4a_channel", "w4_g128"])
def test_dequantize_reproduces_reconstruction(key: str) -> None:
    scheme = {**ASYM_SCHEMES, **SYM_SCHEMES}[key]
    w = student_t(32, 256, seed=2)
    qw = hqq_quantize_weight(w, scheme, scheme.group_size)
    # the codes are exactly RTN's codes of w under the returned qparams ...
    assert torch.equal(qw.codes, quantize(w, qw.scale, qw.zero_point, scheme, scheme.group_size))
    # ... and dequantize() is (q - zero_point) * scale per (row, group)
    q = _grouped(qw.codes.float(), scheme.group_size)
    if qw.zero_point is not None:
        q = q - qw.zero_point.float().unsqueeze(-1)
    manual = (q * qw.scale.unsqueeze(-1)).reshape(w.shape)
    deq = qw.dequantize()
    assert deq.shape == w.shape
    assert torch.equal(deq, manual)
    assert torch.equal(qw.dequantize(torch.bfloat16), manual.to(torch.bfloat16))


@pytest.mark.parametrize("key", ["w4a_g32", "w4a_g128", "w4a_channel", "w3a_g64", "w4_g128"])
def test_beats_minmax_rtn_on_heavy_tails(key: str) -> None:
    scheme = {**ASYM_SCHEMES, **SYM_SCHEMES}[key]
    w = student_t(256, 512, seed=3)
    rtn = rtn_quantize_weight(w, scheme, scheme.group_size)
    hqq = hqq_quantize_weight(w, scheme, scheme.group_size)
    (rtn_mse, rtn_lp), (mse, lp) = errors(w, rtn), errors(w, hqq)
    assert mse < 0.97 * rtn_mse
    assert lp < 0.985 * rtn_lp
    # never worse than min-max in any (row, group): min-max is one of the candidates
    per_group = lambda qw: _grouped((w - qw.dequantize()).square(), scheme.group_size).sum(-1)  # noqa: E731
    assert bool((per_group(hqq) <= per_group(rtn) * (1 + 1e-5) + 1e-12).all())
    # and about as good as RTN's MSE clipping search (which HQQ does not run)
    clip_mse, _ = errors(w, rtn_quantize_weight(w, scheme, scheme.group_size, clip="mse"))
    assert mse < 1.02 * clip_mse


def test_per_channel_gain_is_large() -> None:
    w = student_t(128, 1024, seed=4)
    scheme = ASYM_SCHEMES["w4a_channel"]
    rtn_mse, _ = errors(w, rtn_quantize_weight(w, scheme, None))
    mse, _ = errors(w, hqq_quantize_weight(w, scheme, None))
    assert mse < 0.85 * rtn_mse


def test_iterations_improve_on_the_integer_refit() -> None:
    w = student_t(128, 512, seed=5)
    scheme = ASYM_SCHEMES["w4a_g128"]
    refit_only = hqq_quantize_weight(w, scheme, 128, iters=0)
    full = hqq_quantize_weight(w, scheme, 128)
    (m0, l0), (m1, l1) = errors(w, refit_only), errors(w, full)
    assert l1 < l0 and m1 < m0 * 1.001


def test_deterministic_and_dtype_independent_layout() -> None:
    w = student_t(64, 256, seed=6)
    scheme = ASYM_SCHEMES["w4a_g32"]
    a, b = hqq_quantize_weight(w, scheme, 32), hqq_quantize_weight(w.clone(), scheme, 32)
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.scale, b.scale)
    assert torch.equal(a.zero_point, b.zero_point)
    half = hqq_quantize_weight(w.to(torch.bfloat16), scheme, 32)
    assert half.codes.shape == a.codes.shape and half.codes.dtype == torch.int8
    assert half.scale.dtype == torch.float32 and half.zero_point.dtype == torch.int32


@pytest.mark.parametrize("key", ["w4a_g32", "w4a_channel", "w4_g128"])
def test_zero_and_constant_groups(key: str) -> None:
    scheme = {**ASYM_SCHEMES, **SYM_SCHEMES}[key]
    w = student_t(8, 256, seed=7)
    w[0] = 0.0
    w[1] = 0.37
    w[2] = -0.021
    w[3, :32] = 0.0
    w[4, 32:64] = 5.0
    w[5, :32] = 0.0
    w[5, 7] = 1e-3  # a single non-zero weight
    qw = hqq_quantize_weight(w, scheme, scheme.group_size)
    deq = qw.dequantize()
    assert deq.shape == w.shape
    assert bool(torch.isfinite(deq).all()) and bool(torch.isfinite(qw.scale).all())
    assert bool((qw.scale > 0).all())
    assert torch.equal(deq[0], torch.zeros(256))
    rtn = rtn_quantize_weight(w, scheme, scheme.group_size).dequantize()
    for row in range(6):  # as exact as min-max RTN on these rows
        assert float((deq[row] - w[row]).square().sum()) <= float((rtn[row] - w[row]).square().sum()) * (1 + 1e-5) + 1e-12
    # constant groups: exact up to the 16-bit stored scale (bfloat16: 8 significant bits)
    stored = 2.0 ** -8
    torch.testing.assert_close(deq[1], w[1], rtol=stored, atol=0)
    torch.testing.assert_close(deq[2], w[2], rtol=stored, atol=0)
    if scheme.group_size == 32:
        assert torch.equal(deq[3, :32], torch.zeros(32))
        torch.testing.assert_close(deq[4, 32:64], w[4, 32:64], rtol=stored, atol=0)
        torch.testing.assert_close(deq[5, :32], w[5, :32], rtol=stored, atol=1e-9)


def test_rejects_unsupported_schemes_and_arguments() -> None:
    w = student_t(4, 64)
    for scheme in (PRESETS["FP8"], PRESETS["IQ4_NL"], grid_scheme((-2, -1, 0, 1), 32),
                   int_weight_scheme(4, 32, scale_steps=64)):
        with pytest.raises(ValueError, match="HQQ supports plain integer schemes"):
            hqq_quantize_weight(w, scheme, scheme.group_size)
    scheme = ASYM_SCHEMES["w4a_g32"]
    with pytest.raises(ValueError, match="does not divide"):
        hqq_quantize_weight(w, scheme, 48)
    with pytest.raises(ValueError, match="0 < p <= 1"):
        hqq_quantize_weight(w, scheme, 32, p=1.5)
    with pytest.raises(ValueError, match="kappa"):
        hqq_quantize_weight(w, scheme, 32, kappa=0.5)
    with pytest.raises(ValueError, match="2-D"):
        hqq_quantize_weight(w[0], scheme, 32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu() -> None:
    w = student_t(256, 512, seed=8)
    scheme = ASYM_SCHEMES["w4a_g128"]
    cpu = hqq_quantize_weight(w, scheme, 128)
    gpu = hqq_quantize_weight(w.cuda(), scheme, 128)
    assert gpu.codes.device.type == "cuda" and gpu.scale.device.type == "cuda"
    assert gpu.codes.shape == cpu.codes.shape and gpu.zero_point.dtype == torch.int32
    gpu_mse, _ = errors(w, QuantizedWeight(gpu.codes.cpu(), gpu.scale.cpu(), gpu.zero_point.cpu(), scheme, 128))
    cpu_mse, _ = errors(w, cpu)
    assert abs(gpu_mse - cpu_mse) <= 1e-3 * cpu_mse
