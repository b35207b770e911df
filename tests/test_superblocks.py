"""Q4_K / Q5_K super-block scales and mins chosen together: never worse than rounding each list on
its own, far better on weights near a coarser grid, and still carried exactly by the GGUF blocks
and the scale refit when a super-block's largest multiple goes unused."""

from __future__ import annotations

import pytest
import torch
from conftest import correlated_inputs

from llmopt.formats.registry import FORMATS
from llmopt.formats.schemes import QuantizedWeight, search_qparams
from llmopt.formats.superblocks import (
    SUPERBLOCK,
    fit_affine_superblocks,
    min_factors,
    superblock_factors,
    superblock_mins,
    superblock_scales,
)
from llmopt.quant.gptq import gptq_quantize_weight
from llmopt.quant.scale_refit import refit_scales
from llmopt.quant.sensitivity import format_scheme

K_STEPS, MIN_STEPS = 126, 64  # Q4_K / Q5_K: 6-bit scales and mins


def _affine_error(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor, bits: int) -> torch.Tensor:
    """Reference: weighted squared error of each row of grouped ``x`` coded with these scales and mins."""
    u = torch.round((x + mins[..., None]) / scale[..., None]).clamp(0, 2**bits - 1)
    return (w * (scale[..., None] * u - mins[..., None] - x) ** 2).sum((-1, -2))


def _free_fit(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max scales and mins per group (a plain free fit to start from)."""
    lo = x.amin(-1).clamp(max=0)
    return (x.amax(-1) - lo).clamp(min=1e-8) / (2**bits - 1), -lo


def _q4_1_grid(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights as a model dequantized from Q4_1 holds them (16 levels per 32, float16 step and
    min), with their steps and offsets ``[rows, cols / 32]``."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols // 32, 32, generator=g) * torch.rand(rows, cols // 32, 1, generator=g).add(0.5)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    d, m = ((hi - lo) / 15).half().float(), lo.half().float()
    return (torch.round((w - m) / d).clamp(0, 15) * d + m).reshape(rows, cols), d[..., 0], m[..., 0]


def _q4_1_grid_weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    return _q4_1_grid(rows, cols, seed)[0]


@pytest.mark.parametrize("bits", [4, 5])
@pytest.mark.parametrize("kind", ["gaussian", "q4_1 grid"])
def test_joint_fit_never_worse_than_separate_rounding(bits: int, kind: str) -> None:
    rows, cols = 24, 2 * SUPERBLOCK
    g = torch.Generator().manual_seed(bits)
    if kind == "gaussian":
        w = torch.randn(rows, cols, generator=g)
        free_s, free_m = _free_fit(w.reshape(rows, -1, 32), bits)
    else:  # the free fit holds the grid exactly: its step (4 bits) or half of it (5 bits)
        w, step, offset = _q4_1_grid(rows, cols, bits)
        free_s, free_m = step / 2 ** (bits - 4), -offset
    x = w.reshape(rows, -1, 32)
    col_w = torch.rand(cols, generator=g).add(0.1).reshape(1, -1, 32).expand_as(x)
    scale, mins = fit_affine_superblocks(x, col_w, free_s, free_m, bits, K_STEPS, MIN_STEPS)
    assert scale.shape == mins.shape == free_s.shape
    plain_s = superblock_scales(free_s, 32, K_STEPS)
    plain_m = superblock_mins(free_m, 32, MIN_STEPS)
    per_block = SUPERBLOCK // 32
    blocks = (rows * cols // SUPERBLOCK, per_block, 32)  # each super-block's error on its own
    joint = _affine_error(x.reshape(blocks), col_w.reshape(blocks), scale.reshape(blocks[:2]), mins.reshape(blocks[:2]), bits)
    plain = _affine_error(x.reshape(blocks), col_w.reshape(blocks), plain_s.reshape(blocks[:2]), plain_m.reshape(blocks[:2]), bits)
    assert joint.shape == (rows * cols // SUPERBLOCK,)
    assert bool((joint <= plain * (1 + 1e-6)).all())
    if kind == "q4_1 grid":  # the joint choice finds multiples that nearly hold the coarser grid
        assert float(joint.sum()) < 0.6 * float(plain.sum())
    else:
        assert float(joint.sum()) < float(plain.sum())
    # the exporters' inverse finds float16 factors and 6-bit integers, unused top multiples included
    found_s = superblock_factors(scale, 32, K_STEPS)
    found_m = min_factors(mins, 32, MIN_STEPS)
    assert found_s is not None and found_m is not None
    d, k = found_s
    assert d.shape == (rows, cols // SUPERBLOCK) and k.shape == scale.shape
    assert torch.equal(k * d.repeat_interleave(per_block, 1), scale)
    assert bool((k < 0).all()) and int(k.min()) >= -63  # one sign for every multiple (Q4_K / Q5_K store them unsigned)
    dmin, m = found_m
    assert bool(((m >= 0) & (m < MIN_STEPS)).all())
    torch.testing.assert_close(m * dmin.repeat_interleave(per_block, 1), mins, rtol=1e-6, atol=0)


def test_factors_with_an_unused_top_multiple() -> None:
    """k · d where the largest k is 62, not 63: recovered exactly, and not when d is not float16."""
    d = torch.tensor([[0.0123]]).half().float()
    k = torch.tensor([[62.0, 3, 17, 40, 1, 62, 9, 30]])
    scale = (k * d).reshape(1, 8)
    got = superblock_factors(scale, 32, K_STEPS)
    assert got is not None
    assert torch.equal(got[1] * got[0].repeat_interleave(8, 1), scale)
    assert superblock_factors(scale * (1 + 1e-3), 32, K_STEPS) is None


@pytest.mark.parametrize("fmt,qtype", [("int5km_g32", "Q5_K"), ("int4km_g32", "Q4_K")])
def test_gptq_codes_stay_carried_by_gguf_blocks(fmt: str, qtype: str) -> None:
    """GPTQ with its scale refit on the jointly fitted scales: the GGUF block type still carries them."""
    torch.manual_seed(0)
    x = correlated_inputs(1500, 2 * SUPERBLOCK)
    hessian = (2.0 / x.shape[0]) * (x.T @ x).double()
    w = _q4_1_grid_weights(16, 2 * SUPERBLOCK, 3)
    scheme = format_scheme(fmt, w.shape[1])
    qw = gptq_quantize_weight(w, hessian, scheme, scheme.group_size, act_order=True, clip=True, refit=True)
    carrier = FORMATS[fmt.split("_")[0]].gguf[0]
    assert carrier.qtype.name == qtype
    assert carrier.carries(qw)
    refit = refit_scales(w, qw, hessian)
    assert carrier.carries(refit)
    scale, zero = search_qparams(w, scheme, scheme.group_size)  # round to nearest on the searched scales
    assert carrier.carries(QuantizedWeight.from_weight(w, scheme, scheme.group_size, scale, zero))
