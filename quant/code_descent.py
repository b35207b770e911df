"""Coordinate descent on quantized codes, scales held fixed.

GPTQ chooses each column's codes once, greedily, and never revisits them. With the scales fixed,
the layer's output error ``f(Q) = tr((Q − W) H (Q − W)ᵀ)`` is a quadratic in each single weight
``q_j`` of a row, with curvature ``H_jj`` and gradient ``2 g_j``, ``g = (Q − W) H``. Its exact
minimum over the values the row's group can hold is the representable value nearest to
``t_j = q_j − g_j / H_jj``; moving there cannot raise ``f``. A sweep visits every column once
(all rows at a time), keeping ``g`` exact for the columns still to visit: rank-one updates
inside a block of columns and one matrix product per block for the later ones (``rows × in²``
work per sweep, about GPTQ's).

The codes stay in the scheme's grid and range and keep the scales and zero points, so the stored
layout (and an exact GGUF block) is unchanged. Masked (pruned) weights stay zero.
"""

from __future__ import annotations

import torch

from llmopt.formats.schemes import QuantizedWeight
from llmopt.quant.columns import column_loop_threads, quantize_column

DESCENT_BLOCK = 128  # columns whose gradients are updated one weight at a time
ROW_BLOCK_ELEMENTS = 1 << 23  # float32 entries of one row block's working matrices


def descend_codes(weight: torch.Tensor, qw: QuantizedWeight, hessian: torch.Tensor, sweeps: int = 1,
                  mask: torch.Tensor | None = None) -> QuantizedWeight:
    """``qw`` after ``sweeps`` cyclic sweeps of exact coordinate descent on its codes against
    ``hessian`` (scales and zero points fixed; each step lowers or keeps the row's error)."""
    n = weight.shape[1]
    gs = qw.group_size or n
    h = hessian.float()
    diag = h.diagonal()
    live = diag > 0
    inv_diag = torch.where(live, 1.0 / diag.clamp(min=1e-30), torch.zeros_like(diag))
    col_group = torch.arange(n, device=weight.device) // gs
    codes_out = qw.codes.clone()
    rows_per_block = max(1, ROW_BLOCK_ELEMENTS // n)
    for r0 in range(0, weight.shape[0], rows_per_block):
        r1 = min(r0 + rows_per_block, weight.shape[0])
        part = QuantizedWeight(qw.codes[r0:r1], qw.scale[r0:r1],
                               None if qw.zero_point is None else qw.zero_point[r0:r1], qw.scheme, qw.group_size)
        qt = part.dequantize(torch.float32).T.contiguous()  # [in, rows]: a column is a contiguous row
        wt = weight[r0:r1].float().T.contiguous()
        codes_t = part.codes.T.float().contiguous()
        scale_t = part.scale.float().T.contiguous()
        zp_t = None if part.zero_point is None else part.zero_point.float().T.contiguous()
        keep_t = None if mask is None else mask[r0:r1].T.to(torch.bool).contiguous()
        for _ in range(sweeps):
            gt = h @ (qt - wt)  # gᵀ = H (Q − W)ᵀ, [in, rows], exact at each sweep's start
            for c0 in range(0, n, DESCENT_BLOCK):
                c1 = min(c0 + DESCENT_BLOCK, n)
                moved = torch.zeros(c1 - c0, r1 - r0, device=qt.device)
                g_block = gt[c0:c1]  # view: exact for the block's columns, one weight at a time
                with column_loop_threads(qt, (c1 - c0) * (r1 - r0)):
                    for i in range(c1 - c0):
                        col = c0 + i
                        if not bool(live[col]):
                            continue
                        g = int(col_group[col])
                        target = qt[col] - g_block[i] * inv_diag[col]
                        code, deq = quantize_column(target, scale_t[g], None if zp_t is None else zp_t[g], qw.scheme)
                        if keep_t is not None:
                            kept = keep_t[col]
                            deq = torch.where(kept, deq, qt[col])
                            code = torch.where(kept, code, codes_t[col])
                        step = deq - qt[col]
                        g_block.addr_(h[c0:c1, col], step)
                        moved[i] = step
                        qt[col] = deq
                        codes_t[col] = code
                if c1 < n:  # columns already visited get exact gradients at the next sweep's start
                    gt[c1:].addmm_(h[c1:, c0:c1], moved)
        codes_out[r0:r1] = codes_t.T.to(qw.codes.dtype)
    return QuantizedWeight(codes_out, qw.scale, qw.zero_point, qw.scheme, qw.group_size)
