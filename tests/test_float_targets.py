"""GPTQ with float targets (asymmetric calibration): the least-squares correction, the float
model's inputs that the engine runs alongside (plain and lockstep passes), and the end result."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import correlated_inputs
from test_quant_algorithms import calib_ids, logits, tiny_model

from llmopt.calibration import linear_modules, run_sequential
from llmopt.linear_stats import InputStats, LinearStats
from llmopt.core.lockstep import Lockstep
from llmopt.float_reference import FloatReference
from llmopt.formats.schemes import get_scheme
from llmopt.quant.apply import quantize_model
from llmopt.quant.gptq import float_target_weight, gptq_quantize_weight
from llmopt.quant.request import make_request

pytestmark = pytest.mark.usefixtures("one_thread")


def test_float_target_weight_is_the_least_squares_fit() -> None:
    torch.manual_seed(0)
    x = correlated_inputs(600, 24).double()
    x_q = x + 0.2 * torch.randn_like(x) * x.std(0)  # drifted inputs of the same tokens
    w = torch.randn(10, 24, dtype=torch.float64)
    h = 2 / x.shape[0] * x_q.T @ x_q
    drift = 2 / x.shape[0] * (x - x_q).T @ x_q
    fitted = float_target_weight(w.float(), h, drift, damp=0.0).double()
    assert fitted.shape == w.shape
    expected = torch.linalg.lstsq(x_q, x @ w.T).solution.T
    torch.testing.assert_close(fitted, expected, rtol=1e-4, atol=1e-4)
    assert (fitted - w).abs().max() > 0.05  # a real correction

    # any Q: its error against the float outputs = its error against fitted·x̃ + a constant
    def err(target: torch.Tensor, q: torch.Tensor) -> float:
        return float((target - x_q @ q.T).pow(2).sum())

    q1, q2 = w + 0.1 * torch.randn_like(w), w + 0.3 * torch.randn_like(w)
    float_gap = err(x @ w.T, q1) - err(x @ w.T, q2)
    fitted_gap = err(x_q @ fitted.T, q1) - err(x_q @ fitted.T, q2)
    assert float_gap == pytest.approx(fitted_gap, rel=1e-3)


def test_gptq_on_float_targets_beats_plain_gptq_on_drifted_inputs() -> None:
    torch.manual_seed(1)
    x = correlated_inputs(2000, 64)
    x_q = x + 0.15 * torch.randn_like(x) * x.std(0)
    w = torch.randn(48, 64)
    scheme = get_scheme("W4A16", 32)
    h = (2 / x.shape[0] * x_q.T @ x_q).double()
    drift = (2 / x.shape[0] * (x - x_q).T @ x_q).double()
    plain = gptq_quantize_weight(w, h.clone(), scheme, 32).dequantize()
    fitted = gptq_quantize_weight(float_target_weight(w, h, drift), h.clone(), scheme, 32).dequantize()

    def float_err(q: torch.Tensor) -> float:
        return float((x @ w.T - x_q @ q.T).pow(2).sum())

    # past what no weights on x̃ can reach (the unquantized least-squares fit's error)
    floor = float_err(torch.linalg.lstsq(x_q, x @ w.T).solution.T)
    assert float_err(fitted) - floor < 0.8 * (float_err(plain) - floor)


def _float_inputs(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every Linear's inputs in ``model`` (float), by '<layer>.<name>'."""
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        for n, m in linear_modules(layer).items():
            hooks.append(m.register_forward_pre_hook(lambda _m, a, k=f"{i}.{n}": seen.setdefault(k, []).append(a[0])))
    with torch.no_grad():
        for b in range(0, ids.shape[0], 2):
            model(ids[b:b + 2])
    for h in hooks:
        h.remove()
    return {k: torch.cat(v).reshape(-1, v[0].shape[-1]).double() for k, v in seen.items()}


