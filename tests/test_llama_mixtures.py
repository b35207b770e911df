"""llama.cpp's mixtures by name (``--scheme Q4_K_M`` …): llama.cpp's type for every tensor, codes
found by our quantizers on those types' grids, carried bit-exactly into GGUF blocks (Q2_K, Q4_K and
Q5_K written by us, read back by gguf's own dequantizer)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import save_model, tiny_llama
from gguf import GGMLQuantizationType as T
from gguf import quants

from llmopt.cli.main import main
from llmopt.formats import gguf_blocks as blocks
from llmopt.formats.registry import FORMATS, GGUF_TYPE_CANDIDATES, format_of
from llmopt.formats.schemes import QuantizedWeight, compute_qparams, quantize
from llmopt.quant.llama_mixtures import ModelFacts, embedding_type, linear_types, output_type, use_more_bits

ENCODERS = {T.Q2_K: blocks.encode_q2_k, T.Q4_K: blocks.encode_q4_k, T.Q5_K: blocks.encode_q5_k}


SYMMETRIC_K = {T.Q2_K: ("int2k", 16), T.Q4_K: ("int4k", 32), T.Q5_K: ("int5k", 32)}  # mins = half the range


def rtn_weight(qtype: T, rows: int = 6, cols: int = 512, seed: int = 0) -> tuple[torch.Tensor, QuantizedWeight]:
    """A random weight in ``qtype``'s symmetric format (``SYMMETRIC_K``), or the format a mixture gives it."""
    fmt, group = SYMMETRIC_K[qtype] if qtype in SYMMETRIC_K else (GGUF_TYPE_CANDIDATES[qtype].format.name, GGUF_TYPE_CANDIDATES[qtype].group_size)
    scheme = FORMATS[fmt].scheme(group)
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    w[0, :64] *= 20  # an outlier sub-block: the super-block's d is set by it, other multiples stay small
    scale, zp = compute_qparams(w, scheme, group)
    return w, QuantizedWeight(quantize(w, scale, zp, scheme, group), scale, zp, scheme, group)


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q4_K, T.Q5_K])
def test_k_quant_blocks_carry_codes_exactly(qtype):
    """Symmetric codes with one-sign super-block scales written as Q2_K / Q4_K / Q5_K (each min
    is half the range): gguf's dequantizer gives exactly our dequantized weights, and the codes
    and scales read back equal. (With mins of their own: tests/test_float_zero.py.)"""
    w, qw = rtn_weight(qtype)
    carrier = format_of(qw).gguf_carrier_of(qtype)
    assert format_of(qw).name == SYMMETRIC_K[qtype][0] and carrier.carries(qw)
    d, k = carrier.factors(qw)
    assert (k < 0).all() and (d < 0).all()
    data = ENCODERS[qtype](qw.codes.numpy().astype(np.int8), d.numpy(), k.numpy())
    assert data.shape == (6, 512 // 256 * blocks._type_bytes(qtype))
    theirs = np.asarray(quants.dequantize(data, qtype), dtype=np.float32).reshape(w.shape)
    np.testing.assert_array_equal(theirs, qw.dequantize().numpy())
    codes, scale = blocks.stored_codes(data, qtype, 6)
    assert codes.shape == tuple(qw.codes.shape)
    np.testing.assert_array_equal(codes, qw.codes.numpy())
    np.testing.assert_array_equal(scale, qw.scale.numpy())
    # the rows without the outlier: the error of a 2 / 4 / 5-bit format, relative to the weights' energy
    rel = float(((theirs[1:] - w[1:].numpy()) ** 2).mean() / (w[1:].numpy() ** 2).mean())
    assert rel < {T.Q2_K: 0.4, T.Q4_K: 0.03, T.Q5_K: 0.008}[qtype], rel


def test_llama_cpp_own_q4_k_blocks_are_not_taken_for_carried_codes():
    """An affine Q4_K block (llama.cpp's own min search) read back does not pass as our symmetric codes."""
    x = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32) + 0.5
    codes, _ = blocks.stored_codes(blocks.quantize_q4_k(x), T.Q4_K, 4)
    assert (codes == -128).any()


