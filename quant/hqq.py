"""Half-quadratic quantization (HQQ, Badri & Shaji 2023): calibration-free choice of the zero
point (and scale) of each (row, group) of a weight matrix.

HQQ minimises a robust ``l_p`` norm (``p < 1``) of the reconstruction error
``W - (q - z) * s`` with ``q = clamp(round(W / s + z), qmin, qmax)``, splitting it (half-quadratic
splitting) with an auxiliary error ``E`` and alternating, for all groups at once:

1. ``q`` from the current ``(s, z)``;
2. ``E = shrink_lp(W - (q - z) * s, beta)``, the proximal step of the ``l_p`` norm (generalised
   soft thresholding): large errors (clipped outliers) stay in ``E`` and leave the fit;
3. ``z = mean(q - (W - E) / s)`` in closed form (and, optionally, ``s`` the least-squares slope of
   ``W - E`` on ``q``);

``beta`` grows by ``kappa`` each iteration; the loop stops when the total ``l_p`` error stops
decreasing, and each group keeps its best ``(s, z)``.

llmopt stores integer zero points (compressed-tensors), while HQQ's optimum is fractional, so a
last step rounds ``z`` down and up, re-fits the scale by least squares for that integer zero and
re-rounds the codes (a few rounds, the zero point re-picked from the least-squares line each
round); the min-max RTN qparams are a candidate too, and each group keeps the candidate of least
squared error (so no group is worse than RTN min-max). The codes are finally those of
:meth:`QuantizedWeight.from_weight`, so ``dequantize`` reproduces the reconstruction exactly.

Everything is computed in units of each group's min-max quantization step (``W / s_minmax``), so
``beta`` does not depend on the magnitude of the weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from llmopt.formats.schemes import QuantizedWeight, QuantScheme, _grouped, compute_qparams, round_scales
from llmopt.linear_stats import LinearStats
from llmopt.quant.method import GroupSizes, Quantizer, Schemes

_REFIT_ROUNDS = 8  # least-squares scale refits after the zero point is made an integer
_TINY = 1e-12  # smallest scale, as in compute_qparams


def _shrink_lp(x: torch.Tensor, beta: float, p: float) -> torch.Tensor:
    """Proximal step of ``|x|^p / beta`` (generalised soft thresholding, as in HQQ)."""
    mag = x.abs()
    return torch.sign(x) * torch.relu(mag - mag.clamp_min(1e-8).pow(p - 1.0) / beta)


def _codes(x: torch.Tensor, s: torch.Tensor, z: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """Codes ``clamp(round(x / s) + z)`` (as :func:`quantize` computes them) in float32."""
    return torch.round(x / s.unsqueeze(-1)).add_(z.unsqueeze(-1)).clamp_(qmin, qmax)


def _error(x: torch.Tensor, s: torch.Tensor, z: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """Reconstruction error ``x - (q - z) * s`` with the codes of ``(s, z)``."""
    q = _codes(x, s, z, qmin, qmax)
    return x - (q - z.unsqueeze(-1)) * s.unsqueeze(-1)


def _line_fit(q: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Least-squares ``t ≈ s * q + b`` per group: ``(s, mean q, mean t)`` and whether ``s`` is
    usable (codes not all equal, positive slope)."""
    qm, tm = q.mean(-1, keepdim=True), t.mean(-1, keepdim=True)
    qc = q - qm
    var = qc.square().sum(-1)
    cov = (qc * (t - tm)).sum(-1)
    ok = (var > 0) & (cov > 0)
    return torch.where(ok, cov / var.clamp_min(1e-30), torch.ones_like(var)), qm.squeeze(-1), tm.squeeze(-1), ok


