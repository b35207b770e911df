"""Quantized token embedding and output head inside compressed-tensors checkpoints: what is
saved (codes equal an independent quantization, one copy for a tied head), our loader against a
transformers reference built from the float model, the runtime against both, GGUF types, bad input."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from click.testing import CliRunner
from conftest import save_model, tiny_llama
from llmopt.cli.main import main
from llmopt.core.errors import LlmoptError
from llmopt.formats.compressed import load_dequantized, read_compressed
from llmopt.formats.schemes import dequantize
from llmopt.pipeline.stages.quantize import QuantizeConfig, run_quantize
from llmopt.quant.outer import outer_scheme, quantize_matrix
from llmopt.runtime import LLM, SamplingParams
from llmopt.runtime.layers import QuantLinear

pytestmark = pytest.mark.usefixtures("one_thread")

EMBED, HEAD = "model.embed_tokens", "lm_head"


def _quantize(src, out, head: str, embedding: str, scheme: str = "W4A16") -> dict:
    config = QuantizeConfig(model=str(src), output=str(out), scheme=scheme, group_size=32 if scheme == "W4A16" else None,
                            head=head, embedding=embedding)
    return run_quantize(config)


def _reference(model, weights: dict) -> torch.nn.Module:
    """transformers model: ``model`` with every module in ``weights`` replaced by its dequantized
    weight; a tied head is untied when only one side is quantized."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        if ref.config.tie_word_embeddings:
            ref.config.tie_word_embeddings = False
            ref.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        for name, qw in weights.items():
            ref.get_submodule(name).weight.copy_(qw.dequantize())
    return ref.eval()


CASES = [  # (tied, head, embedding)
    (True, "int8", "int8"),
    (True, "int4", "int4"),
    (True, "int8", "float"),
    (True, "float", "int4"),
    (False, "int8", "float"),
    (False, "int4", "int8"),
    (True, "int5", "int5"),
    (False, "int6", "int5"),
    (True, "int5a", "int5a"),
    (False, "int4a", "int5a"),
]


@pytest.mark.parametrize("tied,head,embedding", CASES)
def test_saved_codes_loader_runtime(tmp_path, tied, head, embedding):
    model = tiny_llama(seed=3, tie_word_embeddings=tied)
    src = save_model(model, tmp_path / "src")
    record = _quantize(src, tmp_path / "q", head, embedding)
    assert record["head"] == head and record["embedding"] == embedding
    weights, qconfig = read_compressed(tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    same = head == embedding
    assert config["tie_word_embeddings"] == (tied and same)
    # what is quantized, and the codes equal an independent quantization of the float matrices
    want = {}
    if embedding != "float":
        want[EMBED] = (model.model.embed_tokens.weight, embedding)
    if head != "float" and not (tied and same):
        want[HEAD] = (model.lm_head.weight, head)
    outer = {n: qw for n, qw in weights.items() if n in (EMBED, HEAD)}
    assert sorted(outer) == sorted(want)
    for name, (w, kind) in want.items():
        expected = quantize_matrix(w.detach(), outer_scheme(kind))
        assert outer[name].codes.shape == w.shape
        assert torch.equal(outer[name].codes, expected.codes), name
        assert torch.equal(outer[name].scale, expected.scale), name
        assert (outer[name].zero_point is None) == kind[-1].isdigit(), name  # int5a / int4a: zero points
        if expected.zero_point is not None:
            assert torch.equal(outer[name].zero_point, expected.zero_point), name
        rel = float((outer[name].dequantize() - w.detach()).norm() / w.detach().norm())
        assert 0 < rel < (0.01 if kind == "int8" else 0.12), (name, rel)
        scheme = outer_scheme(kind)
        assert int(outer[name].codes.max()) <= scheme.qmax and int(outer[name].codes.min()) >= scheme.qmin
        assert (outer[name].group_size is None) == (kind == "int8")
    # a tied head of one format is stored once, without a float copy
    from safetensors import safe_open

    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert (f"{EMBED}.weight" in keys) == (embedding == "float")
    assert ("lm_head.weight" in keys) == (head == "float" and not (tied and same))
    if tied and same:
        assert not any(k.startswith("lm_head") for k in keys)
    # our loader against the transformers reference built from the float model
    ref = _reference(model, weights)
    if tied and same:
        with torch.no_grad():
            ref.lm_head.weight.copy_(weights[EMBED].dequantize())
    ours = load_dequantized(tmp_path / "q")
    ids = torch.randint(3, 259, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want_logits, got_logits = ref(ids).logits, ours(ids).logits
    assert got_logits.shape == want_logits.shape
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
    # the runtime: quantized head run by the quantized kernels, same tokens and log-probs
    llm = LLM(tmp_path / "q")
    w = llm.engine.weights
    if head != "float":
        assert isinstance(w.lm_head, QuantLinear) and w.head_kind == "quantized"
    assert (w.embed_quantized is not None) == (embedding != "float")
    prompt = ids[0, :10].tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1))[0]
    assert len(out.token_ids) == 8
    seq = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(ref(seq).logits[0].float(), -1)
    for i, tok in enumerate(out.token_ids):
        row = logp[len(prompt) - 1 + i]
        top2 = torch.topk(row, 2).values
        assert tok == int(row.argmax()) or float(top2[0] - top2[1]) < 1e-3
        assert out.logprobs[i][tok] == pytest.approx(float(row[tok]), abs=2e-3)


