"""Quantization-aware distillation (``llmopt distill --quantized``): latent codes on every format's
grid, straight-through gradients, training that lowers the KL to the teacher, an exact save in the
checkpoint's own format, resume, and refusals."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from llmopt.cli.main import main
from llmopt.core.errors import LlmoptError
from llmopt.formats.compressed import read_compressed
from llmopt.formats.gguf_export import export_gguf
from llmopt.formats.schemes import QuantizedWeight, get_scheme, superblock_scales
from llmopt.pipeline.stages.quantize import QuantizeConfig, run_quantize
from llmopt.quant.fake_quant import FakeQuantWeight, attach, round_codes
from tests.conftest import CORPORA, randomize, save_model, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def _quantized_weight(scheme: str, rows: int = 8, cols: int = 64, group: int | None = 32) -> QuantizedWeight:
    from llmopt.quant.rtn import rtn_quantize_weight as rtn_quantize

    w = torch.randn(rows, cols) * 0.05
    return rtn_quantize(w, get_scheme(scheme, group), group)


@pytest.mark.parametrize("scheme, group", [("W4A16", 32), ("W4A16_ASYM", 32), ("W8A16", None), ("IQ4_NL", 32),
                                           ("FP8", None), ("NVFP4A16", 16), ("MXFP4A16", 32)])
def test_fake_quant_starts_on_the_stored_weight_and_round_trips(scheme, group):
    qw = _quantized_weight(scheme, group=group)
    fake = FakeQuantWeight(qw)
    w = fake()
    assert w.shape == qw.codes.shape
    assert torch.equal(w.detach(), qw.dequantize())
    back = fake.quantized()
    assert back.codes.dtype == qw.codes.dtype and torch.equal(back.codes.float(), qw.codes.float())
    assert torch.allclose(back.scale, qw.scale, rtol=1e-2)  # stored scales: rounded as written
    assert torch.equal(back.dequantize(), FakeQuantWeight(back)().detach())


@pytest.mark.parametrize("scheme, group", [("W4A16", 32), ("W4A16_ASYM", 32), ("Q4_K_M", 32)])
def test_start_near_the_float_weight_keeps_the_checkpoint_and_puts_latents_at_its_value(scheme, group):
    """RTN codes lie within half a step of the float weight: started near it, every latent sits at
    the float value in code units (those within 0.49 of their code) or 0.49 from its code, and the
    rounded weight is the stored one; one small step towards the edge then flips the codes that were
    near it, which a start on the stored codes would not."""
    from llmopt.quant.rtn import rtn_quantize_weight as rtn_quantize

    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(4)) * 0.05
    if scheme == "Q4_K_M":
        from llmopt.formats.registry import FORMATS
        qw = rtn_quantize(w, FORMATS["int4km"].scheme(group), group)
    else:
        qw = rtn_quantize(w, get_scheme(scheme, group), group)
    fake, stored = FakeQuantWeight(qw), FakeQuantWeight(qw)
    moved = fake.start_near(w)
    assert fake.latent.shape == qw.codes.shape and 0 < moved <= qw.codes.numel()
    codes = stored.latent.detach()
    assert torch.equal(round_codes(fake.latent, qw).float(), codes) and torch.equal(fake().detach(), stored().detach())
    offset = (fake.latent.detach() - codes).abs()
    assert offset.max() <= 0.49 + 1e-6 and offset.mean() > 0.1
    unit = fake.scales.weight_scale(fake.scale).detach()
    back = fake.latent.detach() - (0 if fake.zero is None else fake.zero)
    inside = offset < 0.489
    expected = (w if fake.offset is None else w + fake.offset) / unit
    assert torch.allclose((back * 1.0)[inside], expected[inside], atol=1e-4)
    nudged = [f.latent.detach() + 0.02 * torch.sign(f.latent.detach() - codes) for f in (fake, stored)]
    flips = [int((round_codes(n, qw).float() != codes).sum()) for n in nudged]
    assert flips[0] > 0 and flips[1] == 0


def test_teacher_in_student_basis_finds_the_folded_channel_scalings():
    from llmopt.distillation.quantized import teacher_in_student_basis

    g = torch.Generator().manual_seed(6)
    teacher = torch.randn(48, 64, generator=g)
    rows, cols = torch.rand(48, 1, generator=g) + 0.5, torch.rand(1, 64, generator=g) * 3 + 0.2
    student = rows * teacher * cols + 1e-3 * torch.randn(48, 64, generator=g)
    fitted = teacher_in_student_basis(teacher, student)
    assert fitted.shape == student.shape
    assert (fitted - student).abs().max() < 0.02 and (teacher - student).abs().max() > 1.0


def test_straight_through_gradients_follow_the_scales():
    qw = _quantized_weight("W4A16_ASYM")
    fake = FakeQuantWeight(qw)
    upstream = torch.randn(qw.codes.shape)
    (fake() * upstream).sum().backward()
    scale = qw.scale.float().repeat_interleave(32, dim=1)
    assert torch.allclose(fake.latent.grad, upstream * scale)
    codes = qw.codes.float() - qw.zero_point.float().repeat_interleave(32, dim=1)
    expected = (upstream * codes * scale).reshape(8, 2, 32).sum(-1)  # d/du of s·exp(u), summed over each group
    assert torch.allclose(fake.log_multiplier.grad, expected, rtol=1e-5, atol=1e-7)


def test_a_code_moves_once_its_latent_crosses_half_a_step_and_stays_in_range():
    qw = _quantized_weight("W4A16")
    fake = FakeQuantWeight(qw)
    with torch.no_grad():
        fake.latent[0, 0] += 0.45
        fake.latent[0, 1] += 0.55
        fake.latent[1] = 20.0
    fake.clamp_()
    out = fake.quantized()
    assert out.codes[0, 0] == qw.codes[0, 0] and out.codes[0, 1] == min(int(qw.codes[0, 1]) + 1, 7)
    assert (out.codes[1] == 7).all() and float(fake.latent.detach().max()) == 7.5


def test_superblock_scales_keep_their_multiples_while_codes_train():
    from llmopt.formats.registry import FORMATS
    from llmopt.formats.schemes import superblock_factors

    int4k = FORMATS["int4k"]
    scale = superblock_scales(torch.rand(4, 512 // 32) * 0.02 + 0.01, 32, int4k.scale_steps)
    codes = torch.randint(-8, 8, (4, 512), dtype=torch.int8)
    qw = QuantizedWeight(codes, scale, None, int4k.scheme(32), 32)
    fake = FakeQuantWeight(qw)
    with torch.no_grad():
        fake.log_multiplier.normal_(0, 0.05)
        fake.latent.add_(torch.randn(4, 512))
    out = fake.quantized()
    _, k_before = superblock_factors(scale, 32, int4k.scale_steps)
    _, k_after = superblock_factors(out.scale, 32, int4k.scale_steps)
    assert torch.equal(k_after, k_before) and out.codes.abs().max() <= 8


def test_tied_head_follows_the_embeddings_codes():
    model = randomize(tiny_llama(seed=1))
    emb = model.get_input_embeddings().weight
    from llmopt.quant.rtn import rtn_quantize_weight as rtn_quantize

    q = rtn_quantize(emb.detach(), get_scheme("W4A16", 32), 32)
    fake = attach(model, {"model.embed_tokens": q})
    ids = torch.tensor([[3, 4, 5, 6]])
    model(ids).logits.sum().backward()
    head_grad = fake.weights["model.embed_tokens"].latent.grad
    assert head_grad is not None and head_grad.abs().sum() > 0
    assert torch.equal(model.lm_head.weight, q.dequantize())


# -- through the CLI --------------------------------------------------------------------------------

GUTENBERG = CORPORA / "gutenberg" / "persuasion.txt"


@pytest.fixture(scope="module")
def qad_setup(tmp_path_factory):
    """A tiny teacher, its W4A16 g32 RTN checkpoint (int4 tied embedding), and train / validation texts."""
    root = tmp_path_factory.mktemp("qad")
    teacher = save_model(randomize(tiny_llama(seed=5, num_hidden_layers=3)), root / "teacher")
    quantized = root / "w4"
    run_quantize(QuantizeConfig(model=str(teacher), output=str(quantized), scheme="W4A16", group_size=32, method="rtn",
                                head="int4", embedding="int4"))
    body = GUTENBERG.read_text()[5000:45000]
    (root / "train.txt").write_text(body[:32000])
    (root / "val.txt").write_text(body[32000:])
    return root, teacher, quantized


def _distill(setup, out: Path, *extra: str):
    root, teacher, quantized = setup
    args = ["distill", "--teacher", str(teacher), "--student", str(quantized), "--quantized", "--data", str(root / "train.txt"),
            "--validation", str(root / "val.txt"), "--seq-len", "64", "--batch-size", "4", "--lr", "5e-3",
            "--code-lr", "2e-2", "--precision", "no", "--json", "-o", str(out), *extra]
    return CliRunner().invoke(main, args)


def test_qad_lowers_the_kl_and_saves_the_same_format_exactly(qad_setup, tmp_path):
    root, teacher, quantized = qad_setup
    out = tmp_path / "qad"
    result = _distill(qad_setup, out, "--steps", "80", "--eval-every", "80")
    assert result.exit_code == 0, result.output
    record = json.loads((out / "llmopt.json").read_text())["quantization_aware_distillation"]
    first, last = record["validation_curve"][0], record["validation_curve"][-1]
    assert last["step"] == 80 and last["kl"] < 0.6 * first["kl"]
    assert 0 < record["codes_changed"] < 0.05 * record["codes"]  # a few codes move; most stay

    before, after = load_file(quantized / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(before) == sorted(after)
    for key in before:
        assert after[key].shape == before[key].shape and after[key].dtype == before[key].dtype, key
        if not key.endswith(("weight_packed", "weight_scale")):
            assert torch.equal(after[key], before[key]), key  # norms and everything else untouched
    assert json.loads((out / "config.json").read_text()) == json.loads((quantized / "config.json").read_text())
    card = (out / "README.md").read_text()
    assert f"quantization-aware distillation against `{teacher}` (80 steps, {record['codes_changed']:,} codes moved" in card

    # the saved checkpoint scores what training reported last (scales rounded as stored: within 1%)
    from llmopt.checkpoints.models import load_model
    from llmopt.distillation.data import pack_text, spread
    from llmopt.distillation.losses import kd_loss

    t_model, tok = load_model(teacher)
    s_model, _ = load_model(out)
    val = spread(pack_text(tok, str(root / "val.txt"), 64), 16)
    with torch.no_grad():
        kl = sum(float(kd_loss(s_model(input_ids=val[i:i + 4]).logits, t_model(input_ids=val[i:i + 4]).logits, "fkl"))
                 for i in range(0, 16, 4)) / 4
    assert kl == pytest.approx(last["kl"], rel=1e-2)

    report = export_gguf(out, tmp_path / "qad.gguf", "auto")
    carried = [t for t in report.tensors if t.how == "carried codes"]
    assert len(carried) == len(read_compressed(out)[0]) and all(t.codes_identical for t in carried)


def test_block_phase_lowers_every_layers_error_then_end_to_end_goes_further(qad_setup, tmp_path):
    out = tmp_path / "blocks"
    result = _distill(qad_setup, out, "--steps", "40", "--eval-every", "40", "--block-steps", "30", "--block-windows", "16")
    assert result.exit_code == 0, result.output
    record = json.loads((out / "llmopt.json").read_text())["quantization_aware_distillation"]
    layers = record["block_phase"]["layers"]
    assert [entry["layer"] for entry in layers] == [0, 1, 2] and record["block_phase"]["windows"] == 16
    assert all(entry["mse_after"] < entry["mse_before"] for entry in layers)
    assert layers[0]["mse_after"] < 0.9 * layers[0]["mse_before"]
    # the validation at step 0 already sees the block-trained codes: below the untrained checkpoint's KL
    untrained = _distill(qad_setup, tmp_path / "none", "--steps", "1", "--eval-every", "1", "--code-lr", "1e-9", "--lr", "1e-9")
    assert untrained.exit_code == 0, untrained.output
    start = json.loads((tmp_path / "none" / "llmopt.json").read_text())["quantization_aware_distillation"]["validation_curve"][0]
    first, last = record["validation_curve"][0], record["validation_curve"][-1]
    assert first["kl"] < 0.9 * start["kl"] and last["kl"] < first["kl"]


def test_codes_start_near_the_teacher_where_it_maps_onto_them(qad_setup, tmp_path):
    """The RTN student is the teacher's own weights rounded: every quantized weight starts near the
    teacher (its fit is exact), and the run trains and saves as usual; with a zero step the saved
    codes are the stored ones."""
    root, teacher, quantized = qad_setup
    result = _distill(qad_setup, tmp_path / "near", "--steps", "2", "--code-start", "teacher", "--code-lr", "1e-9", "--lr", "1e-9")
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "near" / "llmopt.json").read_text())["quantization_aware_distillation"]
    student = record["student"]
    assert student["code_start"] == "teacher"
    assert student["weights_started_near_teacher"] == student["quantized_weights"] and student["latents_moved"] > 0
    before, after = read_compressed(quantized)[0], read_compressed(tmp_path / "near")[0]
    assert sorted(before) == sorted(after) and all(torch.equal(before[k].codes, after[k].codes) for k in before)


def test_ctrl_c_and_resume_give_the_uninterrupted_codes_block_phase_included(qad_setup, tmp_path):
    from llmopt.distillation.run import run_distill
    from llmopt.pipeline.stages.distill import DistillConfig

    root, teacher, quantized = qad_setup

    def config(out: Path, **extra) -> DistillConfig:
        return DistillConfig(teacher=str(teacher), student=str(quantized), quantized=True, output=str(out), steps=8,
                             data=str(root / "train.txt"), validation="none", seq_len=64, lr=2e-3, code_lr=5e-2,
                             block_steps=5, block_windows=8, precision="no", **extra)

    full = run_distill(config(tmp_path / "full").request(show_progress=False))

    def ctrl_c(step, terms):
        if step == 5:
            os.kill(os.getpid(), signal.SIGINT)

    split = config(tmp_path / "split", save_every=3)
    stopped = run_distill(split.request(show_progress=False), on_step=ctrl_c)
    assert stopped.interrupted and stopped.result.steps_done == 5 and not (tmp_path / "split").exists()
    split.resume = True
    resumed = run_distill(split.request(show_progress=False))
    assert resumed.record["block_phase"] == {"skipped": "resumed from a checkpoint of the end-to-end phase"}
    assert len(full.record["block_phase"]["layers"]) == 3
    a, b = load_file(full.output / "model.safetensors"), load_file(resumed.output / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("args, message", [
    (["--code-lr", "1e-2"], "--code-lr applies only with --quantized"),
    (["--block-steps", "5"], "--block-steps applies only with --quantized"),
    (["--code-start", "teacher"], "--code-start applies only with --quantized"),
    (["--quantized", "--student-from", "T", "--drop-layers", "1"], "--quantized trains a quantized checkpoint's codes"),
])
def test_options_that_do_not_apply_are_refused(qad_setup, tmp_path, args, message):
    root, teacher, _ = qad_setup
    base = ["distill", "--teacher", str(teacher), "--steps", "2", "-o", str(tmp_path / "x")]
    if "--student-from" not in args:
        base += ["--student", str(teacher)]
    args = [str(teacher) if a == "T" else a for a in args]
    result = CliRunner().invoke(main, base + args)
    assert result.exit_code != 0 and message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "x").exists()


def test_a_float_or_activation_quantized_student_is_refused(qad_setup, tmp_path):
    root, teacher, _ = qad_setup
    w8a8 = tmp_path / "w8a8"
    run_quantize(QuantizeConfig(model=str(teacher), output=str(w8a8), scheme="W8A8", method="rtn"))
    for student, message in ((teacher, "not a compressed-tensors checkpoint"), (w8a8, "trains weight-only schemes")):
        result = CliRunner().invoke(main, ["distill", "--teacher", str(teacher), "--student", str(student), "--quantized",
                                           "--data", str(root / "train.txt"), "--steps", "2", "-o", str(tmp_path / "x")])
        assert result.exit_code != 0 and message in result.output, result.output
        assert "Traceback" not in result.output and not (tmp_path / "x").exists()


def test_python_api_distils_a_quantized_checkpoint_by_path_and_refuses_a_model_object(qad_setup, tmp_path):
    import llmopt
    from llmopt.checkpoints.models import load_model

    root, teacher, quantized = qad_setup
    record = llmopt.distill(str(teacher), student=str(quantized), quantized=True, code_lr=2e-2, lr=5e-3, steps=4, seq_len=64,
                            dataset=str(root / "train.txt"), validation="none", precision="no", output=tmp_path / "api")
    assert record["steps"] == 4 and record["student"]["kind"] == "quantized"
    assert sorted(read_compressed(tmp_path / "api")[0]) == sorted(read_compressed(quantized)[0])
    model, tok = load_model(teacher)
    with pytest.raises(LlmoptError, match="trains a quantized checkpoint's codes, read from disk"):
        llmopt.distill(model, tok, teacher=str(teacher), steps=2, quantized=True, dataset=["some text " * 40])


def test_a_rotated_quantized_checkpoint_distils_against_the_unrotated_teacher(qad_setup, tmp_path):
    root, teacher, _ = qad_setup
    rotated = tmp_path / "rotated"
    run_quantize(QuantizeConfig(model=str(teacher), output=str(rotated), scheme="W4A16", group_size=32, method="rtn", rotate="hadamard"))
    out = tmp_path / "qad"
    result = _distill((root, teacher, rotated), out, "--steps", "30", "--eval-every", "30", "--block-steps", "10", "--block-windows", "8")
    assert result.exit_code == 0, result.output
    curve = json.loads((out / "llmopt.json").read_text())["quantization_aware_distillation"]["validation_curve"]
    assert curve[-1]["kl"] < 0.8 * curve[0]["kl"]
    assert json.loads((out / "llmopt.json").read_text())["rotation"] == json.loads((rotated / "llmopt.json").read_text())["rotation"]
