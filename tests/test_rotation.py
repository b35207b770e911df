"""Offline rotations (``quantize --rotate``): the Hadamard constructions are orthogonal, the rotated
checkpoint computes the same function as the original in every supported architecture, outlier
features are spread over all inputs, and quantizing the rotated model beats the unrotated one on a
model with an outlier feature."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import randomize, save_model, tiny_llama
from test_export_gguf_archs import build

from llmopt.cli import main
from llmopt.checkpoints.models import load_model
from llmopt.pipeline.rotate import rotate_checkpoint
from llmopt.quant.rotation import hadamard, rotation

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("n", [1, 2, 8, 12, 48, 72, 96, 576, 896, 960, 1536, 3072, 5120])
def test_hadamard_orders(n):
    h = hadamard(n)
    assert h is not None and h.shape == (n, n)
    assert set(h.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=h.dtype))


def test_orders_without_a_construction_fall_back_to_random_orthogonal():
    assert hadamard(36) is None  # 36 = 4 · 9, and 35 is not a prime
    q, made = rotation(36, "hadamard", torch.Generator().manual_seed(0))
    assert "random orthogonal" in made and "no Hadamard" in made
    torch.testing.assert_close(q @ q.T, torch.eye(36, dtype=q.dtype), rtol=0, atol=1e-12)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("kind", ["llama-tied", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_rotated_checkpoint_computes_the_same_function(tmp_path, kind):
    import transformers as tf

    if kind == "llama-tied":
        model = randomize(tiny_llama(seed=0))
        src = save_model(model, tmp_path / "src")
    elif kind in ("qwen2", "qwen3"):
        extra = {"head_dim": 16} if kind == "qwen3" else {}
        config = tf.AutoConfig.for_model(kind, vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **extra)
        torch.manual_seed(0)
        model = randomize(tf.AutoModelForCausalLM.from_config(config).eval())
        src = save_model(model, tmp_path / "src")
    else:
        src, model = build(kind, tmp_path / "src")
    record = rotate_checkpoint(src, tmp_path / "rot", "hadamard", seed=3)
    assert record["residual"].startswith("randomized Hadamard, 64 × 64")
    rotated = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "rot", dtype=torch.float32).eval()
    ids = torch.randint(3, 259, (2, 24), generator=torch.Generator().manual_seed(1))
    before, after = _logits(model, ids), _logits(rotated, ids)
    assert before.shape == after.shape
    assert (before - after).abs().max() < 1e-4
    assert not torch.allclose(model.model.embed_tokens.weight, rotated.model.embed_tokens.weight)
    norms = [p for n, p in rotated.named_parameters() if n.endswith(("input_layernorm.weight", "post_attention_layernorm.weight"))]
    assert norms and all(torch.equal(p, torch.ones_like(p)) for p in norms)
    assert json.loads((tmp_path / "rot" / "config.json").read_text())["tie_word_embeddings"] is False


def _outlier_model(tmp_path):
    """A tiny Llama whose residual stream has one outlier feature (as trained LLMs do): a large
    input-norm scale on feature 5 makes one input column of every q/k/v weight 30× the others."""
    model = randomize(tiny_llama(seed=2, tie_word_embeddings=False))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[5] = 30.0
            layer.post_attention_layernorm.weight[5] = 30.0
    return model, save_model(model, tmp_path / "outlier")


def test_rotation_spreads_an_outlier_feature(tmp_path):
    model, src = _outlier_model(tmp_path)
    rotate_checkpoint(src, tmp_path / "rot", "hadamard")
    rotated, _ = load_model(tmp_path / "rot")

    def peakiness(w: torch.Tensor) -> float:  # largest input column's norm over the median column's
        cols = w.detach().norm(dim=0)
        return float(cols.max() / cols.median())

    folded = model.model.layers[0].self_attn.q_proj.weight * model.model.layers[0].input_layernorm.weight
    assert peakiness(folded) > 10
    assert peakiness(rotated.model.layers[0].self_attn.q_proj.weight) < 2


@pytest.mark.parametrize("scheme", [["--scheme", "W4A16", "--group-size", "32"], ["--scheme", "W8A8"], ["--scheme", "W4A8", "--group-size", "32"]],
                         ids=["W4A16", "W8A8", "W4A8"])
def test_quantizing_the_rotated_model_loses_less(tmp_path, scheme):
    """RTN of the outlier model, with and without --rotate: the rotated output's next-token
    distributions are closer to the float model's (weights only, and with int8 activations per token)."""
    model, src = _outlier_model(tmp_path)
    runner = CliRunner()
    ids = torch.randint(3, 259, (4, 32), generator=torch.Generator().manual_seed(5))
    reference = _logits(model, ids).log_softmax(-1)
    kld = {}
    for rotate in ("none", "hadamard"):
        out = tmp_path / rotate
        result = runner.invoke(main, ["quantize", str(src), *scheme, "--rotate", rotate, "-o", str(out)])
        assert result.exit_code == 0, result.output
        quantized, _ = load_model(out)
        got = _logits(quantized, ids).log_softmax(-1)
        kld[rotate] = float((reference.exp() * (reference - got)).sum(-1).mean())
    record = json.loads((tmp_path / "hadamard" / "llmopt.json").read_text())
    assert record["rotation"]["kind"] == "hadamard" and "rotation" not in json.loads((tmp_path / "none" / "llmopt.json").read_text())
    assert kld["hadamard"] < 0.5 * kld["none"], kld
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hadamard", "none", "outlier"]  # no scratch copy left


def test_unsupported_architecture_is_one_line(tmp_path):
    src, _ = build("gemma2", tmp_path / "g")
    result = CliRunner().invoke(main, ["quantize", str(src), "--scheme", "W4A16", "--rotate", "hadamard", "-o", str(tmp_path / "o")])
    assert result.exit_code == 2 and "--rotate does not support the 'gemma2' architecture" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["g"]
