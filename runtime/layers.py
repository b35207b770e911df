"""Linear layers behind one small interface, so faster kernels can replace the reference ones.

``DenseLinear`` holds a float weight (run by the C++ GEMV of ``kernels.cpu_dense`` for a few
rows, torch otherwise); ``QuantLinear`` keeps a quantized weight as stored (int4
codes in int8, int8, or float8 with scales / zero points) and calls a kernel that dequantizes
it per call, or, once ``use_kernels`` has packed it, the C++ CPU kernels (``kernels.cpu_linear``).
Projections that read the same input (q/k/v, gate/up) are merged into one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from llmopt.formats.schemes import QuantizedWeight, compute_qparams, get_scheme, quantize

from .kernels import cpu_dense, cpu_linear, reference


class Linear:
    """``y = x @ W.T + b``."""

    out_features: int
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def nbytes(self) -> int:
        raise NotImplementedError


@dataclass
class DenseLinear(Linear):
    """A float weight, held in the layout its kernel streams best (``use_kernels``):

    - C++ kernels (``auto`` / ``cpu``): ``weight`` ``[out, in]`` as stored in checkpoints. Up to
      ``cpu_dense.GEMV_ROWS`` rows (decode) run our GEMV; more rows run torch's linear on it.
    - ``reference`` (or no C++ build): ``weight_t`` ``[in, out]``, ``x @ W.T`` through
      ``torch.mm``, which CPU BLAS runs markedly faster in that layout for one token.

    Exactly one of the two is set. Loading leaves ``weight`` until ``use_kernels`` picks."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None = None
    weight_t: torch.Tensor | None = None

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

    def use_kernels(self, kernels: str) -> None:
        """``"auto"`` / ``"cpu"``: rows for the C++ GEMV when it builds; ``"reference"``: transposed for torch."""
        rows = kernels != "reference" and self.full_weight().device.type == "cpu" and cpu_dense.available()
        if rows and self.weight is None:
            self.weight, self.weight_t = self.weight_t.t().contiguous(), None
        elif not rows and self.weight_t is None:
            self.weight_t, self.weight = self.weight.t().contiguous(), None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_t is not None:  # a narrower weight (bf16 head) is widened per call, as the GEMV does in registers
            return reference.dense_linear_t(x, self.weight_t.to(x.dtype), self.bias)
        return cpu_dense.linear(x, self.weight, self.bias)

    def nbytes(self) -> int:
        return _nbytes(self.weight, self.weight_t, self.bias)


@dataclass
class QuantLinear(Linear):
    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    group_size: int | None
    activations: str | None
    scheme_name: str
    bias: torch.Tensor | None = None
    packed: cpu_linear.PackedLinear | None = field(default=None, repr=False, compare=False)
    run: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False, compare=False)  # bound kernel

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> QuantLinear:
        return cls(qw.codes, qw.scale, qw.zero_point, qw.group_size, qw.scheme.activations, qw.scheme.name, bias)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    def use_kernels(self, kernels: str) -> None:
        """``"cpu"`` / ``"auto"``: pack the weight for the C++ CPU kernels when they cover its format
        (and are built); ``"reference"``: dequantize per call in plain torch."""
        self.packed = None
        if kernels != "reference":
            self.packed = cpu_linear.pack(self.codes, self.scale, self.zero_point, self.group_size, self.activations)
        self.run = None
        if self.packed is not None:
            # the packed copy replaces the codes (int4 codes held one per byte would double the memory)
            self.codes = self.codes[:, :0]
            self.run = cpu_linear.bind(self.packed, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.run is not None:
            return self.run(x)
        return reference.quant_linear(x, self.codes, self.scale, self.zero_point, self.group_size, self.activations, self.bias)

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


def int8_rows(lin: DenseLinear) -> QuantLinear:
    """``lin`` quantized per output channel to int8: symmetric round-to-nearest, scale = max|w| / 127
    (``W8A16``'s rule; the output head option ``lm_head="int8"``)."""
    scheme = get_scheme("W8A16")
    weight = lin.full_weight()
    scale, _ = compute_qparams(weight, scheme)
    return QuantLinear(quantize(weight, scale, None, scheme), scale, None, None, None, scheme.name, lin.bias)


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _cat_bias(parts: list[Linear]) -> torch.Tensor | None:
    if all(p.bias is None for p in parts):
        return None
    ref = next(p.bias for p in parts if p.bias is not None)
    return torch.cat([p.bias if p.bias is not None else ref.new_zeros(p.out_features) for p in parts])


def merge_linears(parts: list[Linear]) -> Linear:
    """One linear computing ``cat([p(x) for p in parts], -1)``: weights concatenated along the
    output dimension when the formats agree, a ``ConcatLinear`` otherwise."""
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, DenseLinear) for p in parts):
        return DenseLinear(torch.cat([p.full_weight() for p in parts]), _cat_bias(parts))
    if all(isinstance(p, QuantLinear) for p in parts):
        first = parts[0]
        same = all(
            (p.group_size, p.activations, p.scheme_name, p.codes.dtype, p.zero_point is None, p.scale.shape[1])
            == (first.group_size, first.activations, first.scheme_name, first.codes.dtype, first.zero_point is None, first.scale.shape[1])
            for p in parts
        )
        if same:
            zp = None if first.zero_point is None else torch.cat([p.zero_point for p in parts])
            return QuantLinear(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), zp,
                               first.group_size, first.activations, first.scheme_name, _cat_bias(parts))
    return ConcatLinear(parts)
