"""GGUF block formats: encoding integer codes we already have, and quantizing floats to K-quants.

Layouts (one block, little-endian, as ggml stores them; ``d``/``m`` are float16):

* ``Q4_0`` (32 weights, 18 bytes): ``d``, 16 bytes of nibbles; weight ``j`` is in the low nibble of
  byte ``j`` (j < 16) or the high nibble of byte ``j - 16``; ``w = d * (u - 8)``, ``u`` in [0, 15].
* ``Q4_1`` (32 weights, 20 bytes): ``d``, ``m``, nibbles as Q4_0; ``w = d * u + m``.
* ``Q5_0`` (32 weights, 22 bytes): ``d``, ``qh`` (uint32: bit ``j`` is the fifth bit of weight ``j``),
  16 bytes of low nibbles laid out as Q4_0's; ``w = d * (u - 16)``, ``u`` in [0, 31].
* ``Q5_1`` (32 weights, 24 bytes): ``d``, ``m``, ``qh``, low nibbles; ``w = d * u + m``.
* ``Q8_0`` (32 weights, 34 bytes): ``d``, 32 int8 ``q``; ``w = d * q``.
* ``MXFP4`` (32 weights, 17 bytes): the E8M0 byte ``e``, nibbles as Q4_0 holding indices into the
  doubled E2M1 values (``MXFP4_VALUES``); ``w = 2^(e - 128) * value`` — our ``mxfp4`` codes and
  power-of-two scales exactly.
* ``IQ4_NL`` (32 weights, 18 bytes): ``d``, nibbles as Q4_0; ``w = d * kvalues[u]`` on llama.cpp's
  16-value non-uniform grid (``IQ4_NL_GRID``).
* ``IQ4_XS`` (256 weights, 136 bytes): ``d``, ``scales_h`` (uint16: bits ``2j, 2j+1`` are the high
  two bits of sub-block ``j``'s 6-bit scale ``ls``), ``scales_l`` (4 bytes: low nibbles of ``ls``,
  even sub-blocks in the low half), eight sub-blocks of 32 nibbles laid out as IQ4_NL's;
  ``w = d * (ls - 32) * kvalues[u]``.
* ``Q4_K`` (256 weights, 144 bytes): ``d``, ``dmin``, 12 bytes holding eight 6-bit sub-block scales
  and mins, 128 bytes of nibbles (sub-blocks of 32); ``w = d * sc * u - dmin * mn``.
* ``Q3_K`` (256 weights, 110 bytes): ``hmask`` (32 bytes: bit ``b`` of byte ``l`` is the third bit of
  weight ``32 b + l``), ``qs`` (64 bytes: two 32-byte halves of 128 weights, bits ``2j, 2j+1`` of byte
  ``l`` holding the low two bits of weight ``32 j + l`` of its half), ``scales`` (12 bytes: sixteen
  6-bit ``sc``, low nibbles in bytes 0-7 (sub-blocks 8-15 in the high half), high pairs in bytes
  8-11), ``d``; ``w = d * (sc - 32) * (u - 4)``, ``u`` in [0, 7], sub-blocks of 16.
* ``Q6_K`` (256 weights, 210 bytes): 128 bytes of low nibbles, 64 bytes of high 2-bit pairs,
  sixteen int8 sub-block scales (sub-blocks of 16), ``d``; ``w = d * sc * (u - 32)``, ``u`` in [0, 63].

Our codes are signed (int4 in [-8, 7]) with ``w = (q - z) * s``; the exact mappings are

* int4 symmetric → Q4_0: ``u = q + 8``, ``d = fp16(s)``;
* int4 asymmetric → Q4_1: ``u = q + 8`` and ``w = (u - 8 - z) * s = s * u - (z + 8) * s``, so
  ``d = fp16(s)``, ``m = fp16(-(z + 8) * s)``;
* int5 symmetric → Q5_0 (``u = q + 16``), int5 asymmetric → Q5_1 (``m = fp16(-(z + 16) * s)``);
* int8 (or any narrower integer codes, symmetric or not) → Q8_0: ``q8 = q - z``, ``d = fp16(s)``;
* int8 codes that all lie on the IQ4_NL grid (our ``nl4`` formats) → IQ4_NL: ``u`` = the code's
  index in the grid, ``d = fp16(s)`` (signed); → IQ4_XS when, in addition, each super-block's 8
  group scales are ``k * d`` (``nl4x``): ``ls = k + 32`` and that block's ``d``, both exact;
* int3 / int6 symmetric in groups of 16 whose scales are ``k * d`` per super-block (``int3x`` /
  ``int6x``) → Q3_K (``u = q + 4``, ``sc = k + 32``) / Q6_K (``u = q + 32``, ``sc = k``).

Only the scales are rounded (to float16); the integer codes are carried over unchanged.
gguf's own ``quants.quantize`` (the llama.cpp reference) is used for dense Q4_0/Q4_1/Q5_0/Q8_0;
it has no K-quant or IQ4_NL quantizer, so Q4_K and Q6_K are quantized here (per sub-block range
search, then the sub-block scales quantized to 6 / 8 bits), and IQ4_NL by our grid scale search.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from llmopt.formats.schemes import (
    IQ4_NL_GRID,
    IQ4_XS_STEPS,
    K_GROUP,
    grid_scales,
    on_grid,
    round_to_grid,
    superblock_factors,
    superblock_scales,
)

USER_TYPES = ("auto", "F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "IQ4_NL", "Q4_K", "IQ4_XS", "Q6_K", "MXFP4")  # the GGUF types `--type` accepts

QK = 32  # weights per Q4_0 / Q4_1 / Q5_0 / Q8_0 block
QK_K = 256  # weights per K-quant super-block


def block_size(qtype: T) -> int:
    """Weights per block (1 for plain float types)."""
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[qtype][0]


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """``[n]`` float values as float16 little-endian bytes ``[n, 2]``."""
    return np.ascontiguousarray(x.astype(np.float16).reshape(-1, 1)).view(np.uint8)


def _nibbles(u: np.ndarray) -> np.ndarray:
    """``[n, 32]`` values in [0, 15] → ``[n, 16]`` bytes (first half low nibbles, second half high)."""
    u = u.astype(np.uint8)
    return u[:, :16] | (u[:, 16:] << 4)


def _unnibble(qs: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_nibbles`: ``[n, 16]`` bytes → ``[n, 32]`` values in [0, 15]."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


# ---------------------------------------------------------------------------------------------
# Carrying integer codes (rows × columns, one scale per block of 32)


def encode_q4_0(codes: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Q4_0 bytes ``[rows, cols/32*18]`` from int4 codes ``[rows, cols]`` and block scales ``[rows, cols/32]``."""
    rows = codes.shape[0]
    u = (codes.astype(np.int16) + 8).reshape(-1, QK)
    out = np.concatenate([_f16_bytes(d.reshape(-1)), _nibbles(u)], axis=1)
    return out.reshape(rows, -1)


