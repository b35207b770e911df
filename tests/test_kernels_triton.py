"""Triton kernels against the plain-torch reference, run on the CPU by Triton's interpreter.

Triton is a test dependency (the ``test`` extra): without it this module fails to import, on
purpose, rather than skipping.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

try:
    import triton  # noqa: F401
except ImportError as e:  # fail loudly: CI installs triton with the test extra
    raise ImportError("tests/test_kernels_triton.py needs triton: pip install -e '.[test]'") from e

import pytest
import torch
from llmopt.runtime.kernels import (
    kv_quant,
    reference,
    triton_attention,
    triton_linear,
)

# Error allowed relative to the largest output magnitude, by the dtype the kernel computes in.
TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 2e-5}
N = 133  # output features: not a multiple of any BLOCK_N


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Every element of ``out`` (NaN-poisoned before the kernel ran) close to ``ref``."""
    assert not torch.isnan(out).any(), "the kernel left elements unwritten"
    bound = TOLERANCE[dtype] * ref.abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), atol=bound, rtol=0)


# ---------------------------------------------------------------------------------------------
# Quantized linear.

# name: (kind, group size, asymmetric, activations)
FORMATS = {
    "int4-g32": ("int4", 32, False, None),
    "int4-g64": ("int4", 64, False, None),
    "int4-g128": ("int4", 128, False, None),
    "int4-channel": ("int4", None, False, None),
    "int4-asym-g32": ("int4", 32, True, None),
    "int4-asym-g64": ("int4", 64, True, None),
    "int4-asym-g128": ("int4", 128, True, None),
    "int4-asym-channel": ("int4", None, True, None),
    "int4-g48": ("int4", 48, False, None),  # a group no tile size divides: scales per element
    "int8": ("int8", None, False, None),
    "int8-asym-g64": ("int8", 64, True, None),
    "fp8": ("fp8", None, False, None),
    "w8a8": ("int8", None, False, "int8"),
    "fp8-dynamic": ("fp8", None, False, "fp8"),
}


def in_features(group: int | None) -> int:
    """Odd for per-channel weights; otherwise a few groups, not a multiple of 128 unless the group is."""
    if group is None:
        return 333
    return group * (3 if group == 128 else 7)


def random_weight(kind: str, group: int | None, asym: bool, k: int):
    """Fresh random codes over the whole code range, with scales and zero points."""
    n_groups = 1 if group is None else k // group
    if kind == "fp8":
        bits = torch.randint(0, 256, (N, k), dtype=torch.uint8)
        bits[(bits & 0x7F) == 0x7F] = 0x3C  # no NaN codes; every other one, subnormals included
        codes = bits.view(torch.float8_e4m3fn)
    else:
        lo, hi = (-8, 8) if kind == "int4" else (-128, 128)
        codes = torch.randint(lo, hi, (N, k), dtype=torch.int8)
    scale = torch.rand(N, n_groups) * 0.02 + 0.002
    zero = torch.randint(-8, 8, (N, n_groups), dtype=torch.int32) if asym else None
    return codes, scale, zero


def check_linear(name: str, m: int, dtype: torch.dtype, split_k: int | None) -> None:
    kind, group, asym, activations = FORMATS[name]
    k = in_features(group)
    codes, scale, zero = random_weight(kind, group, asym, k)
    packed = triton_linear.pack_weight(codes, scale, zero, group, 4 if kind == "int4" else 8)
    assert packed.kind == kind
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(N).to(dtype)
    out = torch.full((m, N), float("nan"), dtype=dtype)
    triton_linear.triton_quant_linear(x, packed, activations, bias, out=out, split_k=split_k)
    ref = reference.quant_linear(x.float(), codes, scale, zero, group, activations, bias.float())
    assert_matches(out, ref, dtype)


@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("name", list(FORMATS))
def test_quant_linear_matches_reference(name: str, m: int) -> None:
    check_linear(name, m, torch.float16, None)


@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("name", ["int4-g32", "int4-asym-g128", "int4-channel", "int8", "fp8-dynamic"])
def test_quant_linear_split_k(name: str, m: int) -> None:
    check_linear(name, m, torch.float16, 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["int4-asym-g64", "int4-g48", "int8", "fp8"])
