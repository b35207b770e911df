"""C++ float GEMV (runtime/kernels/cpu_dense.py) and fused forward steps (cpu_fused.py) against
plain torch, on fresh random inputs.

GEMV: every instruction set this CPU runs (portable C++ included), float32 / bfloat16 / float16
weights, odd shapes (output sizes that leave rows after the kernel's six far-apart streams, input
sizes with a tail shorter than a vector), rows 1 ... 5, 16, 32 (the GEMV) and beyond (torch's
linear), NaN-poisoned outputs so a skipped element fails. The reference is float64; the kernel
sums float32 products in another order, far below ``1e-5 * (|x| @ |W|.T)``; 16-bit weights are
exact in float32, so only the final rounding to the input's dtype adds one unit.

Fused steps (residual add + RMSNorm, silu * up, q/k norm + RoPE + KV write) against the plain
torch operations the model's reference forward runs.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from llmopt.core.errors import LlmoptError
from llmopt.runtime.kernels import build, cpu_dense, cpu_fused, reference
from llmopt.runtime.rope import apply_rotary

pytestmark = [
    pytest.mark.skipif(not build.compiler_available(), reason="no C++ compiler: the kernels fall back to torch"),
    pytest.mark.usefixtures("one_thread"),  # quick on a shared machine; tests that want more threads set them
]


@pytest.fixture(scope="module", autouse=True)
def shared_kernel_cache():
    """One persistent build folder for the module (compiling takes a minute)."""
    from platformdirs import user_cache_dir

    root = os.environ.get("LLMOPT_TEST_CACHE", user_cache_dir("llmopt"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMOPT_KERNEL_CACHE", os.path.join(root, "kernels"))
        mp.delenv("LLMOPT_KERNELS", raising=False)
        assert cpu_dense.available() and cpu_fused.available(), "a C++ compiler is present but the kernels did not build"
        yield



def expected(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``x @ w.T + b`` and its tolerance (float32 summation order)."""
    x64, w64 = x.double(), w.double()
    want = x64 @ w64.T + (bias.double() if bias is not None else 0)
    tol = 1e-5 * (x64.abs() @ w64.abs().T) + 1e-6
    return want, tol


@pytest.mark.parametrize("wtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemv_matches_float64(wtype):
    for isa in cpu_dense.supported_isas():
        for n, k in ((37, 53), (6 * 7 + 5, 16), (200, 129), (3, 7)):
            w = (torch.randn(n, k) * 0.2).to(wtype)
            bias = torch.randn(n).to(wtype) if n % 2 else None
            for m in (1, 2, 3, 4, 5, 7, 16, 32, 33, 40):
                x = torch.randn(m, k).to(wtype) if wtype != torch.float32 else torch.randn(m, k)
                want, tol = expected(x, w, bias)
                got = cpu_dense.linear(x, w, bias, isa=isa)
                assert got.dtype == x.dtype and got.shape == (m, n)
                if x.dtype == torch.float32:
                    out = torch.full((m, n), float("nan"))
                    assert cpu_dense.linear(x, w, bias, isa=isa, out=out).data_ptr() == out.data_ptr()
                    assert torch.equal(out, got), (isa, m)
                if wtype != torch.float32:
                    tol = tol + want.abs() * 2.0**-7  # one unit of the 16-bit result
                err = (got.double() - want).abs()
                assert bool((err <= tol).all()), (wtype, isa, n, k, m, float((err - tol).max()))


def test_gemv_float32_activations_with_16bit_weights_and_leading_dims():
    w = (torch.randn(45, 40) * 0.2).to(torch.bfloat16)
    x = torch.randn(2, 3, 40)
    got = cpu_dense.linear(x, w)
    want, tol = expected(x.reshape(-1, 40), w, None)
    assert got.shape == (2, 3, 45) and got.dtype == torch.float32
    assert bool(((got.reshape(-1, 45).double() - want).abs() <= tol).all())
    assert cpu_dense.linear(torch.randn(0, 40), w).shape == (0, 45)


def test_gemv_rows_limit_and_threads():
    w, x = torch.randn(300, 64), torch.randn(8, 64)
    want, tol = expected(x, w, None)
    for max_rows in (0, 4, 8):  # 0: torch's linear for any row count
        assert bool(((cpu_dense.linear(x, w, max_rows=max_rows).double() - want).abs() <= tol).all())
    torch.set_num_threads(2)
    big_w, big_x = torch.randn(4099, 257), torch.randn(3, 257)
    want, tol = expected(big_x, big_w, None)
    assert bool(((cpu_dense.linear(big_x, big_w).double() - want).abs() <= tol).all())


def test_gemv_errors():
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="input features"):
        cpu_dense.linear(torch.randn(1, 15), w)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_dense.linear(torch.randn(1, 8), w.t())
    with pytest.raises(RuntimeError, match="out must be"):
        cpu_dense.linear(torch.randn(1, 16), w, out=torch.empty(7))
    with pytest.raises(LlmoptError, match="unknown instruction set"):
        cpu_dense.linear(torch.randn(1, 16), w, isa="neon")


