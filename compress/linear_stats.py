"""Per-Linear input statistics gathered by forward pre-hooks during calibration: the GPTQ
Hessian ``2/n Σ xxᵀ`` (shared by Linears fed the same input), per-channel activation
magnitudes for AWQ / SmoothQuant / Wanda, and the float model's input drift for float targets."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmopt.core.lockstep import current_context
from llmopt.float_reference import FloatReference


class StopForward(Exception):
    """Raised by a hook to end a forward pass early when the rest is not needed."""


ADD_BLOCK = 1 << 24  # entries of a batch's xᵀx added to the float64 sum at once (a float64 temporary each)
GRAM_BLOCK = 512  # column block of the symmetric product xᵀx: only the blocks on and above the diagonal are multiplied


def gram(x: torch.Tensor) -> torch.Tensor:
    """``xᵀx`` of ``x`` [tokens, n], multiplying only the column blocks on and above the diagonal
    and mirroring the rest (3/4 of the work for two blocks, 5/8 for four); the same as
    ``x.T @ x`` up to the summation order inside each product."""
    n = x.shape[1]
    if n < 2 * GRAM_BLOCK:
        return x.T @ x
    out = torch.empty(n, n, dtype=x.dtype, device=x.device)
    edges = list(range(0, n, GRAM_BLOCK)) + [n]
    for a, b in zip(edges[:-1], edges[1:]):
        out[a:b, a:] = x[:, a:b].T @ x[:, a:]
        out[b:, a:b] = out[a:b, b:].T
    return out


SAMPLE_CAP = 1024  # input rows kept per distinct input when sampling (``sample_every``)


@dataclass
class InputStats:
    """Running sums over the input tokens of one Linear (shared by Linears with the same input)."""

    n_tokens: int = 0
    xtx: torch.Tensor | None = None  # float64 Σ x xᵀ
    abs_sum: torch.Tensor | None = None  # float64 Σ |x|
    abs_max: torch.Tensor | None = None  # float32 max |x|
    sq_sum: torch.Tensor | None = None  # float64 Σ x²
    names: list[str] = field(default_factory=list)
    drift: torch.Tensor | None = None  # float64 Σ (x_float − x̃) x̃ᵀ: the float model's inputs against these (FloatReference)
    drift_lost: bool = False  # some token had no float input: no drift term
    samples: list[torch.Tensor] = field(default_factory=list)  # float32 rows of x kept as they were (``sample_every``)

    def add_drift(self, x_float: torch.Tensor | None, x: torch.Tensor) -> None:
        """Add ``Σ (x_float − x̃) x̃ᵀ`` for one batch (in float32: the difference is small, and
        a bfloat16 product would bury it in rounding); a missing or misaligned ``x_float``
        drops the term."""
        if self.drift_lost:
            return
        x = x.reshape(-1, x.shape[-1]).float()
        if x_float is None or x_float.numel() != x.numel():
            self.drift, self.drift_lost = None, True
            return
        product = ((x_float.reshape(x.shape).float() - x).T @ x).double()
        if self.drift is None:
            self.drift = product
        else:
            self.drift.add_(product)

    def add(
        self, x: torch.Tensor, hessian: bool, channel: bool, matmul_dtype: torch.dtype = torch.float32,
        sample_every: int = 0,
    ) -> None:
        x = x.reshape(-1, x.shape[-1])
        self.n_tokens += x.shape[0]
        kept = sum(rows.shape[0] for rows in self.samples)
        if sample_every and kept < SAMPLE_CAP:  # every k-th token, up to SAMPLE_CAP of them
            self.samples.append(x[::sample_every][: SAMPLE_CAP - kept].float().cpu())
        if hessian:
            # straight to the product's dtype (the same values as through float32, without a
            # float32 copy of a large input such as the down projection's)
            xm = x.to(matmul_dtype).contiguous()
            xtx = gram(xm)
            del xm
            if self.xtx is None:
                self.xtx = xtx.double()
            else:  # in blocks of rows: on the CPU a mixed-dtype add_ first copies all of xtx to float64
                rows = max(1, ADD_BLOCK // xtx.shape[1])
                for r in range(0, xtx.shape[0], rows):
                    self.xtx[r : r + rows].add_(xtx[r : r + rows])
            del xtx
        if channel:
            x = x.float()
            a = x.abs()
            s = a.sum(0, dtype=torch.float64)
            q = x.pow(2).sum(0, dtype=torch.float64)
            m = a.amax(0)
            if self.abs_sum is None:
                self.abs_sum, self.sq_sum, self.abs_max = s, q, m
            else:
                self.abs_sum += s
                self.sq_sum += q
                torch.maximum(self.abs_max, m, out=self.abs_max)

    def scale_inputs(self, s: torch.Tensor) -> None:
        """Account for inputs that became ``x / s`` (a scale folded into the preceding op)."""
        s64 = s.double()
        if self.xtx is not None:
            self.xtx = self.xtx / s64.unsqueeze(0) / s64.unsqueeze(1)
        if self.drift is not None:  # W x = (W s)(x / s): the float inputs are divided by s too
            self.drift = self.drift / s64.unsqueeze(0) / s64.unsqueeze(1)
        self.samples = [rows / s.float().cpu() for rows in self.samples]
        if self.abs_sum is not None:
            self.abs_sum = self.abs_sum / s64
            self.sq_sum = self.sq_sum / s64.pow(2)
            self.abs_max = self.abs_max / s.float()

    def permute_inputs(self, perm: torch.Tensor) -> None:
        """Account for input channels reordered as ``x[perm]``."""
        if self.xtx is not None:
            self.xtx = self.xtx[perm][:, perm]
        if self.drift is not None:
            self.drift = self.drift[perm][:, perm]
        self.samples = [rows[:, perm.cpu()] for rows in self.samples]
        if self.abs_sum is not None:
            self.abs_sum, self.sq_sum, self.abs_max = self.abs_sum[perm], self.sq_sum[perm], self.abs_max[perm]


class LinearStats:
    """Collects input statistics of Linears through forward pre-hooks (a context manager).

    Per Linear: the Hessian ``H = 2/n Σ x xᵀ`` (``hessian=True``) and per input channel
    mean |x|, max |x| and ‖x‖₂ (``channel=True``). Linears fed the same input tensor object in
    a forward (q/k/v, gate/up) share one accumulator, so ``H`` is computed once for them.
    With ``stop_early`` the forward is cut short (:class:`StopForward`) after the last observed
    Linear once the execution order is known (from the first batch); use it only when the
    layer outputs of that run are not needed, as with the engine's ``run_layer``.
    ``hessian_dtype``: dtype of the per-batch ``xᵀx`` products (bfloat16 halves their cost on
    CPU; sums are accumulated in float64 either way). ``reference``: with Hessians, also add
    ``Σ (x_float − x̃) x̃ᵀ`` against the float model's inputs of each Linear (:meth:`drift`).
    """

    def __init__(
        self,
        modules: Mapping[str, nn.Module],
        *,
        hessian: bool = True,
        channel: bool = True,
        stop_early: bool = True,
        hessian_dtype: torch.dtype = torch.float32,
        reference: FloatReference | None = None,
        sample_every: int = 0,
    ) -> None:
        self.modules = dict(modules)
        self.sample_every = sample_every
        self.reference = reference
        self.hessian_dtype = hessian_dtype
        self.hessian_enabled = hessian
        self.channel_enabled = channel
        self.stop_early = stop_early
        self._stats: dict[str, InputStats] = {}
        self._order: list[str] = []
        self._order_known = False
        self._last: dict[Any, tuple[torch.Tensor, InputStats] | None] = {}  # per lockstep batch (or thread)
        self._handles: list[Any] = []

    # -- hooks -----------------------------------------------------------------------------------
    def __enter__(self) -> LinearStats:
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_pre_hook(self._hook(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._last.clear()

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            with torch.autocast(args[0].device.type, enabled=False):  # statistics in float32
                self._observe(name, args[0])

        return hook

    def _observe(self, name: str, x: torch.Tensor) -> None:
        context = current_context()
        last = self._last.get(context)
        stats = self._stats.get(name)
        if stats is not None:  # seen before: a later batch, so the order is complete
            self._order_known = True
        else:  # first batch: find out which Linears share an input
            stats = last[1] if last is not None and last[0] is x else InputStats()
            stats.names.append(name)
            self._stats[name] = stats
            self._order.append(name)
        if not (last is not None and last[0] is x and last[1] is stats):
            stats.add(x, self.hessian_enabled, self.channel_enabled, self.hessian_dtype, self.sample_every)
            if self.reference is not None and self.hessian_enabled:
                stats.add_drift(self.reference.input_of(self.modules[name]), x)
        self._last[context] = (x, stats)
        if self.stop_early and self._order_known and name == self._order[-1]:
            self._last[context] = None
            raise StopForward

    def declare_groups(self, groups: list[list[str]]) -> None:
        """Linears known to share their input (e.g. from :meth:`shared_groups` of an earlier
        run), in execution order: their statistics exist before any of them is reached."""
        for group in groups:
            shared = InputStats()
            for name in group:
                shared.names.append(name)
                self._stats[name] = shared
                self._order.append(name)

    # -- results ---------------------------------------------------------------------------------
    def stats(self, name: str) -> InputStats:
        if name not in self._stats:
            raise KeyError(f"no calibration inputs were seen by {name}")
        return self._stats[name]

    def hessian(self, name: str) -> torch.Tensor:
        """``2/n Σ x xᵀ`` (float64, a fresh tensor the caller may modify)."""
        return self._xtx(name) * (2.0 / self.stats(name).n_tokens)

    def take_hessian(self, name: str) -> torch.Tensor:
        """:meth:`hessian` without a copy: the accumulator itself, scaled in place and dropped
        from these statistics (for its last use; the Linears sharing it get no Hessian after)."""
        h = self._xtx(name)
        s = self.stats(name)
        s.xtx = None
        return h.mul_(2.0 / s.n_tokens)

    def drift(self, name: str, take: bool = False) -> torch.Tensor | None:
        """``2/n Σ (x_float − x̃) x̃ᵀ`` (float64, on the scale of :meth:`hessian`), or None without
        a float input for every token; ``take``: the accumulator itself, dropped from these
        statistics (its last use), else a copy."""
        s = self.stats(name)
        drift = s.drift
        if take:
            s.drift = None
        if drift is None:
            return None
        return drift.mul_(2.0 / s.n_tokens) if take else drift * (2.0 / s.n_tokens)

    def _xtx(self, name: str) -> torch.Tensor:
        s = self.stats(name)
        if s.xtx is None:
            raise ValueError(f"no Hessian left for {name}: LinearStats was created with hessian=False, or it was taken")
        return s.xtx

    def samples(self, name: str) -> torch.Tensor | None:
        """The input rows kept of ``name`` (``sample_every``; ``[tokens, in]`` float32), None without."""
        rows = self._stats[name].samples
        return torch.cat(rows) if rows else None

    def abs_mean(self, name: str) -> torch.Tensor:
        s = self.stats(name)
        return (s.abs_sum / s.n_tokens).float()

    def abs_max(self, name: str) -> torch.Tensor:
        return self.stats(name).abs_max.clone()

    def has(self, name: str) -> bool:
        """Whether ``name`` saw calibration inputs (a routed expert may see none)."""
        return name in self._stats

    def _distinct(self, names: list[str]) -> list[InputStats]:
        """The distinct accumulators behind ``names`` that saw tokens."""
        return [st for st in self._accumulators(names) if st.n_tokens]

    def pooled_abs_mean(self, names: list[str]) -> torch.Tensor | None:
        """Mean |x| per channel over every token any of ``names`` saw (the experts behind one
        norm each see their routed tokens); None when none saw any."""
        found = self._distinct(names)
        if not found:
            return None
        return (sum(f.abs_sum for f in found) / sum(f.n_tokens for f in found)).float()

    def pooled_abs_max(self, names: list[str]) -> torch.Tensor | None:
        """Max |x| per channel over the inputs of ``names``; None when none saw any."""
        found = self._distinct(names)
        if not found:
            return None
        out = found[0].abs_max.clone()
        for f in found[1:]:
            torch.maximum(out, f.abs_max, out=out)
        return out

    def l2_norm(self, name: str) -> torch.Tensor:
        return self.stats(name).sq_sum.sqrt().float()

    def shared_groups(self) -> list[list[str]]:
        """Names of observed Linears grouped by shared input, in execution order."""
        seen: list[InputStats] = []
        for name in self._order:
            if all(self._stats[name] is not s for s in seen):
                seen.append(self._stats[name])
        return [list(s.names) for s in seen]

    def _accumulators(self, names: list[str]) -> list[InputStats]:
        """The distinct accumulators behind ``names`` (each once)."""
        found: list[InputStats] = []
        for name in names:
            st = self._stats.get(name)
            if st is not None and all(st is not f for f in found):
                found.append(st)
        return found

    def scale_inputs(self, names: list[str], s: torch.Tensor) -> None:
        """Inputs of ``names`` became ``x / s``; rescale each distinct accumulator once."""
        for st in self._accumulators(names):
            st.scale_inputs(s)

    def permute_inputs(self, names: list[str], perm: torch.Tensor) -> None:
        """Input channels of ``names`` were reordered as ``x[perm]``; reorder each distinct accumulator once."""
        for st in self._accumulators(names):
            st.permute_inputs(perm if st.xtx is None else perm.to(st.xtx.device))
