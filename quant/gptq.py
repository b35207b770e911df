"""GPTQ (Frantar et al., 2022): column-by-column quantization with error feedback through the
inverse Hessian of the layer inputs, with lazy block updates, optional activation ordering
(static groups only, so the stored layout stays plain groups in natural column order) and
sparsity-mask preservation."""

from __future__ import annotations

import torch

from .formats import FP8_MAX, QuantizedWeight, QuantScheme, compute_qparams, search_qparams


def _inverse_hessian_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + λI)⁻¹`` with λ = ``damp`` × mean diagonal (raised if
    ``H`` is not positive definite enough)."""
    mean_diag = h.diagonal().mean().item()
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    for attempt in range(6):
        lam = damp * (10**attempt) * mean_diag
        chol, info = torch.linalg.cholesky_ex(h + lam * eye)
        if info.item() == 0:
            hinv = torch.cholesky_inverse(chol)
            u, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if info.item() == 0:
                return u
    raise ValueError("GPTQ: the Hessian is not positive definite even with strong dampening")


def _qparams(
    w: torch.Tensor,
    scheme: QuantScheme,
    group_size: int | None,
    clip: bool,
    col_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if clip:
        return search_qparams(w, scheme, group_size, weight=col_weight.float())
    return compute_qparams(w, scheme, group_size)


def _quantize_column(
    w: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, scheme: QuantScheme
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (as float64) and dequantized values (float64, float32-exact) of one column."""
    if scheme.is_float:
        code = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        return code.double(), (code * scale).double()
    code = torch.round(w.float() / scale)
    if zp is not None:
        code = (code + zp).clamp(scheme.qmin, scheme.qmax)
        return code.double(), ((code - zp) * scale).double()
    code = code.clamp(scheme.qmin, scheme.qmax)
    return code.double(), (code * scale).double()


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
) -> QuantizedWeight:
    """GPTQ-quantize ``weight`` ``[out, in]`` given the input Hessian ``2/n Σ x xᵀ`` ``[in, in]``.

    Per-group qparams are computed when a group is reached (from the error-updated weights),
    or up front from the original weights with ``static_groups`` (forced with ``act_order``).
    ``clip`` adds a clipping search weighted by the Hessian diagonal. ``mask`` (bool, True =
    kept) forces masked entries to exact zeros, their error compensated by later columns.
    Computation is float64 on the weight's device and deterministic.
    """
    if static_groups is None:
        static_groups = act_order
    if act_order and not static_groups:
        raise ValueError("GPTQ act-order needs static groups (static_groups=True)")
    out_f, n = weight.shape
    if hessian.shape != (n, n):
        raise ValueError(f"Hessian shape {tuple(hessian.shape)} does not match weight {tuple(weight.shape)}")
    w = weight.detach().double().clone()
    h = hessian.detach().double().clone()
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
    dynamic = group_size is not None and not static_groups
    if dynamic:
        scale = torch.zeros(out_f, n_groups)
        zp = None if scheme.symmetric or scheme.is_float else torch.zeros(out_f, n_groups, dtype=torch.int32)
    else:
        scale, zp = _qparams(w, scheme, group_size, clip, diag)

    perm = torch.argsort(h.diagonal(), descending=True, stable=True) if act_order else None
    if perm is not None:
        w = w[:, perm]
        h = h[perm][:, perm]
        keep = None if keep is None else keep[:, perm]
    col_group = (perm if perm is not None else torch.arange(n)) // gs

    u = _inverse_hessian_factor(h, damp)
    if dynamic:
        block_size = gs * max(1, block_size // gs)  # groups never straddle blocks
    codes = torch.zeros_like(w)
    zp_f = None if zp is None else zp.float()

    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        w1 = w[:, i1:i2]  # view: updated in place
        err1 = torch.zeros(out_f, i2 - i1, dtype=torch.float64)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            g = int(col_group[col])
            if dynamic and col % gs == 0:
                part = w1[:, i : i + gs]
                if keep is not None:
                    part = part * keep[:, col : col + gs]
                s_g, z_g = _qparams(part, scheme, gs, clip, diag[col : col + gs])
                scale[:, g] = s_g[:, 0]
                if zp is not None:
                    zp[:, g] = z_g[:, 0]
                    zp_f = zp.float()
            s = scale[:, g]
            z = None if zp_f is None else zp_f[:, g]
            wc = w1[:, i]
            code, deq = _quantize_column(wc, s, z, scheme)
            if keep is not None:
                k = keep[:, col]
                deq = torch.where(k, deq, torch.zeros_like(deq))
                code = torch.where(k, code, torch.zeros_like(code) if z is None else z.double())
            e = (wc - deq) / u1[i, i]
            w1[:, i:] -= e.unsqueeze(1) * u1[i, i:].unsqueeze(0)
            err1[:, i] = e
            codes[:, col] = code
        if i2 < n:
            w[:, i2:] -= err1 @ u[i1:i2, i2:]

    if perm is not None:
        codes = codes[:, torch.argsort(perm)]
    codes = codes.to(torch.float8_e4m3fn) if scheme.is_float else codes.to(torch.int8)
    return QuantizedWeight(codes.to(weight.device), scale.float(), zp, scheme, group_size)


def split_rows(qw: QuantizedWeight, sizes: list[int]) -> list[QuantizedWeight]:
    """Split a row-concatenated quantized weight (e.g. q/k/v quantized together)."""
    codes = qw.codes.split(sizes, dim=0)
    scales = qw.scale.split(sizes, dim=0)
    zps = qw.zero_point.split(sizes, dim=0) if qw.zero_point is not None else [None] * len(sizes)
    return [
        QuantizedWeight(c.contiguous(), s.contiguous(), None if z is None else z.contiguous(), qw.scheme, qw.group_size)
        for c, s, z in zip(codes, scales, zps)
    ]
