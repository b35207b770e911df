"""End-to-end scale tuning: codes kept, scales and norms moved to lower the KLD to the float model."""

from __future__ import annotations

import json

import pytest
import torch

from llmopt.core.errors import LlmoptError
from llmopt.formats.compressed import load_dequantized, read_compressed
from llmopt.formats.gguf_export import export_gguf
from llmopt.formats.schemes import IQ4_NL_GRID, QuantizedWeight, QuantScheme, superblock_factors, superblock_scales
from llmopt.pipeline.stages.quantize import QuantizeConfig, run_quantize
from llmopt.quant.scale_tuning import TunableScales, TuneSettings, kl_divergence, tune_scales
from tests.conftest import randomize, save_model, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

CALIB = dict(calib_samples=12, calib_seq_len=48)


def _quantize(src, out, **options) -> dict:
    settings = dict(model=str(src), output=str(out), scheme="W4A16", group_size=32, head="int4", embedding="int4", **CALIB)
    settings.update(options)
    return run_quantize(QuantizeConfig(**settings))


def _calibration_kld(float_model, path, ids) -> float:
    model = load_dequantized(path, torch.float32)
    with torch.no_grad():
        return float(sum(kl_divergence(float_model(x[None]).logits, model(x[None]).logits) for x in ids) / len(ids))


@pytest.fixture(scope="module")
def tuned_pair(tmp_path_factory):
    """A tiny model (tied head, norms off 1) quantized to int4 g32 by RTN, without and with tuning."""
    root = tmp_path_factory.mktemp("tuning")
    model = randomize(tiny_llama(seed=3))
    src = save_model(model, root / "float")
    plain = root / "plain"
    run_quantize(QuantizeConfig(model=str(src), output=str(plain), scheme="W4A16", group_size=32, head="int4", embedding="int4"))
    tuned = root / "tuned"
    record = _quantize(src, tuned, method="rtn", tune_steps=24, tune_lr=5e-3)
    return model, src, plain, tuned, record


def test_codes_kept_scales_moved_and_float16(tuned_pair):
    _, _, plain, tuned, _ = tuned_pair
    before, _ = read_compressed(plain)
    after, _ = read_compressed(tuned)
    assert sorted(before) == sorted(after) and len(after) == 15  # 14 Linears and the tied embedding
    moved = 0
    for name, qw in after.items():
        assert qw.codes.shape == before[name].codes.shape and torch.equal(qw.codes, before[name].codes)
        assert qw.scale.shape == before[name].scale.shape
        assert torch.equal(qw.scale.to(torch.float16).float(), qw.scale)  # as the GGUF blocks store them
        ratio = qw.scale / before[name].scale
        assert (ratio > 0).all()  # a multiplier never flips a scale's sign
        moved += int((ratio - 1).abs().gt(1e-3).sum())
    assert moved > 0.5 * sum(qw.scale.numel() for qw in after.values())


def test_tuning_lowers_the_kld_on_the_calibration_windows(tuned_pair):
    from llmopt.core.data import calibration_ids
    from transformers import AutoTokenizer

    model, src, plain, tuned, record = tuned_pair
    report = record["scale_tuning"]
    assert report["steps"] == 24 and report["kld_after"] < 0.9 * report["kld_before"]
    ids, _ = calibration_ids(AutoTokenizer.from_pretrained(src), "austen", 12, 48, 0)
    plain_kld, tuned_kld = _calibration_kld(model, plain, ids), _calibration_kld(model, tuned, ids)
    assert tuned_kld < 0.9 * plain_kld
    assert json.loads((tuned / "llmopt.json").read_text())["scale_tuning"]["steps"] == 24
    norms_before = load_dequantized(plain).model.norm.weight
    norms_after = load_dequantized(tuned).model.norm.weight
    assert torch.equal(norms_after, norms_before)  # quantize tunes the scales alone
    assert not list(tuned.parent.glob(".tuned*"))  # the untuned intermediate is gone


