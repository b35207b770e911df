"""FP4 weights (NVFP4A16, MXFP4A16): E2M1 codes and their scales as compressed-tensors defines them,
checked against an independent pure-torch reference quantizer written here; checkpoints round-trip
through our reader, transformers' loader and llmopt's runtime; RTN, GPTQ and the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import CORPORA, byte_tokenizer, correlated_inputs, out_err, save_model, tiny_llama

from llmopt.checkpoints.models import load_model
from llmopt.cli.main import main
from llmopt.formats import fp4
from llmopt.formats.compressed import read_compressed
from llmopt.formats.registry import format_of
from llmopt.formats.schemes import get_scheme
from llmopt.pipeline.stages.quantize import quantize_checkpoint
from llmopt.quant.request import make_request
from llmopt.quant.rtn import rtn_quantize_weight

pytestmark = pytest.mark.usefixtures("one_thread")

SCHEMES = ["NVFP4A16", "MXFP4A16"]
VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
GRID = torch.cat([-VALUES.flip(0), VALUES])  # 16 entries (±0)
ATOL_LOADERS = 1e-4
CALIB = str(CORPORA / "gutenberg" / "persuasion.txt")


# ---------------------------------------------------------------------------------------------
# An independent reference: the formats written down from their definitions, value by value


def ref_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value by distance (ties: the even mantissa, 0 / 1 / 2 / 4), clamped to ±6."""
    a = x.abs().clamp(max=6.0).unsqueeze(-1)
    dist = (a - VALUES).abs()
    even = torch.tensor([1, 0, 1, 0, 1, 0, 1, 0], dtype=torch.float32)  # mantissa bit clear
    index = (dist - 1e-6 * even * (dist == dist.min(-1, keepdim=True).values)).argmin(-1)
    return VALUES[index] * torch.where(x < 0, -1.0, 1.0)


def ref_nvfp4(w: torch.Tensor) -> torch.Tensor:
    """NVFP4 dequantized: global 448·6/absmax, FP8 E4M3 group scales of absmax/6 · global (0 → 0.125)."""
    g = torch.tensor(448.0 * 6.0) / w.abs().max()
    groups = w.reshape(w.shape[0], -1, 16)
    stored = (groups.abs().amax(-1, keepdim=True) / 6.0 * g).to(torch.float8_e4m3fn).float()
    stored[stored == 0] = 0.125
    scale = stored / g
    return (ref_e2m1(groups / scale) * scale).reshape(w.shape)


def ref_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """MXFP4 dequantized: scale 2^(e - 2), e = floor(log2 absmax), plus one where absmax / 2^e >= 1.75."""
    groups = w.reshape(w.shape[0], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    e = torch.floor(torch.log2(amax))
    e = torch.where(amax / torch.exp2(e) >= 1.75, e + 1, e)
    scale = torch.exp2(e - 2)
    return (ref_e2m1(groups / scale) * scale).reshape(w.shape)


def test_e2m1_rounding_is_compressed_tensors_and_the_reference():
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -7.0])
    x = torch.cat([ties, torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 3])
    x = torch.cat([x, torch.tensor([0.0, -0.0, -0.1, 0.1, 6.0, 100.0, -100.0])])
    ours = fp4.round_to_e2m1(x)
    theirs = cast_to_fp4(x.clone().clamp(-6, 6))
    assert torch.equal(ours, theirs) and torch.equal(torch.signbit(ours), torch.signbit(theirs))  # -0 where theirs is
    assert torch.equal(ours, ref_e2m1(x))
    assert fp4.on_e2m1(ours.to(torch.float8_e4m3fn))


def test_packing_is_compressed_tensors():
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8

    codes = GRID[torch.randint(len(GRID), (8, 64), generator=torch.Generator().manual_seed(1))]
    packed = fp4.pack_e2m1(codes.to(torch.float8_e4m3fn))
    assert packed.dtype == torch.uint8 and packed.shape == (8, 32)
    assert torch.equal(packed, pack_fp4_to_uint8(codes))
    assert torch.equal(fp4.unpack_e2m1(packed).float(), unpack_fp4_from_uint8(packed, 8, 64, torch.float32))
    with pytest.raises(ValueError, match="even number of columns"):
        fp4.pack_e2m1(torch.zeros(2, 3))


