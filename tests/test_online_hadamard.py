"""Online Hadamard transforms before the down projections (R4, ``quantize --rotate`` with a scheme
that quantizes activations): the transform against an explicit matrix and against
compressed-tensors' own implementation of the format, the C++ fast Walsh–Hadamard transform, the
rotated checkpoint's function, what it buys int8 activations, and every consumer of the output
(our loader, the runtime, exports)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import randomize, save_model, tiny_llama
from test_runtime import assert_greedy_match, greedy, random_prompts, reference

from llmopt.checkpoints.model_card import consumers
from llmopt.checkpoints.models import load_model
from llmopt.cli import main
from llmopt.formats.hadamard import (
    DOWN_PROJ_TARGET,
    OnlineHadamard,
    add_input_hooks,
    block_for,
    fuse_into_weight,
    hadamard_matrix,
    online_inputs,
    transform_config,
    transform_inputs,
)
from llmopt.formats.schemes import fake_quantize_activations
from llmopt.pipeline.rotate import rotate_checkpoint
from llmopt.runtime import LLM
from llmopt.runtime.backends.base import Backend
from llmopt.runtime.kernels import build
from llmopt.runtime.layers import TransformedLinear

pytestmark = pytest.mark.usefixtures("one_thread")


def _block_diagonal(width: int, block: int) -> torch.Tensor:
    return torch.block_diag(*[hadamard_matrix(block)] * (width // block))


@pytest.mark.parametrize("width,block", [(96, 32), (1536, 512), (11008, 256), (14336, 2048), (64, 64)])
def test_block_is_the_largest_power_of_two_factor(width, block):
    assert block_for(width) == block
    assert width % block == 0 and (width // block) % 2 == 1 or width == block


def test_widths_without_a_large_power_of_two_factor_get_none():
    assert block_for(24) is None and block_for(3 * 8 * 5) is None and block_for(7) is None


@pytest.mark.parametrize("width,block", [(96, 32), (128, 128), (48, 16)])
def test_transform_is_the_orthogonal_block_diagonal_matrix(width, block):
    x = torch.randn(5, width, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    v = _block_diagonal(width, block)
    got = transform_inputs(x, block)
    assert got.shape == x.shape
    torch.testing.assert_close(got, x @ v, rtol=0, atol=1e-12)
    torch.testing.assert_close(v @ v.T, torch.eye(width, dtype=v.dtype), rtol=0, atol=1e-12)
    torch.testing.assert_close(transform_inputs(got, block), x, rtol=0, atol=1e-12)  # V is its own inverse
    w = torch.randn(7, width, dtype=torch.float64)
    torch.testing.assert_close(transform_inputs(x, block) @ fuse_into_weight(w, block).T, x @ w.T, rtol=0, atol=1e-10)


def test_transform_config_is_compressed_tensors_r4():
    """The same linear through compressed-tensors' own transform code (the format's reference) and
    through ours: the fused weights and the outputs agree."""
    from compressed_tensors.transform import TransformConfig, apply_transform_config

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.mlp = torch.nn.Module()
    model.mlp.down_proj = torch.nn.Linear(96, 8, bias=False)
    x = torch.randn(5, 96)
    want = model.mlp.down_proj(x).detach()
    transform = OnlineHadamard((DOWN_PROJ_TARGET,), block_for(96))
    theirs = torch.nn.Module()
    theirs.mlp = torch.nn.Module()
    theirs.mlp.down_proj = torch.nn.Linear(96, 8, bias=False)
    theirs.mlp.down_proj.weight.data.copy_(model.mlp.down_proj.weight.data)
    apply_transform_config(theirs, TransformConfig.model_validate(transform_config([transform])))
    fused = fuse_into_weight(model.mlp.down_proj.weight.detach(), transform.block)
    torch.testing.assert_close(theirs.mlp.down_proj.weight.detach(), fused, rtol=0, atol=1e-6)
    model.mlp.down_proj.weight.data = fused
    add_input_hooks(model, [transform])
    with torch.no_grad():
        torch.testing.assert_close(model.mlp.down_proj(x), want, rtol=0, atol=1e-5)
        torch.testing.assert_close(theirs.mlp.down_proj(x), want, rtol=0, atol=1e-5)
    assert online_inputs({"transform_config": transform_config([transform])}) == [transform]


@pytest.mark.parametrize("group,why", [
    ({"type": "random-hadamard", "apply": [{"targets": ["Linear"], "location": "input"}], "head_dim": 64}, "random-hadamard"),
    ({"type": "hadamard", "apply": [{"targets": ["Linear"], "location": "output"}], "head_dim": 64}, "at output"),
    ({"type": "hadamard", "randomize": True, "apply": [{"targets": ["Linear"], "location": "input"}], "head_dim": 64}, "randomized"),
    ({"type": "hadamard", "apply": [{"targets": ["Linear"], "location": "input"}]}, "no head_dim"),
])
def test_transforms_llmopt_cannot_run_are_refused(group, why):
    with pytest.raises(ValueError, match=why):
        online_inputs({"transform_config": {"config_groups": {"R": group}}})
    fused_only = {**group, "apply": [{"targets": ["Linear"], "location": "weight_input"}]}
    assert online_inputs({"transform_config": {"config_groups": {"R": fused_only}}}) == []


@pytest.mark.skipif(not build.compiler_available(), reason="no C++ compiler: the C++ kernels are not built here")
@pytest.mark.parametrize("shape,block", [((1, 96), 32), ((7, 1536), 512), ((3, 2, 64), 16), ((300, 256), 256), ((0, 64), 64)])
def test_cpp_fast_transform_matches_the_reference(shape, block):
    from llmopt.runtime.backends.cpu import CpuBackend

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    want = Backend(torch.device("cpu"), torch.float32).input_transform(x, block)
    got = CpuBackend(torch.device("cpu"), torch.float32).input_transform(x, block)
    assert got.shape == want.shape == x.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * max(1.0, float(want.abs().max()) if want.numel() else 1.0))


@pytest.mark.parametrize("shape,block", [((1, 96), 32), ((7, 1536), 512), ((3, 2, 64), 16), ((0, 64), 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backend_fast_transform_matches_the_reference(shape, block, dtype):
    """The GPU backend's butterfly transform (float32 torch operations) against the exact product."""
    from llmopt.runtime.backends.triton import TritonBackend

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    want = transform_inputs(x.double(), block)
    got = TritonBackend(torch.device("cpu"), torch.float32).input_transform(x, block)
    assert got.shape == x.shape and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance * max(1.0, float(want.abs().max()) if want.numel() else 1.0))
    with pytest.raises(ValueError, match="power of two"):
        TritonBackend(torch.device("cpu"), torch.float32).input_transform(x, 3)


