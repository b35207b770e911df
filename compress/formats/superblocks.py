"""Sub-block scales and mins tied to a super-block, as llama.cpp's K-quants and IQ4_XS store them.

Along a row, each super-block of ``SUPERBLOCK`` (256) weights holds one float16 ``d`` (and, for
Q4_K / Q5_K, one float16 ``dmin``); each of its sub-blocks has a scale ``k · d`` and a min
``m · dmin`` with small integers ``k`` and ``m``. This module rounds free scales and mins to that
form (:func:`superblock_scales`, :func:`superblock_mins`), fits scales and mins of affine codes
together (:func:`fit_affine_superblocks`), and recovers ``(d, k)`` / ``(dmin, m)`` from stored
values for the exporters (:func:`superblock_factors`, :func:`min_factors`).

Signs: ``k`` is signed, ``-steps/2 <= k < steps/2``, never 0; formats whose GGUF multiples are
unsigned (Q4_K, Q5_K) keep every ``k`` of a super-block of one sign and ``d`` of the other.
"""

from __future__ import annotations

import torch

SUPERBLOCK = 256  # input features sharing one float16 scale of the group scales (llama.cpp's QK_K)
# Offsets t of the candidate super-block factors ``largest / (top + t / 10)`` that
# fit_affine_superblocks tries for d and dmin together: a coarse grid, then a finer one around each
# super-block's best. ``top`` is the largest multiple (63 for 6-bit); t < 0 leaves it unused.
JOINT_COARSE = (-10, -7, -4, -1, 2)
JOINT_FINE = (-2, -1, 0, 1, 2)


def sub_blocks_per_super(group: int | None) -> int:
    """Sub-blocks of ``group`` weights in one super-block (0: ``group`` does not tile it)."""
    return SUPERBLOCK // group if group and SUPERBLOCK % group == 0 else 0


def _tiles(values: torch.Tensor, group: int | None) -> int:
    """Sub-blocks per super-block when ``values`` ``[rows, n_groups]`` tile whole super-blocks, else 0."""
    per = sub_blocks_per_super(group)
    return per if per and values.shape[1] % per == 0 else 0


