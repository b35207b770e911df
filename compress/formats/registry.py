"""The registered weight formats, and the planner's names for them.

Every part of llmopt that depends on how a weight is stored asks this module:

* the planner (:mod:`llmopt.quant.sensitivity`, :mod:`llmopt.quant.allocate`) — the candidate
  formats (:data:`LINEAR_CANDIDATES`, :data:`OUTER_CANDIDATES`: a format and a group size under a
  name such as ``int4_g32``), their schemes and their exact sizes in a checkpoint and a GGUF file;
* the compressed-tensors writer and reader (:mod:`llmopt.formats.compressed`) — packing;
* the GGUF exporter — which block types carry a weight's codes;
* the runtime's loader and kernels — which kernel runs a weight.

:func:`format_of` names the format of a quantized weight: from its scheme, or, for a checkpoint
read back (compressed-tensors records neither grids nor super-block scales), from its codes and
scales. A new format is one :class:`~llmopt.formats.weight_format.WeightFormat` passed to
:func:`register` (before the plain formats it refines, when it is recognized by content), plus a
:class:`Candidate` line when the planner should consider it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as T

from llmopt.formats.schemes import (
    IQ4_NL_GRID,
    IQ4_XS_STEPS,
    K_GROUP,
    K_MIN_STEPS,
    Q2_K_STEPS,
    Q3_K_STEPS,
    Q4_K_STEPS,
    Q6_K_STEPS,
    QuantizedWeight,
    QuantScheme,
    effective_group_size,
    on_grid,
)
from llmopt.formats.weight_format import GgufCarrier, WeightFormat

FORMATS: dict[str, WeightFormat] = {}  # name → format, in recognition order (refinements first)


def register(fmt: WeightFormat) -> WeightFormat:
    if fmt.name in FORMATS:
        raise ValueError(f"weight format {fmt.name} is registered already")
    FORMATS[fmt.name] = fmt
    return fmt


_Q8_0 = GgufCarrier(T.Q8_0, 32)
_IQ4_NL = GgufCarrier(T.IQ4_NL, 32)

# refinements first: recognized by their codes (grid) or scales (k · d) before the plain formats
register(WeightFormat("nl4x", 8, grid=IQ4_NL_GRID, scale_steps=IQ4_XS_STEPS, kernel="nl4",
                      gguf=(GgufCarrier(T.IQ4_XS, 32, IQ4_XS_STEPS), _IQ4_NL, _Q8_0),
                      description="IQ4_NL grid codes in int8, scales k·d per 256 features (GGUF IQ4_XS)"))
register(WeightFormat("nl4", 8, grid=IQ4_NL_GRID, kernel="nl4", gguf=(_IQ4_NL, _Q8_0),
                      description="llama.cpp's non-uniform IQ4_NL grid, codes held in int8 (GGUF IQ4_NL)"))
register(WeightFormat("int6x", 6, scale_steps=Q6_K_STEPS, gguf=(GgufCarrier(T.Q6_K, K_GROUP, Q6_K_STEPS), _Q8_0),
                      description="6-bit codes, 8-bit scale multiples per 256 features (GGUF Q6_K)"))
register(WeightFormat("int3x", 3, scale_steps=Q3_K_STEPS, kernel="int4", gguf=(GgufCarrier(T.Q3_K, K_GROUP, Q3_K_STEPS), _Q8_0),
                      description="3-bit codes, 6-bit scale multiples per 256 features (GGUF Q3_K)"))
register(WeightFormat("int5k", 5, scale_steps=Q4_K_STEPS, gguf=(GgufCarrier(T.Q5_K, 32, Q4_K_STEPS, one_sign=True), _Q8_0),
                      description="5-bit codes, 6-bit unsigned scale multiples per 256 features (GGUF Q5_K)"))
register(WeightFormat("int4k", 4, scale_steps=Q4_K_STEPS, kernel="int4",
                      gguf=(GgufCarrier(T.Q4_K, 32, Q4_K_STEPS, one_sign=True), _Q8_0),
                      description="4-bit codes, 6-bit unsigned scale multiples per 256 features (GGUF Q4_K)"))
# llama.cpp's affine types in full: float offsets (mins) beside the scales, 6-bit per sub-block in the K-quants
register(WeightFormat("int5km", 5, False, scale_steps=Q4_K_STEPS, float_zero=True, min_steps=K_MIN_STEPS,
                      gguf=(GgufCarrier(T.Q5_K, 32, Q4_K_STEPS, one_sign=True, min_steps=K_MIN_STEPS),),
                      description="5-bit codes, 6-bit scales and mins per 256 features (GGUF Q5_K)"))
register(WeightFormat("int4km", 4, False, scale_steps=Q4_K_STEPS, float_zero=True, min_steps=K_MIN_STEPS, kernel="int4",
                      gguf=(GgufCarrier(T.Q4_K, 32, Q4_K_STEPS, one_sign=True, min_steps=K_MIN_STEPS),),
                      description="4-bit codes, 6-bit scales and mins per 256 features (GGUF Q4_K)"))
register(WeightFormat("int5m", 5, False, float_zero=True, gguf=(GgufCarrier(T.Q5_1, 32),),
                      description="5-bit codes, float16 scale and min per group (GGUF Q5_1)"))
register(WeightFormat("int4m", 4, False, float_zero=True, kernel="int4", gguf=(GgufCarrier(T.Q4_1, 32),),
                      description="4-bit codes, float16 scale and min per group (GGUF Q4_1)"))
register(WeightFormat("int2k", 2, scale_steps=Q2_K_STEPS, kernel="int4",
                      gguf=(GgufCarrier(T.Q2_K, K_GROUP, Q2_K_STEPS, one_sign=True), _Q8_0),
                      description="2-bit codes, 4-bit unsigned scale multiples per 256 features (GGUF Q2_K)"))
_PLAIN_GGUF = {
    (4, True): (GgufCarrier(T.Q4_0, 32), GgufCarrier(T.Q4_1, 32), _Q8_0),
    (4, False): (GgufCarrier(T.Q4_1, 32), _Q8_0),
    (5, True): (GgufCarrier(T.Q5_0, 32), GgufCarrier(T.Q5_1, 32), _Q8_0),
    (5, False): (GgufCarrier(T.Q5_1, 32), _Q8_0),
    (8, False): (),  # q - z of 8-bit codes leaves int8
}
for _bits in range(2, 9):
    for _symmetric in (True, False):
        register(WeightFormat(f"int{_bits}{'' if _symmetric else 'a'}", _bits, _symmetric,
                              kernel="int4" if _bits <= 4 else "int8", gguf=_PLAIN_GGUF.get((_bits, _symmetric), (_Q8_0,)),
                              description=f"{_bits}-bit integer codes, {'symmetric' if _symmetric else 'with zero points'}"))
# E2M1 codes held as float8 values: the runtime's fp8 kernel runs them (one byte a code in memory)
register(WeightFormat("nvfp4", 4, float_codes=True, kernel="fp8", fp4="e4m3",
                      description="FP4 E2M1 codes, FP8 E4M3 scales per 16 features and a float32 global scale (NVFP4)"))
register(WeightFormat("mxfp4", 4, float_codes=True, kernel="fp8", fp4="e8m0", gguf=(GgufCarrier(T.MXFP4, 32),),
                      description="FP4 E2M1 codes, E8M0 power-of-two scales per 32 features (MXFP4, GGUF MXFP4)"))
register(WeightFormat("fp8", 8, float_codes=True, kernel="fp8", description="float8 e4m3 codes"))


def format_of(qw: QuantizedWeight) -> WeightFormat:
    """The registered format of a quantized weight (by its scheme, else by its codes and scales)."""
    for fmt in FORMATS.values():
        if fmt.holds(qw):
            return fmt
    raise ValueError(f"no registered weight format holds {qw.scheme.name} codes")


def format_for(scheme: QuantScheme) -> WeightFormat:
    """The registered format a scheme asks for (by its fields alone)."""
    for fmt in FORMATS.values():
        if fmt.describes(scheme):
            return fmt
    raise ValueError(f"no registered weight format for scheme {scheme.name}")


def kernel_for_codes(codes: torch.Tensor, zero_point: torch.Tensor | None) -> str:
    """The runtime kernel for bare codes whose scheme is not known: the narrowest that holds them
    (float8 → fp8; codes in [-8, 7] → int4; on the IQ4_NL grid → nl4; else int8)."""
    if codes.dtype == torch.float8_e4m3fn:
        return "fp8"
    if codes.numel() and int(codes.min()) >= -8 and int(codes.max()) <= 7:
        return "int4"
    if zero_point is None and on_grid(codes):
        return "nl4"
    return "int8"


# ---------------------------------------------------------------------------------------------
# The planner's candidates: a format and a group size under one name


@dataclass(frozen=True)
class Candidate:
    """A format the planner may give a tensor: ``format`` in groups of ``group_size`` (None: one
    scale per row), the group size falling back to a divisor of the row where it does not divide."""

    name: str
    format: WeightFormat
    group_size: int | None

    def scheme(self, in_features: int, scale_dtype: str = "bfloat16") -> QuantScheme:
        return self.format.scheme(effective_group_size(in_features, self.group_size), scale_dtype)

    def checkpoint_bytes(self, shape: tuple[int, int], scale_dtype: str = "bfloat16") -> int:
        """Bytes written for a ``[out, in]`` tensor of this candidate."""
        out_features, in_features = shape
        return self.format.checkpoint_bytes(out_features, in_features, effective_group_size(in_features, self.group_size),
                                            scale_dtype)

    def gguf_bits(self, in_features: int) -> float:
        """Bits per weight in a ``--type auto`` GGUF file (F16 where no block type fits)."""
        carrier = self.format.gguf_carrier(in_features, effective_group_size(in_features, self.group_size))
        return carrier.bits if carrier is not None else float(GGUF_FLOAT_BITS)


GGUF_FLOAT_BITS = 16  # float matrices of a quantized checkpoint are written as F16 in a GGUF file


def _candidates(*rows: tuple[str, str, int | None]) -> dict[str, Candidate]:
    return {name: Candidate(name, FORMATS[fmt], group) for name, fmt, group in rows}


# decoder Linears (their GGUF block: ``gguf_bits``)
LINEAR_CANDIDATES = _candidates(
    ("int4_g128", "int4", 128), ("int4_g64", "int4", 64), ("int4_g32", "int4", 32),
    ("int4a_g32", "int4a", 32), ("nl4x_g32", "nl4x", 32), ("nl4_g32", "nl4", 32), ("int5_g32", "int5", 32),
    ("int5a_g32", "int5a", 32), ("int6_g32", "int6", 32), ("int6x_g16", "int6x", 16), ("int3x_g16", "int3x", 16),
    ("int8_g32", "int8", 32), ("int8", "int8", None),
    # llama.cpp's K-quants with mins (Q4_K, Q5_K): one code a byte in a checkpoint, 4.5 / 5.5 bits in GGUF
    ("int4km_g32", "int4km", 32), ("int5km_g32", "int5km", 32),
)
# candidates larger in a checkpoint than int8 (one code a byte, float32 mins), smaller only in a GGUF file
GGUF_SIZED_CANDIDATES = ("int4km_g32", "int5km_g32")
OUTER_GROUP = 32  # the group size of the grouped embedding/head formats
# the token embedding and the output head (``--head`` / ``--embedding``)
OUTER_CANDIDATES = _candidates(
    ("int4", "int4", OUTER_GROUP), ("nl4", "nl4", OUTER_GROUP), ("int4a", "int4a", OUTER_GROUP),
    ("int5", "int5", OUTER_GROUP), ("int5a", "int5a", OUTER_GROUP), ("int6", "int6", OUTER_GROUP), ("int8", "int8", None),
)


def candidate(name: str) -> Candidate:
    """A planner name (a Linear's ``int4_g32`` … or an outer matrix's ``int4`` …)."""
    found = LINEAR_CANDIDATES.get(name) or OUTER_CANDIDATES.get(name)
    if found is None:
        raise KeyError(name)
    return found


# the format (and group size) holding each GGUF block type's codes and scales exactly, under the
# type's name (``q4_k`` …): what llama.cpp's mixtures (``--scheme Q4_K_M``) give a tensor
GGUF_TYPE_CANDIDATES: dict[T, Candidate] = {qtype: Candidate(qtype.name.lower(), FORMATS[fmt], group) for qtype, fmt, group in (
    (T.Q8_0, "int8", 32), (T.Q6_K, "int6x", 16), (T.Q5_K, "int5km", 32), (T.Q4_K, "int4km", 32), (T.Q3_K, "int3x", 16),
    (T.Q2_K, "int2k", 16), (T.Q5_1, "int5m", 32), (T.Q5_0, "int5", 32), (T.Q4_1, "int4m", 32), (T.Q4_0, "int4", 32),
    (T.IQ4_NL, "nl4", 32), (T.IQ4_XS, "nl4x", 32),
)}
