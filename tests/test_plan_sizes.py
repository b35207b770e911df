"""``--scheme AUTO --target-bpw X`` writes X bits per weight: the checkpoint's safetensors bytes × 8
over the source's parameter count (or, with ``--size-of gguf``, the exported ``--type auto`` GGUF
file's) within 1% of X, for float32 and bfloat16 sources; and the plan's own count is the file's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import tiny_llama
from test_export_gguf import chat_tokenizer

from llmopt.cli.main import main

pytestmark = pytest.mark.usefixtures("one_thread")
TARGET = 4.85
# hidden 256 / intermediate 512: every group size of the candidates divides, the super-block formats apply
SIZES = dict(vocab_size=272, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def _source(path: Path, dtype: torch.dtype, tied: bool) -> tuple[Path, int]:
    model = tiny_llama(seed=0, tie_word_embeddings=tied, **SIZES).to(dtype)
    model.save_pretrained(path)
    chat_tokenizer().save_pretrained(path)
    return path, sum(p.numel() for p in model.parameters())


def _quantize(src: Path, out: Path, *extra: str) -> dict:
    args = ["quantize", str(src), "--scheme", "AUTO", "--target-bpw", str(TARGET), "--method", "rtn", "--price-by", "rtn",
            "--sensitivity-samples", "1", "--calib-samples", "4", "--calib-seq-len", "64", "-o", str(out), *extra]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return json.loads((out / "llmopt.json").read_text())["plan"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_checkpoint_holds_the_target_bits(tmp_path, dtype):
    src, params = _source(tmp_path / "src", dtype, tied=True)
    plan = _quantize(src, tmp_path / "q")
    written = sum(f.stat().st_size for f in (tmp_path / "q").glob("*.safetensors")) * 8 / params
    assert abs(written - TARGET) < 0.01 * TARGET, written
    assert abs(plan["bpw"] - written) < 0.002 * written, (plan["bpw"], written)  # the plan counts what is written
    scales = [t for f in (tmp_path / "q").glob("*.safetensors") for t in _dtypes(f, ".weight_scale")]
    assert scales and set(scales) <= {"BF16", "F32"} and "BF16" in scales  # 16-bit, float32 only for k·d scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_gguf_file_holds_the_target_bits(tmp_path, dtype):
    src, params = _source(tmp_path / "src", dtype, tied=False)
    plan = _quantize(src, tmp_path / "q", "--size-of", "gguf")
    gguf = tmp_path / "q.gguf"
    result = CliRunner().invoke(main, ["export", str(tmp_path / "q"), "--format", "gguf", "--type", "auto", "-o", str(gguf)])
    assert result.exit_code == 0, result.output
    written = gguf.stat().st_size * 8 / params
    assert abs(written - TARGET) < 0.01 * TARGET, written
    assert abs(plan["gguf_bpw"] - written) < 0.005 * written, (plan["gguf_bpw"], written)
    # K-quants with mins (Q4_K, Q5_K) are priced only where sizes are counted as a GGUF file's
    for name, tensor in plan["sensitivity"]["tensors"].items():
        if tensor["kind"] == "linear":
            gguf = tensor["gguf"]  # block bits plus the tensor's share of the file's index
            assert 4.5 <= gguf["int4km_g32"] < 4.52 and 5.5 <= gguf["int5km_g32"] < 5.52, (name, gguf)
            assert 0 < tensor["costs"]["int5km_g32"] < tensor["costs"]["int4km_g32"], name
    checkpoint_sized = _quantize(src, tmp_path / "c")
    assert not any("int4km_g32" in t["costs"] for t in checkpoint_sized["sensitivity"]["tensors"].values())


def _dtypes(path: Path, suffix: str) -> list[str]:
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    return [v["dtype"] for k, v in header.items() if k.endswith(suffix)]
