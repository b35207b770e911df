"""--scheme AUTO: measured sensitivities against true KLD, allocation under budgets, mixed
checkpoints loaded by our loader and the runtime, plan reuse, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import save_model, tiny_llama
from llmopt.cli.main import main
from llmopt.core.errors import LlmoptError
from llmopt.formats.compressed import load_dequantized, read_compressed
from llmopt.pipeline.stages.quantize import QuantizeConfig, run_quantize
from llmopt.quant.allocate import allocate, totals
from llmopt.quant.sensitivity import Sensitivity, TensorCost, format_scheme, measure_sensitivity
from llmopt.formats.schemes import compute_qparams, fake_quantize
from llmopt.runtime import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def _synthetic() -> Sensitivity:
    gen = torch.Generator().manual_seed(0)
    tensors = []
    for i in range(12):
        s = float(torch.rand(1, generator=gen)) * 10 ** int(torch.randint(-3, 0, (1,), generator=gen))
        tensors.append(TensorCost(f"t{i}", "linear", (64, 128), {"a": 4 * s, "b": 2 * s, "c": 0.1 * s, "float": 0.0},
                                  {"a": 4.125, "b": 4.5, "c": 8.125, "float": 32.0}))
    return Sensitivity(tensors, other_bits=0, tokens=1)


def test_allocation_meets_budgets_and_more_bits_cost_less():
    sens = _synthetic()
    previous = None
    for budget in (4.2, 4.5, 5.0, 6.0, 8.0):
        plan = allocate(sens, target_bpw=budget)
        bpw, cost = totals(sens, plan.formats)
        assert len(plan.formats) == 12
        assert bpw <= budget + 1e-9 and bpw == pytest.approx(plan.bpw)
        assert cost == pytest.approx(plan.predicted_kld)
        if previous is not None:
            assert cost <= previous
        previous = cost
    plan = allocate(sens, target_kld=previous * 3)
    assert plan.predicted_kld <= previous * 3
    with pytest.raises(ValueError, match="below the smallest plan"):
        allocate(sens, target_bpw=4.0)


def test_allocation_is_optimal_on_a_small_case():
    """The greedy plan costs no more than the best of all assignments within the budget."""
    import itertools

    sens = _synthetic()
    sens.tensors = sens.tensors[:5]
    for t in sens.tensors:
        del t.costs["float"], t.bits["float"]
    budget = 5.2
    plan = allocate(sens, target_bpw=budget)
    best = min(totals(sens, dict(zip([t.name for t in sens.tensors], combo)))[1]
               for combo in itertools.product("abc", repeat=5)
               if totals(sens, dict(zip([t.name for t in sens.tensors], combo)))[0] <= budget)
    # greedy on convex hulls is optimal up to one partly-filled upgrade: within the next step's gain
    assert plan.predicted_kld <= best * 1.5 + 1e-12


def _kld(model, ids, ref_logp) -> float:
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), -1)
    return float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())


def test_predicted_costs_track_true_kld():
    """Each tensor's predicted int4 cost against the true KLD of quantizing that tensor alone."""
    model = tiny_llama(seed=7, tie_word_embeddings=False)
    ids = torch.randint(3, 259, (8, 64), generator=torch.Generator().manual_seed(1))
    sens = measure_sensitivity(model, ids)
    assert sens.tokens == 8 * 64
    names = [t.name for t in sens.tensors]
    assert "lm_head" in names and "model.embed_tokens" in names and len(names) == 2 * 7 + 2
    with torch.no_grad():
        ref_logp = torch.log_softmax(model(ids).logits.float(), -1)
    predicted, true = [], []
    for t in sens.tensors:
        module = model.get_submodule(t.name)
        fmt = "int4_g32" if t.kind == "linear" else "int4"
        scheme = format_scheme(fmt, t.shape[1])
        w = module.weight.data.clone()
        scale, zp = compute_qparams(w, scheme, scheme.group_size)
        module.weight.data = fake_quantize(w, scale, zp, scheme, scheme.group_size)
        true.append(_kld(model, ids, ref_logp))
        module.weight.data = w
        predicted.append(t.costs[fmt])
    p, q = torch.tensor(predicted), torch.tensor(true)
    assert (p > 0).all() and (q > 0).all()
    ratio = float(p.sum() / q.sum())
    assert 0.5 < ratio < 2.0, ratio
    # ranks agree: Spearman correlation over the tensors
    rp, rq = p.argsort().argsort().float(), q.argsort().argsort().float()
    rho = float(torch.corrcoef(torch.stack([rp, rq]))[0, 1])
    assert rho > 0.6, rho
    head = names.index("lm_head")  # the head is measured exactly
    assert predicted[head] == pytest.approx(true[head], rel=1e-3)


