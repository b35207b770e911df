"""Output-aware clipping search: choose per-(row, group) range shrink factors that minimise the
layer-output error ``e H eᵀ`` (``H`` the input Hessian) instead of the plain weight error."""

from __future__ import annotations

import torch

from llmopt.formats.schemes import QuantScheme, _grouped, compute_qparams, fake_quantize


def _hessian_blocks(hessian: torch.Tensor, group_size: int) -> torch.Tensor:
    """Diagonal ``[group, group]`` blocks of ``hessian`` as ``[n_groups, group, group]``."""
    n = hessian.shape[0] // group_size
    h = hessian.float().reshape(n, group_size, n, group_size)
    idx = torch.arange(n, device=hessian.device)
    return h[idx, :, idx, :]


def search_clip_ratio(
    w: torch.Tensor,
    scheme: QuantScheme,
    group_size: int | None,
    hessian: torch.Tensor | None = None,
    grid: int = 20,
    max_shrink: float = 0.5,
) -> torch.Tensor:
    """Best clip ratio ``[out, n_groups]`` in ``[1 - max_shrink, 1]``.

    With grouped schemes each group's error is weighed by its diagonal block of ``hessian``
    (exact output error of that group alone); per-channel schemes use the Hessian diagonal.
    Without a Hessian the plain squared weight error is used.
    """
    wf = w.float()
    wg = _grouped(wf, group_size)
    blocks = diag = None
    if hessian is not None:
        if group_size is not None:
            blocks = _hessian_blocks(hessian, group_size)  # [G, g, g]
        else:
            diag = hessian.diagonal().float().unsqueeze(0).unsqueeze(0)  # [1, 1, in]
    best_err = torch.full(wg.shape[:2], float("inf"))
    best_ratio = torch.ones(wg.shape[:2])
    for i in range(grid + 1):
        ratio = 1.0 - max_shrink * i / grid
        scale, zp = compute_qparams(wf, scheme, group_size, clip_ratio=ratio, grid_tries=0)  # grids: the ratio's own scale
        e = _grouped(fake_quantize(wf, scale, zp, scheme, group_size), group_size) - wg
        if blocks is not None:
            err = (torch.bmm(e.transpose(0, 1), blocks) * e.transpose(0, 1)).sum(-1).T
        elif diag is not None:
            err = (e.pow(2) * diag).sum(-1)
        else:
            err = e.pow(2).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_ratio = torch.where(better, torch.full_like(best_ratio, ratio), best_ratio)
    return best_ratio


def search_qparams_hessian(
    w: torch.Tensor,
    scheme: QuantScheme,
    group_size: int | None,
    hessian: torch.Tensor | None,
    grid: int = 20,
    max_shrink: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales and zero points from :func:`search_clip_ratio`."""
    ratio = search_clip_ratio(w, scheme, group_size, hessian, grid, max_shrink)
    return compute_qparams(w, scheme, group_size, clip_ratio=ratio)


def clamp_to_ratio(
    w: torch.Tensor, scheme: QuantScheme, group_size: int | None, ratio: torch.Tensor
) -> torch.Tensor:
    """``w`` clamped per (row, group) to the range that min-max qparams with ``ratio`` cover,
    so that plain min-max quantization afterwards reproduces the clipped qparams."""
    wg = _grouped(w.float(), group_size)
    r = ratio.unsqueeze(-1)
    if scheme.symmetric or scheme.is_float:
        hi = wg.abs().amax(-1, keepdim=True) * r
        lo = -hi
    else:
        lo = (wg.amin(-1, keepdim=True) * r).clamp(max=0)
        hi = (wg.amax(-1, keepdim=True) * r).clamp(min=0)
    return torch.maximum(torch.minimum(wg, hi), lo).reshape(w.shape).to(w.dtype)

