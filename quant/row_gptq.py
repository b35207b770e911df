"""GPTQ with one Hessian per output row.

Plain GPTQ weighs every row of a weight by the same input Hessian ``H = E[x xᵀ]``. For an output
head that is not what the KL divergence asks for: to second order a head error ``Δw_v`` of row
(token) ``v`` costs ``½ E_t[p_tv (Δw_v · h_t)²]`` nats, so each row has its own Hessian
``H_v = E_t[p_tv h_t h_tᵀ]`` — the contexts in which that token is likely
(:mod:`llmopt.quant.head_fisher`). Rows are independent in GPTQ, so a batch of rows with their
own Hessians runs one column loop: each row's error feedback goes through its own inverse
Hessian factor. Group scales are chosen as GPTQ chooses them (when a group is reached, or
fixed), then re-solved by least squares (:func:`~llmopt.quant.scale_refit.refit_scales` with a
Hessian per row), a second pass runs on those scales, and each row keeps its better result.
"""

from __future__ import annotations

import torch

from llmopt.core.errors import NumericalError
from llmopt.formats.schemes import QuantizedWeight, QuantScheme, search_qparams
from llmopt.quant.columns import column_loop_threads, quantize_column
from llmopt.quant.scale_refit import better_rows, refit_scales


def _row_factors(hessians: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factors ``U_r`` of ``(H_r + λ_r I)⁻¹`` (float32 ``[rows, n, n]``), λ_r =
    ``damp`` × row r's mean diagonal (raised tenfold, up to five times, where not positive definite)."""
    h = hessians.double().flip(1, 2)  # J H J
    diag = h.diagonal(dim1=1, dim2=2).clone()
    lam = damp * diag.mean(-1).clamp(min=1e-30)
    factor = torch.empty_like(h)
    todo = torch.arange(h.shape[0])
    for attempt in range(6):
        work = h[todo]
        work.diagonal(dim1=1, dim2=2).copy_(diag[todo] + (lam[todo] * 10**attempt).unsqueeze(-1))
        k, info = torch.linalg.cholesky_ex(work)
        ok = info == 0
        if bool(ok.any()):
            eye = torch.eye(h.shape[1], dtype=h.dtype).expand_as(k[ok])
            factor[todo[ok]] = torch.linalg.solve_triangular(k[ok], eye, upper=False)
        todo = todo[~ok]
        if todo.numel() == 0:
            return factor.flip(1, 2).float()
    raise NumericalError("a row's Hessian is not positive definite even with dampening raised 100,000-fold",
                         "use more calibration samples, or check the inputs for NaN / inf")


def _column_loop(w: torch.Tensor, u: torch.Tensor, scheme: QuantScheme, gs: int,
                 diag: torch.Tensor, fixed: tuple[torch.Tensor, torch.Tensor | None] | None) -> QuantizedWeight:
    """One GPTQ pass over the columns of ``w`` ``[rows, n]`` with per-row factors ``u``; group
    qparams chosen when a group is reached (clipping search weighted by each row's Hessian
    diagonal ``diag``) unless ``fixed``."""
    rows, n = w.shape
    w = w.clone()
    codes = torch.zeros_like(w)
    if fixed is not None:
        scale = fixed[0].float().clone()
        zp = None if fixed[1] is None else fixed[1].clone()
    else:
        scale = torch.zeros(rows, n // gs)
        zp = None if scheme.symmetric else torch.zeros(rows, n // gs, dtype=torch.int32)
    inv_d = 1.0 / u.diagonal(dim1=1, dim2=2)
    with column_loop_threads(w, rows * n):
        for col in range(n):
            g = col // gs
            if fixed is None and col % gs == 0:
                s, z = search_qparams(w[:, col : col + gs], scheme, gs, weight=diag[:, col : col + gs])
                scale[:, g] = s[:, 0]
                if zp is not None:
                    zp[:, g] = z[:, 0]
            code, deq = quantize_column(w[:, col], scale[:, g], None if zp is None else zp[:, g].float(), scheme)
            err = (w[:, col] - deq) * inv_d[:, col]
            w[:, col:] -= err.unsqueeze(1) * u[:, col, col:]
            codes[:, col] = code
    return QuantizedWeight(codes.to(torch.int8), scale, zp, scheme, gs)


def gptq_rows(weight: torch.Tensor, hessians: torch.Tensor, scheme: QuantScheme, group_size: int | None,
              damp: float = 0.01) -> QuantizedWeight:
    """GPTQ of ``weight`` ``[rows, n]``, row r against its own input Hessian ``hessians[r]``
    ``[n, n]``, with the least-squares scale refit and second pass of
    :func:`~llmopt.quant.gptq.gptq_quantize_weight` (``refit=True``). Integer and grid schemes
    with free group scales (no super-block scales, no float codes)."""
    if scheme.is_float or scheme.scale_steps is not None or scheme.float_zero:
        raise ValueError(f"per-row GPTQ takes integer or grid schemes with free group scales and integer zero points, not {scheme.name}")
    rows, n = weight.shape
    if hessians.shape != (rows, n, n):
        raise ValueError(f"per-row Hessians of shape {tuple(hessians.shape)} do not match the weight {tuple(weight.shape)}")
    gs = group_size or n
    if n % gs:
        raise ValueError(f"group size {gs} does not divide {n} input features")
    w = weight.detach().float()
    h = hessians.float()
    u = _row_factors(h, damp)
    diag = h.diagonal(dim1=1, dim2=2)
    first = refit_scales(w, _column_loop(w, u, scheme, gs, diag, None), h)
    second = refit_scales(w, _column_loop(w, u, scheme, gs, diag, (first.scale, first.zero_point)), h)
    return better_rows(w, h, first, second)