def test_tuned_checkpoint_exports_exact_gguf(tuned_pair, tmp_path):
    _, _, _, tuned, _ = tuned_pair
    report = export_gguf(tuned, tmp_path / "tuned.gguf", "auto")
    quantized = [t for t in report.tensors if t.how == "carried codes"]
    assert len(quantized) == 15 and all(t.codes_identical for t in quantized)


def test_superblock_scales_keep_their_integer_multiples():
    free = torch.rand(6, 512 // 32) * 0.02 + 0.01
    scale = superblock_scales(free, 32, 64)
    codes = torch.tensor(IQ4_NL_GRID, dtype=torch.int8)[torch.randint(0, 16, (6, 512))]
    d, k = superblock_factors(scale, 32, 64)
    read_back = QuantScheme("W8A16", 8, group_size=32)  # a checkpoint read back names no super-blocks
    t = TunableScales(QuantizedWeight(codes, scale, None, read_back, 32))
    assert t.log_multiplier.shape == (6, 2)  # one per super-block of 256
    with torch.no_grad():
        t.log_multiplier.normal_(0, 0.05)
    out = t.tuned()
    d_new, k_new = superblock_factors(out.scale, 32, 64)
    assert torch.equal(k_new, k) and not torch.equal(d_new, d)
    assert torch.allclose(d_new, d * t.log_multiplier.detach().exp(), rtol=1e-3)
    assert torch.allclose(out.dequantize(), t.weight().detach(), rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("options, message", [
    (dict(scheme="W8A8", group_size=None, head="float", embedding="float", tune_steps=4), "weight-only"),
    (dict(tune_lr=1e-2), "--tune-lr applies only with --tune-steps"),
    (dict(tune_steps=4, tune_lr=0.0), "must be positive"),
    (dict(tune_per="row"), "--tune-per applies only with --tune-steps"),
])
def test_bad_tuning_options_are_refused(tiny_model_dir, tmp_path, options, message):
    with pytest.raises(LlmoptError, match=message):
        _quantize(tiny_model_dir, tmp_path / "out", method="rtn", **options)
    assert not (tmp_path / "out").exists()


def test_row_multipliers_scale_every_group_of_a_row_alike():
    scheme = QuantScheme("int4", 4, group_size=32)
    w = torch.randn(5, 128)
    scale = w.reshape(5, 4, 32).abs().amax(-1) / 7
    qw = QuantizedWeight.from_weight(w, scheme, 32, scale, None)
    t = TunableScales(qw, per="row")
    assert t.log_multiplier.shape == (5, 1)
    with torch.no_grad():
        t.log_multiplier.copy_(torch.linspace(-0.05, 0.05, 5)[:, None])
    out = t.tuned()
    assert out.scale.shape == (5, 4) and torch.equal(out.codes, qw.codes)
    ratio = out.scale / qw.scale
    assert torch.equal(out.scale.bfloat16().float(), out.scale)  # rounded as stored: 16-bit scales
    bf16 = 2**-7  # two bfloat16 roundings apart at most
    assert torch.allclose(ratio, torch.linspace(-0.05, 0.05, 5).exp()[:, None].expand(5, 4), rtol=bf16)
    assert torch.allclose(out.dequantize(), t.weight().detach(), rtol=bf16, atol=1e-6)


def test_norms_tune_with_the_scales_when_asked(tuned_pair):
    from llmopt.core.data import calibration_ids
    from transformers import AutoTokenizer

    model, src, plain, _, _ = tuned_pair
    weights, _ = read_compressed(plain)
    student = load_dequantized(plain, torch.float32)
    ids, _ = calibration_ids(AutoTokenizer.from_pretrained(src), "austen", 12, 48, 0)
    tuned, norms, report = tune_scales(student, model, weights, ids, TuneSettings(24, 5e-3, norms=True, per="group"))
    assert sorted(tuned) == sorted(weights) and len(norms) == 5  # 2 per layer and the final norm
    moved = [k for k, v in norms.items() if not torch.equal(v, model.get_parameter(k))]
    assert len(moved) == 5 and report.norm_weights_tuned == 5 * 64
    assert report.kld_after < 0.9 * report.kld_before


def test_tune_per_row_moves_a_rows_scales_together(tuned_pair, tmp_path):
    """--tune-per row: one multiplier per output row; the default moves each scale on its own."""
    _, src, plain, tuned, _ = tuned_pair
    _quantize(src, tmp_path / "row", method="rtn", tune_steps=8, tune_lr=5e-3, tune_per="row")
    before, _ = read_compressed(plain)
    by_row, _ = read_compressed(tmp_path / "row")
    by_group, _ = read_compressed(tuned)
    assert sorted(by_row) == sorted(before) == sorted(by_group)
    spread_row = spread_group = 0.0
    for name, qw in before.items():
        assert torch.equal(by_row[name].codes, qw.codes)
        row_ratio = by_row[name].scale / qw.scale
        group_ratio = by_group[name].scale / qw.scale
        assert torch.allclose(row_ratio, row_ratio[:, :1].expand_as(row_ratio), rtol=2**-7)  # bfloat16 rounding only
        spread_row = max(spread_row, float((row_ratio / row_ratio[:, :1]).log().abs().max()))
        spread_group = max(spread_group, float((group_ratio / group_ratio[:, :1]).log().abs().max()))
    assert spread_row < 2**-7 and spread_group > 2e-2


def test_tuning_that_never_beats_the_untuned_scales_is_not_kept(tuned_pair):
    """A step size that wrecks the model: no checked state beats the start, so the scales and
    norms come back untouched and the report says so; a sane one keeps its best checked step."""
    from llmopt.core.data import calibration_ids
    from transformers import AutoTokenizer

    from llmopt.quant.scale_tuning import CHECK_EVERY

    model, src, plain, _, _ = tuned_pair
    weights, _ = read_compressed(plain)
    ids, _ = calibration_ids(AutoTokenizer.from_pretrained(src), "austen", 12, 48, 0)
    student = load_dequantized(plain, torch.float32)
    tuned, norms, report = tune_scales(student, model, weights, ids, TuneSettings(CHECK_EVERY, 3.0, norms=True))
    assert not report.kept and report.best_step == 0
    assert report.kld_after == report.kld_before
    assert sorted(tuned) == sorted(weights)
    for name, qw in weights.items():
        assert torch.equal(tuned[name].scale, qw.scale) and torch.equal(tuned[name].codes, qw.codes)
    assert len(norms) == 5 and all(torch.equal(v, model.get_parameter(k)) for k, v in norms.items())
    student = load_dequantized(plain, torch.float32)
    _, _, sane = tune_scales(student, model, weights, ids, TuneSettings(2 * CHECK_EVERY, 5e-3))
    assert sane.kept and sane.best_step in (CHECK_EVERY, 2 * CHECK_EVERY)
    assert sane.kld_after < sane.kld_before


def test_default_step_shrinks_with_the_starting_kld(tuned_pair, tmp_path):
    """Without --tune-lr, Adam's step is 1e-3 from a calibration KLD of 0.01 and proportionally
    smaller below it (a tenth at most); the record says which step ran."""
    from llmopt.quant.scale_tuning import DEFAULT_LR, default_lr

    assert default_lr(0.05) == DEFAULT_LR == default_lr(0.01)
    assert default_lr(0.005) == pytest.approx(DEFAULT_LR / 2) and default_lr(1e-5) == pytest.approx(DEFAULT_LR / 10)
    _, src, _, _, _ = tuned_pair
    record = _quantize(src, tmp_path / "q", method="rtn", tune_steps=2)["scale_tuning"]
    assert record["settings"]["lr"] == pytest.approx(default_lr(record["kld_before"]))
