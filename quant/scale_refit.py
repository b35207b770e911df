"""Least-squares group scales for fixed codes.

GPTQ picks each group's scale before it rounds the group's columns, then chooses codes with
that scale held fixed. Once the codes are known, the scales that minimize the layer's output
error ``tr((W − Ŵ) H (W − Ŵ)ᵀ)`` (``H`` the input Hessian) solve a small linear system per
output row: with ``x_a`` the codes of group ``a`` (zero point removed) and ``Ŵ_row = Σ_a s_a x_a``,

    G s = b,   G[a, b] = x_aᵀ H_ab x_b,   b[a] = x_aᵀ (H w)_a.

``hessian`` may also hold one Hessian per row (``[rows, in, in]``, :mod:`.row_gptq`).
Scales tied to a super-block (``k · d``, IQ4_XS / Q6_K) keep their integers ``k`` and re-solve
``d`` (a float16 value), so the stored layout and the GGUF blocks stay exact; free scales are
rounded to their stored 16-bit dtype (:func:`~llmopt.formats.schemes.round_scales`). A row keeps its old
scales unless the new ones lower its error, so a refit never makes a row worse.
"""

from __future__ import annotations

import torch

from llmopt.formats.schemes import QuantizedWeight, round_scales, sub_blocks_per_super, superblock_factors

BLOCK_ELEMENTS = 1 << 22  # float64 entries of one block's normal matrices (rows × groups²)