@pytest.fixture
def calib_text(tmp_path):
    path = tmp_path / "calib.txt"
    gen = torch.Generator().manual_seed(2)
    path.write_text(" ".join(f"w{int(i)}" for i in torch.randint(0, 200, (12000,), generator=gen)))
    return path


def test_auto_checkpoint_loads_and_plan_is_reused(tmp_path, calib_text):
    src = save_model(tiny_llama(seed=8), tmp_path / "src")
    config = QuantizeConfig(model=str(src), output=str(tmp_path / "a"), scheme="AUTO", target_bpw=5.5,
                            calib=str(calib_text), calib_samples=4, calib_seq_len=64)
    record = run_quantize(config)
    plan = record["plan"]
    assert plan["bpw"] <= 5.5 and len(plan["formats"]) == 2 * 7 + 1  # tied: one embedding/head entry
    stored = json.loads((tmp_path / "a" / "llmopt.json").read_text())
    assert stored["plan"]["formats"] == plan["formats"]
    weights, qconfig = read_compressed(tmp_path / "a")
    chosen = {f for n, f in plan["formats"].items() if f != "float"}
    assert len(qconfig["config_groups"]) >= min(2, len(chosen))
    for name, fmt in plan["formats"].items():
        if fmt == "float":
            assert name not in weights
        elif name != "model.embed_tokens":
            scheme = format_scheme(fmt, weights[name].codes.shape[1])
            assert (weights[name].scheme.num_bits, weights[name].group_size) == (scheme.num_bits, scheme.group_size)
    model = load_dequantized(tmp_path / "a")
    prompt = [1, 5, 9, 30, 44, 2, 7]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0,
                              eos_token_id=None).tolist()[0][len(prompt):]
    got = LLM(tmp_path / "a").generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0].token_ids
    assert len(got) == 6 and got == want
    again = run_quantize(QuantizeConfig(model=str(src), output=str(tmp_path / "b"), scheme="AUTO",
                                        plan=str(tmp_path / "a" / "llmopt.json")))
    assert again["plan"]["formats"] == plan["formats"]
    w2, _ = read_compressed(tmp_path / "b")
    assert sorted(w2) == sorted(weights)
    for name in weights:
        assert torch.equal(w2[name].codes, weights[name].codes), name


@pytest.mark.parametrize("args,message", [
    (["--scheme", "AUTO"], "exactly one of"),
    (["--scheme", "AUTO", "--target-bpw", "5", "--target-kld", "0.1"], "exactly one of"),
    (["--scheme", "W4A16", "--target-bpw", "5"], "only apply to --scheme AUTO"),
    (["--scheme", "AUTO", "--target-bpw", "5", "--method", "awq"], "rtn or gptq"),
    (["--scheme", "AUTO", "--target-bpw", "5", "--head", "int8"], "chooses the head"),
    (["--scheme", "AUTO", "--plan", "missing.json"], "does not exist"),
])
def test_bad_auto_options(tmp_path, args, message):
    src = save_model(tiny_llama(seed=9), tmp_path / "src")
    result = CliRunner().invoke(main, ["quantize", str(src), "-o", str(tmp_path / "out"), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "out").exists()
