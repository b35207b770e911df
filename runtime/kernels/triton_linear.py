"""Triton weight-only quantized linears for CUDA: ``y = x @ dequant(W).T + b``.

One tiled kernel (``tl.dot``, float32 accumulation) serves int4 (two codes per byte), int8 and
float8-e4m3 weights, symmetric or with zero points, per group or per output channel. Weights
are repacked once, at load time, by :func:`pack_weight` into a K-major layout (``[in, out]``,
so a tile's loads run along the contiguous output dimension):

* int4: ``uint8 [ceil(in / 2), out]``, input ``k`` in the low nibble of byte ``k // 2`` when
  ``k`` is even and the high nibble when odd, stored offset by 8 (:func:`pack_int4_pairs`);
* int8: ``int8 [in, out]``; float8: the e4m3fn bits as ``uint8 [in, out]``, decoded in the
  kernel with integer operations (no native fp8 conversion needed, so any GPU runs it);
* ``scale`` (and ``zero`` as float) transposed to ``[n_groups, out]`` float32.

Few rows (decode, ``M <= 16``) run a GEMV-shaped configuration: small ``BLOCK_M`` and long K
tiles. Whenever the output tiles alone would leave multiprocessors idle (decode, or small
projections at any M), K is split across programs (at least two K tiles each) and a second
small kernel adds the float32 partial sums and the bias. The tiles are fixed, not autotuned:
``bench/kernels_gpu.py`` records each shape's configuration beside its timing. Activation-quantized schemes
(W8A8, FP8_DYNAMIC) quantize ``x`` per token in torch first, exactly as the reference does.
The engine reaches it through ``runtime.backends.triton``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from llmopt.formats.schemes import fake_quantize_activations

from .triton_common import dot_dtype_is_f32, multiprocessors, tl, triton

if triton is not None:
    from .triton_common import fp8e4m3_bits_to_f32

WeightKind = Literal["int4", "int8", "fp8"]
_KIND_IDS = {"int4": 0, "int8": 1, "fp8": 2}


# ---------------------------------------------------------------------------------------------
# Packing (plain torch: runs once per weight, on any device).


def pack_int4_pairs(codes: torch.Tensor) -> torch.Tensor:
    """Signed int4 codes ``[out, in]`` (values in [-8, 7]) to ``uint8 [ceil(in / 2), out]``:
    input ``2j`` in the low nibble of row ``j``, input ``2j + 1`` in its high nibble, each
    offset by 8. An odd ``in`` is padded with one zero code."""
    out_features, in_features = codes.shape
    u = (codes.t().to(torch.int16) + 8)
    if in_features % 2:
        u = torch.cat([u, torch.full((1, out_features), 8, dtype=u.dtype, device=u.device)])
    return (u[0::2] | (u[1::2] << 4)).to(torch.uint8).contiguous()


def unpack_int4_pairs(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4_pairs`: int8 codes ``[out, in]``."""
    p = packed.to(torch.int16)
    u = torch.stack([p & 0xF, p >> 4], dim=1).reshape(-1, packed.shape[1])[:in_features]
    return (u - 8).to(torch.int8).t().contiguous()


@dataclass
class PackedWeight:
    """A quantized weight laid out for the Triton kernel (see the module doc)."""

    kind: WeightKind
    data: torch.Tensor
    scale: torch.Tensor  # float32 [n_groups, out]
    zero: torch.Tensor | None  # float32 [n_groups, out], asymmetric only
    group_size: int | None  # None: per output channel
    in_features: int
    out_features: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.zero) if t is not None)


def weight_kind(codes: torch.Tensor, num_bits: int | None = None) -> WeightKind:
    """The kernel format for ``codes``: float8 codes are fp8; integer codes are int4 when
    ``num_bits`` is 4, or (``num_bits`` None) when every code fits in [-8, 7], which packs
    losslessly whatever the scheme said."""
    if codes.dtype == torch.float8_e4m3fn:
        return "fp8"
    if codes.dtype != torch.int8:
        raise TypeError(f"quantized codes must be int8 or float8_e4m3fn, got {codes.dtype}")
    if num_bits is None:
        num_bits = 4 if bool(((codes >= -8) & (codes <= 7)).all()) else 8
    return "int4" if num_bits == 4 else "int8"