def test_a_sign_flipped_scale_is_not_carried_as_q4_k():
    _, qw = rtn_weight(T.Q4_K)
    qw.scale[1, 3] *= -1
    assert T.Q4_K not in [c.qtype for c in GGUF_TYPE_CANDIDATES[T.Q4_K].format.gguf if c.carries(qw)]


def shapes_of(layers: int, hidden: int, inter: int, kv: int) -> dict[str, tuple[int, int]]:
    out = {}
    for i in range(layers):
        for name, shape in {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
                            "self_attn.o_proj": (hidden, hidden), "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
                            "mlp.down_proj": (hidden, inter)}.items():
            out[f"model.layers.{i}.{name}"] = shape
    return out


def test_use_more_bits_is_llama_cpps_layer_set():
    assert [i for i in range(16) if use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]


def test_q4_k_m_and_q3_k_m_types_follow_llama_cpp():
    facts = ModelFacts(16, 8, 2)
    more = {0, 1, 4, 7, 10, 13, 14, 15}
    types = linear_types("Q4_K_M", shapes_of(16, 256, 512, 64), facts)
    assert len(types) == 16 * 7
    for name, qtype in types.items():
        layer = int(name.split(".")[2])
        if name.endswith(("v_proj", "down_proj")) and layer in more:
            assert qtype == T.Q6_K, name
        else:
            assert qtype == T.Q4_K, name
    assert output_type("Q4_K_M", 256) == T.Q6_K and embedding_type("Q4_K_M", 256, tied=False) == T.Q4_K
    assert embedding_type("Q4_K_M", 256, tied=True) == T.Q6_K
    q3 = linear_types("Q3_K_M", shapes_of(16, 256, 512, 64), facts)
    v = [q3[f"model.layers.{i}.self_attn.v_proj"] for i in range(16)]
    assert v == [T.Q5_K] * 2 + [T.Q4_K] * 14
    down = [q3[f"model.layers.{i}.mlp.down_proj"] for i in range(16)]
    assert down == [T.Q5_K] + [T.Q4_K] * 15
    assert {q3[f"model.layers.{i}.self_attn.o_proj"] for i in range(16)} == {T.Q4_K}
    assert {q3[f"model.layers.{i}.mlp.up_proj"] for i in range(16)} == {T.Q3_K}


def test_rows_256_does_not_divide_fall_back_as_llama_cpp():
    """Rows of 576 (the demo's width): Q4_K → Q5_0, Q6_K → Q8_0, Q3_K → Q4_0, Q5_K → Q5_1; the head of
    a 576-wide model is Q8_0 (llama.cpp's rule for rows its default type's blocks do not tile)."""
    facts = ModelFacts(30, 9, 3)
    types = linear_types("Q4_K_M", shapes_of(30, 576, 1536, 192), facts)
    assert types["model.layers.0.self_attn.q_proj"] == T.Q5_0
    assert types["model.layers.0.self_attn.v_proj"] == T.Q8_0  # Q6_K, falling back
    assert types["model.layers.0.mlp.down_proj"] == T.Q6_K  # 1536 = 6 × 256
    assert types["model.layers.4.mlp.down_proj"] == T.Q4_K  # layers 0-2 and 5, 8 … take more bits
    assert output_type("Q4_K_M", 576) == T.Q8_0
    assert linear_types("Q5_K_S", {"x.layers.0.mlp.up_proj": (64, 576)}, facts)["x.layers.0.mlp.up_proj"] == T.Q5_1
    assert linear_types("Q3_K_S", {"x.layers.0.mlp.up_proj": (64, 576)}, facts)["x.layers.0.mlp.up_proj"] == T.Q4_0
    assert linear_types("Q4_K_M", {"x.layers.0.mlp.up_proj": (64, 100)}, facts)["x.layers.0.mlp.up_proj"] is None


