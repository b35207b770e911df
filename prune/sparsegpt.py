"""SparseGPT (Frantar & Alistarh, 2023): prune and reconstruct a layer in one pass.

Columns are visited left to right; removing weight ``w`` of column ``j`` costs
``w² / [H⁻¹]_jj²`` (OBS saliency) and its error is spread over the not-yet-visited columns
through the upper Cholesky factor of ``H⁻¹`` — the same machinery as GPTQ, shared through
:func:`llmopt.quant.gptq._inverse_hessian_factor`. Updates are applied lazily per block of
columns. The mask is chosen adaptively: per block of columns for unstructured sparsity (each
row loses its share of the block, so every row ends at exactly the requested sparsity), per
group of M columns for N:M, each time from the error-updated weights.
"""

from __future__ import annotations

import torch
from llmopt.quant.columns import column_loop_threads
from llmopt.quant.gptq import _inverse_hessian_factor

from llmopt.pruning.masks import Pattern, pruned_per_row


@torch.no_grad()
def sparsegpt_prune_weight(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    sparsity: float | None = None,
    pattern: Pattern | None = None,
    *,
    block_size: int = 128,
    damp: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prune ``weight`` ``[out, in]`` given the input Hessian ``2/n Σ x xᵀ`` ``[in, in]``.

    Returns ``(new_weight, keep_mask)``: the reconstructed weight (``weight``'s dtype, exact
    zeros where the mask is False) and the bool keep-mask. Give ``sparsity`` (per row) or an
    N:M ``pattern``. The Hessian is inverted in float64; the column loop runs in float32.
    """
    if (sparsity is None) == (pattern is None):
        raise ValueError("give exactly one of sparsity and pattern")
    out_f, n = weight.shape
    if hessian.shape != (n, n):
        raise ValueError(f"Hessian shape {tuple(hessian.shape)} does not match weight {tuple(weight.shape)}")
    if pattern is not None:
        if n % pattern.m:
            raise ValueError(f"{pattern} sparsity needs the input size ({n}) to be a multiple of {pattern.m}")
        block_size = pattern.m * max(1, block_size // pattern.m)  # groups never straddle blocks
    h = hessian.detach().to(torch.float64, copy=True)
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    u = _inverse_hessian_factor(h, damp, consume=True, dtype=torch.float32)  # h is its workspace
    del h
    d = u.diagonal()

    wt = weight.detach().float().T.contiguous()  # [in, out]: a column of W is a contiguous row
    wt[dead] = 0.0
    keep_t = torch.ones(n, out_f, dtype=torch.bool, device=wt.device)
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        w1 = wt[i1:i2]  # view, updated in place
        k1 = keep_t[i1:i2]
        u1 = u[i1:i2, i1:i2]
        err1 = torch.zeros(i2 - i1, out_f, device=wt.device)
        if sparsity is not None:  # each row's share of this block, so the totals come out exact
            k = pruned_per_row(i2, sparsity) - pruned_per_row(i1, sparsity)
            _drop_lowest(w1, d[i1:i2], k, k1)
        with column_loop_threads(wt, (i2 - i1) * out_f):
            for i in range(i2 - i1):
                if pattern is not None and i % pattern.m == 0:
                    _drop_lowest(w1[i : i + pattern.m], d[i1 + i : i1 + i + pattern.m], pattern.m - pattern.n, k1[i : i + pattern.m])
                q = w1[i] * k1[i]
                e = (w1[i] - q).div_(d[i1 + i])
                w1[i:].addr_(u1[i, i:], e, alpha=-1.0)
                w1[i] = q  # exact zeros (the update leaves rounding residue)
                err1[i] = e
        if i2 < n:
            wt[i2:].addmm_(u[i1:i2, i2:].T, err1, alpha=-1.0)

    keep = keep_t.T.contiguous()
    return (wt.T * keep).to(weight.dtype).contiguous(), keep


def _drop_lowest(w: torch.Tensor, d: torch.Tensor, k: int, keep: torch.Tensor) -> None:
    """Mark in ``keep`` ``[cols, out]`` the ``k`` columns of each output with the lowest OBS
    saliency ``w² / d²`` (``w`` ``[cols, out]``, ``d`` ``[cols]``)."""
    if k <= 0:
        return
    saliency = w.pow(2) / d.pow(2).unsqueeze(1)
    lowest = torch.argsort(saliency, dim=0, stable=True)[:k]
    keep.scatter_(0, lowest, False)
