"""C++ CPU kernels for quantized linears (int4, int8, nl4, fp8 weight-only; W8A8 integer).

Each weight runs the kernel its registered weight format names (``WeightFormat.kernel``,
:mod:`llmopt.formats.registry`). The int8 codes of the nl4 / nl4x formats (on llama.cpp's IQ4_NL
grid) are packed as 4-bit grid indices (``nl4``): half int8's bytes; the kernels turn an index into its grid value with a
16-entry table (a byte shuffle in the integer GEMV, a float permute elsewhere).

``pack`` turns a quantized weight (codes, scales, zero points as stored in checkpoints) into the
layout the kernels read (see ``csrc/cpu_linear.h``): output features in tiles of 16, each
uint32 lane holding 8 int4 or 4 byte values of one feature along the input. ``linear`` runs
``x @ W.T + b`` on it, choosing the instruction set at run time (AVX-512 with VNNI, AVX2 + FMA,
or portable C++; ``isa`` or ``LLMOPT_CPU_ISA``, read once per process, force one) and the path:

- ``gemv`` (a few rows, decode): int4 / int8 codes times the activations split into three int8
  levels (integer dot products; the split leaves at most ``6.1e-8 * max|x|`` per element, the
  size of float32 rounding), up to 16 rows with AVX-512 and 2 with AVX2;
- ``float-gemv`` (fp8, and int8 on AVX2; up to 4 rows): codes converted to float in registers;
- ``panel`` (many rows, prefill): weights dequantized a panel at a time for an FMA micro-kernel;
- ``levels=1`` (matmul precision ``low``): the integer GEMV with the activations rounded to int8
  per block of at most 32 inputs (one level, llama.cpp's Q8_0 arithmetic) at every row count,
  prefill included: a third of the exact split's dot products, twice the products per
  instruction of the bfloat16 panel;
- ``bf16=True`` (matmul precision ``medium``, CPUs with AVX512-BF16): the panel path rounds the
  dequantized weights and the activations to bfloat16 and multiplies them in pairs with float32
  sums (``vdpbf16ps``: twice the products per instruction of an FMA), as a W4A16 matmul on a GPU
  does; the GEMVs (decode of few rows) stay exact;
- W8A8 always multiplies int8 activations (quantized per token as ``fake_quantize_activations``
  does) by int8 weights; W4A8 (and grouped W8A8) round their activations to int8 per token in
  C++ too and run the integer GEMV with one level (one int8 code per input, one scale per row)
  at every row count where it runs, else the exact paths on the rounded values.

Results match ``reference.quant_linear`` up to float32 rounding (see tests/test_kernels_linear.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

import torch
from llmopt.core.errors import LlmoptError
from llmopt.formats.registry import kernel_for_codes
from llmopt.formats.schemes import IQ4_NL_GRID, fake_quantize_activations

from .build import ISAS, IsaExtension

SOURCES = ["linear.cpp", "cpu_linear_avx2.cpp", "cpu_linear_avx512.cpp", "cpu_linear_avx512bf16.cpp", "cpu_linear_scalar.cpp"]
FORMATS = {"int4": 0, "int8": 1, "fp8": 2, "w8a8": 3, "nl4": 4, "bf16": 5}
PATHS = {"gemv": 0, "panel": 1, "float-gemv": 2}  # gemv: the integer GEMV where it applies
TILE = 16
PACK_ROWS = 2048  # output features packed per step (bounds the int64 intermediates)
W8A8_MAX_K = 65536


@dataclass
class PackedLinear:
    """A quantized weight in the kernels' layout."""

    format: str  # int4 | int8 | fp8 | w8a8 | nl4 | bf16 (a float weight's bfloat16 pairs, see pack_bf16)
    out_features: int
    in_features: int
    group_size: int | None  # None: one scale per output feature
    data: torch.Tensor  # int32 [tiles, Kp / values_per_lane, 16]
    scale: torch.Tensor  # [tiles, groups, 16]: bfloat16 when every scale is a bfloat16 value, else float32
    offset: torch.Tensor | None  # float32 like scale (asymmetric codes), else offset = -2^(bits-1) * scale
    wsum: torch.Tensor | None  # int32 [tiles * 16]: sum of each feature's codes (w8a8)
    act_quant: str | None  # activations quantize-dequantized in torch first (FP8_DYNAMIC)
    token_int8: bool = False  # int8 activations per token (W4A8, grouped W8A8): the C++ kernel rounds them (levels 0)
    handle: object = field(default=None, repr=False)  # the C++ view of the tensors above

    def __post_init__(self) -> None:
        if self.handle is None:
            self.handle = _module().Packed(self.data, self.scale, self.offset, self.wsum, FORMATS[self.format],
                                           self.out_features, self.in_features, self.group_size or 0)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.offset, self.wsum) if t is not None)