@pytest.mark.parametrize("scheme,reference", [("NVFP4A16", ref_nvfp4), ("MXFP4A16", ref_mxfp4)])
def test_rtn_equals_the_reference_quantizer(scheme, reference):
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(2)) * 0.02
    w[3, :16] = 0.0  # an all-zero group
    s = get_scheme(scheme)
    qw = rtn_quantize_weight(w, s, s.group_size)
    assert qw.codes.dtype == torch.float8_e4m3fn and fp4.on_e2m1(qw.codes)
    torch.testing.assert_close(qw.dequantize(), reference(w), rtol=0, atol=0)
    assert format_of(qw).name == scheme[:5].lower()


def test_scales_are_representable():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)) * 0.05
    nv = rtn_quantize_weight(w, get_scheme("NVFP4A16"), 16)
    g = nv.scheme.global_scale_tensor()
    stored = fp4.stored_e4m3(nv.scale, g)  # the FP8 values written: they give the scales back exactly
    assert stored.dtype == torch.float8_e4m3fn and torch.equal(stored.float() / g, nv.scale)
    assert float(stored.float().max()) == 448.0  # the global scale maps the largest group onto FP8's end
    assert math.isclose(float(g), 448.0 * 6.0 / float(w.abs().max()), rel_tol=1e-6)
    mx = rtn_quantize_weight(w, get_scheme("MXFP4A16"), 32)
    exponent = torch.log2(mx.scale)
    assert torch.equal(exponent, exponent.round()) and mx.scale.shape == (64, 4)


# ---------------------------------------------------------------------------------------------
# Checkpoints


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return save_model(tiny_llama(seed=0), tmp_path_factory.mktemp("fp4") / "src")


@pytest.fixture(scope="module")
def source_bf16(tmp_path_factory) -> Path:
    return save_model(tiny_llama(seed=0).to(torch.bfloat16), tmp_path_factory.mktemp("fp4") / "src16")


def ids() -> torch.Tensor:
    return torch.randint(3, 259, (1, 12), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def logits(model) -> torch.Tensor:
    return model(ids()).logits.float()[0]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_checkpoint_round_trip(source, tmp_path, scheme):
    out = tmp_path / "q"
    quantize_checkpoint(source, out, make_request(scheme, "rtn"), tokenizer=byte_tokenizer(), progress=False)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    fmt = {"NVFP4A16": "nvfp4-pack-quantized", "MXFP4A16": "mxfp4-pack-quantized"}[scheme]
    assert qc["format"] == fmt and qc["config_groups"]["group_0"]["weights"]["type"] == "float"
    weights, _ = read_compressed(out)
    assert len(weights) == 14
    # the same weights quantized in memory, from the float model: identical after the round trip
    model = tiny_llama(seed=0)
    s = get_scheme(scheme)
    for name, qw in weights.items():
        assert fp4.on_e2m1(qw.codes) and qw.group_size == s.group_size
        module = model.get_submodule(name)
        fresh = rtn_quantize_weight(module.weight.data, qw.scheme, s.group_size)
        assert torch.equal(fresh.dequantize(), qw.dequantize()), name
    if scheme == "NVFP4A16":  # vLLM's fused q/k/v and gate/up run one global scale: tied, the smallest
        for parent, members in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))):
            found = {weights[f"model.layers.0.{parent}.{m}"].scheme.global_scale for m in members}
            own = min(float(fp4.global_scale(model.get_submodule(f"model.layers.0.{parent}.{m}").weight)) for m in members)
            assert found == {own}
    # our loader: the float model with these dequantized weights
    ref = tiny_llama(seed=0)
    for name, qw in weights.items():
        ref.get_submodule(name).weight.data = qw.dequantize()
    ours, _ = load_model(out)
    torch.testing.assert_close(logits(ours), logits(ref), rtol=0, atol=ATOL_LOADERS)
    assert (logits(ref) - logits(tiny_llama(seed=0))).abs().max() > 1e-3  # quantization is visible


