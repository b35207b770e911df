"""One weight format as an object: what its codes are, what it costs on disk, how it is packed
into a compressed-tensors checkpoint, which GGUF block types carry it exactly, and which runtime
kernel runs it. The registered formats are in :mod:`llmopt.formats.registry`.

A format is *how a Linear's weight is stored* — ``int4`` (symmetric 4-bit codes), ``int5a``
(asymmetric 5-bit), ``nl4`` (int8 codes on llama.cpp's IQ4_NL grid), ``nl4x`` (the same with
super-block scales: IQ4_XS), ``int6x`` / ``int3x`` (Q6_K / Q3_K), ``fp8``, ``nvfp4`` / ``mxfp4``
(E2M1 codes, :mod:`llmopt.formats.fp4`) … — independent of the group size, which a
:class:`~llmopt.formats.schemes.QuantScheme` adds (the FP4 formats have their own: 16, 32).

Sizes are exact: :meth:`WeightFormat.checkpoint_bytes` is the number of bytes of the tensors
:meth:`WeightFormat.pack` writes for one ``[out, in]`` weight (codes packed as compressed-tensors
packs them, scales in their stored dtype, zero points packed), and :meth:`GgufCarrier.bits`
the bits per weight of a GGUF block type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from llmopt.formats import fp4 as fp4_codes
from llmopt.formats.schemes import (
    PRESETS,
    QuantizedWeight,
    QuantScheme,
    get_scheme,
    grid_scheme,
    int_weight_scheme,
    min_factors,
    on_grid,
    superblock_factors,
)

PACKED = "pack-quantized"  # compressed-tensors' format for weight-only integer codes (dense bit packing)
SHAPE_BYTES = 16  # the int64 [2] ``weight_shape`` of a pack-quantized weight


@dataclass(frozen=True)
class GgufCarrier:
    """A GGUF block type that holds a format's codes unchanged: blocks of ``block`` weights along
    a row, one scale per ``sub_block`` weights (``steps``: the scales are ``k · d`` multiples of a
    float16 ``d`` per block, as Q6_K / Q3_K / IQ4_XS store them)."""

    qtype: T
    sub_block: int
    steps: int | None = None
    one_sign: bool = False  # the multiples are stored unsigned (Q4_K, Q5_K, Q2_K): every k of a row has d's sign
    min_steps: int | None = None  # float zero points: mins are m · dmin per block, 0 <= m < min_steps (Q4_K, Q5_K)

    @property
    def block(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def type_bytes(self) -> int:
        """Bytes of one block."""
        return GGML_QUANT_SIZES[self.qtype][1]

    @property
    def bits(self) -> float:
        """Bits per weight in a GGUF file."""
        weights, nbytes = GGML_QUANT_SIZES[self.qtype]
        return nbytes * 8 / weights

    def fits(self, cols: int, group: int | None) -> bool:
        """Whether rows of ``cols`` weights in groups of ``group`` (None: one per row) tile its blocks."""
        return cols % self.block == 0 and (group or cols) % self.sub_block == 0

    def _per_sub_block(self, qw: QuantizedWeight, values: torch.Tensor, steps: int | None) -> torch.Tensor | None:
        """``values`` (one per group) repeated to one per sub-block, None without ``steps`` or when
        ``qw``'s rows do not tile these blocks."""
        cols = qw.codes.shape[1]
        group = qw.group_size or cols
        if steps is None or not self.fits(cols, group):
            return None
        return values.float().repeat_interleave(group // self.sub_block, dim=1)

    def factors(self, qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(d, k)`` of ``qw``'s scales per sub-block (``d`` per block, float16 values), or None
        when they are not of that form (only for types with ``steps``)."""
        per_sub = self._per_sub_block(qw, qw.scale, self.steps)
        found = None if per_sub is None else superblock_factors(per_sub, self.sub_block, self.steps)
        if found is not None and self.one_sign and (found[1] >= 0).any():
            return None
        return found

    def min_factors(self, qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(dmin, m)`` of ``qw``'s mins per sub-block (``dmin`` per block, float16 values), or None
        when they are not of that form (only for types with ``min_steps``)."""
        per_sub = self._per_sub_block(qw, qw.mins(), self.min_steps)
        return None if per_sub is None else min_factors(per_sub, self.sub_block, self.min_steps)

    def carries(self, qw: QuantizedWeight) -> bool:
        """Whether ``qw``'s codes, scales (and mins) go into these blocks exactly."""
        cols = qw.codes.shape[1]
        if not self.fits(cols, qw.group_size):
            return False
        if self.min_steps is not None and self.min_factors(qw) is None:
            return False
        return self.steps is None or self.factors(qw) is not None


@dataclass(frozen=True)
class WeightFormat:
    """One way of storing a Linear's weight (see the module doc).

    ``bits``: bits per code as a checkpoint packs them (``nl4``: 8, int8 codes); ``symmetric``:
    no zero point; ``grid``: the integer codes allowed (None: all of ``bits``); ``scale_steps``:
    group scales are ``k · d`` per 256 features (GGUF K-quant / IQ4_XS scales); ``float_codes``:
    float8 e4m3 codes; ``kernel``: the runtime kernel that runs it (int4, int8, nl4, fp8);
    ``gguf``: block types carrying it exactly, best first; ``info_bits``: bits of information
    per code (what a kernel reads: nl4 runs 4-bit grid indices); ``fp4``: E2M1 codes (held as
    float8 values) with NVFP4 (``e4m3``) or MXFP4 (``e8m0``) scales, packed two a byte;
    ``float_zero``: float zero points (llama.cpp's mins), held with int8 codes in compressed-tensors'
    ``naive-quantized`` form (its packed form takes integer zero points only); ``min_steps``: those
    mins are 6-bit multiples per super-block (Q4_K / Q5_K). Float zero points without super-block
    scales keep float16 scales, as Q4_1 / Q5_1 store them."""

    name: str
    bits: int
    symmetric: bool = True
    grid: tuple[int, ...] | None = None
    scale_steps: int | None = None
    float_codes: bool = False
    kernel: str = "int8"
    gguf: tuple[GgufCarrier, ...] = ()
    description: str = ""
    fp4: str | None = None
    float_zero: bool = False
    min_steps: int | None = None

    # ----- schemes

    def scheme(self, group_size: int | None, scale_dtype: str = "bfloat16") -> QuantScheme:
        """The weight-only scheme of this format with ``group_size`` (None: one scale per row)."""
        if self.fp4 is not None:
            preset = next(p for p in PRESETS.values() if p.scale_format == self.fp4)
            if group_size != preset.group_size:
                raise ValueError(f"{self.name} quantizes in groups of {preset.group_size}, not {group_size}")
            return preset
        if self.float_codes:
            return replace(get_scheme("FP8"), group_size=group_size, scale_dtype=scale_dtype)
        if self.grid is not None:
            scheme = grid_scheme(self.grid, group_size, self.scale_steps)
        else:
            scheme = int_weight_scheme(self.bits, group_size, self.symmetric, self.scale_steps, self.float_zero, self.min_steps)
        return replace(scheme, scale_dtype=scale_dtype)

    def describes(self, scheme: QuantScheme) -> bool:
        """Whether ``scheme`` is this format exactly (as a quantizer is asked for it)."""
        if scheme.scale_format != self.fp4:
            return False
        if scheme.is_float or self.float_codes:
            return scheme.is_float == self.float_codes
        return ((scheme.num_bits, scheme.symmetric, scheme.grid, scheme.scale_steps, scheme.float_zero, scheme.min_steps)
                == (self.bits, self.symmetric, self.grid, self.scale_steps, self.float_zero, self.min_steps))

    def holds(self, qw: QuantizedWeight) -> bool:
        """Whether ``qw`` is of this format: its scheme says so, or (a checkpoint read back names
        neither grids nor super-block scales) its codes lie on the grid / its scales factor."""
        s = qw.scheme
        if s.scale_format != self.fp4:
            return False
        if s.is_float or self.float_codes:
            return s.is_float == self.float_codes
        if (s.num_bits, s.symmetric, s.float_zero) != (self.bits, self.symmetric, self.float_zero):
            return False
        if s.grid is not None or s.scale_steps is not None or s.min_steps is not None:
            return self.describes(s)
        if self.grid is not None and not (qw.zero_point is None and on_grid(qw.codes, self.grid)):
            return False
        if self.min_steps is not None and self.gguf[0].min_factors(qw) is None:
            return False
        return self.scale_steps is None or self.gguf[0].factors(qw) is not None

    @property
    def info_bits(self) -> int:
        """Bits of information per code (what a kernel reads: grid codes run as indices into the grid)."""
        return self.bits if self.grid is None else (len(self.grid) - 1).bit_length()

    def random_codes(self, rows: int, cols: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Codes of this format drawn uniformly (int8; benchmarks and tests)."""
        if self.fp4 is not None:
            grid = torch.tensor(fp4_codes.E2M1_GRID)
            return grid[torch.randint(len(grid), (rows, cols), generator=generator)].to(torch.float8_e4m3fn)
        if self.grid is not None:
            grid = torch.tensor(self.grid, dtype=torch.int8)
            return grid[torch.randint(len(grid), (rows, cols), generator=generator)]
        if self.float_codes:
            return (torch.randn(rows, cols, generator=generator) * 64).to(torch.float8_e4m3fn)
        low = -(2 ** (self.bits - 1))
        return torch.randint(low, -low, (rows, cols), generator=generator, dtype=torch.int8)

    # ----- sizes

    def stored_scale_dtype(self, scale_dtype: str = "bfloat16") -> torch.dtype:
        """The dtype its scales are written in (super-block scales: float32, see ``schemes``)."""
        if self.fp4 is not None:
            return torch.float8_e4m3fn if self.fp4 == "e4m3" else torch.uint8
        return self.scheme(None, scale_dtype).stored_scale_dtype

    def checkpoint_bytes(self, out_features: int, in_features: int, group_size: int | None,
                         scale_dtype: str = "bfloat16", activations: str | None = None) -> int:
        """Bytes of the tensors :meth:`pack` writes for one ``[out, in]`` weight."""
        groups = in_features // (group_size or in_features)
        scale = out_features * groups * self.stored_scale_dtype(scale_dtype).itemsize
        if self.fp4 is not None:  # two codes a byte, one-byte scales, NVFP4's float32 global scale
            return out_features * in_features // 2 + scale + (4 if self.fp4 == "e4m3" else 0)
        if self.packs(activations):
            codes = out_features * math.ceil(in_features * self.bits / 32) * 4 + SHAPE_BYTES
            zero = 0 if self.symmetric else math.ceil(out_features * self.bits / 32) * groups * 4
        else:
            codes = out_features * in_features  # int8 / float8, one byte a code
            zero = 0 if self.symmetric else out_features * groups * (4 if self.float_zero else 1)
        return codes + scale + zero

    def checkpoint_tensors(self, activations: str | None = None) -> tuple[str, ...]:
        """The local names of the tensors :meth:`pack` writes."""
        if self.fp4 is not None:
            return ("weight_packed", "weight_scale", "weight_global_scale")[: 3 if self.fp4 == "e4m3" else 2]
        names = ("weight_packed", "weight_shape", "weight_scale") if self.packs(activations) else ("weight", "weight_scale")
        return names if self.symmetric else (*names, "weight_zero_point")

    # ----- compressed-tensors packing

    def packs(self, activations: str | None = None) -> bool:
        """Whether compressed-tensors packs the codes densely (``pack-quantized``: integer codes of
        a weight-only scheme), rather than one int8 / float8 byte a code; FP4 codes pack two a byte
        in formats of their own (``nvfp4-pack-quantized``, ``mxfp4-pack-quantized``)."""
        return not self.float_codes and not self.float_zero and activations is None

    def pack(self, qw: QuantizedWeight, scale_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The compressed-tensors tensors (local names) of ``qw``: codes packed as compressed-tensors'
        own compressors pack them, scales in ``scale_dtype`` (None: the scheme's stored dtype)."""
        if self.fp4 is not None:
            return self._pack_fp4(qw)
        dtype = scale_dtype or qw.scheme.stored_scale_dtype
        out: dict[str, torch.Tensor] = {"weight_scale": qw.scale.to(dtype).contiguous()}
        codes = qw.codes.contiguous()
        if self.packs(qw.scheme.activations):
            out["weight_packed"] = pack_to_int32(codes.to(torch.int8), self.bits)
            out["weight_shape"] = torch.tensor(tuple(codes.shape), dtype=torch.int64)
            if qw.zero_point is not None:
                out["weight_zero_point"] = pack_to_int32(qw.zero_point.to(torch.int8), self.bits, packed_dim=0)
            return out
        out["weight"] = codes.to(torch.float8_e4m3fn if self.float_codes else torch.int8)
        if qw.zero_point is not None:
            zero_dtype = torch.float32 if self.float_zero else torch.int8
            out["weight_zero_point"] = qw.zero_point.to(zero_dtype).contiguous()
        return out

    def unpack(self, tensors: dict[str, torch.Tensor], scheme: QuantScheme, group_size: int | None) -> QuantizedWeight:
        """Inverse of :meth:`pack`: the QuantizedWeight (scales float32; ``scheme`` records the
        dtype they were stored in)."""
        if self.fp4 is not None:
            return self._unpack_fp4(tensors, scheme, group_size)
        stored = tensors["weight_scale"]
        if stored.dtype in (torch.bfloat16, torch.float16, torch.float32) and scheme.scale_steps is None:
            scheme = scheme.with_scale_dtype(stored.dtype)
        scale = stored.to(torch.float32)
        zp = tensors.get("weight_zero_point")
        if "weight_packed" in tensors:
            shape = torch.Size(tensors["weight_shape"].tolist())
            codes = unpack_from_int32(tensors["weight_packed"], self.bits, shape)
            if zp is not None:
                zp = unpack_from_int32(zp, self.bits, torch.Size((shape[0], scale.shape[1])), packed_dim=0)
        else:
            codes = tensors["weight"]
            codes = codes if self.float_codes else codes.to(torch.int8)
        zp = None if zp is None or self.symmetric else zp.to(torch.float32 if self.float_zero else torch.int32)
        return QuantizedWeight(codes, scale, zp, scheme, group_size)

    def _pack_fp4(self, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        """compressed-tensors' nvfp4 / mxfp4-pack-quantized tensors: E2M1 codes two a byte, FP8
        scales times the global scale (NVFP4) or E8M0 exponents (MXFP4); scales are not re-rounded
        (the scheme's scales always come from :func:`~llmopt.formats.schemes.round_scales`)."""
        out = {"weight_packed": fp4_codes.pack_e2m1(qw.codes)}
        if self.fp4 == "e4m3":
            g = qw.scheme.global_scale_tensor()
            out["weight_scale"] = fp4_codes.stored_e4m3(qw.scale, g).contiguous()
            out["weight_global_scale"] = g
        else:
            out["weight_scale"] = fp4_codes.e8m0_exponents(qw.scale).contiguous()
        return out

    def _unpack_fp4(self, tensors: dict[str, torch.Tensor], scheme: QuantScheme, group_size: int | None) -> QuantizedWeight:
        """Inverse of :meth:`_pack_fp4`: effective float32 scales as compressed-tensors computes them
        (FP8 scale / global scale; ``2^(e - 127)``)."""
        codes = fp4_codes.unpack_e2m1(tensors["weight_packed"])
        stored = tensors["weight_scale"]
        if self.fp4 == "e4m3":
            g = tensors["weight_global_scale"].to(torch.float32).reshape(1)
            scheme = scheme.with_global_scale(g)
            scale = stored.to(torch.float32) / g
        else:
            scale = fp4_codes.e8m0_values(stored)
        return QuantizedWeight(codes, scale, None, scheme, group_size)

    def dequantize(self, qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight: ``(codes - zero point) · scale`` per group (grid codes are the grid's values)."""
        return qw.dequantize(dtype)

    # ----- GGUF

    def gguf_types(self, qw: QuantizedWeight) -> list[T]:
        """GGUF block types that hold ``qw``'s codes exactly, best first."""
        return [c.qtype for c in self.gguf if c.carries(qw)]

    def gguf_carrier(self, in_features: int, group_size: int | None) -> GgufCarrier | None:
        """The block type a ``--type auto`` export writes a weight of this shape in (super-block
        scales assumed of their form), None when none fits (F16)."""
        return next((c for c in self.gguf if c.fits(in_features, group_size)), None)

    def gguf_carrier_of(self, qtype: T) -> GgufCarrier:
        return next(c for c in self.gguf if c.qtype == qtype)
