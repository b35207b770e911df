"""4-bit float (E2M1) weights: NVFP4 and MXFP4, as compressed-tensors stores them.

Every code is one of the 16 E2M1 values ``±{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` (held in
``float8_e4m3fn`` tensors, which hold them exactly). The two formats differ in their scales:

* **NVFP4** (``nvfp4-pack-quantized``): one FP8 E4M3 scale per 16 input features, relative to one
  float32 *global scale* per tensor, ``global = 448 · 6 / absmax(W)`` (compressed-tensors'
  ``generate_gparam``), so the largest group scale uses FP8's whole range. A group's stored scale
  is ``fp8(global · absmax_group / 6)`` (a zero one becomes 0.125, compressed-tensors' FP8 eps) and
  its effective scale ``stored / global`` (float32, as compressed-tensors' ``dequantize`` computes it).
* **MXFP4** (``mxfp4-pack-quantized``): one E8M0 scale (a power of two, stored as the uint8 biased
  exponent ``e``: ``2^(e - 127)``) per 32 input features; ``absmax_group`` is first rounded to a
  power of two (up when its mantissa is at least 1.75, compressed-tensors' ``round_to_power_2``)
  and divided by 4 (``2^floor(log2 6)``, ``generate_mx_scales``).

Codes round to the nearest E2M1 value, ties to the even mantissa (``cast_to_fp4``). Packed two
codes a byte, the even column in the low nibble; a nibble is the sign bit (8) plus the index of
the magnitude in ``E2M1_VALUES`` (``pack_fp4_to_uint8``).
"""

from __future__ import annotations

from typing import Literal

import torch

E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_GRID: tuple[float, ...] = tuple(sorted({-v for v in E2M1_VALUES} | set(E2M1_VALUES)))  # 15 values (±0 once)
FP4_MAX = 6.0
E4M3_MAX = 448.0
E4M3_EPS = 0.125  # compressed-tensors' stand-in for a zero FP8 scale (_get_dtype_eps)
E8M0_BIAS = 127
MX_OFFSET = 2  # floor(log2(FP4_MAX)): the group max maps into [4, 8)

ScaleFormat = Literal["e4m3", "e8m0"]
# midpoints between neighbouring magnitudes; a tie goes to the even mantissa (0, 1, 2, 4): down at 0.25, 1.25,
# 2.5, 5 and up at 0.75, 1.75, 3.5, where the boundary is moved one float32 step down so that the tie passes it
_TIES_UP = (0.75, 1.75, 3.5)
_BOUNDARIES = tuple(float(torch.nextafter(torch.tensor(b), torch.tensor(0.0))) if b in _TIES_UP else b
                    for b in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0))


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Each value of ``x`` (float32) replaced by the nearest E2M1 value, ties to the even mantissa,
    beyond ±6 clamped to ±6; the sign kept as compressed-tensors' ``cast_to_fp4`` keeps it (bit for bit)."""
    xf = x.float()
    boundaries = torch.tensor(_BOUNDARIES, device=x.device)
    index = torch.bucketize(xf.abs(), boundaries, out_int32=True)  # boundaries passed (a tie passes none)
    return torch.tensor(E2M1_VALUES, device=x.device)[index] * torch.sign(xf)  # as cast_to_fp4: -0.1 → -0, -0 → +0


def on_e2m1(codes: torch.Tensor) -> bool:
    """Whether every code is an E2M1 value."""
    grid = torch.tensor(E2M1_GRID, device=codes.device)
    return codes.numel() > 0 and bool(torch.isin(codes.float(), grid).all())


def global_scale(w: torch.Tensor) -> torch.Tensor:
    """NVFP4's float32 global scale ``[1]`` of a weight: ``448 · 6 / absmax(w)``, divided in ``w``'s
    dtype as compressed-tensors' ``generate_gparam`` does (1.0 for an all-zero or non-finite weight)."""
    amax = w.detach().abs().amax().clamp(min=torch.finfo(w.dtype).tiny)
    scale = torch.nan_to_num(E4M3_MAX * FP4_MAX / amax, nan=1.0, posinf=1.0, neginf=1.0)
    return scale.to(torch.float32).reshape(1).cpu()


def tied_global_scale(weights: list[torch.Tensor]) -> torch.Tensor:
    """One global scale for Linears an engine fuses (q/k/v, gate/up): the smallest of theirs, as
    llm-compressor ties them (vLLM runs a fused layer with one global scale)."""
    return torch.stack([global_scale(w) for w in weights]).amin(0)