@pytest.mark.parametrize("scheme", SCHEMES)
def test_transformers_loads_bfloat16_and_refuses_float32(source, source_bf16, tmp_path, scheme):
    """compressed-tensors 0.20 decompresses FP4 weights to bfloat16 whatever the model's dtype: a
    bfloat16 model gives our loader's logits exactly, a float32 one fails in its first matmul."""
    from transformers import AutoModelForCausalLM

    out16 = tmp_path / "q16"
    quantize_checkpoint(source_bf16, out16, make_request(scheme, "rtn"), tokenizer=byte_tokenizer(), progress=False)
    theirs = AutoModelForCausalLM.from_pretrained(out16).eval()
    assert theirs.dtype == torch.bfloat16
    ours, _ = load_model(out16, dtype="bfloat16")
    torch.testing.assert_close(logits(theirs), logits(ours), rtol=0, atol=ATOL_LOADERS)

    out32 = tmp_path / "q32"
    quantize_checkpoint(source, out32, make_request(scheme, "rtn"), tokenizer=byte_tokenizer(), progress=False)
    float32 = AutoModelForCausalLM.from_pretrained(out32).eval()
    with pytest.raises(RuntimeError, match=r"^expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16$"):
        logits(float32)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_runtime_runs_fp4(source, tmp_path, scheme):
    """llmopt's runtime keeps the E2M1 codes and runs them on its fp8 kernel."""
    from llmopt.runtime import LLM, SamplingParams

    out = tmp_path / "q"
    quantize_checkpoint(source, out, make_request(scheme, "rtn"), tokenizer=byte_tokenizer(), progress=False)
    weights, _ = read_compressed(out)
    ref = tiny_llama(seed=0)
    for name, qw in weights.items():
        ref.get_submodule(name).weight.data = qw.dequantize()
    prompt = ids()[0].tolist()
    result = LLM(out).generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=259))[0]
    full = torch.tensor([prompt + result.token_ids])
    with torch.no_grad():
        want = torch.log_softmax(ref(full).logits.float()[0], -1)[len(prompt) - 1:-1]
    got = torch.full_like(want, float("-inf"))
    for i, row in enumerate(result.logprobs):
        for token, value in row.items():
            got[i, token] = value
    top = want.topk(32, dim=-1).indices
    torch.testing.assert_close(got.gather(1, top), want.gather(1, top), rtol=0, atol=2e-3)


# ---------------------------------------------------------------------------------------------
# GPTQ and the command line


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_beats_rtn_on_the_output_error(scheme, act_order):
    """GPTQ (static groups with act-order, dynamic without) on E2M1 codes: codes on the grid, scales of
    the format, and a lower output error than RTN's on correlated inputs."""
    from llmopt.quant.gptq import gptq_quantize_weight

    torch.manual_seed(4)
    x = correlated_inputs(512, 128)
    w = torch.randn(48, 128) * 0.05
    h = 2 * x.T.double() @ x.double() / x.shape[0]
    s = get_scheme(scheme)
    qw = gptq_quantize_weight(w, h, s, s.group_size, act_order=act_order)
    rtn = rtn_quantize_weight(w, s, s.group_size)
    assert fp4.on_e2m1(qw.codes) and format_of(qw).name == scheme[:5].lower()
    if scheme == "NVFP4A16":
        assert qw.scheme.global_scale == rtn.scheme.global_scale  # the weight's own, computed up front
        g = qw.scheme.global_scale_tensor()
        assert torch.equal(fp4.stored_e4m3(qw.scale, g).float() / g, qw.scale)
    else:
        assert torch.equal(torch.log2(qw.scale), torch.log2(qw.scale).round())
    assert out_err(x, w, qw.dequantize()) < 0.8 * out_err(x, w, rtn.dequantize())