def _down_outlier_model(tmp_path):
    """A tiny Llama whose MLP width has one outlier channel: the down projections' inputs
    carry a feature 40× the others, the case int8 activations per token lose most on."""
    model = randomize(tiny_llama(seed=4, tie_word_embeddings=False))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.up_proj.weight[7] *= 40.0
            layer.mlp.down_proj.weight[:, 7] /= 8.0
    return model, save_model(model, tmp_path / "src")


def _kld(reference: torch.Tensor, got: torch.Tensor) -> float:
    return float((reference.exp() * (reference - got)).sum(-1).mean())


def test_online_transform_keeps_the_function_and_helps_int8_activations(tmp_path):
    import transformers as tf

    model, src = _down_outlier_model(tmp_path)
    ids = torch.randint(3, 259, (4, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(ids).logits.log_softmax(-1)
    kld = {}
    for online in (False, True):
        out = tmp_path / f"rot-{online}"
        record = rotate_checkpoint(src, out, "hadamard", seed=1, online="down" if online else "off")
        rotated = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        transforms = OnlineHadamard.from_record(record.get("online"))
        assert online == ("online" in record) and len(transforms) == int(online)
        assert not online or transforms == [OnlineHadamard((DOWN_PROJ_TARGET,), block_for(model.config.intermediate_size))]
        add_input_hooks(rotated, transforms)
        with torch.no_grad():
            same = rotated(ids).logits.log_softmax(-1)
            torch.testing.assert_close(same, want, rtol=0, atol=1e-4)  # R1 + R2 (+ R4): the same function
            for layer in rotated.model.layers:  # after the transform hook: int8 inputs per token, as W8A8 runs
                layer.mlp.down_proj.register_forward_pre_hook(lambda _m, a: (fake_quantize_activations(a[0], "int8"),))
            kld[online] = _kld(want, rotated(ids).logits.log_softmax(-1))
    assert kld[True] < 0.5 * kld[False], kld


def test_rotated_w8a8_checkpoint_runs_everywhere_the_transform_is_known(tmp_path):
    """quantize W8A8 --rotate hadamard: the output records R4 in compressed-tensors' transform
    config; our loader and the runtime (C++ and reference kernels) apply it and agree; the dense
    export folds it back; GGUF export is refused in one line."""
    from compressed_tensors.transform import TransformConfig

    model, src = _down_outlier_model(tmp_path)
    runner = CliRunner()
    out = tmp_path / "w8a8"
    result = runner.invoke(main, ["quantize", str(src), "--scheme", "W8A8", "--rotate", "hadamard", "-o", str(out)])
    assert result.exit_code == 0, result.output
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    transforms = online_inputs(qconfig)
    block = block_for(model.config.intermediate_size)
    assert transforms == [OnlineHadamard((DOWN_PROJ_TARGET,), block)]
    TransformConfig.model_validate(qconfig["transform_config"])
    assert OnlineHadamard.of_provenance(json.loads((out / "llmopt.json").read_text())) == transforms
    card = (out / "README.md").read_text()
    assert "ignores the online Hadamard" in card and "GGUF cannot carry the online Hadamard" in card

    loaded, _ = load_model(out)
    ids = torch.randint(3, 259, (3, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits.log_softmax(-1)
        assert _kld(want, loaded(ids).logits.log_softmax(-1)) < 0.02
    for kernels in ("auto", "reference"):
        llm = LLM(out, kernels=kernels)
        down = llm.engine.weights.layers[0].down
        assert isinstance(down, TransformedLinear) and down.block == block
        prompts = random_prompts(3, seed=3)
        for prompt, got in zip(prompts, llm.generate(prompts, greedy(10))):
            ref, scores = reference(loaded, prompt, 10)
            assert_greedy_match(got.token_ids, ref, scores, f"R4 {kernels}")

    dense = tmp_path / "dense"
    result = runner.invoke(main, ["export", str(out), "--format", "hf", "-o", str(dense)])
    assert result.exit_code == 0, result.output
    assert "quantization_config" not in json.loads((dense / "config.json").read_text())
    import transformers as tf

    exported = tf.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    with torch.no_grad():
        assert _kld(want, exported(ids).logits.log_softmax(-1)) < 0.02  # W8 weights, float inputs: close to the float model

    result = runner.invoke(main, ["export", str(out), "--format", "gguf", "-o", str(tmp_path / "m.gguf")])
    assert result.exit_code != 0 and "online Hadamard" in result.output and "GGUF cannot carry" in result.output
    assert not (tmp_path / "m.gguf").exists()


def test_consumers_of_a_weight_only_rotation_are_unchanged():
    """Only online transforms change what consumers can do: a fused-only transform config is plain."""
    groups = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "group_size": 128}}}
    fused = {"config_groups": {"R1": {"type": "hadamard", "apply": [{"targets": ["Linear"], "location": "weight_input"}]}}}
    plain = consumers({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": groups}})
    assert consumers({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": groups,
                                              "transform_config": fused}}) == plain
    online = transform_config([OnlineHadamard((DOWN_PROJ_TARGET,), 64)])
    got = consumers({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": groups, "transform_config": online}})
    assert sorted(got) == sorted(plain) and got["transformers"].startswith("loads but ignores") and got["llama.cpp"].startswith("no:")


def test_smoothquant_with_rotation_and_activations_is_refused(tmp_path):
    _, src = _down_outlier_model(tmp_path)
    result = CliRunner().invoke(main, ["quantize", str(src), "--scheme", "W8A8", "--method", "smoothquant",
                                       "--rotate", "hadamard", "-o", str(tmp_path / "o")])
    assert result.exit_code == 2 and "cannot fold its input scales through" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


@pytest.mark.parametrize("args,message", [
    (["--scheme", "W8A8", "--online-hadamard", "on"], "--online-hadamard on applies with --rotate"),
    (["--scheme", "W8A8", "--online-hadamard", "off"], "--online-hadamard off applies with --rotate"),
    (["--scheme", "W4A16", "--method", "awq", "--online-hadamard", "all"], "--method awq cannot fold"),
    (["--scheme", "Q4_K_M", "--online-hadamard", "all"], "is written for GGUF, which cannot carry online transforms"),
    (["--scheme", "AUTO", "--target-bpw", "5", "--for", "llama.cpp", "--online-hadamard", "all"], "an AUTO plan for llama.cpp"),
    (["--scheme", "AUTO", "--target-bpw", "5", "--size-of", "gguf", "--online-hadamard", "all"], "an AUTO plan for llama.cpp"),
    (["--scheme", "NF4", "--online-hadamard", "all"], "carry no online transforms"),
    (["--scheme", "W4A16", "--method", "awq", "--rotate", "hadamard", "--online-hadamard", "on"], "--method awq cannot fold"),
    (["--scheme", "Q4_K_M", "--rotate", "hadamard", "--online-hadamard", "on"], "is written for GGUF"),
    (["--scheme", "W4A16", "--rotate", "hadamard", "--online-hadamard", "on", "--tune-steps", "4"], "--tune-steps does not run"),
])
def test_online_hadamard_options_that_do_not_apply_are_refused(tmp_path, args, message):
    _, src = _down_outlier_model(tmp_path)
    result = CliRunner().invoke(main, ["quantize", str(src), *args, "-o", str(tmp_path / "o")])
    assert result.exit_code == 2 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_weight_only_with_online_hadamard_on_and_activations_with_it_off(tmp_path):
    """``on`` adds R4 to a weight-only scheme (the runtime runs it); ``off`` keeps a W8A8 rotation
    an ordinary checkpoint (no transform_config), which transformers runs as it is."""
    model, src = _down_outlier_model(tmp_path)
    runner = CliRunner()
    for scheme, online in (("W4A16", "on"), ("W8A8", "off")):
        out = tmp_path / f"{scheme}-{online}"
        result = runner.invoke(main, ["quantize", str(src), "--scheme", scheme, "--rotate", "hadamard",
                                      "--online-hadamard", online, "-o", str(out)])
        assert result.exit_code == 0, result.output
        qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
        assert bool(online_inputs(qconfig)) == (online == "on")
        loaded, _ = load_model(out)
        llm = LLM(out)
        prompts = random_prompts(2, seed=4)
        for prompt, got in zip(prompts, llm.generate(prompts, greedy(8))):
            ref, scores = reference(loaded, prompt, 8)
            assert_greedy_match(got.token_ids, ref, scores, f"{scheme} {online}")


def test_moe_models_get_no_online_hadamard(tmp_path):
    """Mixtral's MLPs are experts (no dense down_proj): the rotation is fused, no online transform
    is added, and the output is an ordinary W8A8 checkpoint."""
    from test_export_gguf_archs import build

    src, _ = build("mixtral", tmp_path / "src")
    out = tmp_path / "q"
    result = CliRunner().invoke(main, ["quantize", str(src), "--scheme", "W8A8", "--rotate", "hadamard", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "transform_config" not in json.loads((out / "config.json").read_text())["quantization_config"]
    assert json.loads((out / "llmopt.json").read_text())["rotation"]["online"].startswith("none: the model has no dense MLP")
