"""Least-squares group scales after GPTQ: the optimum for fixed codes, exact super-block layouts
(IQ4_XS, Q6_K), never a worse row, zero points and pruned weights kept, and the end result."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import correlated_inputs
from test_quant_algorithms import calib_ids, logits, tiny_model

from llmopt.formats.schemes import SUPERBLOCK, QuantizedWeight, superblock_factors
from llmopt.quant.apply import quantize_model
from llmopt.quant.gptq import gptq_quantize_weight
from llmopt.quant.request import make_request
from llmopt.quant.scale_refit import refit_scales, row_errors
from llmopt.quant.sensitivity import format_scheme

pytestmark = pytest.mark.usefixtures("one_thread")


def _problem(n: int = 256, rows: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    x = correlated_inputs(2000, n)
    x[:, :3] *= 6  # a few outlier features, as in real activations
    hessian = (2.0 / x.shape[0]) * (x.T @ x).double()
    return 0.05 * torch.randn(rows, n), hessian


@pytest.mark.parametrize("fmt", ["int5a_g32", "int4_g32", "nl4_g32", "int8_g32"])
def test_refit_solves_each_rows_least_squares(fmt: str) -> None:
    """The least-squares scales exactly (float32 scales); by default they are rounded as stored (16 bits)."""
    w, hessian = _problem()
    stored = format_scheme(fmt, w.shape[1])
    default = refit_scales(w, gptq_quantize_weight(w, hessian, stored, stored.group_size, act_order=True, clip=True), hessian)
    assert torch.equal(default.scale.bfloat16().float(), default.scale)
    scheme = format_scheme(fmt, w.shape[1], scale_dtype="float32")
    qw = gptq_quantize_weight(w, hessian, scheme, scheme.group_size, act_order=True, clip=True)
    fitted = refit_scales(w, qw, hessian)
    assert fitted.scale.shape == qw.scale.shape
    assert torch.equal(fitted.codes, qw.codes)
    if qw.zero_point is not None:
        assert torch.equal(fitted.zero_point, qw.zero_point)
    # reference: lstsq of L·w_row on L·(codes of each group), H = L Lᵀ
    chol = torch.linalg.cholesky(hessian)
    gs = scheme.group_size
    codes = qw.codes.double()
    if qw.zero_point is not None:
        codes = codes - qw.zero_point.double().repeat_interleave(gs, 1)
    for r in range(w.shape[0]):
        basis = torch.zeros(w.shape[1], w.shape[1] // gs, dtype=torch.float64)
        for g in range(basis.shape[1]):
            basis[g * gs : (g + 1) * gs, g] = codes[r, g * gs : (g + 1) * gs]
        want = torch.linalg.lstsq(chol.T @ basis, chol.T @ w[r].double()).solution
        torch.testing.assert_close(fitted.scale[r].double(), want, rtol=2e-3, atol=1e-7)
    before, after = row_errors(w, qw, hessian), row_errors(w, fitted, hessian)
    assert bool((after <= before * (1 + 1e-6)).all())
    assert float(after.sum()) < 0.98 * float(before.sum())


@pytest.mark.parametrize("fmt", ["nl4x_g32", "int6x_g16", "int3x_g16"])
def test_refit_keeps_super_block_scales_exact(fmt: str) -> None:
    w, hessian = _problem(n=2 * SUPERBLOCK)
    scheme = format_scheme(fmt, w.shape[1])
    qw = gptq_quantize_weight(w, hessian, scheme, scheme.group_size, act_order=True, clip=True)
    fitted = refit_scales(w, qw, hessian)
    old = superblock_factors(qw.scale, scheme.group_size, scheme.scale_steps)
    new = superblock_factors(fitted.scale, scheme.group_size, scheme.scale_steps)
    assert old is not None and new is not None  # float16 d, integer k in range: GGUF blocks stay exact
    assert torch.equal(new[1], old[1])  # the integers k are kept, only d moves
    assert not torch.equal(new[0], old[0])
    assert float(row_errors(w, fitted, hessian).sum()) < float(row_errors(w, qw, hessian).sum())


@pytest.mark.parametrize("fmt", ["int5a_g32", "int4_g32", "nl4x_g32", "int6x_g16", "int8", "int4_g128"])
@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_refit_never_worsens_a_row(fmt: str, act_order: bool) -> None:
    w, hessian = _problem(n=SUPERBLOCK, rows=16, seed=1)
    scheme = format_scheme(fmt, w.shape[1])
    plain = gptq_quantize_weight(w, hessian, scheme, scheme.group_size, act_order=act_order, clip=True)
    refit = gptq_quantize_weight(w, hessian, scheme, scheme.group_size, act_order=act_order, clip=True, refit=True)
    assert refit.codes.shape == plain.codes.shape and refit.scale.shape == plain.scale.shape
    before, after = row_errors(w, plain, hessian), row_errors(w, refit, hessian)
    assert bool((after <= before * (1 + 1e-6)).all())
    if fmt != "int8":  # int8's least-squares scales move by less than a bfloat16 step: nothing to gain
        assert float(after.sum()) < 0.99 * float(before.sum())


def test_gptq_refit_keeps_pruned_weights_zero() -> None:
    w, hessian = _problem(rows=8)
    w[torch.rand_like(w) < 0.5] = 0.0
    scheme = format_scheme("int5a_g32", w.shape[1])
    qw = gptq_quantize_weight(w, hessian, scheme, scheme.group_size, act_order=True, clip=True,
                              mask=w != 0, refit=True)
    assert bool((qw.dequantize()[w == 0] == 0).all())


def test_refit_leaves_rows_without_codes_alone() -> None:
    w, hessian = _problem(rows=4)
    scheme = format_scheme("int4_g32", w.shape[1])
    qw = gptq_quantize_weight(w, hessian, scheme, scheme.group_size, clip=True)
    codes = qw.codes.clone()
    codes[1] = 0  # a row whose codes are all zero: nothing to fit
    codes[2, :32] = 0  # one group without codes
    qz = QuantizedWeight(codes, qw.scale, qw.zero_point, scheme, scheme.group_size)
    fitted = refit_scales(w, qz, hessian)
    assert torch.equal(fitted.scale[1], qz.scale[1])
    assert fitted.scale[2, 0] == qz.scale[2, 0]
    assert bool(torch.isfinite(fitted.scale).all())


def test_scale_refit_lowers_a_tiny_models_kld() -> None:
    torch.manual_seed(0)
    model = tiny_model()
    ids = calib_ids(32, 32)
    reference = logits(model, ids)
    results = {}
    for refit in (False, True):
        m = copy.deepcopy(model)
        quantize_model(m, make_request("W4A16", "gptq", group_size=32, scale_refit=refit), ids, progress=False)
        results[refit] = torch.nn.functional.kl_div(
            torch.log_softmax(logits(m, ids), -1), torch.log_softmax(reference, -1),
            log_target=True, reduction="batchmean").item()
    assert results[True] < results[False]