def hqq_quantize_weight(
    weight: torch.Tensor,
    scheme: QuantScheme,
    group_size: int | None,
    *,
    iters: int = 20,
    p: float = 0.7,
    beta: float = 10.0,
    kappa: float = 1.01,
    optimize_scale: bool = True,
) -> QuantizedWeight:
    """HQQ-quantize one weight matrix ``[out, in]`` (any float dtype, CPU or GPU; float32 inside).

    ``group_size`` as for RTN (None: one group per row; it must divide ``in``). ``iters``: HQQ
    iterations (0: only the integer-zero least-squares refit of the min-max qparams); ``p``: the
    ``l_p`` norm (``0 < p <= 1``); ``beta`` / ``kappa``: the splitting weight, in units of the
    min-max quantization step, and its growth per iteration; ``optimize_scale``: also update the
    scale during the iterations (asymmetric schemes; symmetric ones always optimise the scale,
    their only parameter). Returns codes, scale and zero point shaped and typed as RTN's.
    """
    if weight.dim() != 2:
        raise ValueError(f"HQQ quantizes 2-D weights [out, in], got shape {tuple(weight.shape)}")
    if scheme.is_float or scheme.grid is not None or scheme.scale_steps is not None or scheme.float_zero:
        raise ValueError(
            f"HQQ supports plain integer schemes (uniform codes, free scales, integer zero points); {scheme.name} has "
            + ("float8 codes" if scheme.is_float else "grid codes" if scheme.grid is not None
               else "float zero points" if scheme.float_zero else "super-block scale steps")
        )
    if not 0 < p <= 1:
        raise ValueError(f"HQQ's l_p norm needs 0 < p <= 1, got p={p}")
    if beta <= 0 or kappa < 1 or iters < 0:
        raise ValueError(f"HQQ needs beta > 0, kappa >= 1 and iters >= 0 (got {beta}, {kappa}, {iters})")

    qmin, qmax = scheme.qmin, scheme.qmax
    wg = _grouped(weight.detach().float(), group_size)  # [out, n_groups, group]
    asym = scheme.has_zero_point
    # min-max qparams (compute_qparams's), the unit of everything below
    if asym:
        wmin, wmax = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        step = ((wmax - wmin) / (qmax - qmin)).clamp(min=_TINY)
        z0 = qmin - wmin / step
    else:
        absmax = wg.abs().amax(-1)
        step = (absmax / (qmax + 0.5) if scheme.num_bits < 8 else absmax / qmax).clamp(min=_TINY)
        z0 = torch.zeros_like(step)
    x = wg / step.unsqueeze(-1)  # weights in units of the min-max step

    def lp_error(s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return _error(x, s, z, qmin, qmax).abs().pow(p).sum(-1)

    # --- HQQ iterations: fractional zero point (and scale), least l_p error per group
    s = torch.ones_like(step)
    z = z0.clone()
    best_s, best_z = s, z
    best_err = lp_error(s, z)
    total = float(best_err.sum())
    b = float(beta)
    for _ in range(iters):
        q = _codes(x, s, z, qmin, qmax)
        target = x - _shrink_lp(x - (q - z.unsqueeze(-1)) * s.unsqueeze(-1), b, p)  # W - E
        if asym:
            if optimize_scale:
                slope, _, _, ok = _line_fit(q, target)
                s = torch.where(ok, slope, s)
            z = (q - target / s.unsqueeze(-1)).mean(-1)
        else:
            num, den = (q * target).sum(-1), q.square().sum(-1)
            s = torch.where((num > 0) & (den > 0), num / den.clamp_min(1e-30), s)
        b *= kappa
        err = lp_error(s, z)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s, best_z = torch.where(better, s, best_s), torch.where(better, z, best_z)
        now = float(err.sum())
        if not now < total:
            break
        total = now

    # --- integer zero point: least-squares scale refits, least squared error per group, each
    # candidate judged with its scale as stored (rounded to the scheme's 16-bit dtype)
    def stored(s_units: torch.Tensor) -> torch.Tensor:
        return round_scales((s_units * step).clamp(min=_TINY), scheme) / step

    rtn_scale, rtn_zero = compute_qparams(weight.detach().float(), scheme, group_size)  # RTN min-max, as stored
    fin_s = rtn_scale.reshape(step.shape).float() / step
    fin_z = rtn_zero.reshape(step.shape).float() if asym else torch.zeros_like(step)
    fin_err = _error(x, fin_s, fin_z, qmin, qmax).square().sum(-1)
    starts = [best_z.floor(), best_z.ceil()] if asym else [best_z]
    for zi in starts:
        ci_s, ci_z = best_s, zi.clamp(qmin, qmax)
        for r in range(_REFIT_ROUNDS + 1):
            if r:
                q = _codes(x, ci_s, ci_z, qmin, qmax)
                if asym:  # re-pick the integer zero from the least-squares line of x on q
                    slope, qm, xm, ok = _line_fit(q, x)
                    ci_z = torch.where(ok, (qm - xm / slope).round().clamp(qmin, qmax), ci_z)
                c = q - ci_z.unsqueeze(-1)
                num, den = (c * x).sum(-1), c.square().sum(-1)
                ci_s = torch.where((num > 0) & (den > 0), num / den.clamp_min(1e-30), ci_s)
            ci_s = stored(ci_s)
            err = _error(x, ci_s, ci_z, qmin, qmax).square().sum(-1)
            better = err < fin_err
            fin_err = torch.where(better, err, fin_err)
            fin_s, fin_z = torch.where(better, ci_s, fin_s), torch.where(better, ci_z, fin_z)

    scale = (fin_s * step).clamp(min=_TINY).contiguous()
    zero_point = fin_z.to(torch.int32).contiguous() if asym else None
    return QuantizedWeight.from_weight(weight, scheme, group_size, scale, zero_point)


@dataclass(frozen=True)
class Hqq(Quantizer):
    """HQQ: calibration-free zero points and scales by half-quadratic optimisation of an ``l_p``
    error (``p`` < 1), ``iters`` iterations at most, integer zero points refitted at the end."""

    name: ClassVar[str] = "hqq"

    iters: int = 20
    p: float = 0.7

    def check(self, scheme: QuantScheme) -> None:
        if scheme.is_float or scheme.grid is not None or scheme.scale_steps is not None or scheme.float_zero:
            raise ValueError(f"hqq quantizes plain integer weights (W4A16, W4A16_ASYM, W8A16, W8A8, W4A8), not {scheme.name}")

    @torch.no_grad()
    def quantize(self, mods: Mapping[str, nn.Linear], schemes: Schemes, group_sizes: GroupSizes,
                 stats: LinearStats | None) -> dict[str, QuantizedWeight]:
        out: dict[str, QuantizedWeight] = {}
        for name, module in mods.items():
            self.check(schemes[name])
            qw = hqq_quantize_weight(module.weight.data, schemes[name], group_sizes[name], iters=self.iters, p=self.p)
            module.weight.data.copy_(qw.dequantize(module.weight.dtype))
            out[name] = qw
        return out