def superblock_scales(scale: torch.Tensor, group: int, steps: int | None) -> torch.Tensor:
    """Group scales ``[out, n_groups]`` rounded to ``k * d`` per super-block (``d`` float16, signed
    integers ``-steps/2 <= k < steps/2``, never 0), as llama.cpp quantizes IQ4_XS sub-block scales:
    the scale of largest magnitude is ``-steps/2 * d``. Returned unchanged without ``steps`` or
    when super-blocks do not tile the row."""
    per = _tiles(scale, group)
    if steps is None or not per:
        return scale
    low = -(steps // 2)
    s = scale.float().reshape(scale.shape[0], -1, per)
    extreme = torch.gather(s, -1, s.abs().argmax(-1, keepdim=True))
    d = (extreme / low).to(torch.float16).float()
    d = torch.where(d == 0, torch.full_like(d, 2.0**-24), d)  # float16's smallest step: all-zero blocks
    k = torch.round(s / d).clamp_(low, steps // 2 - 1)
    # a zero scale would divide by zero; weights this small round to ~0 under the smallest multiple of the scale's own sign
    k = torch.where(k == 0, torch.where(s / d > 0, 1.0, -1.0), k)
    return (k * d).reshape(scale.shape)


def superblock_mins(mins: torch.Tensor, group: int, steps: int | None) -> torch.Tensor:
    """Group mins ``[out, n_groups]`` rounded to ``m · dmin`` per super-block (``dmin`` float16,
    ``0 <= m < steps``: Q4_K / Q5_K's 6-bit mins), or to float16 values (Q4_1 / Q5_1's ``m``) without
    ``steps`` or where super-blocks do not tile the row."""
    per = _tiles(mins, group)
    if steps is None or not per:
        return mins.to(torch.float16).float()
    m = mins.float().clamp(min=0).reshape(mins.shape[0], -1, per)
    dmin = (m.amax(-1, keepdim=True) / (steps - 1)).to(torch.float16).float()
    k = torch.where(dmin > 0, torch.round(m / dmin.clamp(min=1e-30)), torch.zeros_like(m)).clamp_(0, steps - 1)
    return (k * dmin).reshape(mins.shape)


def _affine_error(x: torch.Tensor, weight: torch.Tensor | None, scale: torch.Tensor, mins: torch.Tensor,
                  levels: int) -> torch.Tensor:
    """Weighted squared error per super-block of ``x`` ``[rows, n_super, per, group]`` coded as
    ``scale · u − min`` (``scale``, ``mins`` ``[rows, n_super, per]``, ``u`` in ``[0, levels]``)."""
    u = (x + mins[..., None]).div_(scale[..., None]).round_().clamp_(0, levels)  # one buffer, updated in place
    error = u.mul_(scale[..., None]).sub_(mins[..., None]).sub_(x).square_()
    return (error if weight is None else error.mul_(weight)).sum((-1, -2))


def fit_affine_superblocks(
    x: torch.Tensor, weight: torch.Tensor | None, scale: torch.Tensor, mins: torch.Tensor, num_bits: int,
    scale_steps: int, min_steps: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K sub-block scales ``k · d`` and mins ``m · dmin`` (``1 <= k <= scale_steps / 2``,
    ``0 <= m < min_steps``, ``d`` and ``dmin`` float16) for grouped weights ``x``
    ``[rows, n_groups, group]`` whose free fit is ``scale``, ``mins`` ``[rows, n_groups]``.

    llama.cpp rounds the free scales and mins to their 6-bit multiples one list at a time; here
    ``d`` and ``dmin`` are chosen *together*, by the (``weight``-ed) squared error of the codes each
    pair gives the whole super-block: ``largest / (top + t / 10)`` for ``t`` on
    :data:`JOINT_COARSE` for both, then on :data:`JOINT_FINE` around each super-block's best.
    The candidates include the plain rounding (``t = 0``), so the error never exceeds it; halves
    the error of weights that lie near a coarser grid (a model dequantized from Q4_1 / Q4_0, or
    trained for one), a few percent on Gaussian weights. A super-block's largest multiple may be
    left unused (``t < 0``): :func:`superblock_factors` finds such factors too.
    """
    rows, n_groups, group = x.shape
    per = sub_blocks_per_super(group)
    shape = (rows, n_groups // per, per)
    xs = x.float().reshape(*shape, group)
    ws = None if weight is None else weight.float().expand_as(x).reshape(*shape, group)
    free_scale = scale.float().clamp(min=1e-12).reshape(shape)
    free_mins = mins.float().clamp(min=0).reshape(shape)
    top_k, top_m = scale_steps // 2, min_steps - 1
    largest_scale, largest_min = free_scale.amax(-1), free_mins.amax(-1)
    levels = 2**num_bits - 1

    def candidate(t_scale: torch.Tensor | float, t_min: torch.Tensor | float):
        d = (largest_scale / (top_k + 0.1 * t_scale)).to(torch.float16).float().clamp(min=2.0**-24)
        dmin = (largest_min / (top_m + 0.1 * t_min)).to(torch.float16).float()
        s = d[..., None] * torch.round(free_scale / d[..., None]).clamp_(1, top_k)
        m = dmin[..., None] * torch.where(dmin[..., None] > 0, torch.round(free_mins / dmin.clamp(min=1e-30)[..., None]),
                                          torch.zeros_like(free_mins)).clamp_(0, top_m)
        return _affine_error(xs, ws, s, m, levels), s, m

    best_err, best_s, best_m = candidate(0.0, 0.0)
    best_ts = torch.zeros_like(best_err)
    best_tm = torch.zeros_like(best_err)

    def keep(err: torch.Tensor, s: torch.Tensor, m: torch.Tensor, ts, tm) -> None:
        nonlocal best_err, best_s, best_m, best_ts, best_tm
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better[..., None], s, best_s)
        best_m = torch.where(better[..., None], m, best_m)
        best_ts = torch.where(better, ts, best_ts)
        best_tm = torch.where(better, tm, best_tm)

    for ts in JOINT_COARSE:
        for tm in JOINT_COARSE:
            keep(*candidate(float(ts), float(tm)), float(ts), float(tm))
    centre_s, centre_m = best_ts.clone(), best_tm.clone()
    for ds in JOINT_FINE:
        for dm in JOINT_FINE:
            if ds or dm:
                keep(*candidate(centre_s + ds, centre_m + dm), centre_s + ds, centre_m + dm)
    return best_s.reshape(rows, n_groups), best_m.reshape(rows, n_groups)


def _factor_search(values: torch.Tensor, extreme: torch.Tensor, tops: list[int], low: int, high: int,
                   tolerance: torch.Tensor | float = 0.0) -> torch.Tensor | None:
    """``f`` ``[rows, n_super, 1]`` (float16 values) with every value ``[rows, n_super, per]``
    within ``tolerance`` of an integer multiple of it in ``[low, high]`` — ``extreme`` taken as
    ``t · f`` for the first ``t`` of ``tops`` that fits each super-block (0 where ``extreme`` is
    0) — or None where none does."""
    found = torch.zeros_like(extreme)
    todo = extreme != 0
    for top in tops:
        if not todo.any():
            break
        f = (extreme / top).to(torch.float16).float()
        k = torch.round(values / torch.where(f == 0, 1.0, f))
        fits = (todo & (f != 0) & ((k * f - values).abs() <= tolerance).all(-1, keepdim=True)
                & (k >= low).all(-1, keepdim=True) & (k <= high).all(-1, keepdim=True))
        found = torch.where(fits, f, found)
        todo &= ~fits
    return None if todo.any() else found


def superblock_factors(scale: torch.Tensor, group: int, steps: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(d [out, n_super] float32 holding float16 values, k [out, n_groups] integers)`` with
    ``scale == k * d`` exactly and ``k`` in the ``steps`` range, or None when ``scale`` is not of
    that form (the inverse of :func:`superblock_scales` and :func:`fit_affine_superblocks`, for
    exporters). The largest scale is tried as ``-steps/2 · d`` first, then as smaller multiples."""
    per = _tiles(scale, group)
    if not per:
        return None
    low, high = -(steps // 2), steps // 2 - 1
    s = scale.float().reshape(scale.shape[0], -1, per)
    extreme = torch.gather(s, -1, s.abs().argmax(-1, keepdim=True))
    if (extreme == 0).any():
        return None
    d = _factor_search(s, extreme, [*range(low, 0), *range(high, 0, -1)], low, high)
    if d is None:
        return None
    return d.squeeze(-1), torch.round(s / d).reshape(scale.shape)


def min_factors(mins: torch.Tensor, group: int, steps: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(dmin [out, n_super] float16 values, m [out, n_groups] integers)`` with ``mins ≈ m · dmin``
    to float32 rounding (mins come back from float zero points: ``(z + 2^(bits−1)) · s``), or None
    when they are not of that form (the inverse of :func:`superblock_mins` and
    :func:`fit_affine_superblocks`, for exporters). The largest min is tried as ``(steps − 1) ·
    dmin`` first, then as smaller multiples."""
    per = _tiles(mins, group)
    if not per:
        return None
    m = mins.float().reshape(mins.shape[0], -1, per)
    largest = m.amax(-1, keepdim=True)
    dmin = _factor_search(m, largest.clamp(min=0), list(range(steps - 1, 0, -1)), 0, steps - 1,
                          1e-5 * largest.clamp(min=1e-30))  # all-zero mins: dmin 0
    if dmin is None or (m < 0).any():
        return None
    k = torch.where(dmin > 0, torch.round(m / dmin.clamp(min=1e-30)), torch.zeros_like(m))
    return dmin.squeeze(-1), k.reshape(mins.shape)
