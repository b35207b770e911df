"""Coordinate descent on GPTQ's codes: the same steps as a brute-force reference, never a worse
row, the stored layout (ranges, grids, zero points, super-block scales, pruned zeros) kept, and
a real gain over GPTQ with its scale refit."""

from __future__ import annotations

import pytest
import torch
from test_scale_refit import _problem

from llmopt.formats.schemes import SUPERBLOCK, superblock_factors
from llmopt.quant import code_descent
from llmopt.quant.code_descent import descend_codes
from llmopt.quant.gptq import gptq_quantize_weight
from llmopt.quant.scale_refit import refit_scales, row_errors
from llmopt.quant.sensitivity import format_scheme

pytestmark = pytest.mark.usefixtures("one_thread")


def _levels(scheme) -> torch.Tensor:
    """Every code value the scheme can store (a grid's levels, or the integer range)."""
    if scheme.grid is not None:
        return torch.as_tensor(scheme.grid, dtype=torch.float64)
    return torch.arange(scheme.qmin, scheme.qmax + 1, dtype=torch.float64)


def _brute_force_sweep(w: torch.Tensor, qw, hessian: torch.Tensor) -> torch.Tensor:
    """One cyclic sweep, row by row and weight by weight, each weight set to the code (of all the
    scheme can store) with the lowest full objective ``e H eᵀ``: float64, no shortcuts."""
    h = hessian.double()
    gs = qw.group_size or w.shape[1]
    levels = _levels(qw.scheme)
    codes = qw.codes.double().clone()
    for r in range(w.shape[0]):
        scale = qw.scale[r].double().repeat_interleave(gs)
        zp = None if qw.zero_point is None else qw.zero_point[r].double().repeat_interleave(gs)
        for j in range(w.shape[1]):
            trial = codes[r].repeat(len(levels), 1)
            trial[:, j] = levels
            deq = (trial if zp is None else trial - zp) * scale
            e = w[r].double() - deq
            codes[r, j] = levels[((e @ h) * e).sum(-1).argmin()]
    return codes


@pytest.mark.parametrize("fmt", ["int4_g32", "int4a_g32", "nl4_g32", "int5_g32"])
def test_sweep_matches_brute_force(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(code_descent, "DESCENT_BLOCK", 24)  # blocks that do not align with the groups
    w, hessian = _problem(n=96, rows=6, seed=3)
    scheme = format_scheme(fmt, w.shape[1])
    qw = gptq_quantize_weight(w, hessian, scheme, scheme.group_size, act_order=True, clip=True)
    swept = descend_codes(w, qw, hessian, sweeps=1)
    want = _brute_force_sweep(w, qw, hessian)
    assert swept.codes.shape == qw.codes.shape
    agree = (swept.codes.double() == want).float().mean().item()
    assert agree == 1.0, f"{agree:.4f} of the codes agree with the brute-force sweep"
    assert not torch.equal(swept.codes, qw.codes)  # GPTQ's codes are not a coordinate-wise optimum


@pytest.mark.parametrize("fmt", ["int4_g32", "int4a_g32", "int5a_g32", "nl4_g32", "nl4x_g32", "int6x_g16", "int3x_g16", "int8_g32", "int4_g128"])
def test_descent_keeps_layout_and_never_worsens_a_row(fmt: str) -> None:
    w, hessian = _problem(n=SUPERBLOCK, rows=16, seed=2)
    scheme = format_scheme(fmt, w.shape[1])
    qw = gptq_quantize_weight(w, hessian, scheme, scheme.group_size, act_order=True, clip=True)
    swept = descend_codes(w, qw, hessian, sweeps=2)
    assert swept.codes.shape == qw.codes.shape and swept.codes.dtype == qw.codes.dtype
    assert torch.equal(swept.scale, qw.scale)
    if qw.zero_point is not None:
        assert torch.equal(swept.zero_point, qw.zero_point)
    levels = _levels(scheme)
    assert bool(torch.isin(swept.codes.double(), levels).all())  # on the grid / in range
    before, after = row_errors(w, qw, hessian), row_errors(w, swept, hessian)
    assert bool((after <= before * (1 + 1e-6)).all())
    assert float(after.sum()) < 0.99 * float(before.sum())
    if scheme.scale_steps is not None:
        assert superblock_factors(swept.scale, scheme.group_size, scheme.scale_steps) is not None


def test_pruned_weights_and_dead_columns_stay() -> None:
    w, hessian = _problem(n=128, rows=8, seed=4)
    hessian[5, :] = 0
    hessian[:, 5] = 0  # a feature never seen in calibration
    w[:, 5] = 0
    torch.manual_seed(4)
    mask = torch.rand(w.shape) > 0.5
    scheme = format_scheme("int4a_g32", w.shape[1])
    qw = gptq_quantize_weight(w, hessian, scheme, scheme.group_size, act_order=False, clip=True, mask=mask)
    swept = descend_codes(w, qw, hessian, sweeps=2, mask=mask)
    deq = swept.dequantize(torch.float32)
    assert bool((deq[~mask] == 0).all())
    assert torch.equal(swept.codes[:, 5], qw.codes[:, 5])
    assert float(row_errors(w, swept, hessian).sum()) < float(row_errors(w, qw, hessian).sum())


def test_gptq_refit_gains_from_descent(monkeypatch: pytest.MonkeyPatch) -> None:
    """The refit pipeline with its descent rounds against the same pipeline without them, scored on
    the descent's damped objective ``H + DESCENT_DAMP · mean(diag H) · I``."""
    from llmopt.quant import gptq

    w, hessian = _problem(n=SUPERBLOCK, rows=32, seed=5)
    scheme = format_scheme("int4_g32", w.shape[1])
    monkeypatch.setattr(gptq, "DESCENT_ROUNDS", 0)
    no_descent = gptq_quantize_weight(w, hessian, scheme, scheme.group_size, act_order=True, clip=True, refit=True)
    monkeypatch.setattr(gptq, "DESCENT_ROUNDS", 4)
    full = gptq_quantize_weight(w, hessian, scheme, scheme.group_size, act_order=True, clip=True, refit=True)
    assert full.codes.shape == no_descent.codes.shape
    damped = hessian.clone()
    damped.diagonal().add_(gptq.DESCENT_DAMP * float(hessian.diagonal().mean()))
    before, after = row_errors(w, no_descent, damped), row_errors(w, full, damped)
    assert bool((after <= before * (1 + 1e-5)).all())
    assert float(after.sum()) < 0.97 * float(before.sum())
    # descent, then scales: the alternation's second half re-solves them
    again = refit_scales(w, descend_codes(w, full, damped), damped)
    assert float(row_errors(w, again, damped).sum()) <= float(after.sum()) * (1 + 1e-6)