EXTENSION = IsaExtension("cpu_linear", SOURCES)
available = EXTENSION.available
supported_isas = EXTENSION.supported_isas


def _module() -> ModuleType | None:
    return EXTENSION.module()


def _tiles(t: torch.Tensor, tiles: int) -> torch.Tensor:
    """``[N, G]`` per-feature values → ``[tiles, G, 16]`` (zero rows past N)."""
    padded = t.new_zeros(tiles * TILE, t.shape[1])
    padded[: t.shape[0]] = t
    return padded.view(tiles, TILE, -1).transpose(1, 2).contiguous()


def _lanes(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``values`` ``[N, K]`` (each < 2^bits) → int32 lanes ``[tiles, Kp / vpl, 16]``."""
    vpl = 32 // bits
    n, k = values.shape
    tiles, chunks = -(-n // TILE), -(-k // vpl)
    shifts = torch.arange(vpl, dtype=torch.int64) * bits
    words = torch.empty(tiles * TILE, chunks, dtype=torch.int32)
    words[n:] = 0
    for start in range(0, n, PACK_ROWS):
        rows = values[start : start + PACK_ROWS].to(torch.int64)
        padded = rows.new_zeros(rows.shape[0], chunks * vpl)
        padded[:, :k] = rows
        word = (padded.view(rows.shape[0], chunks, vpl) << shifts).sum(-1)
        words[start : start + rows.shape[0]] = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return words.view(tiles, TILE, chunks).transpose(1, 2).contiguous()


_GRID_INDEX = torch.zeros(256, dtype=torch.int64)  # int8 code + 128 → its index in the IQ4_NL grid
_GRID_INDEX[torch.tensor(IQ4_NL_GRID) + 128] = torch.arange(len(IQ4_NL_GRID))


def pack(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    group_size: int | None,
    activations: str | None,
    kernel: str | None = None,
) -> PackedLinear | None:
    """The kernels' layout of a quantized weight (see ``quant.formats``), or None when the
    kernels are unavailable or do not cover it (the caller keeps the reference path).
    ``kernel``: the one its weight format runs on (int4, int8, nl4, fp8: ``WeightFormat.kernel``;
    None: the narrowest that holds the codes, :func:`~llmopt.formats.registry.kernel_for_codes`);
    an int8 per-channel weight with int8 activations (W8A8) runs the integer-activation kernel."""
    if not available():
        return None
    if codes.dim() != 2 or scale.dim() != 2 or codes.device.type != "cpu":
        return None
    n, k = codes.shape
    groups = scale.shape[1]
    if scale.shape[0] != n or k % groups or (groups > 1 and group_size is not None and group_size * groups != k):
        return None
    if zero_point is not None and zero_point.shape != scale.shape:
        return None
    tiles = -(-n // TILE)
    scale = scale.float()
    gs = None if groups == 1 else k // groups
    act_quant = activations
    offset = wsum = None
    kernel = kernel or kernel_for_codes(codes, zero_point)
    if (codes.dtype == torch.float8_e4m3fn) != (kernel == "fp8") or codes.dtype not in (torch.int8, torch.float8_e4m3fn):
        return None
    if kernel == "fp8":
        if zero_point is not None:
            return None
        fmt, data = "fp8", _lanes(codes.view(torch.uint8), 8)
    # W8A8 sums whole rows in int32: |sum| <= 255 * 128 * K stays below 2^31 up to K = 65536.
    elif activations == "int8" and zero_point is None and groups == 1 and k <= W8A8_MAX_K:
        fmt, data, act_quant = "w8a8", _lanes(codes.view(torch.uint8), 8), None
        sums = torch.zeros(tiles * TILE, dtype=torch.int32)
        sums[:n] = codes.sum(1, dtype=torch.int32)
        wsum = sums
    elif kernel == "nl4" and zero_point is None and n * k:
        fmt, data = "nl4", _lanes(_GRID_INDEX[codes.to(torch.int64) + 128], 4)  # 4-bit grid indices
    else:
        fmt = "int4" if kernel == "int4" and n * k else "int8"
        half = 8 if fmt == "int4" else 128
        data = _lanes(codes.to(torch.int16) + half, 4 if fmt == "int4" else 8)
        if zero_point is not None:
            offset = _tiles(-(zero_point.float() + half) * scale, tiles)
    tiled = _tiles(scale, tiles)
    narrow = tiled.to(torch.bfloat16)
    if torch.equal(narrow.float(), tiled):  # bfloat16 scales (checkpoints' default) kept exactly in half the bytes
        tiled = narrow
    token_int8 = act_quant == "int8" and fmt in ("int4", "int8", "nl4")
    return PackedLinear(fmt, n, k, gs, data, tiled, offset, wsum, None if token_int8 else act_quant, token_int8)


def linear(
    x: torch.Tensor,
    packed: PackedLinear,
    bias: torch.Tensor | None = None,
    *,
    isa: str | None = None,
    path: str | None = None,
    out: torch.Tensor | None = None,
    bf16: bool = False,
    levels: int = 3,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a packed ``W``; ``x`` is ``[..., in]`` of any float dtype (computed
    in float32, returned in ``x``'s dtype). ``out`` (float32 ``x`` only) receives the result;
    ``isa`` / ``path`` force a variant (tests, benchmarks); ``bf16``: bfloat16 products in the
    panel path (:func:`bf16_supported` CPUs only); ``levels``: 3 (exact) or 1 (activations rounded
    to int8 per block, ``reference.round_activations_int8``) in the integer GEMV."""
    if x.shape[-1] != packed.in_features:
        raise LlmoptError(f"input has {x.shape[-1]} features, the layer expects {packed.in_features}", "check the model's shapes")
    if path is not None and path not in PATHS:
        raise LlmoptError(f"unknown kernel path {path!r}", f"use one of {', '.join(PATHS)}")
    if levels not in (1, 3):
        raise LlmoptError(f"levels must be 1 or 3, not {levels}", "use 3 (exact) or 1 (int8 activations)")
    if packed.act_quant is not None:
        x = fake_quantize_activations(x, packed.act_quant)
    return _module().linear(x, packed.handle, bias, EXTENSION.isa_code(isa), PATHS.get(path, -1), out, bf16,
                            0 if packed.token_int8 else levels)


def pack_bf16(weight: torch.Tensor) -> PackedLinear | None:
    """A float ``[out, in]`` weight rounded to bfloat16 (nearest even) in the bfloat16 panel's pair
    layout (``csrc/cpu_linear.h``, format ``bf16``), or None where that panel does not run: for
    many rows at once under matmul precision ``medium`` / ``low`` without a conversion per call."""
    if not bf16_supported():
        return None
    n, k = weight.shape
    kb, pairs = -(-k // 2), -(-n // 32)
    padded = torch.zeros(pairs * 32, 2 * kb, dtype=torch.bfloat16)
    padded[:n, :k] = weight
    words = padded.view(torch.int32).view(pairs, 32, kb).transpose(1, 2).contiguous()  # input 2p in the low half
    return PackedLinear("bf16", n, k, None, words, torch.zeros(-(-n // TILE), 1, TILE), None, None, None)


def running_isa() -> str:
    """The instruction set the kernels run with here (the best one, or ``LLMOPT_CPU_ISA``'s)."""
    code = EXTENSION.isa_code(None)
    return supported_isas()[-1] if code == -1 else ISAS[code]


def bf16_supported() -> bool:
    """Whether this CPU runs the panel with bfloat16 products (AVX-512 with VNNI and BF16)."""
    module = _module()
    return module is not None and module.bf16_supported()


def bind(packed: PackedLinear, bias: torch.Tensor | None = None, bf16: bool = False,
         levels: int = 3) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> linear(x, packed, bias, bf16=bf16, levels=levels)`` with the Python-side checks and
    choices made once: a decode step calls every linear of every layer (the C++ side still checks
    the input's size)."""
    if packed.act_quant is not None:
        return lambda x: linear(x, packed, bias, bf16=bf16, levels=levels)
    run, handle, isa = _module().linear, packed.handle, EXTENSION.isa_code(None)
    levels = 0 if packed.token_int8 else levels  # the checkpoint's per-token activations, whatever the precision
    return lambda x: run(x, handle, bias, isa, -1, None, bf16, levels)
