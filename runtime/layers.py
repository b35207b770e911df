"""Linear layers behind one small interface; the engine's backend lays each weight out and
binds the kernel that runs it (``Backend.prepare_linear`` sets ``run``).

``DenseLinear`` holds a float weight; ``QuantLinear`` a quantized one as stored (int4 codes in
int8, int8, or float8 with scales / zero points), or the backend's packed copy of it.
Projections that read the same input (q/k/v, gate/up) are merged into one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from llmopt.formats.registry import format_for, format_of
from llmopt.formats.schemes import QuantizedWeight, compute_qparams, get_scheme, quantize


class Linear:
    """``y = x @ W.T + b``, run by the kernel its backend bound (``run``)."""

    out_features: int
    bias: torch.Tensor | None
    run: Callable[[torch.Tensor], torch.Tensor] | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)

    def nbytes(self) -> int:
        raise NotImplementedError


@dataclass
class DenseLinear(Linear):
    """A float weight, ``weight`` ``[out, in]`` as stored in checkpoints or ``weight_t``
    ``[in, out]``, whichever its backend streams best (``set_layout``); exactly one is set."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None = None
    weight_t: torch.Tensor | None = None
    run: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False, compare=False)
    extra: Any = field(default=None, repr=False, compare=False)  # a backend's second copy (its nbytes() counts)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> DenseLinear:
        return cls(weight.contiguous(), bias)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0] if self.weight is not None else self.weight_t.shape[1]

    def full_weight(self) -> torch.Tensor:
        """The ``[out, in]`` weight (a transposed view in the reference layout)."""
        return self.weight if self.weight is not None else self.weight_t.t()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the ``[out, in]`` weight (an embedding lookup of a tied head)."""
        if self.weight is not None:
            return torch.nn.functional.embedding(ids, self.weight)
        return self.weight_t.index_select(1, ids).t()

    def set_layout(self, transposed: bool) -> None:
        """Hold the weight as ``weight_t`` (``transposed``) or as ``weight``."""
        if transposed and self.weight_t is None:
            self.weight_t, self.weight = self.weight.t().contiguous(), None
        elif not transposed and self.weight is None:
            self.weight, self.weight_t = self.weight_t.t().contiguous(), None

    def nbytes(self) -> int:
        return _nbytes(self.weight, self.weight_t, self.bias) + (self.extra.nbytes() if self.extra is not None else 0)


@dataclass
class QuantLinear(Linear):
    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    group_size: int | None
    activations: str | None
    scheme_name: str
    bias: torch.Tensor | None = None
    kernel: str | None = None  # the kernel its weight format runs on (llmopt.formats.registry); None: from the codes
    packed: Any = field(default=None, repr=False, compare=False)  # the backend's layout (then ``codes`` are emptied)
    run: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> QuantLinear:
        """The linear of a quantized weight; its kernel is its registered weight format's."""
        return cls(qw.codes, qw.scale, qw.zero_point, qw.group_size, qw.scheme.activations, qw.scheme.name, bias,
                   format_of(qw).kernel)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    def nbytes(self) -> int:
        if self.packed is not None:
            return self.packed.nbytes() + _nbytes(self.bias)
        return _nbytes(self.codes, self.scale, self.zero_point, self.bias)


@dataclass
class ConcatLinear(Linear):
    """Several linears of one input whose outputs are concatenated (when they cannot merge)."""

    parts: list[Linear]
    bias: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)


@dataclass
class TransformedLinear(Linear):
    """A linear that reads its input multiplied by an online Hadamard (compressed-tensors'
    ``transform_config``, QuaRot / SpinQuant's R4) whose inverse its weight holds: ``transform``
    is the backend's (a fast Walsh–Hadamard transform on the CPU), ``block`` its order."""

    inner: Linear
    block: int
    transform: Callable[[torch.Tensor, int], torch.Tensor] = field(repr=False, compare=False)

    @property
    def out_features(self) -> int:
        return self.inner.out_features

    @property
    def bias(self) -> torch.Tensor | None:
        return self.inner.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.transform(x, self.block))

    def nbytes(self) -> int:
        return self.inner.nbytes()


