"""C++ CPU quantized linears (runtime/kernels/cpu_linear.py) against ``reference.quant_linear``.

Every instruction set this CPU runs (the portable C++ path included) and every path (integer
GEMV, float GEMV, dequantized panel, W8A8 integer dot products), on fresh random weights and
inputs: odd output sizes (not multiples of the 16-feature tile), input sizes that are multiples
of the group size only, rows 1 ... 300. Outputs are NaN-poisoned first, so a skipped element
fails. End to end: a tiny quantized Llama decodes the same greedy tokens with either kernels.

Tolerance (weight-only, FP8_DYNAMIC): the reference sums float32 products in another order, and
the integer GEMV splits activations into three int8 levels whose residual is at most
6.1e-8 * max|x| per element (float32's own rounding is 6e-8 relative); both stay far below
``1e-5 * (|x| @ |W|.T) + 1e-6 * max|x| * sum|W|``. W8A8 also allows one activation rounding
step per row (``scale_x * max|W_row|``): the kernels quantize activations with the same float
division and round-half-even as torch, but a tie decided differently would move one code.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import byte_tokenizer, tiny_llama
from llmopt.core.errors import LlmoptError
from llmopt.formats.schemes import (
    compute_qparams,
    dequantize,
    fake_quantize_activations,
    get_scheme,
    quantize,
)
from llmopt.runtime.kernels import build, cpu_linear, reference

pytestmark = [
    pytest.mark.skipif(not build.compiler_available(), reason="no C++ compiler: the kernels fall back to torch"),
    pytest.mark.usefixtures("one_thread"),  # quick on a shared machine; tests that want more threads set them
]

ROWS = (1, 2, 3, 7, 16, 33, 300)
N = 37  # two full tiles and a partial one


@pytest.fixture(scope="module", autouse=True)
def shared_kernel_cache():
    """Build (or load) the C++ extensions from one persistent folder for the whole module rather
    than from each test's private cache (conftest's ``isolated_cache``): compiling takes minutes."""
    from platformdirs import user_cache_dir

    root = os.environ.get("LLMOPT_TEST_CACHE", user_cache_dir("llmopt"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMOPT_KERNEL_CACHE", os.path.join(root, "kernels"))
        mp.delenv("LLMOPT_KERNELS", raising=False)
        assert cpu_linear.available(), "a C++ compiler is present but the kernels did not build (see the warning)"
        yield


def quantized(preset: str, group: int | None, n: int, k: int):
    """Codes, scale, zero point of a random ``[n, k]`` weight under ``preset``."""
    scheme = get_scheme(preset, group if group is not None else 0)
    w = torch.randn(n, k) * 0.1
    scale, zp = compute_qparams(w, scheme, group)
    return quantize(w, scale, zp, scheme, group), scale, zp, scheme.activations


def tolerance(x: torch.Tensor, weight: torch.Tensor, activations: str | None) -> torch.Tensor:
    x2, w = x.reshape(-1, x.shape[-1]).float(), weight.float()
    tol = 1e-5 * (x2.abs() @ w.abs().T) + 1e-6 * x2.abs().amax(1, keepdim=True) * w.abs().sum(1)
    if activations == "int8":
        step = x2.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127.0
        tol = tol + step * w.abs().amax(1)
    return tol.reshape(*x.shape[:-1], -1)



def paths(isa: str, lanes: bool = True) -> list[str | None]:
    """Automatic choice plus every forced path (the GEMVs need groups of whole lanes)."""
    if isa == "scalar":
        return [None]
    return [None, "gemv", "float-gemv", "panel"] if lanes else [None, "panel"]


def check_all(codes, scale, zp, group, activations, k, bias=None):
    """Every ISA, path and row count against the reference."""
    packed = cpu_linear.pack(codes, scale, zp, group, activations)
    assert packed is not None
    lanes = group is None or group % (8 if packed.format in ("int4", "nl4") else 4) == 0
    weight = dequantize(codes, scale, zp, group)
    for rows in ROWS:
        x = torch.randn(rows, k)
        ref = reference.quant_linear(x, codes, scale, zp, group, activations, bias)
        tol = tolerance(x, weight, activations)
        for isa in cpu_linear.supported_isas():
            for path in paths(isa, lanes):
                out = torch.full((rows, codes.shape[0]), float("nan"))
                got = cpu_linear.linear(x, packed, bias, isa=isa, path=path, out=out)
                assert got.data_ptr() == out.data_ptr()
                assert not got.isnan().any(), f"{isa}/{path} M={rows}: unwritten outputs"
                excess = ((got - ref).abs() - tol).max().item()
                assert excess <= 0, f"{isa}/{path} M={rows}: error beyond tolerance by {excess:.3g}"


@pytest.mark.parametrize("preset", ["W4A16", "W4A16_ASYM"])
@pytest.mark.parametrize("group", [32, 64, 128, None])
def test_int4(preset, group):
    k = 3 * group if group else 131  # per-channel: an input size off the 8-value lanes
    codes, scale, zp, act = quantized(preset, group, N, k)
    check_all(codes, scale, zp, group, act, k, bias=torch.randn(N))


@pytest.mark.parametrize("group,k,steps", [(32, 96, None), (None, 131, None), (32, 512, 64), (12, 60, None)])
def test_nl4_grid_codes(group, k, steps):
    """int8 codes on the IQ4_NL grid (signed scales; IQ4_XS super-block scales too) pack as 4-bit
    grid indices, half int8's bytes, and every ISA and path matches the reference."""
    from llmopt.formats.schemes import IQ4_NL_GRID, grid_scheme

    scheme = grid_scheme(IQ4_NL_GRID, group, steps)
    w = torch.randn(N, k) * 0.1
    scale, zp = compute_qparams(w, scheme, group)
    codes = quantize(w, scale, zp, scheme, group)
    assert set(codes.unique().tolist()) <= set(IQ4_NL_GRID) and (scale < 0).any()
    packed = cpu_linear.pack(codes, scale, None, group, None)
    off = codes.clone()
    off[0, 0] = 126  # one code off the grid: plain int8
    int8 = cpu_linear.pack(off, scale, None, group, None)
    assert packed.format == "nl4" and int8.format == "int8"
    assert packed.data.shape[1] == -(-k // 8) and int8.data.shape[1] == -(-k // 4)  # 8 vs 4 codes per 32-bit lane
    check_all(codes, scale, None, group, None, k, bias=torch.randn(N))


@pytest.mark.parametrize("preset,k", [("W8A16", 131), ("FP8", 131), ("W8A8", 131), ("FP8_DYNAMIC", 96)])
def test_byte_formats(preset, k):
    codes, scale, zp, act = quantized(preset, None, N, k)
    check_all(codes, scale, zp, None, act, k, bias=torch.randn(N) if preset != "FP8" else None)


def test_scales_packed_in_bfloat16_only_when_exact():
    """bfloat16 scales (the checkpoints' default) are packed in half the bytes, any others stay
    float32; both run every path within the tolerance."""
    torch.manual_seed(4)
    codes, scale, zp, act = quantized("W4A16", 32, N, 64)
    assert torch.equal(scale.to(torch.bfloat16).float(), scale)
    wide = scale * (1 + 2.0**-12)  # between bfloat16 values
    for s, dtype in ((scale, torch.bfloat16), (wide, torch.float32)):
        assert cpu_linear.pack(codes, s, zp, 32, act).scale.dtype == dtype
        check_all(codes, s, zp, 32, act, 64)
    bf16_bytes = cpu_linear.pack(codes, scale, zp, 32, act).nbytes()
    assert bf16_bytes < cpu_linear.pack(codes, wide, zp, 32, act).nbytes()


@pytest.mark.parametrize("group", [32, 128, None])
def test_w4a8_rounds_activations_per_token_in_the_kernel(group):
    """W4A8: int4 codes with int8 activations per token, rounded by the C++ kernel (one integer
    level scaled per row where the integer GEMV runs; rounded values on the exact paths elsewhere)."""
    k = 4 * group if group else 136
    codes, scale, zp, act = quantized("W4A8", group, N, k)
    packed = cpu_linear.pack(codes, scale, zp, group, act)
    assert act == "int8" and packed.act_quant is None
    if group is None:  # one scale per row: the W8A8 kernel (int8 weights, int8 activations) holds the int4 codes
        assert packed.format == "w8a8" and not packed.token_int8
    else:
        assert packed.format == "int4" and packed.token_int8
    check_all(codes, scale, zp, group, act, k, bias=torch.randn(N))


def test_w4a8_ties_round_as_torch():
    """Exact .5 ties after scaling: the kernel's per-token codes are torch's (half to even)."""
    codes, scale, zp, act = quantized("W4A8", 32, N, 64)
    packed = cpu_linear.pack(codes, scale, zp, 32, act)
    x = torch.randint(-254, 255, (5, 64)).float() / 2
    x[:, 0] = 127.0  # scale exactly 1
    ref = reference.quant_linear(x, codes, scale, zp, 32, act, None)
    for isa in cpu_linear.supported_isas():
        for levels in (1, 3):  # the matmul precision does not change the checkpoint's per-token rounding
            got = cpu_linear.linear(x, packed, isa=isa, levels=levels)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(), msg=f"{isa} {levels}")