def encode_q4_1(codes: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_1 bytes from int4 codes (``u = q + 8``), block scales ``d`` and offsets ``m``."""
    rows = codes.shape[0]
    u = (codes.astype(np.int16) + 8).reshape(-1, QK)
    out = np.concatenate([_f16_bytes(d.reshape(-1)), _f16_bytes(m.reshape(-1)), _nibbles(u)], axis=1)
    return out.reshape(rows, -1)


def _fifth_bits(u: np.ndarray) -> np.ndarray:
    """``[n, 32]`` values in [0, 31] → ``[n, 4]`` bytes: the little-endian uint32 of their fifth bits."""
    return np.packbits((u >> 4).astype(np.uint8), axis=-1, bitorder="little")


def encode_q5_0(codes: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Q5_0 bytes ``[rows, cols/32*22]`` from int5 codes (in [-16, 15]) and block scales."""
    rows = codes.shape[0]
    u = (codes.astype(np.int16) + 16).astype(np.uint8).reshape(-1, QK)
    out = np.concatenate([_f16_bytes(d.reshape(-1)), _fifth_bits(u), _nibbles(u & 0x0F)], axis=1)
    return out.reshape(rows, -1)


def encode_q5_1(codes: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q5_1 bytes from int5 codes (``u = q + 16``), block scales ``d`` and offsets ``m``."""
    rows = codes.shape[0]
    u = (codes.astype(np.int16) + 16).astype(np.uint8).reshape(-1, QK)
    out = np.concatenate([_f16_bytes(d.reshape(-1)), _f16_bytes(m.reshape(-1)), _fifth_bits(u), _nibbles(u & 0x0F)], axis=1)
    return out.reshape(rows, -1)


def encode_q8_0(codes: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Q8_0 bytes from int8-range codes ``[rows, cols]`` and block scales ``[rows, cols/32]``."""
    rows = codes.shape[0]
    q = codes.astype(np.int8).reshape(-1, QK).view(np.uint8)
    out = np.concatenate([_f16_bytes(d.reshape(-1)), q], axis=1)
    return out.reshape(rows, -1)


_GRID_INDEX = np.full(256, -1, dtype=np.int16)  # int8 code + 128 → its index in the IQ4_NL grid
_GRID_INDEX[np.array(IQ4_NL_GRID) + 128] = np.arange(len(IQ4_NL_GRID))


def encode_iq4_nl(codes: np.ndarray, d: np.ndarray) -> np.ndarray:
    """IQ4_NL bytes ``[rows, cols/32*18]`` from grid codes ``[rows, cols]`` and block scales ``[rows, cols/32]``."""
    rows = codes.shape[0]
    u = _GRID_INDEX[codes.astype(np.int16) + 128]
    if (u < 0).any():
        raise ValueError("a code is not on the IQ4_NL grid")
    out = np.concatenate([_f16_bytes(d.reshape(-1)), _nibbles(u.reshape(-1, QK))], axis=1)
    return out.reshape(rows, -1)


MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # E2M1 values doubled, by 4-bit index
_MXFP4_INDEX = np.full(25, -1, dtype=np.int16)  # doubled value + 12 → its index (+0 for zero)
for _i, _v in reversed(list(enumerate(MXFP4_VALUES))):
    _MXFP4_INDEX[_v + 12] = _i


def encode_mxfp4(doubled: np.ndarray, d: np.ndarray) -> np.ndarray:
    """MXFP4 bytes ``[rows, cols/32*17]`` from E2M1 codes doubled (integers in [-12, 12]) and block
    scales ``d`` ``[rows, cols/32]`` that are powers of two ``2^(e - 127)`` (stored as the E8M0 byte ``e``)."""
    rows = doubled.shape[0]
    v = doubled.astype(np.int16)
    if v.min(initial=0) < -12 or v.max(initial=0) > 12 or (_MXFP4_INDEX[v + 12] < 0).any():
        raise ValueError("a code is not an E2M1 value")
    u = _MXFP4_INDEX[v + 12]
    e = np.log2(d.astype(np.float64).reshape(-1)) + 127
    if not np.array_equal(e, np.round(e)) or e.min(initial=0) < 0 or e.max(initial=0) > 254:
        raise ValueError("an MXFP4 scale is not a power of two E8M0 holds")
    out = np.concatenate([e.astype(np.uint8).reshape(-1, 1), _nibbles(u.astype(np.uint8).reshape(-1, QK))], axis=1)
    return out.reshape(rows, -1)


def encode_iq4_xs(codes: np.ndarray, d: np.ndarray, k: np.ndarray) -> np.ndarray:
    """IQ4_XS bytes ``[rows, cols/256*136]`` from grid codes ``[rows, cols]``, super-block scales
    ``d`` ``[rows, cols/256]`` (float16 values) and sub-block multipliers ``k`` ``[rows, cols/32]``."""
    rows = codes.shape[0]
    u = _GRID_INDEX[codes.astype(np.int16) + 128]
    if (u < 0).any():
        raise ValueError("a code is not on the IQ4_NL grid")
    ls = (k.astype(np.int16) + 32).reshape(-1, 8)
    if (ls < 0).any() or (ls > 63).any():
        raise ValueError("an IQ4_XS sub-block scale is outside [-32, 31]")
    high = ((ls >> 4) & 3).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))
    scales_h = np.bitwise_or.reduce(high, axis=1).astype(np.uint16).reshape(-1, 1).view(np.uint8)
    low = (ls & 15).astype(np.uint8)
    scales_l = low[:, 0::2] | (low[:, 1::2] << 4)
    qs = _nibbles(u.reshape(-1, QK)).reshape(-1, 8 * 16)
    out = np.concatenate([_f16_bytes(d.reshape(-1)), scales_h, scales_l, qs], axis=1)
    return out.reshape(rows, -1)


def quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    """IQ4_XS bytes of float weights ``[rows, cols]`` (cols % 256 == 0): grid scale search per
    sub-block, the sub-block scales then quantized per super-block."""
    w = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).reshape(x.shape[0], -1, QK)
    scale = superblock_scales(grid_scales(w, IQ4_NL_GRID), QK, IQ4_XS_STEPS)
    d, k = superblock_factors(scale, QK, IQ4_XS_STEPS)
    codes = round_to_grid(w / scale.unsqueeze(-1), IQ4_NL_GRID).reshape(x.shape)
    return encode_iq4_xs(codes.to(torch.int8).numpy(), d.numpy(), k.numpy())


def quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    """IQ4_NL bytes of float weights ``[rows, cols]`` (cols % 32 == 0): grid scale search per block."""
    w = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).reshape(x.shape[0], -1, QK)
    d = grid_scales(w, IQ4_NL_GRID).to(torch.float16).float()
    codes = round_to_grid(w / d.unsqueeze(-1), IQ4_NL_GRID).reshape(x.shape)
    return encode_iq4_nl(codes.to(torch.int8).numpy(), d.numpy())


def stored_codes(data: np.ndarray, qtype: T, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The integer codes and fp16 scales ``d`` stored in a Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL / IQ4_XS / Q3_K / Q6_K tensor's bytes.

    Codes are returned in our signed convention (``u - 8`` for the 4-bit types, ``u - 16`` for
    the 5-bit ones, ``u - 32`` for Q6_K, ``u - 4`` for Q3_K, the grid value for IQ4_NL), shape
    ``[rows, cols]``; ``d`` has shape ``[rows, cols/32]`` (``[rows, cols/16]`` for Q3_K / Q6_K; float32).
    """
    blocks = np.ascontiguousarray(data.reshape(-1)).reshape(-1, _type_bytes(qtype))
    if qtype == T.MXFP4:  # codes: E2M1 values doubled; d: 2^(e - 127)
        codes = np.array(MXFP4_VALUES, dtype=np.int8)[_unnibble(blocks[:, 1:])]
        d = np.ldexp(np.float32(1), blocks[:, 0].astype(np.int32) - 127).astype(np.float32)
        return codes.reshape(rows, -1), d.reshape(rows, -1)
    if qtype == T.Q6_K:
        return _q6_k_codes(blocks, rows)
    if qtype == T.Q3_K:
        return _q3_k_codes(blocks, rows)
    if qtype in (T.Q4_K, T.Q5_K):
        return _q45_k_codes(blocks, rows, high_bits=qtype == T.Q5_K)
    if qtype == T.Q2_K:
        return _q2_k_codes(blocks, rows)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
    if qtype == T.Q8_0:
        codes = blocks[:, 2:].copy().view(np.int8)
    elif qtype in (T.Q5_0, T.Q5_1):
        start = 2 if qtype == T.Q5_0 else 4
        high = np.unpackbits(blocks[:, start : start + 4], axis=-1, bitorder="little")
        codes = (_unnibble(blocks[:, start + 4 :]) | (high << 4)).astype(np.int8) - 16
    elif qtype == T.IQ4_NL:
        codes = np.array(IQ4_NL_GRID, dtype=np.int8)[_unnibble(blocks[:, 2:])]
    elif qtype == T.IQ4_XS:  # d is returned per sub-block of 32: the super-block's d times ls - 32
        sh = blocks[:, 2:4].copy().view(np.uint16).reshape(-1, 1) >> (2 * np.arange(8, dtype=np.uint16))
        sl = blocks[:, 4:8]
        ls = np.stack([sl & 15, sl >> 4], axis=-1).reshape(-1, 8) | ((sh & 3).astype(np.uint8) << 4)
        d = (d.reshape(-1, 1) * (ls.astype(np.float32) - 32)).reshape(rows, -1)
        codes = np.array(IQ4_NL_GRID, dtype=np.int8)[_unnibble(blocks[:, 8:].reshape(-1, 16))]
    else:
        start = 2 if qtype == T.Q4_0 else 4
        codes = _unnibble(blocks[:, start:]).astype(np.int8) - 8
    return codes.reshape(rows, -1), d


def _q6_k_codes(blocks: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes (``u - 32``) and ``d`` per sub-block of 16 (the super-block's d times its int8
    scale) of Q6_K blocks (``ql`` 128 bytes, ``qh`` 64, scales 16, ``d`` 2)."""
    ql = blocks[:, :128].reshape(-1, 2, 64)
    qh = blocks[:, 128:192].reshape(-1, 2, 32)
    low = np.stack([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 256)
    high = np.stack([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=2).reshape(-1, 256)
    codes = (low | (high << 4)).astype(np.int8) - 32
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    return codes.reshape(rows, -1), (d * sc).reshape(rows, -1)


def _q3_k_codes(blocks: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes (``u - 4``) and ``d`` per sub-block of 16 (the super-block's d times ``sc - 32``) of
    Q3_K blocks (``hmask`` 32 bytes, ``qs`` 64, ``scales`` 12, ``d`` 2)."""
    hmask = blocks[:, :32]
    qs = blocks[:, 32:96].reshape(-1, 2, 1, 32)  # [n, half, 1, 32]
    low = (qs >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3  # [n, half, j, 32]
    high = (hmask[:, None, :] >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1  # [n, 8 = 4 * half + j, 32]
    codes = (low.reshape(-1, 256) | (high.reshape(-1, 256) << 2)).astype(np.int8) - 4
    raw = blocks[:, 96:108]
    low4 = np.concatenate([raw[:, :8] & 15, raw[:, :8] >> 4], axis=1)  # sub-blocks 0-7, then 8-15
    high2 = np.concatenate([(raw[:, 8:12] >> (2 * i)) & 3 for i in range(4)], axis=1)  # sub-blocks 4i .. 4i+3
    sc = (low4 | (high2 << 4)).astype(np.float32) - 32
    d = blocks[:, 108:110].copy().view(np.float16).astype(np.float32)
    return codes.reshape(rows, -1), (d * sc).reshape(rows, -1)


def _check_k_quant(qtype: str, codes: np.ndarray, code_bits: int, k: np.ndarray, scale_bits: int) -> None:
    """Refuse codes or sub-block multipliers outside the signed ranges of ``qtype``'s fields."""
    for values, bits, what in ((codes, code_bits, "code"), (k, scale_bits, "sub-block scale")):
        low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        if values.min(initial=0) < low or values.max(initial=0) > high:
            raise ValueError(f"a {qtype} {what} is outside [{low}, {high}]")


def encode_q3_k(codes: np.ndarray, d: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Q3_K bytes ``[rows, cols/256*110]`` from 3-bit codes ``[rows, cols]`` (in [-4, 3]), super-block
    scales ``d`` ``[rows, cols/256]`` (float16 values) and sub-block multipliers ``k`` ``[rows, cols/16]``
    (in [-32, 31]): weight = d * k * code."""
    rows = codes.shape[0]
    _check_k_quant("Q3_K", codes, 3, k, 6)
    u = (codes.astype(np.int16) + 4).astype(np.uint8).reshape(-1, 8, 32)  # [n, 4 * half + j, 32]
    low = (u & 3).reshape(-1, 2, 4, 32)
    qs = (low << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)).sum(axis=2, dtype=np.uint8).reshape(-1, 64)
    hmask = ((u >> 2) << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)).sum(axis=1, dtype=np.uint8)
    sc = (k.astype(np.int16) + 32).astype(np.uint8).reshape(-1, 16)
    low4 = (sc[:, :8] & 15) | ((sc[:, 8:] & 15) << 4)
    high2 = (sc >> 4).reshape(-1, 4, 4)  # [n, i, sub-block 4i + b]
    packed = (high2 << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 4, 1)).sum(axis=1, dtype=np.uint8)
    out = np.concatenate([hmask, qs, low4, packed, _f16_bytes(d.reshape(-1))], axis=1)
    return out.reshape(rows, -1)


def _type_bytes(qtype: T) -> int:
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[qtype][1]


# ---------------------------------------------------------------------------------------------
# K-quants from float weights

_SHRINK = np.linspace(1.0, 0.7, 13, dtype=np.float32)  # range shrinks tried per sub-block


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Q4_K bytes ``[rows, cols/256*144]`` of float weights ``[rows, cols]`` (cols % 256 == 0)."""
    rows = x.shape[0]
    sub = x.astype(np.float32).reshape(-1, 8, 32)  # [n_super, 8 sub-blocks, 32]
    scale, mn = _search_affine(sub, levels=15)
    # Sub-block scale and min as 6-bit multiples of the super-block's d and dmin.
    d = (scale.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    dmin = (mn.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    sc = _safe_div(scale, d[:, None]).round().clip(0, 63).astype(np.uint8)
    mc = _safe_div(mn, dmin[:, None]).round().clip(0, 63).astype(np.uint8)
    eff_scale = (d[:, None] * sc)[..., None]
    eff_min = (dmin[:, None] * mc)[..., None]
    u = _safe_div(sub + eff_min, eff_scale).round().clip(0, 15).astype(np.uint8)  # [n, 8, 32]
    return _pack_q45_k(u.reshape(-1, 256), d, dmin, sc, mc, high_bits=False).reshape(rows, -1)


def _pack_k_scales(sc: np.ndarray, mc: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 12 scale bytes from 6-bit scales and mins ``[n, 8]``."""
    lo, hi, mlo, mhi = sc[:, :4], sc[:, 4:], mc[:, :4], mc[:, 4:]
    return np.concatenate([lo | ((hi >> 4) << 6), mlo | ((mhi >> 4) << 6), (hi & 0x0F) | ((mhi & 0x0F) << 4)], axis=1)


def _unpack_k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`_pack_k_scales`: ``(scales, mins)`` ``[n, 8]``."""
    a, b, c = raw[:, :4], raw[:, 4:8], raw[:, 8:12]
    sc = np.concatenate([a & 63, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    mc = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, mc


def _pack_q45_k(u: np.ndarray, d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, mc: np.ndarray, high_bits: bool) -> np.ndarray:
    """Q4_K (``high_bits`` False, u in [0, 15]) or Q5_K (u in [0, 31]) blocks from unsigned codes
    ``[n, 256]``, super-block ``d`` / ``dmin`` ``[n]`` and 6-bit sub-block scales / mins ``[n, 8]``:
    weight = d * sc * u - dmin * m per sub-block of 32."""
    pairs = (u & 0x0F).reshape(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    parts = [_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mc)]
    if high_bits:  # bit i of qh[l]: the fifth bit of weight 32 i + l
        high = (u >> 4).reshape(-1, 8, 32)
        parts.append((high << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)).sum(axis=1, dtype=np.uint8))
    return np.concatenate([*parts, qs], axis=1)


def _symmetric_k(codes: np.ndarray, d: np.ndarray, k: np.ndarray, bits: int, scale_bits: int, sub: int, qtype: str):
    """Symmetric codes with one-sign multiples as an affine K-quant's fields: unsigned codes, the
    super-block ``d`` (sign flipped to positive), ``dmin = 2^(bits-1) d`` and unsigned scales,
    each sub-block's min multiple equal to its scale's."""
    half = 2 ** (bits - 1)
    if codes.min(initial=0) < -half or codes.max(initial=0) > half - 1:
        raise ValueError(f"a {qtype} code is outside [{-half}, {half - 1}]")
    mult = -k.astype(np.int16)
    if mult.min(initial=1) < 1 or mult.max(initial=1) > 2**scale_bits - 1:
        raise ValueError(f"a {qtype} sub-block scale is outside [1, {2**scale_bits - 1}] times d")
    u = (codes.astype(np.int16) + half).astype(np.uint8).reshape(-1, QK_K)
    dd = -d.reshape(-1).astype(np.float32)
    return u, dd, dd * half, mult.astype(np.uint8).reshape(-1, QK_K // sub)


def encode_q4_k(codes: np.ndarray, d: np.ndarray, k: np.ndarray, mins: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Q4_K bytes ``[rows, cols/256*144]`` from 4-bit codes ``[rows, cols]`` (in [-8, 7]), super-block
    scales ``d`` ``[rows, cols/256]`` (negative float16 values) and multipliers ``k`` ``[rows, cols/32]``
    (in [-63, -1]): weight = d * k * code, stored as d' = -d, sc = m = -k, dmin = 8 d'. With ``mins``
    (``dmin`` ``[rows, cols/256]`` float16 values, ``m`` ``[rows, cols/32]`` in [0, 63]: float zero
    points), weight = d' * sc * (code + 8) - dmin * m."""
    return _encode_q45_k(codes, d, k, mins, 4, "Q4_K")


def encode_q5_k(codes: np.ndarray, d: np.ndarray, k: np.ndarray, mins: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Q5_K bytes ``[rows, cols/256*176]``: as :func:`encode_q4_k` with 5-bit codes in [-16, 15] (dmin = 16 d')."""
    return _encode_q45_k(codes, d, k, mins, 5, "Q5_K")


def _encode_q45_k(codes: np.ndarray, d: np.ndarray, k: np.ndarray, mins: tuple[np.ndarray, np.ndarray] | None,
                  bits: int, qtype: str) -> np.ndarray:
    u, dd, dmin, sc = _symmetric_k(codes, d, k, bits, 6, 32, qtype)
    mc = sc
    if mins is not None:
        dmin = mins[0].reshape(-1).astype(np.float32)
        m = mins[1].reshape(-1, QK_K // 32)
        if m.min(initial=0) < 0 or m.max(initial=0) > 63:
            raise ValueError(f"a {qtype} sub-block min is outside [0, 63] times dmin")
        mc = m.astype(np.uint8)
    return _pack_q45_k(u, dd, dmin, sc, mc, high_bits=bits == 5).reshape(codes.shape[0], -1)


def encode_q2_k(codes: np.ndarray, d: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Q2_K bytes ``[rows, cols/256*84]`` from 2-bit codes (in [-2, 1]), negative super-block ``d`` and
    multipliers ``k`` ``[rows, cols/16]`` in [-15, -1]: scales byte = sc | (m << 4) with m = sc = -k,
    dmin = 2 d'."""
    u, dd, dmin, sc = _symmetric_k(codes, d, k, 2, 4, K_GROUP, "Q2_K")
    q = u.reshape(-1, 2, 4, 32)  # [n, half, j, l]: weight 128 half + 32 j + l
    qs = (q << (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)).sum(axis=2, dtype=np.uint8).reshape(-1, 64)
    out = np.concatenate([sc | (sc << 4), qs, _f16_bytes(dd), _f16_bytes(dmin)], axis=1)
    return out.reshape(codes.shape[0], -1)


def _k_codes(u: np.ndarray, scale: np.ndarray, offset: np.ndarray, half: int) -> tuple[np.ndarray, np.ndarray]:
    """Signed codes ``u - half`` and per-sub-block scales of an affine K-quant's fields, where each
    sub-block's min is ``half`` times its scale (our symmetric form); elsewhere codes are marked out of
    range (-128) so a comparison with carried codes fails."""
    per = u.shape[1] // scale.shape[1]
    symmetric = np.isclose(offset, half * scale, rtol=0, atol=0)
    codes = u.astype(np.int16) - half
    codes = np.where(np.repeat(symmetric, per, axis=1), codes, -128).astype(np.int8)
    return codes, scale


def stored_k_mins(data: np.ndarray, qtype: T, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_K / Q5_K tensor's codes (signed, ``u - 8`` / ``u - 16``), sub-block scales ``d · sc`` and
    sub-block mins ``dmin · m`` (``[rows, cols]``, ``[rows, cols/32]`` twice, float32), whatever the mins."""
    blocks = np.ascontiguousarray(data.reshape(-1)).reshape(-1, _type_bytes(qtype))
    u, scale, offset = _q45_k_fields(blocks, high_bits=qtype == T.Q5_K)
    half = 16 if qtype == T.Q5_K else 8
    return (u.astype(np.int16) - half).astype(np.int8).reshape(rows, -1), scale.reshape(rows, -1), offset.reshape(rows, -1)


def _q45_k_codes(blocks: np.ndarray, rows: int, high_bits: bool) -> tuple[np.ndarray, np.ndarray]:
    u, scale, offset = _q45_k_fields(blocks, high_bits)
    codes, scale = _k_codes(u, scale, offset, 16 if high_bits else 8)
    return codes.reshape(rows, -1), scale.reshape(rows, -1)


def _q45_k_fields(blocks: np.ndarray, high_bits: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unsigned codes ``[n, 256]``, sub-block scales and mins ``[n, 8]`` of Q4_K / Q5_K blocks."""
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mc = _unpack_k_scales(blocks[:, 4:16])
    qs = blocks[:, 48:] if high_bits else blocks[:, 16:]
    u = np.stack([qs.reshape(-1, 4, 32) & 0x0F, qs.reshape(-1, 4, 32) >> 4], axis=2).reshape(-1, 256)
    if high_bits:
        qh = blocks[:, 16:48]
        u = u | ((((qh[:, None, :] >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1) << 4).reshape(-1, 256))
    return u, d * sc, dmin * mc


def _q2_k_codes(blocks: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    raw = blocks[:, :16]
    qs = blocks[:, 16:80].reshape(-1, 2, 1, 32)
    u = ((qs >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3).reshape(-1, 256)
    d = blocks[:, 80:82].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 82:84].copy().view(np.float16).astype(np.float32)
    codes, scale = _k_codes(u, d * (raw & 15), dmin * (raw >> 4), 2)
    return codes.reshape(rows, -1), scale.reshape(rows, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K bytes ``[rows, cols/256*210]`` of float weights ``[rows, cols]`` (cols % 256 == 0)."""
    rows = x.shape[0]
    sub = x.astype(np.float32).reshape(-1, 16, 16)  # [n_super, 16 sub-blocks, 16]
    scale = _search_symmetric(sub)
    # ggml maps the largest sub-block scale to -128: d = -max/128, scales in [-128, 127].
    imax = np.abs(scale).argmax(axis=1)
    big = np.take_along_axis(scale, imax[:, None], axis=1)[:, 0]
    d = (big / -128).astype(np.float16).astype(np.float32)
    sc = _safe_div(scale, d[:, None]).round().clip(-128, 127)
    eff = (d[:, None] * sc)[..., None]
    q = _safe_div(sub, eff).round().clip(-32, 31)
    return encode_q6_k(q.reshape(rows, -1), d.reshape(rows, -1), sc.reshape(rows, -1))


def encode_q6_k(codes: np.ndarray, d: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Q6_K bytes ``[rows, cols/256*210]`` from 6-bit codes ``[rows, cols]`` (in [-32, 31]), super-block
    scales ``d`` ``[rows, cols/256]`` (float16 values) and sub-block multipliers ``k`` ``[rows, cols/16]``
    (in [-128, 127]): weight = d * k * code."""
    rows = codes.shape[0]
    _check_k_quant("Q6_K", codes, 6, k, 8)
    u = (codes.astype(np.int16) + 32).astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128 weights
    low, high = u & 0x0F, u >> 4
    low = low.reshape(-1, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = high.reshape(-1, 2, 4, 32)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    sc = k.astype(np.int8).reshape(-1, 16).view(np.uint8)
    out = np.concatenate([ql, qh, sc, _f16_bytes(d.reshape(-1))], axis=1)
    return out.reshape(rows, -1)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1), 0).astype(np.float32)


def _search_affine(sub: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block ``(scale, min)`` with ``w ≈ scale * u - min``, ``u`` in [0, levels], min ≥ 0,
    choosing the range shrink with least squared error."""
    lo = np.minimum(sub.min(axis=-1), 0)
    hi = sub.max(axis=-1)
    best_err = np.full(lo.shape, np.inf, dtype=np.float32)
    best_scale = np.zeros_like(lo)
    best_min = np.zeros_like(lo)
    for r in _SHRINK:
        s = (hi - lo) * r / levels
        m = -lo * r
        u = _safe_div(sub + m[..., None], s[..., None]).round().clip(0, levels)
        err = ((u * s[..., None] - m[..., None] - sub) ** 2).sum(-1)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_scale = np.where(better, s, best_scale)
        best_min = np.where(better, m, best_min)
    return best_scale, best_min


def _search_symmetric(sub: np.ndarray) -> np.ndarray:
    """Per sub-block signed scale with ``w ≈ scale * q``, ``q`` in [-32, 31]: the largest magnitude
    maps to -32 (using the extra negative level), range shrinks searched for least squared error."""
    imax = np.abs(sub).argmax(axis=-1)
    extreme = np.take_along_axis(sub, imax[..., None], axis=-1)[..., 0]
    best_err = np.full(extreme.shape, np.inf, dtype=np.float32)
    best = np.zeros_like(extreme)
    for r in _SHRINK:
        s = extreme * r / -32
        q = _safe_div(sub, s[..., None]).round().clip(-32, 31)
        err = ((q * s[..., None] - sub) ** 2).sum(-1)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best = np.where(better, s, best)
    return best
