"""Importance matrices in llama.cpp's format: written from llmopt's calibration (the sums of
squared inputs the calibration saw, under gguf's tensor names), read back to weigh RTN's range
search; bad requests refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import CORPORA, byte_tokenizer, save_model, tiny_llama
from gguf import GGUFReader

from llmopt.cli.main import main
from llmopt.core.data import calibration_ids
from llmopt.formats.compressed import read_compressed
from llmopt.quant.imatrix import read_imatrix

pytestmark = pytest.mark.usefixtures("one_thread")
CALIB = ["--calib", str(CORPORA / "gutenberg" / "persuasion.txt"), "--calib-samples", "4", "--calib-seq-len", "32"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_model(tiny_llama(seed=5), tmp_path_factory.mktemp("imatrix") / "src")


def test_saved_imatrix_holds_the_calibration_inputs(source, tmp_path):
    out, imatrix = tmp_path / "q", tmp_path / "imatrix.gguf"
    result = CliRunner().invoke(main, ["quantize", str(source), "--scheme", "W4A16", "--group-size", "32", "--method", "gptq",
                                       *CALIB, "--save-imatrix", str(imatrix), "-o", str(out)])
    assert result.exit_code == 0, result.output
    reader = GGUFReader(str(imatrix))
    assert reader.fields["general.type"].contents() == "imatrix"
    assert reader.fields["imatrix.chunk_count"].contents() == 4 and reader.fields["imatrix.chunk_size"].contents() == 32
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 2 * 7 * 2  # in_sum2 and counts per Linear
    assert {float(tensors[f"blk.{i}.{n}.weight.counts"].data[0]) for i in range(2)
            for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")} == {128.0}
    # layer 0's q/k/v read the float model's normed embeddings: the sums equal a direct measurement
    model = tiny_llama(seed=5).eval()
    ids, _ = calibration_ids(byte_tokenizer(), CALIB[1], 4, 32, 0)
    seen = []
    hook = model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    with torch.no_grad():
        model(ids)
    hook.remove()
    want = torch.cat(seen).reshape(-1, 64).double().pow(2).sum(0)
    got = torch.from_numpy(tensors["blk.0.attn_q.weight.in_sum2"].data.copy()).double()
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-3)
    assert read_imatrix(imatrix)["blk.0.attn_k.weight"].shape == (64,)


def test_imatrix_weighs_rtn_range_search(source, tmp_path):
    """RTN with an imatrix searches each group's range for the least importance-weighted error: never
    worse, by that measure, than plain min-max RTN (which the search includes)."""
    imatrix = tmp_path / "imatrix.gguf"
    runner = CliRunner()
    result = runner.invoke(main, ["quantize", str(source), "--scheme", "W4A16", "--group-size", "32", "--method", "gptq",
                                  *CALIB, "--save-imatrix", str(imatrix), "-o", str(tmp_path / "g")])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["quantize", str(source), "--scheme", "W4A16", "--group-size", "32", "--imatrix", str(imatrix),
                                  "-o", str(tmp_path / "w")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "w" / "llmopt.json").read_text())["imatrix"]["linears"] == 14
    result = runner.invoke(main, ["quantize", str(source), "--scheme", "W4A16", "--group-size", "32", "-o", str(tmp_path / "p")])
    assert result.exit_code == 0, result.output
    weighted, _ = read_compressed(tmp_path / "w")
    plain, _ = read_compressed(tmp_path / "p")
    importance = read_imatrix(imatrix)
    model = tiny_llama(seed=5)
    modules = dict(model.named_modules())
    changed = 0
    for i in range(2):
        for hf, g in (("self_attn.q_proj", "attn_q"), ("mlp.down_proj", "ffn_down"), ("mlp.up_proj", "ffn_up")):
            name = f"model.layers.{i}.{hf}"
            w = modules[name].weight.detach()
            col = importance[f"blk.{i}.{g}.weight"]
            err = {k: float(((q[name].dequantize() - w) ** 2 * col).sum()) for k, q in (("w", weighted), ("p", plain))}
            assert err["w"] <= err["p"] * (1 + 1e-6), name
            changed += not torch.equal(weighted[name].codes, plain[name].codes)
    assert changed > 0


@pytest.mark.parametrize("args, message", [
    (["--method", "gptq", "--imatrix", "{imatrix}"], "--imatrix weighs RTN's range search"),
    (["--save-imatrix", "{tmp}/x.gguf"], "--save-imatrix writes the calibration's statistics"),
    (["--imatrix", "{tmp}/missing.gguf"], "does not exist"),
    (["--imatrix", "{model}"], "not a llama.cpp imatrix file"),
])
def test_bad_imatrix_requests(source, tmp_path, args, message):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"GGUF" + b"\0" * 60)
    args = [a.format(imatrix=bogus, tmp=tmp_path, model=bogus) for a in args]
    result = CliRunner().invoke(main, ["quantize", str(source), "--scheme", "W4A16", "-o", str(tmp_path / "out"), *args])
    assert result.exit_code != 0 and message in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()