# ---------------------------------------------------------------------------------------------
# Fused steps


@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_add_rms_norm_matches_torch(tokens):
    hidden, eps = 77, 1e-5
    h, delta, weight = torch.randn(tokens, hidden), torch.randn(tokens, hidden), torch.randn(hidden)
    want_h = h + delta
    want = F.rms_norm(want_h, (hidden,), weight, eps)
    out = torch.full_like(h, float("nan"))
    cpu_fused.add_rms_norm(h, delta, weight, eps, out)
    assert torch.equal(h, want_h)  # the residual add is one float32 add, exactly torch's
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    out2 = torch.full_like(h, float("nan"))
    cpu_fused.add_rms_norm(h, None, weight, eps, out2)  # no delta: h unchanged
    assert torch.equal(h, want_h)
    torch.testing.assert_close(out2, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 3, 300])
def test_silu_mul_matches_torch(tokens):
    gate_up = torch.randn(tokens, 2 * 97) * 4
    want = F.silu(gate_up[:, :97]) * gate_up[:, 97:]
    torch.testing.assert_close(cpu_fused.silu_mul(gate_up), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_kv_write_match_torch(qk_norm):
    tokens, heads, kv_heads, dim, slots_total, eps = 7, 4, 2, 32, 64, 1e-6
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    angles = torch.rand(tokens, dim // 2) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([-angles.sin(), angles.sin()], -1)
    norm = torch.randn(heads + kv_heads, dim) if qk_norm else None
    slots = torch.randperm(slots_total)[:tokens]

    view = qkv.view(tokens, heads + 2 * kv_heads, dim)
    qk = view[:, :heads + kv_heads]
    if qk_norm:
        qk = F.rms_norm(qk, (dim,), None, eps) * norm
    want_qk = apply_rotary(qk, cos[:, None], sin[:, None])
    want_v = view[:, heads + kv_heads:].clone()
    want_k_cache = torch.full((kv_heads, slots_total, dim), float("nan"))
    want_v_cache = want_k_cache.clone()
    reference.write_kv(want_k_cache, want_v_cache, want_qk[:, heads:], want_v, slots)

    k_cache, v_cache = torch.full_like(want_k_cache, float("nan")), torch.full_like(want_v_cache, float("nan"))
    got = qkv.clone()
    cpu_fused.rope(got, cos, sin, heads, kv_heads, norm, eps, k_cache, v_cache, slots)
    got = got.view(tokens, heads + 2 * kv_heads, dim)
    torch.testing.assert_close(got[:, :heads + kv_heads], want_qk, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:, heads + kv_heads:], want_v)
    written = torch.zeros(slots_total, dtype=torch.bool)
    written[slots] = True
    assert k_cache[:, ~written].isnan().all() and v_cache[:, ~written].isnan().all()  # nothing else touched
    torch.testing.assert_close(k_cache[:, written], want_k_cache[:, written], rtol=1e-5, atol=1e-5)
    assert torch.equal(v_cache[:, written], want_v_cache[:, written])

    rotated_only = qkv.clone()
    cpu_fused.rope(rotated_only, cos, sin, heads, kv_heads, norm, eps)  # no cache: rotation only
    assert torch.equal(rotated_only.view_as(got), got)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_fused.rope(qkv.clone(), cos, sin, heads, kv_heads, norm, eps, k_cache, v_cache, slots + slots_total)


@pytest.mark.parametrize("kind", ["int8", "fp8", "int4", "int4_g16"])
@pytest.mark.parametrize("dim", [64, 80, 128])
def test_store_kv_writes_the_references_codes_and_scales_bit_for_bit(kind, dim):
    """The C++ quantized KV write against ``reference.write_kv`` (keys less their block's offset first), on
    strided views of a merged q/k/v row as the CPU backend passes them, with wide value ranges,
    a constant head and a head of exact ties; untouched slots stay as they were."""
    from llmopt.runtime.kernels import kv_quant

    tokens, heads, kv_heads, slots_total = 9, 6, 3, 40
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim) * torch.logspace(-3, 3, tokens)[:, None, None]
    qkv[0, heads] = 1.5  # a constant key head: zero range
    qkv[1, heads + kv_heads] = torch.tensor([0.0, 1.0]).repeat(dim // 2)  # ties at every rounding boundary
    k, v = qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    offsets = torch.randn(kv_heads, 5, dim).half()  # [kv_heads, blocks of positions, dim], as the cache keeps them
    key_blocks = torch.tensor([0, 0, 1, 4, 2, 2, 3, 0, 4])
    slots = torch.randperm(slots_total)[:tokens]
    storage = kv_quant.storage_dtype(kind, torch.float32)
    shape = (kv_heads, slots_total, dim // kv_quant.values_per_element(kind))
    scale_shape = shape[:2] + kv_quant.scale_shape(kind, dim)

    def empty():
        codes = [torch.full(shape, 0x55, dtype=storage) for _ in range(2)]
        scales = [torch.full(scale_shape, 7.0, dtype=kv_quant.scale_dtype(kind)) for _ in range(2)]
        return codes, scales

    (want_k, want_v), (want_ks, want_vs) = empty()
    reference.write_kv(want_k, want_v, k - offsets[:, key_blocks].transpose(0, 1).float(), v, slots, want_ks, want_vs)
    (got_k, got_v), (got_ks, got_vs) = empty()
    cpu_fused.store_kv(k, v, slots, got_k, got_v, got_ks, got_vs, offsets, key_blocks)
    for got, want in ((got_k, want_k), (got_v, want_v), (got_ks, want_ks), (got_vs, want_vs)):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float16 else got,
                           want.view(torch.uint8) if want.dtype == torch.float16 else want)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_fused.store_kv(k, v, slots + slots_total, got_k, got_v, got_ks, got_vs, None)
    with pytest.raises(RuntimeError, match="outside the key offsets"):
        cpu_fused.store_kv(k, v, slots, got_k, got_v, got_ks, got_vs, offsets, key_blocks + 1)


def test_argmax_matches_torch_with_ties_and_nan():
    for vocab in (1, 15, 16, 17, 1000, 49152):
        logits = torch.randn(6, vocab)
        logits[1] = 0.0  # all tied: the first
        logits[2, vocab // 2:] = logits[2].max() + 1  # tied maxima in the second half
        logits[3, vocab - 1] = float("nan")  # a NaN wins, as in torch
        logits[4, vocab // 3] = float("nan")
        logits[4, 0] = float("inf")
        logits[5] = -float("inf")
        assert torch.equal(cpu_fused.argmax(logits), logits.argmax(-1)), vocab