def test_embedding_rows_dequantize_only_the_rows_asked():
    from llmopt.runtime.loader import embedding_rows

    w = torch.randn(50, 64, generator=torch.Generator().manual_seed(1))
    qw = quantize_matrix(w, outer_scheme("int4"))
    ids = torch.tensor([[3, 7, 3], [49, 0, 1]])
    rows = embedding_rows(qw, ids, torch.float32)
    assert rows.shape == (2, 3, 64)
    full = dequantize(qw.codes, qw.scale, None, 32)
    assert torch.equal(rows, full[ids])


def test_tied_int4_head_exports_to_gguf_exactly(tmp_path):
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader
    from llmopt.formats.gguf_export import export_gguf

    src = save_model(tiny_llama(seed=4, tie_word_embeddings=False), tmp_path / "src")
    _quantize(src, tmp_path / "q", "int8", "int4")
    export_gguf(tmp_path / "q", tmp_path / "q.gguf", "auto")
    types = {t.name: t.tensor_type for t in GGUFReader(tmp_path / "q.gguf").tensors}
    assert types["token_embd.weight"] == T.Q4_0
    assert types["output.weight"] == T.Q8_0
    assert types["blk.0.attn_q.weight"] == T.Q4_0


@pytest.mark.parametrize("args,options,message", [
    (["--scheme", "NF4", "--head", "int8"], dict(scheme="NF4", head="int8"), "NF4"),
    (["--scheme", "W8A8", "--embedding", "int8"], dict(scheme="W8A8", embedding="int8"), "weights only"),
    (["--scheme", "W4A16", "--head", "int8", "--ignore", "lm_head"], dict(scheme="W4A16", head="int8", ignore=("lm_head",)), "lm_head"),
    (["--scheme", "W4A16", "--head", "int3"], None, "int3"),
])
def test_bad_head_options(tmp_path, args, options, message):
    src = save_model(tiny_llama(seed=5), tmp_path / "src")
    result = CliRunner().invoke(main, ["quantize", str(src), "-o", str(tmp_path / "out"), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "out").exists()
    if options is not None:  # the same check for recipes and the Python API
        with pytest.raises(LlmoptError, match=message):
            QuantizeConfig(model=str(src), output=str(tmp_path / "o2"), **options).check()


@pytest.mark.parametrize("tied", [True, False])
def test_calibrated_head_is_gptq_on_its_input_hessian(tmp_path, tied):
    """With calibration (GPTQ here) the head is quantized by GPTQ against the Hessian of its
    inputs, the final norm's outputs on the calibration text after the quantized layers: the
    saved codes equal that computation done in memory, and its output error on those inputs is
    below the uncalibrated (RTN + clipping search) head's."""
    from llmopt.pipeline.stages.quantize import quantize_checkpoint
    from llmopt.quant.apply import quantize_model
    from llmopt.quant.head_fisher import HeadFisher
    from llmopt.quant.outer import HEAD_GPTQ_NOTICE, gptq_matrix, head_input_hessian, head_inputs
    from llmopt.quant.request import make_request
    from conftest import byte_tokenizer

    model = tiny_llama(seed=4, tie_word_embeddings=tied)
    src = save_model(model, tmp_path / "src")
    calib = torch.randint(3, 259, (4, 48), generator=torch.Generator().manual_seed(2))
    options = dict(compute_dtype=None, batch_size=2)
    request = make_request("W4A16", "gptq", group_size=32, ignore=(), head="int4", embedding="int4" if tied else "float",
                           **options)
    result = quantize_checkpoint(src, tmp_path / "q", request, calib, tokenizer=byte_tokenizer(), progress=False).result
    assert HEAD_GPTQ_NOTICE in result.notices
    weights, _ = read_compressed(tmp_path / "q")
    name = EMBED if tied else HEAD
    saved = weights[name]
    in_memory = copy.deepcopy(model)
    # a quantized head keeps the last layer's calibration outputs (lm_head itself stays float in memory)
    done = quantize_model(in_memory, make_request("W4A16", "gptq", group_size=32, head="int4", **options), calib, progress=False)
    assert done.final_hidden is not None and done.final_hidden.shape == (4, 48, 64)
    hessian = head_input_hessian(in_memory, in_memory.state_dict(), done.final_hidden)
    assert hessian.shape == (64, 64) and hessian.dtype == torch.float64
    w = model.lm_head.weight.detach()
    inputs = head_inputs(in_memory, in_memory.state_dict(), done.final_hidden)
    assert inputs.shape == (4 * 48, 64)
    want = gptq_matrix(w, outer_scheme("int4"), hessian, fisher=HeadFisher.measure(inputs, w))
    assert saved.codes.shape == w.shape
    assert torch.equal(saved.codes, want.codes) and torch.equal(saved.scale, want.scale)
    rtn = quantize_matrix(w, outer_scheme("int4"))

    def output_error(qw) -> float:
        e = (qw.dequantize() - w).double()
        return float(((e @ hessian) * e).sum())

    assert output_error(saved) < 0.9 * output_error(rtn)
    if tied:  # one matrix for both roles, still tied
        assert HEAD not in weights and json.loads((tmp_path / "q" / "config.json").read_text())["tie_word_embeddings"]
