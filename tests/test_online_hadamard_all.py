"""``--online-hadamard all``: an online Hadamard on the input of every decoder Linear (QuIP's
input-side rotation in blocks), alone or after the offline rotation. Checked against
compressed-tensors' own transforms (the format's reference), the model's function, what it buys
weight-only int4 on input-channel outliers, and the consumers of the output (our loader, the
runtime with its merged projections, GGUF export refused)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import randomize, save_model, tiny_llama
from test_runtime import assert_greedy_match, greedy, random_prompts, reference

from llmopt.checkpoints.models import load_model
from llmopt.cli import main
from llmopt.formats.hadamard import (
    DOWN_PROJ_TARGET,
    OnlineHadamard,
    add_input_hooks,
    online_inputs,
    plan_online,
    transform_config,
)
from llmopt.pipeline.rotate import rotate_checkpoint
from llmopt.runtime import LLM
from llmopt.runtime.layers import TransformedLinear

pytestmark = pytest.mark.usefixtures("one_thread")
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _outlier_model(tmp_path):
    """A tiny Llama (MLP width 160: blocks of 32 there, 64 elsewhere) whose Linears have a few
    input columns 12× the rest: the weights int4 groups lose most on."""
    model = randomize(tiny_llama(seed=7, intermediate_size=160, tie_word_embeddings=False))
    with torch.no_grad():
        for layer in model.model.layers:
            for name in LINEARS:
                weight = layer.get_submodule(name).weight
                weight[:, [3, weight.shape[1] // 2 + 1]] *= 12.0
    return model, save_model(model, tmp_path / "src")


def _kld(reference: torch.Tensor, got: torch.Tensor) -> float:
    return float((reference.exp() * (reference - got)).sum(-1).mean())


def test_plan_groups_linears_by_block_and_leaves_narrow_ones_out():
    widths = {"self_attn.q_proj": 64, "self_attn.o_proj": 64, "mlp.down_proj": 160, "mlp.up_proj": 64, "mlp.odd": 24}
    transforms, left_out = plan_online(widths, "all")
    assert len(transforms) == 2 and left_out == ["mlp.odd"]
    assert [t.block for t in transforms] == [32, 64]
    by_block = {t.block: t for t in transforms}
    assert by_block[32].applies_to("mlp.down_proj") and by_block[32].applies_to("model.layers.11.mlp.down_proj")
    assert not by_block[32].applies_to("model.layers.1.mlp.shared_expert.down_proj")
    for name in ("self_attn.q_proj", "model.layers.0.self_attn.o_proj", "model.layers.3.mlp.up_proj"):
        assert by_block[64].applies_to(name) and not by_block[32].applies_to(name)
    assert not by_block[64].applies_to("model.layers.0.mlp.down_proj") and not by_block[64].applies_to("lm_head")
    down, left = plan_online(widths, "down")
    assert down == [OnlineHadamard((DOWN_PROJ_TARGET,), 32)] and left == []


def test_provenance_records_of_older_checkpoints_still_read():
    """Checkpoints written before ``all`` existed record R4 as one dict; ``none: …`` lines hold none."""
    old = {"rotation": {"kind": "hadamard", "online": {"transform": "hadamard", "location": "input", "block": 64,
                                                        "targets": [DOWN_PROJ_TARGET]}}}
    assert OnlineHadamard.of_provenance(old) == [OnlineHadamard((DOWN_PROJ_TARGET,), 64)]
    assert OnlineHadamard.of_provenance({"rotation": {"online": "none: the model has no dense MLP down_proj"}}) == []
    assert OnlineHadamard.of_provenance({}) == []


@pytest.mark.parametrize("kind", ["none", "hadamard"])
def test_online_all_matches_compressed_tensors_and_keeps_the_function(tmp_path, kind):
    """Every decoder Linear's stored weight is ``W V``; compressed-tensors, given our
    transform_config, fuses the same weights from the source and runs the same function."""
    import transformers as tf
    from compressed_tensors.transform import TransformConfig, apply_transform_config

    model, src = _outlier_model(tmp_path)
    out = tmp_path / kind
    record = rotate_checkpoint(src, out, kind, seed=2, online="all")
    transforms = OnlineHadamard.from_record(record["online"])
    assert len(transforms) == 2 and sorted(t.block for t in transforms) == [32, 64]
    config = transform_config(transforms)
    TransformConfig.model_validate(config)
    assert online_inputs({"transform_config": config}) == transforms
    ids = torch.randint(3, 259, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits.log_softmax(-1)
    ours = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hooked = sum(1 for n, m in ours.named_modules() if isinstance(m, torch.nn.Linear) and any(t.applies_to(n) for t in transforms))
    assert hooked == len(LINEARS) * model.config.num_hidden_layers  # every decoder Linear, not the head
    add_input_hooks(ours, transforms)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits.log_softmax(-1), want, rtol=0, atol=1e-4)
    if kind == "none":  # no offline rotation: compressed-tensors' transforms of the source are our checkpoint
        theirs = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        apply_transform_config(theirs, TransformConfig.model_validate(config))
        for name in LINEARS:
            key = f"model.layers.1.{name}"
            torch.testing.assert_close(theirs.get_submodule(key).weight.detach(), ours.get_submodule(key).weight.detach(),
                                       rtol=0, atol=1e-5)
        with torch.no_grad():
            torch.testing.assert_close(theirs(ids).logits.log_softmax(-1), want, rtol=0, atol=1e-4)
        torch.testing.assert_close(ours.model.norm.weight, model.model.norm.weight)  # nothing folded


def test_quantize_online_all_helps_int4_and_runs_in_every_consumer(tmp_path):
    """W4A16 GPTQ with ``--online-hadamard all`` against without, on the same outlier columns:
    the transform spreads them over each group; the output records both transforms, our loader
    and the runtime (C++, reference and Triton kernels, q/k/v and gate/up merged under one transform)
    agree, and GGUF export is refused in one line."""
    model, src = _outlier_model(tmp_path)
    runner = CliRunner()
    ids = torch.randint(3, 259, (4, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits.log_softmax(-1)
    kld = {}
    for online in ("off", "all"):
        out = tmp_path / online
        extra = ["--online-hadamard", "all"] if online == "all" else []
        result = runner.invoke(main, ["quantize", str(src), "--scheme", "W4A16", "--group-size", "32", "--method", "gptq",
                                      "--calib-samples", "16", "--calib-seq-len", "64", *extra, "-o", str(out)])
        assert result.exit_code == 0, result.output
        loaded, _ = load_model(out)
        with torch.no_grad():
            kld[online] = _kld(want, loaded(ids).logits.log_softmax(-1))
    assert kld["all"] < 0.7 * kld["off"], kld

    out = tmp_path / "all"
    transforms = online_inputs(json.loads((out / "config.json").read_text())["quantization_config"])
    assert sorted(t.block for t in transforms) == [32, 64]
    assert OnlineHadamard.of_provenance(json.loads((out / "llmopt.json").read_text())) == transforms
    result = runner.invoke(main, ["inspect", str(out), "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)["online_transforms"]
    assert sorted((t["block"], t["linears"]) for t in shown) == [(32, 2), (64, 12)]  # down; the other six, in 2 layers
    card = (out / "README.md").read_text()
    assert "after online Hadamards in blocks of 32 / 64," in card and "GGUF cannot carry the online Hadamard" in card
    loaded, _ = load_model(out)
    for kernels in ("auto", "reference", "triton"):  # triton: its CPU interpreter here (conftest)
        llm = LLM(out, kernels=kernels)
        layer = llm.engine.weights.layers[0]
        for lin, block in ((layer.qkv, 64), (layer.gate_up, 64), (layer.o, 64), (layer.down, 32)):
            assert isinstance(lin, TransformedLinear) and lin.block == block
            assert not isinstance(lin.inner, TransformedLinear)
        prompts = random_prompts(3, seed=5)
        for prompt, got in zip(prompts, llm.generate(prompts, greedy(10))):
            ref, scores = reference(loaded, prompt, 10)
            assert_greedy_match(got.token_ids, ref, scores, f"online all {kernels}")
    result = runner.invoke(main, ["export", str(out), "--format", "gguf", "-o", str(tmp_path / "m.gguf")])
    assert result.exit_code != 0 and "GGUF cannot carry" in result.output
    assert not (tmp_path / "m.gguf").exists()
    # a dense export folds V back into every weight: transformers runs the quantized model's function, no hooks
    import transformers as tf

    result = runner.invoke(main, ["export", str(out), "--format", "hf", "-o", str(tmp_path / "dense")])
    assert result.exit_code == 0, result.output
    dense = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(dense(ids).logits, loaded(ids).logits, rtol=0, atol=1e-3)


def test_auto_plan_prices_formats_on_the_transformed_model(tmp_path, monkeypatch):
    """AUTO with ``--online-hadamard all``: the sensitivity pass runs the model the checkpoint
    describes (fused weights read through the transforms: the source's function), and the planned
    output runs in our loader and the runtime alike."""
    import llmopt.quant.sensitivity as sensitivity

    model, src = _outlier_model(tmp_path)
    ids = torch.randint(3, 259, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(ids).logits
    measure, seen = sensitivity.measure_sensitivity, []

    def spy(measured, *args, **kwargs):
        with torch.no_grad():
            seen.append(float((measured(ids).logits - want).abs().max()))
        return measure(measured, *args, **kwargs)

    monkeypatch.setattr(sensitivity, "measure_sensitivity", spy)
    out = tmp_path / "auto"
    result = CliRunner().invoke(main, ["quantize", str(src), "--scheme", "AUTO", "--target-bpw", "5", "--online-hadamard", "all",
                                       "--calib-samples", "8", "--calib-seq-len", "64", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert len(seen) == 1 and seen[0] < 1e-3, seen
    record = json.loads((out / "llmopt.json").read_text())
    assert record["plan"]["formats"] and len(OnlineHadamard.of_provenance(record)) == 2
    assert online_inputs(json.loads((out / "config.json").read_text())["quantization_config"]) == OnlineHadamard.of_provenance(record)
    loaded, _ = load_model(out)
    llm = LLM(out)
    prompts = random_prompts(2, seed=6)
    for prompt, got in zip(prompts, llm.generate(prompts, greedy(8))):
        ref, scores = reference(loaded, prompt, 8)
        assert_greedy_match(got.token_ids, ref, scores, "AUTO online all")


def test_online_all_finds_nothing_to_transform_in_one_line(tmp_path):
    """Widths with no power-of-two factor of 16: nothing to transform, refused before writing."""
    model = randomize(tiny_llama(seed=1, hidden_size=24, intermediate_size=40, num_attention_heads=3, num_key_value_heads=1))
    src = save_model(model, tmp_path / "src")
    result = CliRunner().invoke(main, ["quantize", str(src), "--scheme", "W4A16", "--group-size", "8",
                                       "--online-hadamard", "all", "-o", str(tmp_path / "o")])
    assert result.exit_code != 0 and "finds no decoder Linear to transform" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "o").exists()
