"""Float zero points (llama.cpp's mins): formats int4m / int5m (Q4_1 / Q5_1) and int4km / int5km
(Q4_K / Q5_K with 6-bit scales and mins per super-block). Fitted by least squares, carried into
GGUF blocks exactly, written as compressed-tensors ``naive-quantized`` with float32 zero points
that transformers loads, kept by GPTQ's scale refit."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import correlated_inputs, save_model, tiny_llama
from gguf import GGMLQuantizationType as T
from gguf import quants

from llmopt.cli.main import main
from llmopt.formats import gguf_blocks as blocks
from llmopt.formats.compressed import load_dequantized, read_compressed
from llmopt.formats.registry import FORMATS, format_of
from llmopt.formats.schemes import QuantizedWeight, compute_qparams, get_scheme, quantize, search_qparams
from llmopt.quant.gptq import gptq_quantize_weight
from llmopt.quant.scale_refit import refit_scales, row_errors


def fitted(fmt: str, w: torch.Tensor, group: int = 32, col_w: torch.Tensor | None = None) -> QuantizedWeight:
    scheme = FORMATS[fmt].scheme(group)
    scale, zp = compute_qparams(w, scheme, group) if col_w is None else search_qparams(w, scheme, group, weight=col_w)
    return QuantizedWeight.from_weight(w, scheme, group, scale, zp)


def q4_1_grid(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Weights of a Q4_1 file: per 32, ``d · u + m`` with float16 ``d``, ``m`` and ``u`` in [0, 15]."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(rows, cols // 32, 1, generator=g) * 0.01 + 0.001).half().float()
    m = (-torch.rand(rows, cols // 32, 1, generator=g) * 0.08).half().float()
    u = torch.randint(0, 16, (rows, cols // 32, 32), generator=g).float()
    u[..., 0], u[..., 1] = 0, 15  # every group spans the whole range
    return (d * u + m).reshape(rows, cols)


@pytest.mark.parametrize("fmt", ["int4m", "int5m"])
def test_weights_of_a_q4_1_file_are_held_exactly(fmt):
    """Q4_1 weights are on int4m's grid, and on int5m's at half the step: the least-squares fit
    finds both (integer zero points cannot: the offsets are not multiples of the step)."""
    w = q4_1_grid(16, 256)
    qw = fitted(fmt, w)
    assert qw.zero_point.dtype == torch.float32 and qw.scale.dtype == torch.float32
    assert torch.equal(qw.scale.half().float(), qw.scale)  # float16 scales, as Q4_1 / Q5_1 store d
    torch.testing.assert_close(qw.dequantize(), w, rtol=0, atol=1e-6)
    integer = fitted(fmt.replace("m", "a"), w)
    assert float((integer.dequantize() - w).abs().max()) > 1e-4


def test_least_squares_mins_beat_integer_zero_points():
    """On shifted Gaussian weights the float-offset fit has less error than min-max integer zero
    points at the same width, and less than symmetric codes; weighted columns count more."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 512, generator=g) * 0.02 + 0.004
    err = {fmt: float((fitted(fmt, w).dequantize() - w).square().mean()) for fmt in ("int4m", "int4a", "int4")}
    assert err["int4m"] < 0.9 * err["int4a"] and err["int4m"] < err["int4"], err
    col_w = torch.ones(512)
    col_w[::8] = 50.0
    plain, weighted = fitted("int4m", w), fitted("int4m", w, col_w=col_w)
    def weighted_err(qw):
        return float(((qw.dequantize() - w).square() * col_w).mean())
    assert weighted_err(weighted) < weighted_err(plain)


