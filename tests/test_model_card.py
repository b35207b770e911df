"""Every checkpoint carries a model card (README.md): Hugging Face metadata, what made it, its
evaluation once there is one, and which consumers load it; GGUF files carry general.* origin keys."""

from __future__ import annotations

import json
import re

from click.testing import CliRunner
from conftest import save_model, tiny_llama

from llmopt.checkpoints.model_card import card_text, consumers
from llmopt.checkpoints.provenance import update_provenance
from llmopt.cli.main import main


def front_matter(text: str) -> list[str]:
    found = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    assert found, text[:200]
    return found.group(1).splitlines()


def test_quantized_checkpoint_has_a_card_that_follows_its_record(tmp_path):
    source = save_model(tiny_llama(seed=3), tmp_path / "src")
    (source / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny\n")
    out = tmp_path / "w4"
    result = CliRunner().invoke(main, ["quantize", str(source), "--scheme", "W4A16", "--group-size", "32", "-o", str(out)])
    assert result.exit_code == 0, result.output
    card = (out / "README.md").read_text()
    meta = front_matter(card)
    assert {"library_name: transformers", "pipeline_tag: text-generation", "license: apache-2.0", "- llmopt",
            "- compressed-tensors", "- w4a16", "- rtn"} <= set(meta)
    assert not any(line.startswith("base_model") for line in meta)  # a local source has no Hub id
    assert "| vLLM | loads |" in card and "| transformers | loads |" in card
    assert "## Evaluation" not in card
    update_provenance(out, evaluation={"perplexity": 12.5, "kld_mean": 0.0123, "windows": 2})
    card = (out / "README.md").read_text()
    assert "## Evaluation" in card and "| kld_mean | 0.0123 |" in card
    # a Hub source names its base model and the relation
    record = {**json.loads((out / "llmopt.json").read_text()), "hub": {"repo_id": "org/tiny", "commit": "0" * 40}}
    meta = front_matter(card_text(out, record))
    assert meta[:2] == ["base_model: org/tiny", "base_model_relation: quantized"]
    # the GGUF export states where its weights come from
    gguf = tmp_path / "w4.gguf"
    result = CliRunner().invoke(main, ["export", str(out), "-o", str(gguf)])
    assert result.exit_code == 0, result.output
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields
    assert fields["general.quantized_by"].contents() == "llmopt" and fields["general.license"].contents() == "apache-2.0"


def test_cards_name_what_a_consumer_cannot_load():
    def config(bits, targets, symmetric=True, group=32):
        return {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
            "g": {"targets": targets, "weights": {"num_bits": bits, "type": "int", "symmetric": symmetric, "group_size": group}}}}}

    plain = consumers(config(4, ["Linear"]))
    assert plain["vLLM"] == "loads" and plain["transformers"] == "loads"
    three_bit = consumers(config(3, ["Linear"]))
    assert three_bit["vLLM"].startswith("cannot serve it: no kernel for 3-bit codes")
    embedded = consumers(config(4, ["Linear", "model.embed_tokens"]))
    assert embedded["transformers"].startswith("cannot load a quantized embedding")
    assert "no quantized embedding / head" in embedded["vLLM"]
    assert consumers({})["vLLM"] == "loads"
    # integer zero points in one group size: compressed-tensors 0.20 cannot load them either (interop: W4A16_ASYM)
    assert consumers(config(4, ["Linear"], symmetric=False))["transformers"].startswith("cannot load integer zero points")


def test_cards_of_moe_checkpoints_follow_what_the_interop_bench_measured():
    """bench/results/interop.md, MoE rows: transformers 5.25 cannot convert experts with int8 activations
    into its fused experts; vLLM's CPU build has no MoE kernel for FP8, W4A8 or asymmetric int4 experts
    but serves W4A16 and W8A8 ones; its CPU build has no bitsandbytes."""
    def config(weights, activations=None, experts=4):
        group = {"targets": ["Linear"], "weights": {"type": "int", "symmetric": True, "group_size": None, **weights}}
        if activations:
            group["input_activations"] = {"num_bits": 8, "type": activations, "strategy": "token", "dynamic": True}
        return {"num_local_experts": experts, "quantization_config": {"quant_method": "compressed-tensors",
                                                                      "config_groups": {"g": group}}}

    w8a8 = consumers(config({"num_bits": 8}, "int"))
    assert w8a8["transformers"].startswith("cannot load it: transformers 5.25 fails to convert") and w8a8["vLLM"] == "loads"
    w4a8 = consumers(config({"num_bits": 4, "group_size": 128}, "int"))
    assert w4a8["transformers"].startswith("cannot load") and "no MoE kernel for these experts" in w4a8["vLLM"]
    fp8 = consumers(config({"num_bits": 8, "type": "float"}, "float"))
    assert fp8["transformers"] == "loads" and "no MoE kernel for these experts" in fp8["vLLM"]
    w4a16 = consumers(config({"num_bits": 4, "group_size": 128}))
    assert w4a16["transformers"] == "loads" and w4a16["vLLM"] == "loads"
    planned = config({"num_bits": 4, "group_size": 64})  # a mixed plan names each layer's experts
    planned["quantization_config"]["config_groups"]["g"]["targets"] = ["model.layers.0.block_sparse_moe.experts.0.w1"]
    assert consumers(planned)["transformers"].startswith("cannot load it: transformers 5.25 fails to convert")
    planned["quantization_config"]["config_groups"]["g"]["targets"] = ["model.layers.0.mlp.experts.0.gate_proj"]
    assert consumers(planned)["transformers"] == "loads"  # Qwen-MoE's names are transformers' own: they load
    dense_w4a8 = consumers({**config({"num_bits": 4, "group_size": 128}, "int"), "num_local_experts": None})
    assert dense_w4a8["transformers"] == "loads" and dense_w4a8["vLLM"] == "loads"
    nf4 = consumers({"quantization_config": {"quant_method": "bitsandbytes"}})
    assert "CPU build (0.32) has no bitsandbytes" in nf4["vLLM"]


def test_cards_of_float_zero_points():
    """llama.cpp's mins (float32 zp_dtype, naive-quantized): transformers loads them beside groups of
    other sizes (tests/test_float_zero.py loads one); vLLM 0.32 does not load them (measured: it
    asserts that naive-quantized weights without quantized activations are float)."""
    groups = {"a": {"targets": ["re:.*q_proj"], "format": "naive-quantized",
                    "weights": {"num_bits": 4, "type": "int", "symmetric": False, "group_size": 32, "zp_dtype": "torch.float32"}},
              "b": {"targets": ["re:.*down_proj"], "weights": {"num_bits": 6, "type": "int", "symmetric": True, "group_size": 16}}}
    found = consumers({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": groups}})
    assert found["transformers"] == "loads"
    assert "no loader for float zero points" in found["vLLM"] and "6-bit" in found["vLLM"]
    groups["a"]["weights"].pop("zp_dtype")  # integer zero points in groups of two sizes: compressed-tensors' bug
    assert consumers({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": groups}})[
        "transformers"].startswith("cannot load integer zero points")
