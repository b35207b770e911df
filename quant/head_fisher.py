"""Per-row Hessians of the output head, weighted by how likely each row's token is.

With logits ``z = W h`` and ``p = softmax(z)``, an error ``ΔW`` costs to second order
``½ E_t[Δz_tᵀ (diag p_t − p_t p_tᵀ) Δz_t]`` nats of KL divergence. Keeping the diagonal of that
Fisher, row (token) ``v`` costs ``½ Δw_vᵀ H_v Δw_v`` with its own Hessian

    H_v = E_t[p_tv (1 − p_tv) h_t h_tᵀ],

the head inputs of the contexts in which ``v`` is likely (and not certain). Plain GPTQ uses
``E[h hᵀ]`` for every row; a few hundred frequent tokens carry much of the head's KL divergence,
and those rows gain most from their own Hessian (:func:`~llmopt.quant.row_gptq.gptq_rows`).

Only the ``FISHER_ROWS`` rows of largest mean ``p (1 − p)`` get their own Hessian, and the
positions summed are capped so that the work stays within ``FISHER_FLOPS`` (a uniform subsample
of the calibration positions). ``SHARED_WEIGHT`` × the row's mean ``p (1 − p)`` times the shared
shape ``E[h hᵀ]`` is added as a prior: it keeps ``H_v`` full rank and guards against calibration
text unlike the text the model will see.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from llmopt.formats.schemes import QuantizedWeight
from llmopt.quant.row_gptq import gptq_rows
from llmopt.quant.scale_refit import better_rows

FISHER_ROWS = 256  # rows (tokens of largest mean p(1-p)) that get their own Hessian
FISHER_FLOPS = 4e12  # work of the per-row Hessians (rows × positions × hidden²): caps the positions
SHARED_WEIGHT = 0.1  # prior: this many times the row's mean p(1-p) of E[h hᵀ]
ROW_CHUNK = 128  # rows whose Hessians are held at once
TOKEN_CHUNK = 1024  # positions whose logits are held at once


@dataclass
class HeadFisher:
    """The head inputs of the calibration positions and the rows that get their own Hessian."""

    inputs: torch.Tensor  # [positions, hidden] float32: the head's inputs (final norm applied)
    log_norm: torch.Tensor  # [positions] log Σ_v exp(z_tv) of the float head
    rows: torch.Tensor  # [k] row indices, by decreasing mean p(1-p)
    mean_fisher: torch.Tensor  # [k] float64 mean p(1-p) of each of those rows (the Fisher diagonal)
    shared: torch.Tensor  # [hidden, hidden] float64 E[h hᵀ]

    @classmethod
    def measure(cls, inputs: torch.Tensor, weight: torch.Tensor, max_rows: int | None = None) -> "HeadFisher":
        """The log-normalizers and mean p(1-p) of the rows of the head ``weight`` ``[vocab, hidden]``
        on ``inputs`` ``[positions, hidden]``; the ``max_rows`` (``FISHER_ROWS``) rows of largest mean are kept."""
        x = inputs.reshape(-1, inputs.shape[-1]).float()
        w = weight.float()
        log_norm = torch.empty(x.shape[0])
        mass = torch.zeros(w.shape[0], dtype=torch.float64)
        with torch.no_grad():
            for t0 in range(0, x.shape[0], TOKEN_CHUNK):
                z = x[t0 : t0 + TOKEN_CHUNK] @ w.T
                lse = torch.logsumexp(z, -1)
                log_norm[t0 : t0 + TOKEN_CHUNK] = lse
                p = torch.exp(z - lse.unsqueeze(-1))
                mass += (p * (1 - p)).sum(0, dtype=torch.float64)
        mean = mass / max(x.shape[0], 1)
        k = min(FISHER_ROWS if max_rows is None else max_rows, w.shape[0])
        rows = torch.argsort(mean, descending=True, stable=True)[:k]
        shared = x.T.double() @ x.double() / max(x.shape[0], 1)
        return cls(x, log_norm, rows, mean[rows], shared)

    def hessians(self, weight: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(row indices, Hessians [k, hidden, hidden] float32)`` a chunk of rows at a time."""
        hidden = self.inputs.shape[1]
        cap = max(hidden, int(FISHER_FLOPS / (max(self.rows.numel(), 1) * hidden * hidden)))
        stride = -(-self.inputs.shape[0] // cap)  # ceil: a uniform subsample of at most `cap` positions
        x, log_norm = self.inputs[::stride], self.log_norm[::stride]
        prior = SHARED_WEIGHT * self.shared.float()
        for r0 in range(0, self.rows.numel(), ROW_CHUNK):
            rows = self.rows[r0 : r0 + ROW_CHUNK]
            probs = torch.exp(x @ weight[rows].float().T - log_norm.unsqueeze(-1))  # [positions, k]
            probs = probs * (1 - probs)
            out = torch.empty(rows.numel(), hidden, hidden)
            for i in range(rows.numel()):
                own = (x * probs[:, i : i + 1]).T @ x / x.shape[0]
                out[i] = own + float(self.mean_fisher[r0 + i]) * prior
            yield rows, out

    def requantize(self, weight: torch.Tensor, quantized: QuantizedWeight) -> QuantizedWeight:
        """``quantized`` (GPTQ of ``weight`` on the shared Hessian) with its most probable rows
        solved again by :func:`~llmopt.quant.row_gptq.gptq_rows` on their own Hessians; a row
        keeps the new codes only where they cost less under its own Hessian."""
        codes, scale = quantized.codes.clone(), quantized.scale.clone()
        zero = None if quantized.zero_point is None else quantized.zero_point.clone()
        w = weight.float()
        for rows, hessians in self.hessians(w):
            old = QuantizedWeight(codes[rows], scale[rows], None if zero is None else zero[rows],
                                  quantized.scheme, quantized.group_size)
            new = gptq_rows(w[rows], hessians, quantized.scheme, quantized.group_size)
            best = better_rows(w[rows], hessians, old, new)
            codes[rows], scale[rows] = best.codes, best.scale
            if zero is not None:
                zero[rows] = best.zero_point
        return QuantizedWeight(codes, scale, zero, quantized.scheme, quantized.group_size)
