"""GPTQ (Frantar et al., 2022): column-by-column quantization with error feedback through the
inverse Hessian of the layer inputs, with lazy block updates, optional activation ordering
(static groups only, so the stored layout stays plain groups in natural column order) and
sparsity-mask preservation."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from llmopt.checkpoints.estimate import IN_PLACE_FACTOR_MIN
from llmopt.core.errors import NumericalError
from llmopt.formats import fp4
from llmopt.formats.schemes import QuantizedWeight, QuantScheme, compute_qparams, search_qparams
from llmopt.quant.code_descent import descend_codes
from llmopt.quant.columns import column_loop_threads, quantize_column
from llmopt.linear_stats import LinearStats
from llmopt.quant.method import PRICED_BY_GPTQ, PRICED_BY_RTN, GroupSizes, Quantizer, Schemes
from llmopt.quant.scale_refit import better_rows, refit_scales

SPARSE_ZERO_FRACTION = 0.1  # preserve_zeros=None: keep zeros of layers at least this sparse


def _inverse_hessian_factor(h: torch.Tensor, damp: float, *, consume: bool = False,
                            dtype: torch.dtype | None = None) -> torch.Tensor:
    """Upper Cholesky factor ``U`` of ``(H + λI)⁻¹`` (``UᵀU = (H + λI)⁻¹``), λ = ``damp`` × mean
    diagonal, raised if ``H`` is not positive definite enough.

    With ``J`` the order reversal and ``JHJ = KKᵀ`` (Cholesky), ``H = VVᵀ`` for the upper
    triangular ``V = JKJ``, so ``U = V⁻¹ = JK⁻¹J``: one factorisation and one triangular inverse.
    ``consume``: ``h`` (float64) is used as workspace — the shifted matrix, then the identity and
    ``K⁻¹`` are written into it — so at most two float64 ``[n, n]`` matrices exist at once
    (``h`` and ``K``) instead of four; ``h`` holds garbage afterwards. ``dtype``: the factor's
    dtype (converted before the final reversal, which then copies the smaller matrix). Same
    result to the bit.
    """
    mean_diag = h.diagonal().mean().item()
    if consume and h.dtype == torch.float64 and h.is_contiguous() and h.device.type == "cpu" and h.shape[0] >= IN_PLACE_FACTOR_MIN:
        factor = _factor_in_place(h, damp, mean_diag, dtype or torch.float64)
        if factor is not None:
            return factor
    if consume and h.dtype == torch.float64 and h.is_contiguous():
        work = h
        work.copy_(h.flip(0, 1))  # JHJ in place (one [n, n] temporary while copied)
    else:
        work = h.flip(0, 1)  # a copy
    diag = work.diagonal().clone()
    for attempt in range(6):
        lam = damp * (10**attempt) * mean_diag
        work.diagonal().copy_(diag)
        work.diagonal().add_(lam)
        k, info = torch.linalg.cholesky_ex(work)
        if info.item() == 0:
            # K⁻¹ solved into the workspace, set to the identity and viewed column-major, as a fresh
            # output would be: the same triangular solve, bit for bit, without a third matrix
            eye = work.T
            eye.zero_()
            eye.diagonal().fill_(1.0)
            torch.linalg.solve_triangular(k, eye, upper=False, out=eye)
            del k
            return (eye if dtype is None else eye.to(dtype)).flip(0, 1)
        del k
    raise NumericalError("the calibration Hessian is not positive definite even with dampening raised 100,000-fold",
                         "raise --damp (e.g. 0.1), use more calibration samples, or check the inputs for NaN / inf")


def _factor_in_place(work: torch.Tensor, damp: float, mean_diag: float, dtype: torch.dtype) -> torch.Tensor | None:
    """:func:`_inverse_hessian_factor` for a large consumed float64 Hessian, with one [n, n]
    float64 matrix instead of two: LAPACK factors it (``potrf``) and inverts the factor
    (``trtri``) in place, and the reversed factor is copied out in blocks of rows. Peak: the
    Hessian plus the returned factor (12 n² bytes for float32 instead of 16 n²). Not the same
    to the bit as the torch path (another LAPACK), so only from ``IN_PLACE_FACTOR_MIN`` on;
    None when scipy's LAPACK is missing or would copy."""
    try:
        from scipy.linalg.lapack import dpotrf, dtrtri
    except ImportError:
        return None
    n = work.shape[0]
    work.copy_(work.flip(0, 1)) if n < 2 else _reverse_in_place(work)  # JHJ
    a = work.numpy().T  # Fortran order: LAPACK writes the lower triangle of `a`, the upper of `work`
    diag = work.diagonal().clone()
    for attempt in range(6):
        if attempt:  # potrf overwrote the upper triangle: rebuild it from the untouched lower one
            _mirror_lower(work)
        work.diagonal().copy_(diag).add_(damp * (10**attempt) * mean_diag)
        c, info = dpotrf(a, lower=1, clean=0, overwrite_a=1)
        if not np.shares_memory(c, a):
            return None
        if info == 0:
            break
    else:
        raise NumericalError("the calibration Hessian is not positive definite even with dampening raised 100,000-fold",
                             "raise --damp (e.g. 0.1), use more calibration samples, or check the inputs for NaN / inf")
    c, info = dtrtri(a, lower=1, overwrite_c=1)
    if info != 0 or not np.shares_memory(c, a):
        raise NumericalError("the Cholesky factor of the calibration Hessian could not be inverted", "raise --damp (e.g. 0.1)")
    work.triu_()  # K⁻¹ is the lower triangle of `a` = work.T; clear the rest
    k_inv = work.T
    out = torch.empty(n, n, dtype=dtype)
    rows = max(1, (1 << 22) // n)
    for r0 in range(0, n, rows):  # out = J K⁻¹ J, a block of rows at a time
        r1 = min(n, r0 + rows)
        out[r0:r1] = k_inv[n - r1 : n - r0].flip(0, 1)
    return out


def _reverse_in_place(m: torch.Tensor) -> None:
    """``m ← J m J`` (rows and columns reversed) with a temporary of two rows at a time."""
    n = m.shape[0]
    for i in range(n // 2):
        top, bottom = m[i].flip(0).clone(), m[n - 1 - i].flip(0).clone()
        m[i], m[n - 1 - i] = bottom, top
    if n % 2:
        m[n // 2] = m[n // 2].flip(0).clone()


def _mirror_lower(m: torch.Tensor) -> None:
    """Copy the strict lower triangle of ``m`` onto its upper one, a block of rows at a time."""
    n = m.shape[0]
    rows = max(1, (1 << 22) // n)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        block = m[r0:r1]
        cols = torch.arange(n).unsqueeze(0) > torch.arange(r0, r1).unsqueeze(1)  # strictly above the diagonal
        block[cols] = m[:, r0:r1].T[cols]


def permute_symmetric_(h: torch.Tensor, perm: torch.Tensor) -> None:
    """``h ← h[perm][:, perm]`` in place, with temporaries of a block of rows (the columns) and
    one row (the rows, moved along the permutation's cycles) instead of a copy of ``h``."""
    n = h.shape[0]
    rows = max(1, (1 << 22) // max(1, n))
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        h[r0:r1] = h[r0:r1].index_select(1, perm)
    order = perm.tolist()
    done = [False] * n
    for start in range(n):
        if done[start] or order[start] == start:
            done[start] = True
            continue
        first = h[start].clone()
        j = start
        while True:  # row j takes row order[j]
            done[j] = True
            k = order[j]
            if k == start:
                h[j] = first
                break
            h[j] = h[k]
            j = k


def float_target_weight(weight: torch.Tensor, hessian: torch.Tensor, drift: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """Weights whose outputs on the quantized model's inputs best match the float model's outputs
    (asymmetric calibration, GPTAQ): with ``H = 2/n Σ x̃ x̃ᵀ`` over the quantized model's inputs
    and ``D = 2/n Σ (x − x̃) x̃ᵀ`` against the float model's inputs ``x`` of the same tokens, the
    least squares ``min Σ ‖W x − W' x̃‖²`` gives ``W' = W (H + D) H⁻¹ = W + W D H⁻¹`` (``H``
    damped by ``damp`` × its mean diagonal, as GPTQ does). The error of any ``Q`` against the
    float outputs is its error against ``W' x̃`` plus a constant, so GPTQ of ``W'`` with ``H``
    then minimizes the float-target error. ``drift`` is not modified; float32 result.
    """
    factor = _inverse_hessian_factor(hessian, damp)  # UᵀU = (H + λI)⁻¹
    rhs = drift.T @ weight.T.double()  # Dᵀ Wᵀ  [in, out]
    delta = factor.T @ (factor @ rhs)  # (H + λI)⁻¹ Dᵀ Wᵀ
    del factor, rhs
    return (weight.double() + delta.T).float()


# Rounds of code descent + least-squares scales after the refit (each: about GPTQ's work). Off: on
# the undamped calibration objective, 4 rounds cut each Linear's calibration error by a further
# ~7% but not its error on WikiText-2 inputs, and the demo's Q4_K_M-size plan measured 0.0212
# against 0.0205 without (bench/results/mixed_precision_descent, in git history at acf41d6). On a ridge-damped objective
# (DESCENT_DAMP) its gain per Linear carried over to WikiText-2 inputs (0.877 of plain GPTQ's
# error against the refit's 0.933, layers 2/14/26 of the demo model).
DESCENT_ROUNDS = 0
DESCENT_DAMP = 0.1  # the descent's objective: H + DESCENT_DAMP · mean(diag H) · I
QPARAM_BLOCK = 1 << 24  # weight entries per qparams call: the range search holds a few float32 copies of it


def _qparams(
    w: torch.Tensor,
    scheme: QuantScheme,
    group_size: int | None,
    clip: bool,
    col_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-(row, group) qparams of ``w``, computed over blocks of rows (each row is independent,
    so the result is the same; the search's temporaries follow the block, not the matrix)."""
    rows = max(1, QPARAM_BLOCK // max(1, w.shape[1]))
    parts = []
    for r in range(0, w.shape[0], rows):
        part = w[r : r + rows]
        parts.append(search_qparams(part, scheme, group_size, weight=col_weight.float()) if clip
                     else compute_qparams(part, scheme, group_size))
    if len(parts) == 1:
        return parts[0]
    zps = [z for _, z in parts]
    return torch.cat([s for s, _ in parts]), None if zps[0] is None else torch.cat(zps)


def gptq_quantize_weight(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    scheme: QuantScheme,
    group_size: int | None,
    *,
    block_size: int = 128,
    damp: float = 0.01,
    act_order: bool = False,
    static_groups: bool | None = None,
    clip: bool = False,
    mask: torch.Tensor | None = None,
    hessian_owned: bool = False,
    weight_owned: bool = False,
    qparams: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    refit: bool = False,
) -> QuantizedWeight:
    """GPTQ-quantize ``weight`` ``[out, in]`` given the input Hessian ``2/n Σ x xᵀ`` ``[in, in]``.

    Per-group qparams are computed when a group is reached (from the error-updated weights),
    or up front from the original weights with ``static_groups`` (forced with ``act_order``).
    ``clip`` adds a clipping search weighted by the Hessian diagonal. ``mask`` (bool, True =
    kept) forces masked entries to exact zeros, their error compensated by later columns.
    ``hessian_owned``: the caller keeps no reference to a float64 ``hessian``, which is then
    used (and overwritten) in place instead of copied — one [in, in] matrix less at the peak;
    ``weight_owned`` likewise for a float32 ``weight`` (e.g. q/k/v concatenated by the caller).
    Memory: at most two float64 ``[in, in]`` matrices at once (the Hessian, permuted and factored
    in place, and its Cholesky factor; see :func:`_inverse_hessian_factor`) and two float32
    ``[out, in]`` working copies of the weights (qparams are float32 computations either way).
    The Hessian is inverted in float64, the column loop runs in float32; deterministic.
    ``qparams``: static ``(scale, zero_point)`` to use instead of computing them. ``refit``:
    after the column loop, re-solve the group scales by least squares for the chosen codes, run
    GPTQ again with those scales and re-solve once more, keeping each row's best
    (:mod:`llmopt.quant.scale_refit`; one more float32 copy of the Hessian and of the weights),
    then ``DESCENT_ROUNDS`` rounds of exact coordinate descent on the codes
    (:mod:`llmopt.quant.code_descent`) alternated with least-squares scales (none by default); no
    row's error rises at any step. An NVFP4 scheme without a global scale takes ``weight``'s own
    (for q/k/v stacked by the caller: one for all three, as vLLM's fused layer needs).
    """
    if scheme.needs_global_scale and scheme.global_scale is None:
        scheme = scheme.with_global_scale(fp4.global_scale(weight))
    if refit:
        return _gptq_refit(weight, hessian, scheme, group_size, block_size=block_size, damp=damp,
                           act_order=act_order, static_groups=static_groups, clip=clip, mask=mask,
                           hessian_owned=hessian_owned, weight_owned=weight_owned)
    if qparams is not None:
        static_groups = True
    if static_groups is None:
        static_groups = act_order
    if act_order and not static_groups:
        raise ValueError("GPTQ act-order needs static groups (static_groups=True)")
    out_f, n = weight.shape
    if hessian.shape != (n, n):
        raise ValueError(f"Hessian shape {tuple(hessian.shape)} does not match weight {tuple(weight.shape)}")
    own_w = weight_owned and weight.dtype == torch.float32
    w = weight.detach() if own_w else weight.detach().to(torch.float32, copy=True)
    del weight
    owned = hessian_owned and hessian.dtype == torch.float64 and hessian.is_contiguous()
    h = hessian.detach() if owned else hessian.detach().to(torch.float64, copy=True)
    del hessian
    keep = None if mask is None else mask.to(torch.bool)

    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    if keep is not None:
        w[~keep] = 0.0

    diag = h.diagonal().clone()  # column importance for the clipping search
    gs = group_size if group_size is not None else n
    n_groups = n // gs
    if n % gs:
        raise ValueError(f"group size {gs} does not divide {n} input features")
    # super-block scales (IQ4_XS) tie the groups of a super-block: they are chosen together, up front
    dynamic = group_size is not None and not static_groups and scheme.scale_steps is None
    if dynamic:
        scale = torch.zeros(out_f, n_groups, device=w.device)
        zero_dtype = torch.float32 if scheme.float_zero else torch.int32
        zp = None if scheme.symmetric or scheme.is_float else torch.zeros(out_f, n_groups, dtype=zero_dtype, device=w.device)
    elif qparams is not None:
        scale, zp = qparams[0].float().clone(), None if qparams[1] is None else qparams[1].clone()
    else:
        scale, zp = _qparams(w, scheme, group_size, clip, diag)

    perm = torch.argsort(h.diagonal(), descending=True, stable=True) if act_order else None
    # Work transposed ([in, out]) so that a column of W is a contiguous row.
    wt = w.T.contiguous()
    device = w.device
    del w
    if perm is not None:
        wt = wt[perm]
        permute_symmetric_(h, perm)  # h[perm][:, perm], in place
        keep = None if keep is None else keep[:, perm]
    col_group = (perm if perm is not None else torch.arange(n, device=device)) // gs

    u = _inverse_hessian_factor(h, damp, consume=True, dtype=torch.float32)
    del h
    if dynamic:
        block_size = gs * max(1, block_size // gs)  # groups never straddle blocks
    codes_t = torch.zeros_like(wt)
    keep_t = None if keep is None else keep.T.float().contiguous()
    scale_t = scale.T.contiguous()
    zp_t = None if zp is None else zp.T.float().contiguous()
    inv_d = 1.0 / u.diagonal()

    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        w1 = wt[i1:i2]  # view, updated in place
        err1 = torch.zeros(i2 - i1, out_f, device=device)
        u1 = u[i1:i2, i1:i2]
        with column_loop_threads(wt, (i2 - i1) * out_f):
            for i in range(i2 - i1):
                col = i1 + i
                g = int(col_group[col])
                if dynamic and col % gs == 0:
                    part = w1[i : i + gs].T
                    if keep_t is not None:
                        part = part * keep_t[col : col + gs].T
                    s_g, z_g = _qparams(part, scheme, gs, clip, diag[col : col + gs])
                    scale_t[g] = s_g[:, 0]
                    scale[:, g] = s_g[:, 0]
                    if zp is not None:
                        zp[:, g] = z_g[:, 0]
                        zp_t[g] = z_g[:, 0].float()
                code, deq = quantize_column(w1[i], scale_t[g], None if zp_t is None else zp_t[g], scheme)
                if keep_t is not None:
                    k = keep_t[col]
                    deq.mul_(k)
                    code = code * k if zp_t is None else torch.where(k > 0, code, zp_t[g])
                e = (w1[i] - deq).mul_(inv_d[col])
                w1[i:].addr_(u1[i, i:], e, alpha=-1.0)
                err1[i] = e
                codes_t[col] = code
        if i2 < n:
            wt[i2:].addmm_(u[i1:i2, i2:].T, err1, alpha=-1.0)

    codes = codes_t.T
    if perm is not None:
        codes = codes[:, torch.argsort(perm)]
    codes = codes.to(torch.float8_e4m3fn) if scheme.is_float else codes.to(torch.int8)
    return QuantizedWeight(codes.contiguous().to(device), scale.float(), zp, scheme, group_size)


def _gptq_refit(weight: torch.Tensor, hessian: torch.Tensor, scheme: QuantScheme, group_size: int | None,
                hessian_owned: bool, weight_owned: bool, **options) -> QuantizedWeight:
    """GPTQ, least-squares scales, GPTQ again on those scales, least-squares scales again; each
    row's best of the two, then ``DESCENT_ROUNDS`` rounds of coordinate descent on the codes, each
    followed by least-squares scales (see :func:`gptq_quantize_weight`)."""
    w_ref = weight.detach().to(torch.float32, copy=True)
    h_ref = hessian.detach().to(torch.float32, copy=True)
    dead = h_ref.diagonal() == 0
    w_ref[:, dead] = 0.0
    first = gptq_quantize_weight(weight, hessian, scheme, group_size, hessian_owned=hessian_owned,
                                 weight_owned=weight_owned, **options)
    del weight, hessian
    first = refit_scales(w_ref, first, h_ref)
    second = gptq_quantize_weight(w_ref, h_ref, scheme, group_size, qparams=(first.scale, first.zero_point), **options)
    second = refit_scales(w_ref, second, h_ref)
    best = better_rows(w_ref, h_ref, first, second)
    del first, second
    if DESCENT_ROUNDS:  # on a ridge-damped objective: it carries to other text better than the raw Hessian
        h_ref.diagonal().add_(DESCENT_DAMP * float(h_ref.diagonal().mean()))
    for _ in range(DESCENT_ROUNDS):
        best = refit_scales(w_ref, descend_codes(w_ref, best, h_ref, mask=options.get("mask")), h_ref)
    return best


def split_rows(qw: QuantizedWeight, sizes: list[int]) -> list[QuantizedWeight]:
    """Split a row-concatenated quantized weight (e.g. q/k/v quantized together)."""
    codes = qw.codes.split(sizes, dim=0)
    scales = qw.scale.split(sizes, dim=0)
    zps = qw.zero_point.split(sizes, dim=0) if qw.zero_point is not None else [None] * len(sizes)
    return [
        QuantizedWeight(c.contiguous(), s.contiguous(), None if z is None else z.contiguous(), qw.scheme, qw.group_size)
        for c, s, z in zip(codes, scales, zps)
    ]


@dataclass(frozen=True)
class Gptq(Quantizer):
    """GPTQ with its options: ``act_order`` (activation ordering, static groups), ``damp``
    (fraction of the mean Hessian diagonal), ``scale_refit`` (least-squares group scales for the
    chosen codes, :mod:`~llmopt.quant.scale_refit`), ``float_targets`` (fit the float model's
    outputs on its own inputs, the float hidden states run alongside), ``block_size`` (lazy
    updates), ``preserve_zeros`` (keep pruned weights zero; None: Linears at least 10% zeros)."""

    name: ClassVar[str] = "gptq"
    calibrated: ClassVar[bool] = True
    one_pass: ClassVar[bool] = True
    prices: ClassVar[tuple[str, ...]] = (PRICED_BY_GPTQ, PRICED_BY_RTN)

    clip_search: bool = True
    act_order: bool = True
    damp: float = 0.01
    scale_refit: bool = True
    float_targets: bool = False
    block_size: int = 128
    preserve_zeros: bool | None = None

    @property
    def uses_float_reference(self) -> bool:
        return self.float_targets

    @property
    def head_refit(self) -> bool:
        return self.scale_refit

    def options(self) -> dict:
        return {**super().options(), "descent_rounds": DESCENT_ROUNDS if self.scale_refit else 0}

    @torch.no_grad()
    def quantize(self, mods: Mapping[str, nn.Linear], schemes: Schemes, group_sizes: GroupSizes,
                 stats: LinearStats | None) -> dict[str, QuantizedWeight]:
        """GPTQ of one layer's ``mods``; Linears sharing an input (q/k/v, gate/up) are stacked
        row-wise and solved at once, which is exact since GPTQ treats rows independently."""
        assert stats is not None, "GPTQ needs the layer's calibration statistics"
        batches: dict[tuple[int, int | None, QuantScheme], list[str]] = {}
        for name in mods:
            batches.setdefault((id(stats.stats(name)), group_sizes[name], schemes[name]), []).append(name)
        out: dict[str, QuantizedWeight] = {}
        uses = [key[0] for key in batches]
        for (sid, gs, scheme), names in batches.items():
            weights = [mods[n].weight.detach() for n in names]
            stacked = len(weights) > 1  # a fresh tensor, handed over to the solver as its working copy
            w = torch.cat(weights, dim=0) if stacked else weights[0]
            mask = None
            keep = self.preserve_zeros
            zero_frac = float((w == 0).float().mean())
            if keep is None:
                keep = zero_frac >= SPARSE_ZERO_FRACTION
            if keep and zero_frac > 0:
                mask = w != 0
            uses.remove(sid)
            # a float64 tensor handed over to the solver: on its last use the accumulator itself
            last = sid not in uses
            hessian = [stats.take_hessian(names[0]) if last else stats.hessian(names[0])]
            drift = stats.drift(names[0], take=last)
            if drift is not None:  # fit the float model's outputs (asymmetric calibration)
                w, stacked = float_target_weight(w, hessian[0], drift, self.damp), True
                del drift
            weight, device = [w], w.device
            del w
            try:
                # the range search and factorization of a small Linear are latency-bound too (12 s -> 0.9 s on a loaded machine)
                with column_loop_threads(device, weight[0].numel()):
                    qw = gptq_quantize_weight(
                        weight.pop(), hessian.pop(), scheme, gs, block_size=self.block_size, damp=self.damp,
                        act_order=self.act_order, clip=self.clip_search, mask=mask, hessian_owned=True,
                        weight_owned=stacked, refit=self.scale_refit,
                    )
            except NumericalError as exc:
                raise exc.at(f"GPTQ on {', '.join(names)}") from exc
            for name, part in zip(names, split_rows(qw, [x.shape[0] for x in weights])):
                module = mods[name]
                module.weight.data.copy_(part.dequantize(module.weight.dtype))
                out[name] = part
        return out