def e4m3_scales(scale: torch.Tensor, global_: torch.Tensor) -> torch.Tensor:
    """Effective float32 scales rounded so that ``scale · global`` is an FP8 E4M3 value (the stored
    scale), returned as ``stored / global``: a negative scale (a least-squares refit's) takes its
    magnitude, one that rounds to zero 0.125 (compressed-tensors' FP8 eps)."""
    g = global_.float().to(scale.device)
    stored = (scale.float().abs() * g).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    stored = torch.where(stored == 0, torch.full_like(stored, E4M3_EPS), stored)
    return stored / g


def stored_e4m3(scale: torch.Tensor, global_: torch.Tensor) -> torch.Tensor:
    """The FP8 E4M3 scales written for effective ``scale`` (inverse of ``stored / global``)."""
    return (scale.float() * global_.float().to(scale.device)).to(torch.float8_e4m3fn)


def e8m0_exponents(scale: torch.Tensor) -> torch.Tensor:
    """The uint8 biased exponents of power-of-two scales (``2^(e - 127)``; others round in log2)."""
    e = torch.round(torch.log2(scale.float().abs().clamp(min=2.0**-127))) + E8M0_BIAS
    return e.clamp(0, 254).to(torch.uint8)


def e8m0_scales(scale: torch.Tensor) -> torch.Tensor:
    """Float32 scales rounded to the nearest power of two (in log2) that E8M0 holds."""
    return e8m0_values(e8m0_exponents(scale))


def e8m0_values(exponents: torch.Tensor) -> torch.Tensor:
    """Float32 scales ``2^(e - 127)`` of uint8 E8M0 exponents."""
    return torch.exp2(exponents.to(torch.float32) - E8M0_BIAS)


def mx_scales(absmax: torch.Tensor) -> torch.Tensor:
    """MXFP4 scales (float32 powers of two) of group maxima, as compressed-tensors' ``generate_mx_scales``:
    ``absmax`` rounded to a power of two (up from a mantissa of 1.75), divided by 4."""
    a = absmax.float().clamp(min=0)
    bits = a.view(torch.int32) + (1 << 21)  # float32: 23 mantissa bits, E2M1: 1
    rounded = (bits & ~((1 << 23) - 1)).view(torch.float32)
    exponent = torch.floor(torch.log2(rounded)) - MX_OFFSET + E8M0_BIAS
    return e8m0_values(exponent.clamp(0, 254).to(torch.uint8))


def _nibble_table() -> torch.Tensor:
    """float8_e4m3fn bit pattern (0..255) → nibble of that E2M1 value (others: 0)."""
    table = torch.zeros(256, dtype=torch.uint8)
    values = torch.tensor(E2M1_VALUES)
    for sign in (0, 1):
        bits = (values * (1 - 2 * sign)).to(torch.float8_e4m3fn).view(torch.uint8).long()
        table[bits] = torch.arange(len(E2M1_VALUES), dtype=torch.uint8) | (sign << 3)
    table[0x80] = 8  # -0.0
    return table


_NIBBLE = _nibble_table()
_FP8_OF_NIBBLE = torch.cat([torch.tensor(E2M1_VALUES), -torch.tensor(E2M1_VALUES)]).to(torch.float8_e4m3fn).view(torch.uint8)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes ``[rows, cols]`` (cols even; float8_e4m3fn or float values) packed as uint8
    ``[rows, cols / 2]``: the even column in the low nibble, each nibble ``sign << 3 | index of
    |code| in E2M1_VALUES``."""
    rows, cols = codes.shape
    if cols % 2:
        raise ValueError(f"FP4 packing needs an even number of columns, got {cols}")
    fp8 = codes if codes.dtype == torch.float8_e4m3fn else codes.float().to(torch.float8_e4m3fn)
    nibble = _NIBBLE[fp8.cpu().view(torch.uint8).to(torch.int32)].reshape(rows, cols // 2, 2)
    return (nibble[..., 0] | (nibble[..., 1] << 4)).contiguous()


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`: the codes as float8_e4m3fn ``[rows, 2 · packed cols]``."""
    nibbles = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
    return _FP8_OF_NIBBLE.to(packed.device)[nibbles.to(torch.int32)].view(torch.float8_e4m3fn)