@pytest.mark.parametrize("fmt,qtype", [("int4km", T.Q4_K), ("int5km", T.Q5_K)])
def test_k_quants_with_mins_are_carried_exactly(fmt, qtype):
    """Scales and mins as 6-bit multiples of float16 ``d`` / ``dmin`` per 256 weights: the Q4_K /
    Q5_K blocks hold them; gguf's dequantizer gives our weights to float32 rounding and the codes,
    scales and mins read back are ours."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(6, 512, generator=g) * 0.02 + 0.01
    w[0, :64] *= 20  # one wide sub-block sets the super-block's d
    qw = fitted(fmt, w)
    carrier = format_of(qw).gguf_carrier_of(qtype)
    assert format_of(qw).name == fmt and carrier.carries(qw)
    d, k = carrier.factors(qw)
    dmin, m = carrier.min_factors(qw)
    assert m.shape == (6, 16) and int(m.max()) == 63 and int(m.min()) >= 0
    encode = blocks.encode_q4_k if qtype == T.Q4_K else blocks.encode_q5_k
    data = encode(qw.codes.numpy(), d.numpy(), k.numpy(), (dmin.numpy(), m.numpy()))
    assert data.shape == (6, 2 * blocks._type_bytes(qtype))
    theirs = np.asarray(quants.dequantize(data, qtype), dtype=np.float32).reshape(w.shape)
    np.testing.assert_allclose(theirs, qw.dequantize().numpy(), rtol=0, atol=2e-7 * float(w.abs().max()))
    codes, scale, mins = blocks.stored_k_mins(data, qtype, 6)
    assert codes.shape == tuple(qw.codes.shape)
    np.testing.assert_array_equal(codes, qw.codes.numpy())
    np.testing.assert_array_equal(scale, qw.scale.numpy())
    np.testing.assert_array_equal(mins, (m * dmin.repeat_interleave(8, dim=1)).numpy())
    # a min moved off its 6-bit step is not carried
    moved = QuantizedWeight(qw.codes, qw.scale, qw.zero_point.clone(), qw.scheme, qw.group_size)
    moved.zero_point[2, 3] += 0.3
    assert carrier.min_factors(moved) is None and not carrier.carries(moved)


@pytest.mark.parametrize("fmt", ["int4km", "int5m"])
def test_gptq_and_the_refit_keep_the_mins(fmt):
    """GPTQ on correlated inputs lowers the output error below RTN's with the same mins; the
    least-squares scale refit keeps every min (and the K-quant's 6-bit structure)."""
    x = correlated_inputs(2048, 256)
    h = 2 * x.T @ x / x.shape[0]
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(3)) * 0.05 + 0.01
    scheme = FORMATS[fmt].scheme(32)
    rtn = fitted(fmt, w)
    gptq = gptq_quantize_weight(w, h.double(), scheme, 32, clip=True, refit=True)
    assert gptq.zero_point.dtype == torch.float32
    assert float(row_errors(w, gptq, h).sum()) < 0.8 * float(row_errors(w, rtn, h).sum())
    refit = refit_scales(w, rtn, h)
    torch.testing.assert_close(refit.mins(), rtn.mins(), rtol=1e-6, atol=1e-9)
    assert float(row_errors(w, refit, h).sum()) <= float(row_errors(w, rtn, h).sum())
    assert format_of(refit).name == fmt and format_of(gptq).name == fmt


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_keeps_weights_its_grid_holds(act_order):
    """Q4_1 weights through GPTQ as int5m, with groups fitted as reached (float zero points in the
    running buffers) or up front: every weight comes back exactly (no error to feed forward)."""
    x = correlated_inputs(1024, 128)
    w = q4_1_grid(24, 128, seed=5)
    qw = gptq_quantize_weight(w, (2 * x.T @ x / x.shape[0]).double(), FORMATS["int5m"].scheme(32), 32,
                              act_order=act_order, clip=True, refit=True)
    assert qw.zero_point.dtype == torch.float32
    torch.testing.assert_close(qw.dequantize(), w, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def q5_k_m(tmp_path_factory):
    """A tiny 96-wide Llama (rows 256 does not divide: Q5_K falls back to Q5_1) with a 256-wide
    down projection (Q5_K), its Linears' weights those of a Q4_1 file, quantized as Q5_K_M by RTN
    (the model's bfloat16 scale dtype must not reach Q5_1's float16 scales)."""
    root = tmp_path_factory.mktemp("float_zero")
    model = tiny_llama(seed=0, hidden_size=96, intermediate_size=256, num_hidden_layers=2, tie_word_embeddings=False)
    for i, module in enumerate(m for m in model.modules() if isinstance(m, torch.nn.Linear)):
        module.weight.data = q4_1_grid(*module.weight.shape, seed=i)
    source = save_model(model, root / "float")
    result = CliRunner().invoke(main, ["quantize", str(source), "--scheme", "Q5_K_M", "--method", "rtn", "-o", str(root / "q")])
    assert result.exit_code == 0, result.output
    return root, model


def test_checkpoint_loads_in_transformers_and_exports_exactly(q5_k_m):
    """The checkpoint's float zero points: naive-quantized with float32 ``zp_dtype``, read back as
    int5m / int5km, the Q4_1 weights held exactly by every Q5_1 tensor; transformers' own loader
    gives our dequantized model's logits; export --type Q5_K_M carries every code, scale and min."""
    from transformers import AutoModelForCausalLM

    q5_k_m, source = q5_k_m
    weights, qconfig = read_compressed(q5_k_m / "q")
    names = {name: format_of(qw).name for name, qw in weights.items()}
    assert len(names) == 2 * 7 + 2
    assert names["model.layers.0.mlp.down_proj"] == "int5km" and names["model.layers.0.self_attn.q_proj"] == "int5m"
    exact = [n for n, f in names.items() if f == "int5m" and n.startswith("model.layers")]
    assert len(exact) == 2 * 6 - 1  # all but the down projections and the last layer's v (Q6_K → Q8_0)
    for name in exact:
        assert weights[name].scale.dtype == torch.float32 and weights[name].scheme.stored_scale_dtype == torch.float16
        torch.testing.assert_close(weights[name].dequantize(), source.get_submodule(name).weight.float(), rtol=0, atol=1e-6)
    # a mixture's free scales are float16, as its GGUF blocks hold them (not the model's bfloat16)
    v_last = weights["model.layers.1.self_attn.v_proj"]
    assert names["model.layers.1.self_attn.v_proj"] == "int8" and v_last.scheme.stored_scale_dtype == torch.float16
    groups = [g for g in qconfig["config_groups"].values() if g["weights"].get("zp_dtype") == "torch.float32"]
    assert len(groups) == 1 and groups[0]["format"] == "naive-quantized"
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(4))
    theirs = AutoModelForCausalLM.from_pretrained(q5_k_m / "q").eval()
    ours = load_dequantized(q5_k_m / "q").eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids).logits, rtol=1e-5, atol=1e-5)
    gguf = q5_k_m / "q.gguf"
    result = CliRunner().invoke(main, ["export", str(q5_k_m / "q"), "--type", "Q5_K_M", "-o", str(gguf), "--json"])
    assert result.exit_code == 0, result.output
    written = [t for t in json.loads(result.stdout)["tensors"] if len(t["shape"]) == 2]
    assert len(written) == 2 * 7 + 2
    assert {t["type"] for t in written} >= {"Q5_1", "Q5_K"}
    assert all(t["codes_identical"] for t in written), [t["source"] for t in written if not t["codes_identical"]]