@pytest.mark.parametrize("lockstep", [False, True])
def test_engine_drift_terms_pair_float_and_compressed_inputs(lockstep: bool) -> None:
    torch.manual_seed(2)
    model = tiny_model(2)
    ids = calib_ids(6, 12)
    float_x = _float_inputs(copy.deepcopy(model), ids)
    reference = FloatReference()
    seen: dict[str, list[torch.Tensor]] = {}
    drifts: dict[str, torch.Tensor] = {}

    def layer_fn(index: int, layer: torch.nn.Module, run) -> None:
        mods = linear_modules(layer)

        def perturb() -> None:  # "compress": perturb the weights, so later inputs drift
            with torch.no_grad():
                for m in mods.values():
                    m.weight.mul_(1 + 0.3 * torch.randn_like(m.weight))

        grab = [m.register_forward_pre_hook(lambda _m, a, k=f"{index}.{n}": seen.setdefault(k, []).append(a[0]))
                for n, m in mods.items()]
        with LinearStats(mods, stop_early=False, reference=reference) as stats:
            if lockstep:  # every batch waits before down_proj (their float inputs must stay their own),
                step = Lockstep()  # then runs on with the perturbed weights: its outputs feed layer 1
                meet = mods["mlp.down_proj"].register_forward_pre_hook(lambda _m, _a: step.meet("down", perturb))
                run(keep_outputs=True, lockstep=step)
                meet.remove()
            else:
                run()
                perturb()
        for g in grab:
            g.remove()
        for n in mods:
            drifts[f"{index}.{n}"] = stats.drift(n)

    run_sequential(model, ids, layer_fn, batch_size=2, show_progress=False, reference=reference)
    assert sorted(drifts) == sorted(float_x)
    for key, drift in drifts.items():
        x_q = torch.cat(seen[key]).reshape(-1, float_x[key].shape[1]).double()
        assert x_q.shape == float_x[key].shape
        torch.testing.assert_close(drift, 2 / x_q.shape[0] * (float_x[key] - x_q).T @ x_q, rtol=1e-4, atol=1e-5)
    assert torch.equal(float_x["0.self_attn.q_proj"], torch.cat(seen["0.self_attn.q_proj"]).reshape(-1, 64).double())
    drift = (float_x["1.mlp.down_proj"] - torch.cat(seen["1.mlp.down_proj"]).reshape(-1, 128).double()).abs().max()
    assert drift > 1e-2  # layer 1's inputs come from the perturbed layer 0


def test_drift_term_lost_when_tokens_do_not_pair() -> None:
    x = torch.randn(5, 8)
    s = InputStats()
    s.add_drift(x, x)
    assert s.drift is not None and s.drift.shape == (8, 8) and not s.drift.any()
    s.add_drift(torch.randn(3, 8), x)  # routed tokens: no pairing
    assert s.drift is None and s.drift_lost
    s.add_drift(torch.randn(5, 8), x)
    assert s.drift is None


@pytest.mark.parametrize("method", ["gptq", "awq+gptq"])
def test_float_targets_reduce_the_error_against_the_float_model(method: str) -> None:
    torch.manual_seed(3)
    base = tiny_model(4)
    ids, test_ids = calib_ids(64, 32), calib_ids(16, 32)
    ref = torch.log_softmax(logits(base, test_ids), -1)
    kld, codes = {}, {}
    for on in (False, True):
        model = copy.deepcopy(base)
        res = quantize_model(model, make_request("W4A16", method, group_size=32, float_targets=on), ids, progress=False)
        assert len(res.weights) == 4 * 7
        out = torch.log_softmax(logits(model, test_ids), -1)
        kld[on] = float((ref.exp() * (ref - out)).sum(-1).mean())
        codes[on] = torch.cat([q.codes.flatten() for q in res.weights.values()])
    assert not torch.equal(codes[False], codes[True])
    assert kld[True] < 0.8 * kld[False]


def test_float_targets_only_with_gptq() -> None:
    with pytest.raises(ValueError, match="--float-targets does not apply to method awq: it is an option of gptq"):
        quantize_model(tiny_model(1), make_request("W4A16", "awq", group_size=32, float_targets=True), calib_ids(),
                       progress=False)


@pytest.mark.parametrize("float_targets", [False, True])
def test_gptq_after_awq_sees_the_quantized_linears_before_it(monkeypatch, float_targets: bool) -> None:
    """After AWQ's scales, GPTQ runs in true sequential order: the Hessian each Linear is solved
    on comes from the inputs that the finished quantized model gives it (o_proj after the
    quantized q/k/v, down_proj after the quantized gate/up). Solving every Linear of a layer on
    one pass through its float weights instead made float targets correct the same drift twice
    per layer, which compounded over the layers of a real model."""
    from llmopt.quant.gptq import Gptq

    torch.manual_seed(5)
    model = tiny_model(3)
    ids = calib_ids(8, 24)
    seen: dict[str, torch.Tensor] = {}
    solve = Gptq.quantize

    def recording(self, mods, schemes, group_sizes, stats):
        for name in mods:
            seen[name] = stats.hessian(name)
        return solve(self, mods, schemes, group_sizes, stats)

    monkeypatch.setattr(Gptq, "quantize", recording)
    request = make_request("W4A16", "awq+gptq", group_size=32, float_targets=float_targets,
                           compute_dtype=None)  # float32 forwards: the same products as the check below
    res = quantize_model(model, request, ids, progress=False)
    assert len(res.weights) == 3 * 7 and sorted(seen) == sorted(res.weights)
    inputs: dict[str, list[torch.Tensor]] = {}
    hooks = [m.register_forward_pre_hook(lambda _m, args, n=n: inputs.setdefault(n, []).append(args[0].reshape(-1, args[0].shape[-1])))
             for n, m in model.named_modules() if n in seen]
    logits(model, ids)
    for h in hooks:
        h.remove()
    for name, recorded in seen.items():
        x = torch.cat(inputs[name]).double()
        assert recorded.shape == (x.shape[1], x.shape[1])
        torch.testing.assert_close(recorded, 2 / x.shape[0] * x.T @ x, rtol=1e-4, atol=1e-6, msg=name)
