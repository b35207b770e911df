"""The runtime's generic path (runtime/models/generic.py): transformers' own modeling code with the
paged KV attention and the runtime's linears. Tiny random GPT-NeoX (partial rotary), OPT (learned
positions), Starcoder2 (sliding window, biases) and Llama forced through it: greedy token-for-token
parity with transformers, float and W4A16 (RTN), batched with prefix caching and chunked prefill;
models it cannot run are refused with one line."""

from __future__ import annotations

import pytest
import torch
from conftest import byte_tokenizer, lazy_models, randomize, save_model
from safetensors.torch import save_file
from test_runtime_architectures import check_parity, w4a16_parity
from test_runtime_architectures import tiny as native_tiny

from llmopt.core.errors import LlmoptError
from llmopt.formats.compressed import read_compressed, save_compressed
from llmopt.formats.schemes import QuantizedWeight, compute_qparams, get_scheme
from llmopt.runtime import LLM
from llmopt.runtime.layers import QuantLinear
from llmopt.runtime.models.generic import GenericModel, RuntimeLinear

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 259
GENERIC = ["gpt_neox", "opt", "starcoder2", "llama"]


def config(kind: str):
    """A real transformers config of ``kind``, shrunk (2 layers, hidden 64, 4 heads)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "gpt_neox":  # rotary on half of each head, parallel residual, embed_out stored name
        return tf.GPTNeoXConfig(**common, intermediate_size=96, rotary_pct=0.5)
    if kind == "opt":  # learned positions (offset 2), LayerNorm, ReLU MLP
        return tf.OPTConfig(**{k: v for k, v in common.items() if k != "num_hidden_layers"}, num_hidden_layers=2, ffn_dim=96,
                            word_embed_proj_dim=64)
    if kind == "starcoder2":  # GQA, sliding window, biases everywhere
        return tf.Starcoder2Config(**common, intermediate_size=96, num_key_value_heads=2, sliding_window=7)
    if kind == "llama":  # has a native model: forced through the generic path here
        return tf.LlamaConfig(**common, intermediate_size=96, num_key_value_heads=2)
    raise ValueError(kind)


def tiny(kind: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return randomize(AutoModelForCausalLM.from_config(config(kind), dtype=torch.float32, attn_implementation="eager").eval())


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("generic")
    return lazy_models(root, tiny)


def settings(kind: str) -> dict:
    return dict(block_size=4, max_num_batched_tokens=24, model_impl="transformers" if kind == "llama" else "auto")


def write_w4a16(model, path) -> None:
    scheme = get_scheme("W4A16", 32)
    weights = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            scale, zero_point = compute_qparams(module.weight.data, scheme, 32)
            weights[name] = QuantizedWeight.from_weight(module.weight.data, scheme, 32, scale, zero_point)
    save_compressed(model, byte_tokenizer(), path, weights, ["lm_head"])


@pytest.mark.parametrize("kind", GENERIC)
def test_float_greedy_matches_transformers(built, kind):
    model, path = built(kind)
    llm = check_parity(model, path, kind, **settings(kind))
    assert isinstance(llm.engine.model, GenericModel)
    swapped = [m for m in llm.engine.model.hf.modules() if isinstance(m, RuntimeLinear)]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(swapped) == len(linears)  # every linear runs on the runtime's kernels


@pytest.mark.parametrize("kind", GENERIC)
def test_w4a16_greedy_matches_transformers(built, kind, tmp_path):
    """A W4A16 (RTN, group 32) checkpoint stays quantized on the generic path and matches
    transformers running the dequantized weights. (llmopt's quantizer walks Llama-family layers
    only, so the checkpoint is written here: every Linear but the head, round-to-nearest.)"""
    model, _ = built(kind)
    write_w4a16(model, tmp_path / "w4")
    weights, _ = read_compressed(tmp_path / "w4")
    assert len(weights) == sum(isinstance(m, torch.nn.Linear) for m in model.modules()) - 1
    ref = tiny(kind)
    modules = dict(ref.named_modules())
    for name, qw in weights.items():
        modules[name].weight.data = qw.dequantize(torch.float32)
    llm = check_parity(ref, tmp_path / "w4", kind, **settings(kind))
    quant = [m for m in llm.engine.model.hf.modules() if isinstance(m, RuntimeLinear) and isinstance(m.lin, QuantLinear)]
    assert len(quant) == len(weights)


@pytest.fixture(scope="module")
def moe_built(tmp_path_factory):
    return lazy_models(tmp_path_factory.mktemp("generic-moe"), native_tiny)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_through_the_generic_path(moe_built, kind, tmp_path):
    """Mixture-of-experts models forced through transformers' code: the fused experts are unfused
    so every expert projection runs on the runtime's linears (quantized ones stay quantized) and
    per-expert checkpoints load; float and W4A16 greedy parity with transformers."""
    from llmopt.checkpoints.moe import UnfusedExperts

    model, path = moe_built(kind)
    llm = check_parity(model, path, kind, block_size=4, max_num_batched_tokens=24, model_impl="transformers")
    hf = llm.engine.model.hf
    assert isinstance(llm.engine.model, GenericModel)
    experts = [m for m in hf.modules() if isinstance(m, UnfusedExperts)]
    assert len(experts) == (1 if kind == "qwen2_moe" else 2)  # Qwen2-MoE's layer 1 is dense (mlp_only_layers)
    assert all(isinstance(e.gate_proj, RuntimeLinear) for block in experts for e in block)
    quant = w4a16_parity(moe_built, kind, tmp_path, model_impl="transformers")
    blocks = [m for m in quant.engine.model.hf.modules() if isinstance(m, UnfusedExperts)]
    assert blocks and all(isinstance(e.down_proj.lin, QuantLinear) for block in blocks for e in block)


def test_native_is_the_default_and_native_refuses_others(built):
    _, llama = built("llama")
    assert not isinstance(LLM(llama).engine.model, GenericModel)
    _, neox = built("gpt_neox")
    with pytest.raises(LlmoptError, match="natively"):
        LLM(neox, model_impl="native")


def test_unsupported_models_are_refused_with_the_reason(tmp_path):
    import transformers as tf

    falcon = tf.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    path = save_model(tf.AutoModelForCausalLM.from_config(falcon), tmp_path / "falcon")
    with pytest.raises(LlmoptError, match="does not support custom attention"):
        LLM(path)
    t5 = tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    (tmp_path / "t5").mkdir()
    t5.save_pretrained(tmp_path / "t5")
    save_file({"shared.weight": torch.zeros(VOCAB, 32)}, tmp_path / "t5" / "model.safetensors")  # refused before any is read
    with pytest.raises(LlmoptError, match="encoder-decoder"):
        LLM(tmp_path / "t5")


def test_cli_model_impl(built, monkeypatch):
    """``--model-impl`` reaches the engine from the CLI (generate here; bench and serve share the
    option, compare takes it for its speed figures) and a bad combination is one clear line."""
    import json

    from click.testing import CliRunner

    from llmopt.cli.main import main
    from llmopt.runtime.models import generic

    loads = []
    real = generic.load_model
    monkeypatch.setattr(generic, "load_model", lambda *a, **k: loads.append(a[1].model_type) or real(*a, **k))
    _, llama = built("llama")
    _, neox = built("gpt_neox")
    argv = ["generate", str(llama), "ab", "--max-tokens", "5", "--ignore-eos", "--json"]
    tokens = {}
    for impl in ("native", "transformers"):
        result = CliRunner().invoke(main, argv + ["--model-impl", impl])
        assert result.exit_code == 0, (result.output, result.exception)
        tokens[impl] = json.loads(result.stdout)["token_ids"]
    assert loads == ["llama"]  # only the forced run went through transformers' code
    assert len(tokens["native"]) == len(tokens["transformers"]) == 5
    refused = CliRunner().invoke(main, ["generate", str(neox), "ab", "--model-impl", "native"])
    assert refused.exit_code == 2 and "natively" in refused.stderr and "Traceback" not in refused.output
    for args in (["generate", str(llama), "ab", "--model-impl", "fast"],
                 ["compare", str(llama), str(llama), "--no-speed", "--model-impl", "native"]):
        bad = CliRunner().invoke(main, args)
        assert bad.exit_code == 2, (args, bad.output)
        assert "model-impl" in bad.stderr