def test_group_sizes_off_the_lanes():
    """Groups of 12 (not whole 8-value lanes): the panel path serves every row count."""
    codes, scale, zp, act = quantized("W4A16_ASYM", 12, 21, 60)
    check_all(codes, scale, zp, 12, act, 60)


def test_asymmetric_int8_and_grouped_w8a8():
    """Codes outside int4's range with zero points, and a grouped W8A8 (activations then
    quantized in torch, weights through the int8 weight-only kernels)."""
    w = torch.randn(N, 64)
    scale, zp = compute_qparams(w, get_scheme("W4A16_ASYM"), 32)
    scale = scale / 16
    zp = torch.randint(-20, 20, zp.shape, dtype=torch.int32)
    codes = torch.randint(-128, 128, (N, 64), dtype=torch.int8)
    check_all(codes, scale, zp, 32, None, 64)
    check_all(codes, scale, None, 32, "int8", 64)


def test_many_threads_and_tiles():
    """Large enough to split across threads; rows on both sides of every path switch."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cases = [("W4A16", 64, 517), ("W8A16", None, 517), ("W8A8", None, 517), ("FP8", None, 517),
                 ("W4A16", 32, 4099), ("W8A16", None, 4099)]  # decode GEMVs split only past ~1 MB a task
        for preset, group, n in cases:
            codes, scale, zp, act = quantized(preset, group, n, 576)
            packed = cpu_linear.pack(codes, scale, zp, group, act)
            weight = dequantize(codes, scale, zp, group)
            for rows in (1, 4, 5, 16, 17, 40):
                x = torch.randn(rows, 576)
                got = cpu_linear.linear(x, packed)
                ref = reference.quant_linear(x, codes, scale, zp, group, act, None)
                assert ((got - ref).abs() <= tolerance(x, weight, act)).all(), (preset, rows)
    finally:
        torch.set_num_threads(before)


def test_input_shapes_and_dtypes():
    codes, scale, zp, act = quantized("W4A16", 32, N, 64)
    packed = cpu_linear.pack(codes, scale, zp, 32, act)
    x = torch.randn(2, 5, 64)
    bias = torch.randn(N)
    ref = reference.quant_linear(x, codes, scale, zp, 32, act, bias)
    got = cpu_linear.linear(x, packed, bias)
    assert got.shape == (2, 5, N)
    assert ((got - ref).abs() <= tolerance(x, dequantize(codes, scale, zp, 32), act)).all()
    # bfloat16 in and out: computed in float32, so within bf16's rounding of the float32 result
    xb = x.to(torch.bfloat16)
    got_b = cpu_linear.linear(xb, packed, bias.to(torch.bfloat16))
    want = reference.quant_linear(xb.float(), codes, scale, zp, 32, act, bias.to(torch.bfloat16).float())
    assert got_b.dtype == torch.bfloat16
    assert torch.allclose(got_b.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


def test_errors_and_unsupported_formats():
    codes, scale, zp, act = quantized("W4A16", 32, N, 64)
    packed = cpu_linear.pack(codes, scale, zp, 32, act)
    with pytest.raises(LlmoptError, match="expects 64"):
        cpu_linear.linear(torch.randn(1, 65), packed)
    with pytest.raises(LlmoptError, match="unknown instruction set"):
        cpu_linear.linear(torch.randn(1, 64), packed, isa="neon")
    with pytest.raises(LlmoptError, match="unknown kernel path"):
        cpu_linear.linear(torch.randn(1, 64), packed, path="fast")
    assert cpu_linear.pack(codes.to(torch.int32), scale, zp, 32, act) is None  # not a stored code type


def test_fp8_special_values():
    """Every finite e4m3 code (subnormals, zeros of both signs, the largest) decodes exactly."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    codes = values[~values.float().isnan()][:240].reshape(16, 15).repeat(1, 4)  # [16, 60]
    scale = torch.rand(16, 1) + 0.5
    packed = cpu_linear.pack(codes, scale, None, None, None)
    eye = torch.eye(60)
    want = dequantize(codes, scale, None, None).T
    for isa in cpu_linear.supported_isas():
        for path in paths(isa):
            assert torch.equal(cpu_linear.linear(eye, packed, isa=isa, path=path), want), (isa, path)