def test_quant_linear_dtypes(name: str, dtype: torch.dtype) -> None:
    check_linear(name, 3, dtype, None)
    check_linear(name, 17, dtype, 2)


def test_quant_linear_batched_input_and_fresh_output() -> None:
    codes, scale, zero = random_weight("int4", 64, True, 192)
    packed = triton_linear.pack_weight(codes, scale, zero, 64)  # int4 inferred from the codes
    assert packed.kind == "int4"
    x = torch.randn(2, 5, 192, dtype=torch.float16)
    out = triton_linear.triton_quant_linear(x, packed, None, None)
    assert out.shape == (2, 5, N)
    ref = reference.quant_linear(x.float(), codes, scale, zero, 64, None, None)
    assert_matches(out, ref, torch.float16)


def test_int4_pairs_layout_and_round_trip() -> None:
    for k in (64, 77):
        codes = torch.randint(-8, 8, (N, k), dtype=torch.int8)
        packed = triton_linear.pack_int4_pairs(codes)
        assert packed.dtype == torch.uint8 and packed.shape == ((k + 1) // 2, N)
        low = (packed.to(torch.int16) & 0xF) - 8
        high = (packed.to(torch.int16) >> 4) - 8
        assert torch.equal(low.t(), codes[:, 0::2].to(torch.int16))
        assert torch.equal(high.t()[:, : k // 2], codes[:, 1::2].to(torch.int16))
        assert torch.equal(triton_linear.unpack_int4_pairs(packed, k), codes)


def test_weight_kind() -> None:
    small = torch.randint(-8, 8, (4, 32), dtype=torch.int8)
    wide = small.clone()
    wide[0, 0] = 100
    assert triton_linear.weight_kind(small) == "int4"
    assert triton_linear.weight_kind(wide) == "int8"
    assert triton_linear.weight_kind(small, num_bits=8) == "int8"
    assert triton_linear.weight_kind(small.float().to(torch.float8_e4m3fn)) == "fp8"


def test_split_k_heuristic() -> None:
    codes, scale, _ = random_weight("int4", 128, False, 4096 // 4)
    packed = triton_linear.pack_weight(codes, scale, None, 128)
    for m in (1, 16, 64, 128):
        cfg = triton_linear.choose_config(m, packed, torch.device("cpu"), split_k=5)
        k_tiles = -(-packed.in_features // cfg.block_k)
        assert 128 % cfg.block_k == 0 and 1 <= cfg.split_k <= 5
        assert (cfg.split_k - 1) * -(-k_tiles // cfg.split_k) < k_tiles  # no empty split


# ---------------------------------------------------------------------------------------------
# Paged decode attention.


def paged_case(lens: list[int], heads: int, kv_heads: int, dim: int, block_size: int, dtype: torch.dtype, kv: str = "auto"):
    """A poisoned cache (NaN floats, or random codes with NaN scales) holding each sequence's
    K/V in shuffled blocks, plus the reference's inputs (rows, width, mask) as the model runner
    builds them. Returns ``q, k_cache, v_cache, k_scale, v_scale, rows, width, mask``."""
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    shape = (kv_heads, num_blocks * block_size, dim // kv_quant.values_per_element(kv))
    k_scale = v_scale = None
    if kv_quant.is_quantized(kv):
        storage = kv_quant.storage_dtype(kv, dtype)
        k_cache, v_cache = (torch.randint(-128 if storage == torch.int8 else 0, 128, shape).to(storage) for _ in range(2))
        k_scale, v_scale = (torch.full(shape[:2] + kv_quant.scale_shape(kv, dim), float("nan"), dtype=kv_quant.scale_dtype(kv))
                            for _ in range(2))
    else:
        k_cache = torch.full(shape, float("nan"), dtype=dtype)
        v_cache = k_cache.clone()
    width = max(lens)
    n_table = -(-width // block_size)
    free = torch.randperm(num_blocks).tolist()
    tables = torch.zeros(len(lens), n_table, dtype=torch.long)
    for i, n in enumerate(lens):
        used = -(-n // block_size)
        tables[i, :used] = torch.tensor([free.pop() for _ in range(used)])
        slots = (tables[i, :used, None] * block_size + torch.arange(block_size)).flatten()[:n]
        k, v = (torch.randn(n, kv_heads, dim).to(dtype) for _ in range(2))
        reference.write_kv(k_cache, v_cache, k, v, slots, k_scale, v_scale)
    rows = reference.block_rows(tables, kv_heads, num_blocks)
    mask = None
    if min(lens) != width:
        visible = torch.arange(n_table * block_size)[None, :] < torch.tensor(lens)[:, None]
        mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))[:, None, None, :]
    q = (torch.randn(len(lens), heads, dim) * 2).to(dtype)
    return q, k_cache, v_cache, k_scale, v_scale, rows, width, mask, tables


def reference_attention(q, k_cache, v_cache, k_scale, v_scale, rows, width, mask, block_size) -> torch.Tensor:
    """The reference in float32 (a float cache upcast; a quantized one dequantized to float32)."""
    if k_scale is None:
        k_cache, v_cache = k_cache.float(), v_cache.float()
    return reference.paged_decode_attention(
        q.float(), k_cache, v_cache, rows, width, mask, block_size, q.shape[-1] ** -0.5,
        reference.Workspace(k_cache.dtype), reference.Workspace(k_cache.dtype), k_scale, v_scale)


# (lengths, heads, kv heads, head dim, block size, partitions)
ATTENTION_CASES = [
    ([1, 37, 150], 6, 2, 48, 16, None),  # GQA 3, padded head dim, one-token sequence
    ([70, 37, 150], 6, 2, 48, 8, 3),  # blocks smaller than a chunk, split context
    ([100, 100], 4, 4, 64, 16, None),  # MHA, every sequence full width (no mask)
    ([129, 5], 8, 2, 64, 32, 4),  # GQA 4, empty partitions for the short sequence
    ([200], 9, 3, 64, 16, 2),  # SmolLM2-like heads
    ([33, 90], 4, 2, 128, 16, None),  # head dim 128: four int4 (scale, minimum) groups
]


def check_attention(case: int, dtype: torch.dtype, kv: str) -> None:
    lens, heads, kv_heads, dim, block_size, parts = ATTENTION_CASES[case]
    q, k_cache, v_cache, k_scale, v_scale, rows, width, mask, tables = paged_case(lens, heads, kv_heads, dim, block_size, dtype, kv)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    out = torch.full((len(lens), heads * dim), float("nan"), dtype=dtype)
    triton_attention.triton_paged_decode_attention(
        q, k_cache, v_cache, tables, context_lens, block_size, dim ** -0.5, k_scale, v_scale, out=out, num_parts=parts)
    assert_matches(out, reference_attention(q, k_cache, v_cache, k_scale, v_scale, rows, width, mask, block_size), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", range(len(ATTENTION_CASES)))
def test_paged_decode_attention_matches_reference(case: int, dtype: torch.dtype) -> None:
    check_attention(case, dtype, "auto")


@pytest.mark.parametrize("kv", ["int8", "fp8", "int4", "int4_g16"])
@pytest.mark.parametrize("case", [0, 1, 3, 5])
def test_paged_decode_attention_quantized_cache(case: int, kv: str) -> None:
    check_attention(case, torch.float16, kv)


@pytest.mark.parametrize("kind,bits", [("int4", 4), ("int8", 8)])
def test_quant_linear_float_zero_points(kind: str, bits: int) -> None:
    """llama.cpp's mins (float zero points, not multiples of the scale: formats int4km, int5m …)
    run as the kernels' float offsets, against the reference."""
    k = 32 * 7
    codes, scale, _ = random_weight(kind, 32, False, k)
    zero = torch.rand(N, k // 32) * 12 - 6  # float32, off the integers
    packed = triton_linear.pack_weight(codes, scale, zero, 32, bits)
    x = torch.randn(5, k).to(torch.float16)
    out = torch.full((5, N), float("nan"), dtype=torch.float16)
    triton_linear.triton_quant_linear(x, packed, None, None, out=out, split_k=None)
    assert_matches(out, reference.quant_linear(x.float(), codes, scale, zero, 32, None, None), torch.float16)