def _cli(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_gptq_through_the_cli(source, tmp_path, scheme):
    out = tmp_path / "g"
    result = _cli("quantize", str(source), "--scheme", scheme, "--method", "gptq", "--calib", CALIB,
                  "--calib-samples", "4", "--calib-seq-len", "32", "-o", str(out))
    assert result.exit_code == 0, result.output
    weights, _ = read_compressed(out)
    assert len(weights) == 14 and all(fp4.on_e2m1(qw.codes) for qw in weights.values())
    if scheme == "NVFP4A16":  # q/k/v are solved stacked: one global scale
        assert len({weights[f"model.layers.1.self_attn.{m}_proj"].scheme.global_scale for m in "qkv"}) == 1
        for qw in weights.values():
            g = qw.scheme.global_scale_tensor()
            assert torch.equal(fp4.stored_e4m3(qw.scale, g).float() / g, qw.scale)
    else:
        assert all(torch.equal(torch.log2(qw.scale), torch.log2(qw.scale).round()) for qw in weights.values())
    ours, _ = load_model(out)
    ref = tiny_llama(seed=0)
    for name, qw in weights.items():
        ref.get_submodule(name).weight.data = qw.dequantize()
    torch.testing.assert_close(logits(ours), logits(ref), rtol=0, atol=ATOL_LOADERS)


def test_rtn_through_the_cli(source, tmp_path):
    out = tmp_path / "r"
    result = _cli("quantize", str(source), "--scheme", "NVFP4A16", "--method", "rtn", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "nvfp4-pack-quantized"
    info = json.loads(_cli("inspect", str(out), "--json").stdout)
    assert {m["format"] for m in info["modules"] if "layers" in m["name"]} == {"nvfp4"}


@pytest.mark.parametrize("args, expected", [
    (("--scheme", "NVFP4A16", "--group-size", "32"), "NVFP4A16 quantizes in fixed groups of 16"),
    (("--scheme", "MXFP4A16", "--group-size", "16"), "MXFP4A16 quantizes in fixed groups of 32"),
    (("--scheme", "NVFP4A16", "--method", "hqq"), "hqq quantizes plain integer weights"),
    (("--scheme", "MXFP4A16", "--method", "awq", "--calib", CALIB), "awq does not search scales for MXFP4A16"),
    (("--scheme", "NVFP4"), "NVFP4 (FP4 activations as well as weights) is not offered"),
    (("--scheme", "mxfp4"), "MXFP4 (FP4 activations as well as weights) is not offered: llmopt quantizes FP4 weights only, use MXFP4A16"),
])
def test_options_that_do_not_apply_are_refused_in_one_line(source, tmp_path, args, expected):
    result = _cli("quantize", str(source), "-o", str(tmp_path / "x"), *args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], result.stderr


def test_groups_that_do_not_divide_are_refused(tmp_path):
    odd = save_model(tiny_llama(seed=0, intermediate_size=200), tmp_path / "odd")  # 200 = 12·16 + 8
    result = _cli("quantize", str(odd), "--scheme", "NVFP4A16", "-o", str(tmp_path / "x"))
    assert result.exit_code == 2, result.output
    assert "NVFP4A16 quantizes in groups of 16, which do not divide the 200 input features" in result.stderr


def test_mxfp4_is_carried_into_llama_cpps_mxfp4_blocks(source, tmp_path):
    """MXFP4A16 → GGUF (auto): every Linear in llama.cpp's MXFP4 blocks, codes and E8M0 scales
    read back equal, gguf's own dequantizer gives our weights bit for bit; NVFP4 (no GGUF type)
    goes to F16; a float model takes ``--type MXFP4`` (gguf's quantizer)."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader, quants

    out = tmp_path / "mx"
    quantize_checkpoint(source, out, make_request("MXFP4A16", "rtn"), tokenizer=byte_tokenizer(), progress=False)
    weights, _ = read_compressed(out)
    gguf = tmp_path / "mx.gguf"
    result = _cli("export", str(out), "-o", str(gguf), "--json")
    assert result.exit_code == 0, result.output
    written = {t["source"].removesuffix(".weight"): t for t in json.loads(result.stdout)["tensors"]}
    assert len(weights) == 14 and all(written[n]["type"] == "MXFP4" and written[n]["codes_identical"] for n in weights)
    tensors = {t.name: t for t in GGUFReader(str(gguf)).tensors}
    q = tensors["blk.0.ffn_down.weight"]
    assert q.tensor_type == T.MXFP4
    theirs = np.asarray(quants.dequantize(q.data, T.MXFP4), dtype=np.float32).reshape(weights["model.layers.0.mlp.down_proj"].codes.shape)
    np.testing.assert_array_equal(theirs, weights["model.layers.0.mlp.down_proj"].dequantize().numpy())
    nv = tmp_path / "nv"
    quantize_checkpoint(source, nv, make_request("NVFP4A16", "rtn"), tokenizer=byte_tokenizer(), progress=False)
    result = _cli("export", str(nv), "-o", str(tmp_path / "nv.gguf"), "--json")
    assert result.exit_code == 0, result.output
    assert {t["type"] for t in json.loads(result.stdout)["tensors"] if "layers.0.mlp" in t["source"]} == {"F16"}
    result = _cli("export", str(source), "--type", "MXFP4", "-o", str(tmp_path / "f.gguf"), "--json")
    assert result.exit_code == 0, result.output
    assert {t["type"] for t in json.loads(result.stdout)["tensors"] if "layers.0.mlp" in t["source"]} == {"MXFP4"}