# ---------------------------------------------------------------------------------------------
# Runtime integration


def quantized_checkpoint(path, preset: str, group: int | None):
    from llmopt.formats.compressed import save_compressed
    from llmopt.formats.schemes import QuantizedWeight, effective_group_size

    model = tiny_llama(seed=3, tie_word_embeddings=False)
    scheme = get_scheme(preset, group if group is not None else 0)
    weights = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            gs = effective_group_size(module.in_features, scheme.group_size)
            scale, zp = compute_qparams(module.weight.data, scheme, gs)
            weights[name] = QuantizedWeight.from_weight(module.weight.data, scheme, gs, scale, zp)
    save_compressed(model, byte_tokenizer(), path, weights, ["lm_head"])
    return path


@pytest.mark.parametrize("preset,group", [("W8A16", None), ("W4A16", 32)])
def test_engine_cpu_kernels_match_reference(tmp_path, preset, group):
    from llmopt.runtime import LLM, SamplingParams

    path = quantized_checkpoint(tmp_path / "q", preset, group)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[1, 40, 41, 42, 43], [1, 100, 7, 250, 3, 3, 90]]
    outputs = {}
    for kernels in ("cpu", "reference"):
        llm = LLM(path, kernels=kernels)
        qkv = llm.engine.weights.layers[0].qkv
        assert (qkv.packed is not None) == (kernels == "cpu")
        outputs[kernels] = [o.token_ids for o in llm.generate(prompts, params)]
    assert [len(ids) for ids in outputs["cpu"]] == [len(ids) for ids in outputs["reference"]] == [12, 12]
    assert outputs["cpu"] == outputs["reference"]


