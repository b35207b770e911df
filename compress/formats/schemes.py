"""Quantization schemes and number formats: the one place that knows how weights are stored.

A weight matrix ``W`` of shape ``[out, in]`` is split along ``in`` into groups of
``group_size`` columns (one group spanning all of ``in`` when the scheme is per-channel).
Each (row, group) has a ``scale`` and, for asymmetric schemes, an integer ``zero_point``::

    q = clamp(round(W / scale) + zero_point, qmin, qmax)      # integer codes
    W_hat = (q - zero_point) * scale                          # dequantized

FP8 (e4m3) weights have a per-row scale and no zero point; the codes are float8 values.
FP4 weights (NVFP4, MXFP4: ``QuantScheme.scale_format``) have E2M1 codes, held as float8 values,
and scales of their own formats (FP8 relative to a per-tensor global scale, or powers of two):
see :mod:`llmopt.formats.fp4`. ``QuantizedWeight.scale`` holds the effective float32 scales.

A *grid* scheme (``QuantScheme.grid``) restricts the int8 codes to a fixed set of values: each
weight rounds to the nearest ``scale * g`` over ``g`` in the grid. ``IQ4_NL_GRID`` is llama.cpp's
16-value non-uniform IQ4_NL grid: 4 bits of information per weight held in int8 codes, so that
compressed-tensors loaders read them exactly (as 8-bit) and the GGUF export stores them as
IQ4_NL (4.5 bits per weight) without rounding again. Grid scales are signed: the weight of
largest magnitude may map onto either end of the (asymmetric) grid. With ``scale_steps`` the
scales of each super-block of ``SUPERBLOCK`` (256) input features are further restricted to
integer multiples ``k * d`` of one float16 ``d``, ``-steps/2 <= k < steps/2``: llama.cpp's IQ4_XS
(6-bit sub-block scales, 4.25 bits per weight) when ``steps`` is 64 (rows whose length 256
does not divide keep free scales: IQ4_NL). Symmetric integer schemes take ``scale_steps`` too:
6-bit codes in groups of 16 with 8-bit multiples (``Q6_K_STEPS``) are llama.cpp's Q6_K
(6.5625 bits per weight), 3-bit codes in groups of 16 with 6-bit multiples (``Q3_K_STEPS``) its
Q3_K (3.4375 bits per weight).

*Float zero points* (``QuantScheme.float_zero``) are llama.cpp's mins: the offset of a group is any
float, not a multiple of its scale, so ``zero_point`` is float32 and the codes are
``round(W / scale + zero_point)``; Q4_1 / Q5_1 keep float16 scales and mins, Q4_K / Q5_K tie both
to their super-block (``scale_steps``, ``min_steps``: 6-bit multiples of a float16 ``d`` and
``dmin``); :func:`affine_qparams` fits them.

Scales are stored in 16 bits (``QuantScheme.scale_dtype``: bfloat16 by default, the source's
float16 for a float16 model) and rounded to that dtype where they are chosen
(:func:`round_scales`, called by :func:`compute_qparams`, :func:`search_qparams`, the scale refit
and :meth:`QuantizedWeight.from_weight`), so the codes are those of the scales as written.
Super-block scales (``scale_steps``) are products ``k * d`` that no 16-bit float holds exactly:
they are stored in float32, so that the GGUF blocks carry them exactly.
The algorithms (RTN, GPTQ, AWQ …) only choose scales and codes; how they are laid out on
disk (compressed-tensors, GGUF) is decided by the savers from what is defined here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from llmopt.formats import fp4
from llmopt.formats.superblocks import (  # noqa: F401 (re-exported: the schemes' super-block rules)
    SUPERBLOCK,
    fit_affine_superblocks,
    min_factors,
    sub_blocks_per_super,
    superblock_factors,
    superblock_mins,
    superblock_scales,
)

FP8_MAX = 448.0  # largest finite float8 e4m3fn value
WeightType = Literal["int", "float"]
ActType = Literal["int8", "fp8"]


@dataclass(frozen=True)
class QuantScheme:
    """How a Linear's weights (and optionally its input activations) are quantized."""

    name: str
    num_bits: int
    weight_type: WeightType = "int"
    group_size: int | None = None  # None: one scale per output row
    symmetric: bool = True
    activations: ActType | None = None  # dynamic per-token activation quantization
    grid: tuple[int, ...] | None = None  # allowed integer codes, ascending (None: every code)
    scale_steps: int | None = None  # scales are k * d per super-block, -steps/2 <= k < steps/2
    # zero points are float offsets, not integers: llama.cpp's mins (Q4_1 / Q5_1 / Q4_K / Q5_K), see affine_qparams
    float_zero: bool = False
    # float_zero with mins quantized per super-block: min = m * dmin, 0 <= m < min_steps, dmin float16 (Q4_K / Q5_K: 64)
    min_steps: int | None = None
    # FP4 scales (E2M1 codes): "e4m3" (NVFP4: FP8 relative to a float32 global scale), "e8m0" (MXFP4)
    scale_format: fp4.ScaleFormat | None = None
    # dtype the scales are stored (and rounded) in: bfloat16 / float16 / float32 (super-block scales: always float32)
    scale_dtype: str = field(default="bfloat16", compare=False)
    # NVFP4: the tensor's float32 global scale (set per weight by the quantizer, fp4.global_scale)
    global_scale: float | None = field(default=None, compare=False)

    # Integer codes are signed for both symmetric and asymmetric schemes (asymmetric ones add a
    # signed zero point), matching compressed-tensors.
    @property
    def qmin(self) -> int:
        return -(2 ** (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        return 2 ** (self.num_bits - 1) - 1

    @property
    def is_float(self) -> bool:
        return self.weight_type == "float"

    @property
    def has_zero_point(self) -> bool:
        return not self.symmetric

    @property
    def is_fp4(self) -> bool:
        """E2M1 codes with NVFP4 / MXFP4 scales."""
        return self.scale_format is not None

    @property
    def needs_global_scale(self) -> bool:
        """NVFP4: scales relative to a per-tensor global scale (set by :meth:`with_global_scale`)."""
        return self.scale_format == "e4m3"

    def with_global_scale(self, value: torch.Tensor | float) -> "QuantScheme":
        """This NVFP4 scheme for one tensor of global scale ``value`` (a float32 value)."""
        return replace(self, global_scale=float(torch.as_tensor(value, dtype=torch.float32).reshape(-1)[0]))

    def global_scale_tensor(self) -> torch.Tensor:
        """The global scale as compressed-tensors stores it: float32 ``[1]``."""
        if self.global_scale is None:
            raise ValueError(f"{self.name} scales are relative to the tensor's global scale: set it with with_global_scale")
        return torch.tensor([self.global_scale], dtype=torch.float32)

    @property
    def stored_scale_dtype(self) -> torch.dtype:
        """The dtype the scales are written in: ``scale_dtype``, float32 for super-block scales
        (``k * d`` products, exact only in float32), float16 for float zero points with free
        scales (Q4_1 / Q5_1's ``d``)."""
        if self.is_fp4:
            return torch.float8_e4m3fn if self.scale_format == "e4m3" else torch.uint8
        if self.scale_steps is not None:
            return torch.float32
        return torch.float16 if self.float_zero else SCALE_DTYPES[self.scale_dtype]  # Q4_1 / Q5_1 hold d in float16

    @property
    def bits_per_weight(self) -> float:
        """Average stored bits per weight including scales (in their stored dtype) and zero points
        (per-channel: the codes alone; see :mod:`llmopt.formats.registry` for exact sizes)."""
        if self.group_size is None:
            return float(self.num_bits)
        zero_bits = 32 if self.float_zero else self.num_bits if self.has_zero_point else 0
        extra = self.stored_scale_dtype.itemsize * 8 + zero_bits
        return self.num_bits + extra / self.group_size

    @property
    def info_bits(self) -> int:
        """Bits of information per code: ``num_bits``, or log2 of a grid's size."""
        return self.num_bits if self.grid is None else (len(self.grid) - 1).bit_length()

    def with_group_size(self, group_size: int | None) -> "QuantScheme":
        return replace(self, group_size=group_size)

    def with_scale_dtype(self, dtype: str | torch.dtype) -> "QuantScheme":
        """This scheme with its scales stored in ``dtype`` (bfloat16, float16 or float32)."""
        name = str(dtype).replace("torch.", "")
        if name not in SCALE_DTYPES:
            raise ValueError(f"scales are stored in {', '.join(SCALE_DTYPES)}, not {name}")
        return replace(self, scale_dtype=name)


SCALE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def scale_dtype_for(source_dtype: torch.dtype | str | None) -> str:
    """The default scale dtype for a model stored in ``source_dtype``: the source's own 16-bit
    dtype (bfloat16, float16), bfloat16 for anything else (float32)."""
    name = str(source_dtype).replace("torch.", "")
    return name if name in ("bfloat16", "float16") else "bfloat16"


def round_scales(scale: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """``scale`` (float32) rounded to the scheme's stored scale dtype: what is written is what the
    codes were chosen for. A scale that would round to zero keeps its sign and the dtype's
    smallest normal magnitude."""
    if scheme.scale_format == "e4m3":
        return fp4.e4m3_scales(scale, scheme.global_scale_tensor())
    if scheme.scale_format == "e8m0":
        return fp4.e8m0_scales(scale)
    dtype = scheme.stored_scale_dtype
    if dtype == torch.float32:
        return scale.float()
    out = scale.to(dtype).float()
    tiny = torch.finfo(dtype).tiny
    return torch.where((out == 0) & (scale != 0), torch.where(scale < 0, -tiny, tiny), out)


# Presets named as compressed-tensors names them.
PRESETS: dict[str, QuantScheme] = {
    "W4A16": QuantScheme("W4A16", 4, group_size=128),
    "W4A16_ASYM": QuantScheme("W4A16_ASYM", 4, group_size=128, symmetric=False),
    "W8A16": QuantScheme("W8A16", 8),
    "W8A8": QuantScheme("W8A8", 8, activations="int8"),
    "W4A8": QuantScheme("W4A8", 4, group_size=128, activations="int8"),
    "FP8": QuantScheme("FP8", 8, weight_type="float"),
    "FP8_DYNAMIC": QuantScheme("FP8_DYNAMIC", 8, weight_type="float", activations="fp8"),
    # llama.cpp's IQ4_NL grid (defined below), held as int8 grid values in compressed-tensors
    "IQ4_NL": QuantScheme("IQ4_NL", 8, group_size=32, grid=(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)),
    # E2M1 codes (see llmopt.formats.fp4); their group sizes are the formats' own
    "NVFP4A16": QuantScheme("NVFP4A16", 4, "float", group_size=16, scale_format="e4m3"),
    "MXFP4A16": QuantScheme("MXFP4A16", 4, "float", group_size=32, scale_format="e8m0"),
}
FP4_SCHEMES = {"NVFP4A16", "MXFP4A16"}
GROUPED_SCHEMES = {"W4A16", "W4A16_ASYM", "W4A8", "IQ4_NL"}


def get_scheme(name: str, group_size: int | None = None) -> QuantScheme:
    """Look up a preset by name; ``group_size`` overrides the preset's (0 or None: per-channel)."""
    key = name.upper()
    if key not in PRESETS:
        raise KeyError(name)
    scheme = PRESETS[key]
    if key in GROUPED_SCHEMES and group_size is not None:
        scheme = scheme.with_group_size(group_size or None)
    return scheme


def int_weight_scheme(num_bits: int, group_size: int | None, symmetric: bool = True,
                      scale_steps: int | None = None, float_zero: bool = False,
                      min_steps: int | None = None) -> QuantScheme:
    """A weight-only integer scheme of any width (2 to 8 bits): the preset of that width when
    there is one (``W4A16``, ``W4A16_ASYM``, ``W8A16``), else ``W<bits>A16`` (as read back from a
    checkpoint's config); ``scale_steps``: group scales quantized per super-block (symmetric, or
    with float zero points); ``float_zero``: float offsets (mins) instead of integer zero points,
    ``min_steps``: those mins quantized per super-block."""
    if not 2 <= num_bits <= 8:
        raise ValueError(f"integer weights take 2 to 8 bits, not {num_bits}")
    if (float_zero or min_steps is not None) and symmetric:
        raise ValueError("float zero points need an asymmetric scheme")
    if min_steps is not None and not float_zero:
        raise ValueError("super-block mins are float zero points: set float_zero")
    if scale_steps is not None and not (symmetric or float_zero):
        raise ValueError("super-block scale steps need a symmetric scheme or float zero points")
    extra = {"scale_steps": scale_steps, "float_zero": float_zero, "min_steps": min_steps}
    for preset in PRESETS.values():
        if preset.grid is None and (preset.num_bits, preset.weight_type, preset.symmetric, preset.activations) == (num_bits, "int", symmetric, None):
            return replace(preset.with_group_size(group_size), **extra)
    return QuantScheme(f"W{num_bits}A16", num_bits, group_size=group_size, symmetric=symmetric, **extra)


# llama.cpp's IQ4_NL values (kvalues_iq4nl): a non-uniform 4-bit grid fitted to bell-shaped weights.
IQ4_NL_GRID: tuple[int, ...] = PRESETS["IQ4_NL"].grid


IQ4_XS_STEPS = 64  # IQ4_XS: 6-bit signed sub-block scales
Q6_K_STEPS = 256  # Q6_K: 8-bit signed scales of 16-weight sub-blocks (with 6-bit codes)
Q3_K_STEPS = 64  # Q3_K: 6-bit signed scales of 16-weight sub-blocks (with 3-bit codes in [-4, 3])
K_GROUP = 16  # sub-block of Q3_K and Q6_K
# Q4_K / Q5_K (6-bit) and Q2_K (4-bit) store unsigned sub-block scales with a min per sub-block. Symmetric
# codes with positive scales fit them exactly (the min is 2^(bits-1) times the scale): the signed range
# below holds those scales as k in [-63, -1] (resp. [-15, -1]) with a negative d, stored as -k and -d.
Q4_K_STEPS = 126
K_MIN_STEPS = 64  # Q4_K / Q5_K's 6-bit unsigned mins (with float zero points: formats int4km, int5km)
Q2_K_STEPS = 30


def on_grid(codes: torch.Tensor, grid: tuple[int, ...] = IQ4_NL_GRID) -> bool:
    """Whether every integer code is a value of ``grid`` (int8 codes of an nl4 / nl4x weight)."""
    return codes.numel() > 0 and bool(torch.isin(codes.to(torch.int16), torch.tensor(grid, dtype=torch.int16)).all())


def grid_scheme(grid: tuple[int, ...], group_size: int | None, scale_steps: int | None = None) -> QuantScheme:
    """A weight-only scheme whose int8 codes lie on ``grid`` (symmetric, signed scales; with
    ``scale_steps``, group scales quantized per super-block)."""
    return QuantScheme("W8A16", 8, group_size=group_size, grid=tuple(grid), scale_steps=scale_steps)


def effective_group_size(in_features: int, asked: int | None) -> int | None:
    """Largest group size dividing ``in_features`` and not larger than ``asked``.

    Returns ``None`` (per-channel) when ``asked`` is None. Powers of two are preferred (the
    group sizes inference kernels such as vLLM's and llama.cpp's blocks support), then
    multiples of 8 (int4 packing stays aligned), then any divisor.
    """
    if asked is None or in_features % asked == 0:
        return asked
    candidates = range(min(asked, in_features), 0, -1)
    for accept in (lambda g: g & (g - 1) == 0 and g >= 8, lambda g: g % 8 == 0, lambda g: True):
        for g in candidates:
            if in_features % g == 0 and accept(g):
                return g
    return None


def _grouped(w: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """View ``[out, in]`` as ``[out, n_groups, group]``."""
    out_features, in_features = w.shape
    g = in_features if group_size is None else group_size
    if in_features % g:
        raise ValueError(f"group size {g} does not divide {in_features} input features")
    return w.reshape(out_features, in_features // g, g)


def compute_qparams(
    w: torch.Tensor,
    scheme: QuantScheme,
    group_size: int | None = None,
    clip_ratio: torch.Tensor | float = 1.0,
    grid_tries: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min-max scales (and zero points) per (row, group) of ``w``.

    ``clip_ratio`` shrinks the range (scalar or ``[out, n_groups]``); see :func:`search_qparams`.
    Grid schemes search their scales (:func:`grid_scales`, ``grid_tries`` candidates a side).
    Returns ``scale [out, n_groups]`` (float32 holding values of the stored scale dtype,
    :func:`round_scales`) and ``zero_point [out, n_groups]`` (int32) or None.
    """
    wg = _grouped(w.float(), group_size)
    if scheme.scale_format == "e8m0":
        return fp4.mx_scales(wg.abs().amax(dim=-1) * clip_ratio), None
    if scheme.scale_format == "e4m3":
        return round_scales(wg.abs().amax(dim=-1) * clip_ratio / fp4.FP4_MAX, scheme), None
    if scheme.is_float:
        absmax = wg.abs().amax(dim=-1) * clip_ratio
        return round_scales((absmax / FP8_MAX).clamp(min=1e-12), scheme), None
    if scheme.grid is not None:
        scales = grid_scales(wg, scheme.grid, clip_ratio, tries=GRID_TRIES if grid_tries is None else grid_tries)
        return round_scales(superblock_scales(scales, wg.shape[-1], scheme.scale_steps), scheme), None
    if scheme.symmetric:
        absmax = wg.abs().amax(dim=-1) * clip_ratio
        # Below 8 bits use the full negative code as llama.cpp's Q4_0 / Q5_0 do: absmax maps onto
        # qmin's magnitude only when the extreme value is negative; dividing by (qmax + 0.5)
        # balances both signs. 8-bit keeps absmax / 127 (W8A16, Q8_0).
        scale = absmax / (scheme.qmax + 0.5) if scheme.num_bits < 8 else absmax / scheme.qmax
        return round_scales(superblock_scales(scale.clamp(min=1e-12), wg.shape[-1], scheme.scale_steps), scheme), None
    if scheme.float_zero:
        return affine_qparams(wg, scheme, clip_ratio)
    wmin = (wg.amin(dim=-1) * clip_ratio).clamp(max=0)
    wmax = (wg.amax(dim=-1) * clip_ratio).clamp(min=0)
    scale = round_scales(((wmax - wmin) / (scheme.qmax - scheme.qmin)).clamp(min=1e-12), scheme)
    zero_point = torch.round(scheme.qmin - wmin / scale).clamp(scheme.qmin, scheme.qmax).to(torch.int32)
    return scale, zero_point


def quantize(
    w: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    scheme: QuantScheme,
    group_size: int | None = None,
) -> torch.Tensor:
    """Integer codes (int8 tensor, or float8_e4m3fn for FP8 and FP4's E2M1 values) of ``w`` with the given qparams."""
    wg = _grouped(w.float(), group_size)
    s = scale.float().unsqueeze(-1)
    if scheme.is_fp4:
        return fp4.round_to_e2m1(wg / s).to(torch.float8_e4m3fn).reshape(w.shape)
    if scheme.is_float:
        q = (wg / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q.reshape(w.shape)
    if scheme.grid is not None:
        return round_to_grid(wg / s, scheme.grid).to(torch.int8).reshape(w.shape)
    if zero_point is not None and zero_point.is_floating_point():  # a float offset: round after adding it
        q = torch.round(wg / s + zero_point.unsqueeze(-1))
    else:
        q = torch.round(wg / s)
        if zero_point is not None:
            q = q + zero_point.unsqueeze(-1)
    q = q.clamp(scheme.qmin, scheme.qmax)
    return q.to(torch.int8).reshape(w.shape)


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    group_size: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Float weights from codes and qparams (inverse of :func:`quantize` up to rounding)."""
    qg = _grouped(q.float(), group_size)
    if zero_point is not None:
        qg = qg - zero_point.float().unsqueeze(-1)
    return (qg * scale.float().unsqueeze(-1)).reshape(q.shape).to(dtype)


def fake_quantize(
    w: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    scheme: QuantScheme,
    group_size: int | None = None,
) -> torch.Tensor:
    """Quantize then dequantize, in ``w``'s dtype."""
    q = quantize(w, scale, zero_point, scheme, group_size)
    return dequantize(q, scale, zero_point, group_size, dtype=w.dtype)


def search_qparams(
    w: torch.Tensor,
    scheme: QuantScheme,
    group_size: int | None = None,
    weight: torch.Tensor | None = None,
    grid: int = 20,
    max_shrink: float = 0.25,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-(row, group) clipping search: the range shrink in ``[1 - max_shrink, 1]`` with least
    (optionally input-weighted) squared error. ``weight`` is a per-input-column importance
    (e.g. the diagonal of the Hessian); None weighs all columns equally.
    """
    wf = w.float()
    wg = _grouped(wf, group_size)
    col_w = None if weight is None else _grouped(weight.float().expand_as(wf), group_size)
    if scheme.grid is not None:
        scale = superblock_scales(grid_scales(wg, scheme.grid, 1.0, col_w), wg.shape[-1], scheme.scale_steps)
        return round_scales(scale, scheme), None
    if scheme.float_zero:  # its own search: least-squares scales and mins over candidate codes
        return affine_qparams(wg, scheme, 1.0, col_w)
    free = replace(scheme, scale_steps=None)  # super-block scales: searched free, rounded once at the end
    best_err = torch.full(wg.shape[:2], float("inf"))
    best_scale, best_zp = compute_qparams(wf, free, group_size)
    for i in range(grid + 1):
        ratio = 1.0 - max_shrink * i / grid
        scale, zp = compute_qparams(wf, free, group_size, clip_ratio=ratio)
        err = (_grouped(fake_quantize(wf, scale, zp, scheme, group_size), group_size) - wg).pow(2)
        if col_w is not None:
            err = err * col_w
        err = err.sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        if zp is not None:
            best_zp = torch.where(better, zp, best_zp)
    return superblock_scales(best_scale, wg.shape[-1], scheme.scale_steps), best_zp


GRID_TRIES = 8  # scale candidates on each side of those mapping the extreme weight onto an end of the grid


@functools.lru_cache(maxsize=8)
def _grid_table(grid: tuple[int, ...]) -> torch.Tensor:
    """The nearest grid value for each half-unit bin ``[k/2, (k+1)/2)``, ``k`` from ``2 * grid[0]``
    to ``2 * grid[-1]``: midpoints of integer grid values are multiples of 1/2, so no bin
    straddles one and the lookup is exact."""
    values = torch.tensor(grid, dtype=torch.float32)
    centers = torch.arange(2 * grid[0], 2 * grid[-1] + 1, dtype=torch.float32) / 2 + 0.25
    return values[(centers.unsqueeze(-1) - values).abs().argmin(-1)]


def round_to_grid(x: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
    """Each value of ``x`` (in grid units) replaced by the nearest grid value (float32; a value
    exactly halfway between two grid values takes the upper one)."""
    table = _grid_table(grid).to(x.device)
    bins = torch.floor(x.float() * 2).clamp_(2 * grid[0], 2 * grid[-1]).sub_(2 * grid[0])
    return table[bins.long()]


def grid_scales(
    wg: torch.Tensor, grid: tuple[int, ...], clip_ratio: torch.Tensor | float = 1.0, col_w: torch.Tensor | None = None,
    tries: int = GRID_TRIES,
) -> torch.Tensor:
    """Signed scales ``[out, n_groups]`` of grouped weights ``wg`` ``[out, n_groups, group]`` on ``grid``.

    Much as llama.cpp chooses IQ4_NL scales: the weight of largest magnitude ``m`` (times
    ``clip_ratio``) maps near either end ``e`` of the grid: candidates ``m / (e + 2t)`` for
    ``|t| <= tries``, each also refined to the least-squares scale of its codes; the
    candidate with the least (``col_w``-weighted) squared error wins (within 0.2% of a dense
    sweep of signed scales on Gaussian weights).
    """
    wg = wg.float()
    pick = wg.abs().argmax(dim=-1, keepdim=True)
    extreme = torch.gather(wg, -1, pick).squeeze(-1) * clip_ratio
    extreme = torch.where(extreme.abs() < 1e-12, torch.full_like(extreme, 1e-12), extreme)
    weight = torch.ones_like(wg) if col_w is None else col_w.float()
    best_err = torch.full(wg.shape[:2], float("inf"), device=wg.device)
    best = extreme / grid[0]

    def consider(d: torch.Tensor, q: torch.Tensor) -> None:
        nonlocal best, best_err
        err = (weight * (q * d.unsqueeze(-1) - wg).square()).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, d, best)

    for end, t in ((end, t) for end in (grid[0], grid[-1]) for t in range(-tries, tries + 1)):
        d = extreme / (end + 2 * t)
        q = round_to_grid(wg / d.unsqueeze(-1), grid)
        consider(d, q)
        wq = weight * q
        refined = (wq * wg).sum(-1) / (wq * q).sum(-1).clamp(min=1e-30)
        refined = torch.where(refined.abs() > 1e-12, refined, d)
        consider(refined, round_to_grid(wg / refined.unsqueeze(-1), grid))
    return best


AFFINE_STEPS = 10  # candidate scales each side of min-max: (levels + t / 10) / range for |t| <= 10


def affine_qparams(
    wg: torch.Tensor, scheme: QuantScheme, clip_ratio: torch.Tensor | float = 1.0, col_w: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and float zero points ``[out, n_groups]`` of grouped weights ``wg`` for a
    ``float_zero`` scheme: ``w ≈ s · u − min`` with unsigned codes ``u`` in ``[0, 2^bits − 1]``.

    Much as llama.cpp fits Q4_K / Q5_K / Q4_1 / Q5_1 blocks: for candidate scales around the
    min-max one, the codes they give are fitted by (``col_w``-weighted) least squares for both the
    scale and the min, and the best fit kept; mins are non-negative for super-block mins (Q4_K's are
    unsigned), free otherwise. Scales are then rounded as stored (``k · d`` per super-block, or the
    scale dtype), mins to ``m · dmin`` per super-block (``min_steps``; ``d`` and ``dmin`` chosen
    together, :func:`~llmopt.formats.superblocks.fit_affine_superblocks`) or to float16, and the zero
    point is ``min / s − 2^(bits−1)`` (our codes are signed: ``u − 2^(bits−1)``).
    """
    x = wg.float()
    weight = None if col_w is None else col_w.float().expand_as(x)  # None: every weight counts once

    def weighted(t: torch.Tensor) -> torch.Tensor:
        return t if weight is None else weight * t

    levels, half = 2**scheme.num_bits - 1, 2 ** (scheme.num_bits - 1)
    nonneg = scheme.min_steps is not None
    lo = x.amin(-1) * clip_ratio
    lo = lo.clamp(max=0) if nonneg else lo
    hi = torch.maximum(x.amax(-1) * clip_ratio, lo + 1e-12)
    sw = torch.full_like(x[..., 0], x.shape[-1]) if weight is None else weight.sum(-1)
    sx = weighted(x).sum(-1)
    best_s, best_b = (hi - lo) / levels, lo
    best_err = weighted((torch.round((x - lo[..., None]) / best_s[..., None]).clamp(0, levels) * best_s[..., None]
                         + lo[..., None] - x).square()).sum(-1)
    for t in range(-AFFINE_STEPS, AFFINE_STEPS + 1):
        inv = (levels + t / AFFINE_STEPS) / (hi - lo)
        u = (x - lo[..., None]).mul_(inv[..., None]).round_().clamp_(0, levels)
        wu = weighted(u)
        su, suu, sux = wu.sum(-1), (wu * u).sum(-1), (wu * x).sum(-1)
        det = sw * suu - su * su
        ok = det > 1e-30 * sw * suu.clamp(min=1e-30)
        s = torch.where(ok, (sw * sux - su * sx) / det.clamp(min=1e-30), best_s)
        b = torch.where(ok, (suu * sx - su * sux) / det.clamp(min=1e-30), best_b)
        if nonneg:  # a positive offset cannot be stored: fit the scale alone
            pos = b > 0
            s, b = torch.where(pos, sux / suu.clamp(min=1e-30), s), torch.where(pos, torch.zeros_like(b), b)
        ok = ok & (s > 0)
        err = weighted(u.mul_(s[..., None]).add_(b[..., None]).sub_(x).square_()).sum(-1)  # u is spent here
        better = ok & (err < best_err)
        best_err = torch.where(better, err, best_err)
        best_s, best_b = torch.where(better, s, best_s), torch.where(better, b, best_b)
    per = sub_blocks_per_super(x.shape[-1])
    if scheme.scale_steps is not None and scheme.min_steps is not None and per and x.shape[1] % per == 0:
        scale, mins = fit_affine_superblocks(x, weight, best_s, -best_b, scheme.num_bits, scheme.scale_steps,
                                             scheme.min_steps)
        return scale, mins / scale - half
    scale = round_scales(superblock_scales(best_s.clamp(min=1e-12), x.shape[-1], scheme.scale_steps), scheme)
    mins = superblock_mins(-best_b, x.shape[-1], scheme.min_steps)
    return scale, mins / scale - half


# ---------------------------------------------------------------------------------------------
# Activation quantization (dynamic, per token), used by W8A8 / FP8_DYNAMIC at run time.


def fake_quantize_activations(x: torch.Tensor, kind: ActType) -> torch.Tensor:
    """Quantize-dequantize ``x`` per token (last dim) as W8A8 / FP8_DYNAMIC do at inference."""
    xf = x.float()
    absmax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    if kind == "int8":
        scale = absmax / 127.0
        return (torch.round(xf / scale).clamp(-128, 127) * scale).to(x.dtype)
    scale = absmax / FP8_MAX
    return ((xf / scale).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# int4 packing, compressed-tensors "pack-quantized" layout: eight 4-bit values per int32,
# lowest nibble first, along the last dimension; values stored offset by 8 (unsigned).


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack signed int4 codes ``[rows, cols]`` (cols % 8 == 0) into int32 ``[rows, cols/8]``."""
    rows, cols = q.shape
    if cols % 8:
        raise ValueError(f"int4 packing needs a multiple of 8 columns, got {cols}")
    u = (q.to(torch.int32) + 8).reshape(rows, cols // 8, 8)
    packed = torch.zeros(u.shape[:-1], dtype=torch.int64)
    for i in range(8):
        packed |= u[..., i].to(torch.int64) << (4 * i)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int8 codes in ``[-8, 7]`` of shape ``[rows, cols]``."""
    p = packed.to(torch.int64) & 0xFFFFFFFF
    parts = [((p >> (4 * i)) & 0xF) for i in range(8)]
    u = torch.stack(parts, dim=-1).reshape(packed.shape[0], -1)[:, :cols]
    return (u - 8).to(torch.int8)


@dataclass
class QuantizedWeight:
    """One Linear's quantized weight: codes plus what is needed to dequantize them."""

    codes: torch.Tensor  # int8 codes [out, in] (int4 values in [-8, 7]), or float8_e4m3fn
    scale: torch.Tensor  # [out, n_groups] float32 (values of the scheme's stored scale dtype)
    zero_point: torch.Tensor | None  # [out, n_groups] int32 (float32 for float_zero schemes), asymmetric schemes only
    scheme: QuantScheme
    group_size: int | None  # the group size actually used for this layer (None: per-channel)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.codes, self.scale, self.zero_point, self.group_size, dtype)

    def mins(self) -> torch.Tensor:
        """Each group's offset ``min`` in ``w = s · (q + 2^(bits−1)) − min`` (``[out, n_groups]``
        float32; zero for symmetric codes): llama.cpp's Q4_1 / Q5_1 ``−m`` and Q4_K / Q5_K ``dmin · m``."""
        if self.zero_point is None:
            return torch.zeros_like(self.scale, dtype=torch.float32)
        return (self.zero_point.float() + 2 ** (self.scheme.num_bits - 1)) * self.scale.float()

    @classmethod
    def from_weight(
        cls,
        w: torch.Tensor,
        scheme: QuantScheme,
        group_size: int | None,
        scale: torch.Tensor,
        zero_point: torch.Tensor | None,
    ) -> "QuantizedWeight":
        """Codes of ``w`` for the given qparams, the scales first rounded as they are stored."""
        scale = round_scales(scale, scheme)
        codes = quantize(w, scale, zero_point, scheme, group_size)
        return cls(codes, scale, zero_point, scheme, group_size)