def test_float_zero_points_refused_where_they_cannot_go():
    """HQQ fits integer zero points: a float-offset scheme is refused in one line."""
    from llmopt.quant.hqq import hqq_quantize_weight

    with pytest.raises(ValueError, match="float zero points"):
        hqq_quantize_weight(torch.randn(8, 64), FORMATS["int4m"].scheme(32), 32)
    assert get_scheme("W4A16_ASYM").float_zero is False
    # Q4_1 / Q5_1 scales stay float16 whatever scale dtype a model asks for
    assert FORMATS["int5m"].scheme(32).with_scale_dtype("bfloat16").stored_scale_dtype == torch.float16


def test_scale_tuning_and_qad_keep_the_mins():
    """Tuned scale multipliers (end-to-end scale tuning) and the QAD student's weight move the
    scales only: the mins stay, the K-quant's 6-bit structure too, and the weight at the start is
    the checkpoint's."""
    from llmopt.quant.fake_quant import FakeQuantWeight
    from llmopt.quant.scale_tuning import TunableScales

    w = torch.randn(8, 512, generator=torch.Generator().manual_seed(6)) * 0.02 + 0.01
    qw = fitted("int4km", w)
    tunable = TunableScales(qw)
    torch.testing.assert_close(tunable.weight().detach(), qw.dequantize(), rtol=0, atol=1e-6)
    with torch.no_grad():
        tunable.log_multiplier.add_(0.01)
    tuned = tunable.tuned()
    assert not torch.equal(tuned.scale, qw.scale)
    torch.testing.assert_close(tuned.mins(), qw.mins(), rtol=1e-6, atol=1e-9)
    assert format_of(tuned).gguf_carrier_of(T.Q4_K).carries(tuned)
    student = FakeQuantWeight(fitted("int5m", w))
    torch.testing.assert_close(student().detach(), fitted("int5m", w).dequantize(), rtol=0, atol=1e-6)


def test_tuned_checkpoint_keeps_the_mins_and_the_k_quant_blocks(q5_k_m):
    """quantize --tune-steps on a mixture with float zero points: the checkpoint's zero points follow
    the tuned scales, so every min is the untuned one, every weight keeps its format (Q5_K's 6-bit
    scales and mins included) and export --type Q5_K_M still carries every code, scale and min."""
    root, _ = q5_k_m
    tuned = root / "tuned"
    result = CliRunner().invoke(main, ["quantize", str(root / "float"), "--scheme", "Q5_K_M", "--method", "rtn", "--tune-steps", "32",
                                       "--tune-lr", "0.001", "--calib-samples", "8", "--calib-seq-len", "32", "-o", str(tuned)])
    assert result.exit_code == 0, result.output
    assert json.loads((tuned / "llmopt.json").read_text())["scale_tuning"]["kept"]  # its held-out check fell
    before, _ = read_compressed(root / "q")
    after, _ = read_compressed(tuned)
    assert sorted(after) == sorted(before) and len(after) == 2 * 7 + 2
    moved = 0
    for name, qw in after.items():
        assert format_of(qw).name == format_of(before[name]).name, name
        if qw.scheme.float_zero:
            torch.testing.assert_close(qw.mins(), before[name].mins(), rtol=1e-5, atol=1e-7)
            moved += int(not torch.equal(qw.scale, before[name].scale))
    assert moved >= 2 * 6
    result = CliRunner().invoke(main, ["export", str(tuned), "--type", "Q5_K_M", "-o", str(root / "tuned.gguf"), "--json"])
    assert result.exit_code == 0, result.output
    written = [t for t in json.loads(result.stdout)["tensors"] if len(t["shape"]) == 2]
    assert len(written) == 2 * 7 + 2 and all(t["codes_identical"] for t in written)