def int8_rows(lin: DenseLinear) -> QuantLinear:
    """``lin`` quantized per output channel to int8: symmetric round-to-nearest, scale = max|w| / 127
    (``W8A16``'s rule; the output head option ``lm_head="int8"``)."""
    scheme = get_scheme("W8A16")
    weight = lin.full_weight()
    scale, _ = compute_qparams(weight, scheme)
    return QuantLinear(quantize(weight, scale, None, scheme), scale, None, None, None, scheme.name, lin.bias,
                       format_for(scheme).kernel)


HALF_HEADS = {"bf16": torch.bfloat16, "f16": torch.float16}


def smaller_head(head: DenseLinear, kind: str) -> Linear:
    """The float output head as ``lm_head`` asks: ``int8`` rows, or rounded to ``bf16`` / ``f16``
    (f16: the values a GGUF export keeps for an unquantized head)."""
    if kind == "int8":
        return int8_rows(head)
    return DenseLinear.from_weight(head.full_weight().to(HALF_HEADS[kind]), head.bias)


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _cat_bias(parts: list[Linear]) -> torch.Tensor | None:
    if all(p.bias is None for p in parts):
        return None
    ref = next(p.bias for p in parts if p.bias is not None)
    return torch.cat([p.bias if p.bias is not None else ref.new_zeros(p.out_features) for p in parts])


def merge_linears(parts: list[Linear]) -> Linear:
    """One linear computing ``cat([p(x) for p in parts], -1)``: weights concatenated along the
    output dimension when the formats agree, a ``ConcatLinear`` otherwise. Linears reading the same
    online transform of the input transform it once, before their merged product."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if isinstance(first, TransformedLinear) and all(
            isinstance(p, TransformedLinear) and (p.block, p.transform) == (first.block, first.transform) for p in parts):
        return TransformedLinear(merge_linears([p.inner for p in parts]), first.block, first.transform)
    if all(isinstance(p, DenseLinear) for p in parts):
        return DenseLinear(torch.cat([p.full_weight() for p in parts]), _cat_bias(parts))
    if all(isinstance(p, QuantLinear) for p in parts):
        same = all(
            (p.group_size, p.activations, p.scheme_name, p.codes.dtype, p.zero_point is None, p.scale.shape[1], p.kernel)
            == (first.group_size, first.activations, first.scheme_name, first.codes.dtype, first.zero_point is None,
                first.scale.shape[1], first.kernel)
            for p in parts
        )
        if same:
            zp = None if first.zero_point is None else torch.cat([p.zero_point for p in parts])
            return QuantLinear(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), zp,
                               first.group_size, first.activations, first.scheme_name, _cat_bias(parts), first.kernel)
    return ConcatLinear(parts)


@dataclass
class GatedMLP:
    """``down(act(gate) * up)`` with gate and up merged into one linear (``gate_up``)."""

    gate_up: Linear
    down: Linear
    act_mul: Callable[[torch.Tensor], torch.Tensor]  # the backend's silu_mul / gelu_mul

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act_mul(self.gate_up(x)))

    def linears(self) -> list[Linear]:
        return [self.gate_up, self.down]


@dataclass
class SparseMoE:
    """A mixture-of-experts MLP: a float router picks ``top_k`` experts per token (softmax over
    all experts, then the chosen weights renormalised when ``renormalize``: Mixtral, Qwen3-MoE's
    ``norm_topk_prob``); each expert runs once on the rows routed to it, weighted outputs summed
    in expert order (as transformers does); a shared expert, gated by ``sigmoid(shared_gate(x))``,
    is added to every token (Qwen2-MoE)."""

    router: Linear
    experts: list[GatedMLP]
    top_k: int
    renormalize: bool
    shared: GatedMLP | None = None
    shared_gate: Linear | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            rows, slot = torch.where(chosen == e)
            # rows are distinct (top-k picks an expert once per token): a plain indexed add; CPU
            # index_add_ runs tiny adds through the thread pool (~20 ms each on a loaded 2-core machine)
            out[rows] += self.experts[e](x[rows]) * weights[rows, slot, None]
        if self.shared is not None:
            shared = self.shared(x)
            out = out + (torch.sigmoid(self.shared_gate(x)) * shared if self.shared_gate is not None else shared)
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token: the weights ``[T, top_k]`` (x's dtype) and indices of its experts."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def linears(self) -> list[Linear]:
        found = [self.router] + [lin for e in self.experts for lin in e.linears()]
        if self.shared is not None:
            found += self.shared.linears()
        return found + ([self.shared_gate] if self.shared_gate is not None else [])