def _times_h(x: torch.Tensor, h: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Rows ``r0:r1`` of a matrix, ``x`` ``[r1 - r0, n]``, each times the Hessian: the shared
    ``h`` ``[n, n]`` or row r's own ``h[r]`` (``[rows, n, n]``)."""
    if h.dim() == 2:
        return x @ h
    return torch.bmm(x.unsqueeze(1), h[r0:r1]).squeeze(1)


def row_errors(weight: torch.Tensor, qw: QuantizedWeight, hessian: torch.Tensor) -> torch.Tensor:
    """Each row's output error ``e H eᵀ`` (float64 ``[rows]``), ``e`` = weight − dequantized row."""
    out = torch.empty(weight.shape[0], dtype=torch.float64, device=weight.device)
    step = max(1, (1 << 24) // max(1, weight.shape[1]))
    h = hessian.float()
    for r in range(0, weight.shape[0], step):
        e = weight[r : r + step].float() - _rows(qw, r, r + step)
        out[r : r + step] = (_times_h(e, h, r, r + e.shape[0]) * e).sum(-1, dtype=torch.float64)
    return out


def _rows(qw: QuantizedWeight, r0: int, r1: int) -> torch.Tensor:
    zp = None if qw.zero_point is None else qw.zero_point[r0:r1]
    part = QuantizedWeight(qw.codes[r0:r1], qw.scale[r0:r1], zp, qw.scheme, qw.group_size)
    return part.dequantize(torch.float32)


def _centred_codes(qw: QuantizedWeight, r0: int, r1: int, gs: int) -> torch.Tensor:
    """Codes of rows ``r0:r1`` less their zero points, float32 ``[rows, in]``; with float zero points
    (mins held fixed) the unsigned codes ``q + 2^(bits-1)``."""
    x = qw.codes[r0:r1].float()
    if qw.scheme.float_zero and qw.zero_point is not None:
        return x + 2 ** (qw.scheme.num_bits - 1)
    if qw.zero_point is not None:
        x = x - qw.zero_point[r0:r1].float().repeat_interleave(gs, dim=1)
    return x


def _normal_equations(x: torch.Tensor, wh: torch.Tensor, h: torch.Tensor, gs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``G [rows, groups, groups]`` and ``b [rows, groups]`` (float64) for codes ``x`` and ``W H``
    rows; ``h`` is shared ``[n, n]`` or these rows' own ``[rows, n, n]``."""
    rows, n = x.shape
    ng = n // gs
    g = torch.empty(rows, ng, ng, dtype=torch.float64, device=x.device)
    for a in range(ng):
        cols = slice(a * gs, (a + 1) * gs)
        # x_aᵀ H_a·, for every group b at once
        pa = x[:, cols] @ h[cols, :] if h.dim() == 2 else torch.bmm(x[:, None, cols], h[:, cols, :]).squeeze(1)
        g[:, a, :] = (pa * x).reshape(rows, ng, gs).sum(-1, dtype=torch.float64)
    b = (x * wh).reshape(rows, ng, gs).sum(-1, dtype=torch.float64)
    return g, b


def _superblock_steps(qw: QuantizedWeight, gs: int) -> int:
    """Groups per super-block when the scales are tied as ``k · d`` (0: free scales)."""
    steps = qw.scheme.scale_steps
    n_groups = qw.scale.shape[1]
    per = sub_blocks_per_super(gs)
    return per if steps is not None and per and n_groups % per == 0 else 0


def refit_scales(weight: torch.Tensor, qw: QuantizedWeight, hessian: torch.Tensor) -> QuantizedWeight:
    """``qw`` with each row's scales re-solved by least squares against ``hessian`` for its fixed
    codes (rows whose error would not fall keep their scales). With float zero points the mins
    (``w = s · u − min``) are held fixed and the zero points follow the new scales."""
    n = weight.shape[1]
    gs = qw.group_size or n
    ng = n // gs
    per = _superblock_steps(qw, gs)
    h = hessian.float()
    scale = qw.scale.float().clone()
    mins = qw.mins() if qw.scheme.float_zero and qw.zero_point is not None else None
    step = max(1, min(BLOCK_ELEMENTS // (ng * ng), (1 << 24) // n))
    for r0 in range(0, weight.shape[0], step):
        r1 = min(r0 + step, weight.shape[0])
        x = _centred_codes(qw, r0, r1, gs)
        h_rows = h if h.dim() == 2 else h[r0:r1]
        target = weight[r0:r1].float()
        if mins is not None:  # s · u ≈ w + min
            target = target + mins[r0:r1].repeat_interleave(gs, dim=1)
        g, b = _normal_equations(x, _times_h(target, h, r0, r1), h_rows, gs)
        if per:  # s = k · d: solve for d per super-block, k fixed
            found = superblock_factors(scale[r0:r1], gs, qw.scheme.scale_steps)
            if found is None:  # not of that form: these rows keep their scales
                continue
            d_old, k = found[0].double(), found[1].double().reshape(r1 - r0, -1, per)
            kk = torch.block_diag(*[torch.ones(1, per, dtype=torch.float64)] * (ng // per))  # [n_super, groups]
            a = kk.unsqueeze(0) * k.reshape(r1 - r0, 1, ng)  # [rows, n_super, groups]: ∂s/∂d
            g, b = a @ g @ a.transpose(1, 2), (a @ b.unsqueeze(-1)).squeeze(-1)
            d = _solve(g, b, d_old).half().double()
            d = torch.where((d == 0) | ~torch.isfinite(d), d_old, d)
            new = (k * d.unsqueeze(-1)).reshape(r1 - r0, ng).float()
        else:
            new = round_scales(_solve(g, b, scale[r0:r1].double()).float(), qw.scheme)  # as they are stored
        scale[r0:r1] = new
    zero = qw.zero_point if mins is None else mins / scale - 2 ** (qw.scheme.num_bits - 1)
    fitted = QuantizedWeight(qw.codes, scale, zero, qw.scheme, qw.group_size)
    return better_rows(weight, hessian, qw, fitted)


def _solve(g: torch.Tensor, b: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Solve each row's ``g s = b``; unknowns with no codes (a zero diagonal) keep ``fallback``."""
    diag = torch.diagonal(g, dim1=1, dim2=2)
    dead = diag <= 0
    ridge = 1e-10 * diag.clamp(min=0).mean(-1, keepdim=True).clamp(min=1e-30)
    g = g.clone()
    torch.diagonal(g, dim1=1, dim2=2).add_(ridge).masked_fill_(dead, 1.0)
    off = (dead.unsqueeze(1) | dead.unsqueeze(2)) & ~torch.eye(g.shape[-1], dtype=torch.bool, device=g.device)
    g.masked_fill_(off, 0.0)
    b = torch.where(dead, fallback, b)
    s = torch.linalg.solve(g, b.unsqueeze(-1)).squeeze(-1)
    return torch.where(torch.isfinite(s), s, fallback)


def better_rows(weight: torch.Tensor, hessian: torch.Tensor, *candidates: QuantizedWeight) -> QuantizedWeight:
    """Row by row, the candidate (same scheme and layout) with the lowest output error."""
    best = candidates[0]
    best_err = row_errors(weight, best, hessian)
    for other in candidates[1:]:
        err = row_errors(weight, other, hessian)
        take = err < best_err
        if not bool(take.any()):
            continue
        t = take.unsqueeze(1)
        zp = None if best.zero_point is None else torch.where(t, other.zero_point, best.zero_point)
        codes = torch.where(t, other.codes.view(torch.int8) if other.codes.dtype != torch.int8 else other.codes,
                            best.codes.view(torch.int8) if best.codes.dtype != torch.int8 else best.codes)
        codes = codes.view(best.codes.dtype)
        best = QuantizedWeight(codes, torch.where(t, other.scale, best.scale), zp, best.scheme, best.group_size)
        best_err = torch.minimum(err, best_err)
    return best
