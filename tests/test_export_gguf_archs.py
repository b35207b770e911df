"""GGUF export beyond the Llama family: Gemma 2 / 3, Phi-3, Mixtral, Qwen2-MoE and Qwen3-MoE.

Names come from gguf's TensorNameMap; experts are stacked into one 3-D tensor per projection;
Gemma norms are stored as 1 + w; the metadata llama.cpp's graphs read (experts, sliding windows,
soft-capping) is written. Each file is read back through transformers' GGUF loader (with the
source's config where that loader does not read every key) and compared with the source model;
transformers cannot load Mixtral GGUFs, so its tensors are compared one by one. (llama.cpp
itself runs each architecture in bench/interop.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from test_export_gguf import chat_tokenizer, save, unpermute

from llmopt.formats.gguf_export import export_gguf
from llmopt.formats.gguf_source import UnsupportedArchitectureError, check_architecture
from llmopt.pipeline.stages.quantize import quantize_checkpoint
from llmopt.quant.request import make_request

pytestmark = pytest.mark.usefixtures("one_thread")

COMMON = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=None)


def config(kind: str, **overrides):
    import transformers as tf

    gemma = {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8}
    if kind == "gemma2":
        return tf.Gemma2Config(**{**COMMON, **gemma, **overrides})
    if kind == "gemma3":
        layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
        return tf.Gemma3TextConfig(**{**COMMON, **gemma, "num_hidden_layers": 3, "layer_types": layer_types, **overrides})
    if kind == "phi3":
        return tf.Phi3Config(**COMMON, tie_word_embeddings=False, **overrides)
    if kind == "mixtral":
        return tf.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, **overrides)
    if kind == "qwen2_moe":
        return tf.Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=64, **overrides)
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(**{**COMMON, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                    "head_dim": 16, "norm_topk_prob": True, **overrides})
    raise ValueError(kind)


def build(kind: str, path, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(kind, **overrides), dtype=torch.float32).eval()
    with torch.no_grad():  # weights larger than the init, norms away from their trivial values
        for p in model.parameters():
            p.normal_(0, 0.15) if p.dim() >= 2 else p.normal_(0.2, 0.1)
    return save(model, path), model


def field(path, key):
    return GGUFReader(str(path)).fields[key].contents()


def tensor(path, name) -> np.ndarray:
    t = next(t for t in GGUFReader(str(path)).tensors if t.name == name)
    return np.asarray(t.data, dtype=np.float32).reshape([int(n) for n in reversed(t.shape)])


@pytest.mark.parametrize("kind, gguf_arch", [("gemma2", "gemma2"), ("gemma3", "gemma3"), ("phi3", "phi3"),
                                             ("qwen2_moe", "qwen2moe"), ("qwen3_moe", "qwen3moe")])
def test_architectures_through_transformers(tmp_path, kind, gguf_arch):
    src, model = build(kind, tmp_path / kind)
    out = tmp_path / "a.gguf"
    report = export_gguf(src, out, "F32", verify=True)
    assert report.architecture == gguf_arch
    v = report.verify
    assert v["token_ids_match"] and v["max_abs_logit_diff"] < 1e-4 and v["top1_agreement"] == 1.0, v
    assert field(out, f"{gguf_arch}.block_count") == model.config.num_hidden_layers
    if kind.startswith("gemma"):
        # stored norms are 1 + w; the sliding window and which layers use it are llama.cpp's keys
        assert np.allclose(tensor(out, "blk.0.attn_norm.weight"), model.model.layers[0].input_layernorm.weight.detach().numpy() + 1)
        assert field(out, f"{gguf_arch}.attention.sliding_window") == 8
        pattern = list(field(out, f"{gguf_arch}.attention.sliding_window_pattern"))
        assert pattern == [t == "sliding_attention" for t in model.config.layer_types]
    if kind.endswith("moe"):
        assert field(out, f"{gguf_arch}.expert_count") == 4 and field(out, f"{gguf_arch}.expert_used_count") == 2
        assert field(out, f"{gguf_arch}.expert_feed_forward_length") == 32
        gate = tensor(out, "blk.1.ffn_gate_exps.weight")
        assert gate.shape == (4, 32, 64)
        assert np.array_equal(gate, model.model.layers[1].mlp.experts.gate_up_proj[:, :32].detach().numpy())
    if kind == "qwen2_moe":
        assert field(out, "qwen2moe.expert_shared_feed_forward_length") == 64
        assert tensor(out, "blk.0.ffn_gate_inp_shexp.weight").shape == (64,)  # a vector, as llama.cpp reads it
        assert "output.weight" in {t.name for t in GGUFReader(str(out)).tensors}


def test_mixtral_tensors_one_by_one(tmp_path):
    src, model = build("mixtral", tmp_path / "mixtral")
    out = tmp_path / "m.gguf"
    report = export_gguf(src, out, "F32", verify=True)
    assert report.architecture == "llama" and "Mixtral" in report.verify["limitation"]
    assert field(out, "llama.expert_count") == 4 and field(out, "llama.expert_used_count") == 2
    assert field(out, "llama.feed_forward_length") == 96
    layer = model.model.layers[1]
    router = tensor(out, "blk.1.ffn_gate_inp.weight")
    assert router.shape == (4, 64) and np.array_equal(router, layer.mlp.gate.weight.detach().numpy())
    gate_up = layer.mlp.experts.gate_up_proj.detach().numpy()  # [experts, 2 × ffn, hidden]: w1 rows, then w3
    assert np.array_equal(tensor(out, "blk.1.ffn_gate_exps.weight"), gate_up[:, :96])
    assert np.array_equal(tensor(out, "blk.1.ffn_up_exps.weight"), gate_up[:, 96:])
    assert np.array_equal(tensor(out, "blk.1.ffn_down_exps.weight"), layer.mlp.experts.down_proj.detach().numpy())
    q = unpermute(tensor(out, "blk.1.attn_q.weight"), 4)
    assert np.array_equal(q, layer.self_attn.q_proj.weight.detach().numpy())


def test_quantized_experts_carry_their_codes(tmp_path):
    """W4A16 g32 (int4 symmetric) experts of a Qwen3-MoE checkpoint become Q4_0 blocks holding the
    same codes, stacked per projection; transformers' logits equal our dequantized model's."""
    src, _ = build("qwen3_moe", tmp_path / "src")
    quantized = tmp_path / "w4"
    quantize_checkpoint(src, quantized, make_request("W4A16", "rtn", group_size=32), tokenizer=chat_tokenizer(),
                        progress=False)
    out = tmp_path / "q.gguf"
    report = export_gguf(quantized, out, "auto", verify=True)
    stacked = [t for t in report.tensors if "_exps" in t.name]
    assert len(stacked) == 2 * 3
    assert all(t.type == "Q4_0" and t.codes_identical and len(t.shape) == 3 for t in stacked), stacked
    # the only change is each scale rounded to float16 (|Δ| ≤ 2^-11 relative): logits move by ~3e-4,
    # while a misplaced expert or a wrong code moves them by > 0.1
    assert report.verify["max_abs_logit_diff"] < 2e-3 and report.verify["top1_agreement"] == 1.0, report.verify


@pytest.mark.parametrize("kind, overrides, words", [
    ("gemma2", {"query_pre_attn_scalar": 32}, "query_pre_attn_scalar"),
    ("qwen3_moe", {"norm_topk_prob": False}, "norm_topk_prob"),
    ("qwen2_moe", {"mlp_only_layers": [1]}, "experts in every layer"),
])
def test_refused_where_llama_cpp_would_compute_otherwise(kind, overrides, words):
    with pytest.raises(UnsupportedArchitectureError, match=words):
        check_architecture(config(kind, **overrides).to_dict())


def test_gemma2_with_its_own_head_is_refused(tmp_path):
    src, _ = build("gemma2", tmp_path / "g", tie_word_embeddings=False)
    with pytest.raises(UnsupportedArchitectureError, match="embedding as the output head"):
        export_gguf(src, tmp_path / "g.gguf", "F32")
    assert not (tmp_path / "g.gguf").exists()