def test_eight_expert_models_keep_attention_in_more_bits():
    facts = ModelFacts(8, 8, 8, n_expert=8)
    shapes = {"model.layers.0.self_attn.v_proj": (256, 256), "model.layers.0.self_attn.k_proj": (256, 256),
              "model.layers.0.self_attn.o_proj": (256, 256), "model.layers.0.mlp.experts.3.down_proj": (256, 512)}
    types = linear_types("Q4_K_M", shapes, facts)
    assert types["model.layers.0.self_attn.v_proj"] == T.Q8_0 and types["model.layers.0.self_attn.k_proj"] == T.Q8_0
    assert types["model.layers.0.self_attn.o_proj"] == T.Q5_K
    assert types["model.layers.0.mlp.experts.3.down_proj"] == T.Q6_K  # layer 0 of 8: more bits


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    model = tiny_llama(seed=0, hidden_size=256, intermediate_size=512, num_hidden_layers=8, tie_word_embeddings=False)
    return save_model(model, tmp_path_factory.mktemp("mixture") / "float")


def test_q4_k_m_gptq_checkpoint_exports_exactly(float_dir, tmp_path):
    """quantize --scheme Q4_K_M --method gptq → export --type Q4_K_M: every tensor in llama.cpp's type
    for it, codes and scales carried bit-exactly, the file typed MOSTLY_Q4_K_M."""
    runner = CliRunner()
    out = tmp_path / "q4km"
    result = runner.invoke(main, ["quantize", str(float_dir), "--scheme", "Q4_K_M", "--method", "gptq", "--calib-samples", "4",
                                  "--calib-seq-len", "32", "-o", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads((out / "llmopt.json").read_text())
    planned = record["llama_mixture"]
    assert planned["mixture"] == "Q4_K_M" and len(planned["types"]) == 8 * 7 + 2
    # GPTQ for llama.cpp orders each MLP's channels first: every layer's order is recorded
    assert record["method_run"] == "order+gptq" and sum(record["mlp_channel_orders"].values()) == 8
    gguf = tmp_path / "q4km.gguf"
    result = runner.invoke(main, ["export", str(out), "--type", "Q4_K_M", "-o", str(gguf), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["file_type"] == "MOSTLY_Q4_K_M"
    written = {t["source"].removesuffix(".weight"): t for t in report["tensors"] if len(t["shape"]) == 2}
    assert len(written) == len(planned["types"])
    for name, qtype in planned["types"].items():
        assert written[name]["type"] == qtype, name
        assert written[name]["codes_identical"] is True, name
    assert {t["type"] for t in written.values()} == {"Q4_K", "Q6_K"}
    # another mixture's name is refused for this checkpoint, in one line
    result = runner.invoke(main, ["export", str(out), "--type", "Q5_K_M", "-o", str(tmp_path / "x.gguf")])
    assert result.exit_code != 0 and "not quantized as llama.cpp's Q5_K_M" in result.output
    assert not (tmp_path / "x.gguf").exists()


def test_mixture_from_a_float_model_and_refused_options(float_dir, tmp_path):
    runner = CliRunner()
    gguf = tmp_path / "q3km.gguf"
    result = runner.invoke(main, ["export", str(float_dir), "--type", "q3_k_m", "-o", str(gguf), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["file_type"] == "MOSTLY_Q3_K_M"
    types = {t["type"] for t in report["tensors"] if len(t["shape"]) == 2}
    assert types == {"Q3_K", "Q4_K", "Q5_K", "Q6_K"}
    assert all(t["codes_identical"] for t in report["tensors"] if len(t["shape"]) == 2)
    assert [p.name for p in tmp_path.iterdir()] == ["q3km.gguf"]  # no scratch checkpoint left behind
    for extra in (["--group-size", "32"], ["--head", "int8"], ["--method", "smoothquant"], ["--ignore", "mlp"]):
        result = runner.invoke(main, ["quantize", str(float_dir), "--scheme", "Q4_K_M", *extra, "-o", str(tmp_path / "bad")])
        assert result.exit_code != 0 and "Traceback" not in result.output, extra
        assert not (tmp_path / "bad").exists()