def pack_weight(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    group_size: int | None,
    num_bits: int | None = None,
) -> PackedWeight:
    """Repack a quantized weight (layout of :class:`llmopt.formats.schemes.QuantizedWeight`)
    for :func:`triton_quant_linear`; done once per weight, on the device it will run on."""
    out_features, in_features = codes.shape
    groups = 1 if group_size is None else in_features // group_size
    if group_size is not None and in_features % group_size:
        raise ValueError(f"group size {group_size} does not divide {in_features} input features")
    if scale.shape != (out_features, groups):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match {(out_features, groups)}")
    kind = weight_kind(codes, num_bits)
    if kind == "int4":
        data = pack_int4_pairs(codes)
    elif kind == "int8":
        data = codes.t().contiguous()
    else:
        data = codes.view(torch.uint8).t().contiguous()
    zero = None if zero_point is None else zero_point.float().t().contiguous()
    return PackedWeight(kind, data, scale.float().t().contiguous(), zero, group_size, in_features, out_features)


# ---------------------------------------------------------------------------------------------
# Tile configuration.


@dataclass(frozen=True)
class LinearConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def choose_config(m: int, w: PackedWeight, device: torch.device, split_k: int | None = None) -> LinearConfig:
    """Tile sizes for ``m`` rows: GEMV-shaped for ``m <= 16``, tensor-core tiles beyond; split-K
    when the output tiles alone would leave multiprocessors idle (``split_k`` overrides)."""
    if m <= 16:
        block_m, block_n, block_k, warps, stages = 16, 64, 128, 4, 4
    elif m <= 64:
        block_m, block_n, block_k, warps, stages = 64, 128, 64, 4, 3
    else:
        block_m, block_n, block_k, warps, stages = 128, 128, 64, 8, 3
    g = w.group_size
    if g is not None and g % block_k and g >= 16 and g & (g - 1) == 0:
        block_k = g  # a tile inside one group reads one scale row: power-of-two groups shrink the tile to fit
    k_tiles = -(-w.in_features // block_k)
    if split_k is None:
        tiles = -(-m // block_m) * -(-w.out_features // block_n)
        split_k = max(1, min(2 * multiprocessors(device) // tiles, k_tiles // 2))
    split_k = max(1, min(split_k, k_tiles))
    split_k = -(-k_tiles // -(-k_tiles // split_k))  # no empty splits
    return LinearConfig(block_m, block_n, block_k, split_k, warps, stages)


# ---------------------------------------------------------------------------------------------
# Kernels.

if triton is not None:

    @triton.jit
    def _dequant_matmul_kernel(
        x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, part_ptr,
        M, N, K, group_size, tiles_per_split,
        stride_xm, stride_xk, stride_wk, stride_om, stride_on,
        KIND: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
        GROUP_MODE: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """GROUP_MODE 0: per-channel (scale applied to the sums); 1: each K tile inside one group;
        2: any group size (scales gathered per element)."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_s = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        if GROUP_MODE == 0 and HAS_ZERO:
            zero_row = tl.load(zero_ptr + offs_n, mask=n_mask, other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_tiles = tl.cdiv(K, BLOCK_K)
        first = pid_s * tiles_per_split
        last = tl.minimum(first + tiles_per_split, k_tiles)
        for t in range(first, last):
            ks = t * BLOCK_K + offs_k
            k_mask = ks < K
            x = tl.load(x_rows + ks[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w_mask = k_mask[:, None] & n_mask[None, :]
            if KIND == 0:
                b = tl.load(w_ptr + (ks // 2)[:, None].to(tl.int64) * stride_wk + offs_n[None, :], mask=w_mask, other=0)
                w = (((b.to(tl.int32) >> ((ks % 2) * 4)[:, None]) & 0xF) - 8).to(tl.float32)
            elif KIND == 1:
                w = tl.load(w_ptr + ks[:, None].to(tl.int64) * stride_wk + offs_n[None, :], mask=w_mask, other=0).to(tl.float32)
            else:
                w = fp8e4m3_bits_to_f32(tl.load(w_ptr + ks[:, None].to(tl.int64) * stride_wk + offs_n[None, :], mask=w_mask, other=0))
            if GROUP_MODE == 0:
                if HAS_ZERO:
                    w = w - zero_row[None, :]
            elif GROUP_MODE == 1:
                g = (t * BLOCK_K) // group_size
                s = tl.load(scale_ptr + g * N + offs_n, mask=n_mask, other=0.0)
                if HAS_ZERO:
                    w = w - tl.load(zero_ptr + g * N + offs_n, mask=n_mask, other=0.0)[None, :]
                w = w * s[None, :]
            else:
                gk = (ks // group_size)[:, None] * N + offs_n[None, :]
                s = tl.load(scale_ptr + gk, mask=w_mask, other=0.0)
                if HAS_ZERO:
                    w = w - tl.load(zero_ptr + gk, mask=w_mask, other=0.0)
                w = w * s
            if DOT_F32:
                acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
        if GROUP_MODE == 0:
            acc = acc * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
        out_mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT:
            part = part_ptr + pid_s.to(tl.int64) * M * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
            tl.store(part, acc, mask=out_mask)
        else:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _split_sum_kernel(
        part_ptr, bias_ptr, out_ptr, M, N, SPLITS, stride_om, stride_on,
        HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """``out = sum of the split-K partials [SPLITS, M, N] (+ bias)``, cast to out's dtype."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < M * N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(SPLITS):
            acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
        n = offs % N
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + (offs // N) * stride_om + n * stride_on, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _group_mode(w: PackedWeight, block_k: int) -> int:
    if w.group_size is None:
        return 0
    return 1 if w.group_size % block_k == 0 else 2


def triton_quant_linear(
    x: torch.Tensor,
    w: PackedWeight,
    activations: str | None,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a packed quantized ``W`` on the Triton kernel.

    ``x`` ``[..., in]`` float16 / bfloat16 / float32; ``out`` (optional) ``[..., out]`` in
    ``x``'s dtype is written in place; ``split_k`` overrides the heuristic.
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    if x.shape[-1] != w.in_features:
        raise ValueError(f"input has {x.shape[-1]} features, weight expects {w.in_features}")
    if activations is not None:
        x = fake_quantize_activations(x, activations)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features)
    m, n = x2.shape[0], w.out_features
    if out is None:
        out = torch.empty(*lead, n, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, n)
    if m == 0:
        return out
    cfg = choose_config(m, w, x.device, split_k)
    k_tiles = -(-w.in_features // cfg.block_k)
    tiles_per_split = -(-k_tiles // cfg.split_k)
    split = cfg.split_k > 1
    part = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device) if split else out2
    zero = w.zero if w.zero is not None else w.scale
    has_bias = bias is not None and not split
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), cfg.split_k)
    _dequant_matmul_kernel[grid](
        x2, w.data, w.scale, zero, bias if has_bias else w.scale, out2, part,
        m, n, w.in_features, w.group_size or w.in_features, tiles_per_split,
        x2.stride(0), x2.stride(1), w.data.stride(0), out2.stride(0), out2.stride(1),
        KIND=_KIND_IDS[w.kind], HAS_ZERO=w.zero is not None, HAS_BIAS=has_bias,
        GROUP_MODE=_group_mode(w, cfg.block_k), SPLIT=split, DOT_F32=dot_dtype_is_f32(x.dtype),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split:
        block = 1024
        _split_sum_kernel[(triton.cdiv(m * n, block),)](
            part, bias if bias is not None else part, out2, m, n, cfg.split_k, out2.stride(0), out2.stride(1),
            HAS_BIAS=bias is not None, BLOCK=block,
        )
    return out