def test_engine_kernels_setting_is_validated(tmp_path):
    from llmopt.runtime import LLM

    with pytest.raises(LlmoptError, match="kernels must be one of"):
        LLM(tmp_path, kernels="gpu")


def test_cli_kernels_option(tmp_path):
    from click.testing import CliRunner
    from llmopt.cli.main import main

    path = quantized_checkpoint(tmp_path / "q", "W4A16", 32)
    ids = {}
    for kernels in ("cpu", "reference"):
        result = CliRunner().invoke(main, ["generate", str(path), "hello", "--max-tokens", "6", "--ignore-eos",
                                           "--kernels", kernels, "--json"])
        assert result.exit_code == 0, result.output
        ids[kernels] = json.loads(result.stdout)["token_ids"]
    assert len(ids["cpu"]) == len(ids["reference"]) == 6
    assert ids["cpu"] == ids["reference"]
    for command in ("generate", "bench"):
        help_text = " ".join(CliRunner().invoke(main, [command, "--help"]).output.split())
        assert "reference forces the plain-torch path" in help_text


def test_fake_quantized_activations_match_torch():
    """The W8A8 kernels' activation codes are torch's: an input built from exact ties."""
    codes, scale, zp, act = quantized("W8A8", None, N, 64)
    packed = cpu_linear.pack(codes, scale, zp, None, act)
    x = (torch.randint(-254, 255, (3, 64)).float() / 2)  # halves: many exact .5 ties after scaling
    x[:, 0] = 127.0  # absmax 127: scale exactly 1, so x / scale keeps the ties
    ref = reference.quant_linear(x, codes, scale, zp, None, act, None)
    assert torch.equal(fake_quantize_activations(x, "int8"), torch.round(x))
    for isa in cpu_linear.supported_isas():
        got = cpu_linear.linear(x, packed, isa=isa)
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item()), isa


@pytest.mark.parametrize("fmt", ["int4km", "int5m"])
def test_float_zero_points(fmt):
    """llama.cpp's mins (float zero points, not multiples of the scale): 4-bit codes run the int4
    kernel, 5-bit codes the int8 one, both against the reference."""
    from llmopt.formats.registry import FORMATS

    scheme = FORMATS[fmt].scheme(32)
    w = torch.randn(N, 256) * 0.1 + 0.03
    scale, zp = compute_qparams(w, scheme, 32)
    assert zp.dtype == torch.float32 and not torch.equal(zp, zp.round())
    codes = quantize(w, scale, zp, scheme, 32)
    assert cpu_linear.pack(codes, scale, zp, 32, None).format == ("int4" if scheme.num_bits == 4 else "int8")
    check_all(codes, scale, zp, 32, None, 256)
