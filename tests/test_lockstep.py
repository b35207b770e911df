"""Lockstep batches (greenlets taking turns and meeting at hooks) and the one-pass GPTQ built on
them, checked against a plain true-sequential reference made of the engine's own pieces."""

from __future__ import annotations

import copy

import pytest
import torch
from llmopt.calibration import linear_modules, run_sequential
from llmopt.linear_stats import LinearStats
from llmopt.formats.schemes import get_scheme
from llmopt.core.lockstep import Lockstep
from llmopt.quant.apply import quantize_model
from llmopt.quant.gptq import gptq_quantize_weight, split_rows
from llmopt.quant.request import make_request
from test_quant_algorithms import calib_ids, logits, tiny_model


def test_turns_follow_call_order_between_meeting_points() -> None:
    log: list[tuple[str, int]] = []
    lockstep = Lockstep()

    def call(i: int):
        def run() -> int:
            log.append(("a", i))
            lockstep.meet("p", lambda: log.append(("solve-p", i)))
            log.append(("b", i))
            lockstep.meet("q", lambda: log.append(("solve-q", i)))
            return 10 * i
        return run

    assert lockstep.run([call(i) for i in range(4)]) == [0, 10, 20, 30]
    assert len(log) == 10
    assert log == [("a", 0), ("a", 1), ("a", 2), ("a", 3), ("solve-p", 3),
                   ("b", 0), ("b", 1), ("b", 2), ("b", 3), ("solve-q", 3)]
    with pytest.raises(RuntimeError, match="outside"):
        lockstep.meet("p", lambda: None)


def test_a_failure_reaches_the_caller_and_stops_the_others() -> None:
    lockstep = Lockstep()
    reached: list[int] = []

    def call(i: int):
        def run() -> None:
            lockstep.meet("p", lambda: (_ for _ in ()).throw(ValueError("solve failed")))
            reached.append(i)
        return run

    with pytest.raises(ValueError, match="solve failed"):
        lockstep.run([call(i) for i in range(3)])
    assert reached == []


def test_calls_that_take_different_paths_are_refused() -> None:
    lockstep = Lockstep()
    calls = [lambda: lockstep.meet("p", lambda: None), lambda: None]
    with pytest.raises(RuntimeError, match="different paths"):
        lockstep.run(calls)


def _true_sequential_gptq(model, ids, scheme_name: str, group_size: int,
                          compute_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Reference: for each group of Linears sharing an input, in execution order, a full pass
    over the calibration batches observes it (the groups before it already quantized; float32
    ``xᵀx`` products, whatever the forwards' dtype) and GPTQ quantizes it; the engine then
    re-runs the quantized layer."""
    scheme = get_scheme(scheme_name)
    codes: dict[str, torch.Tensor] = {}

    def layer_fn(index, layer, run_layer) -> None:
        mods = linear_modules(layer, f"model.layers.{index}.")
        with LinearStats(mods, hessian=False, channel=False, stop_early=False) as probe:
            run_layer()
        for group in probe.shared_groups():
            with LinearStats({n: mods[n] for n in group}, channel=False) as stats:
                run_layer()
            weight = torch.cat([mods[n].weight.detach() for n in group])
            qw = gptq_quantize_weight(weight, stats.hessian(group[0]), scheme, group_size, act_order=True, clip=True, refit=True)
            for name, part in zip(group, split_rows(qw, [mods[n].weight.shape[0] for n in group])):
                mods[name].weight.data.copy_(part.dequantize(torch.float32))
                codes[name] = part.codes

    run_sequential(model, ids, layer_fn, batch_size=2, compute_dtype=compute_dtype, show_progress=False)
    return codes


@pytest.mark.parametrize("family,compute_dtype", [("llama", None), ("qwen3", None), ("llama", torch.bfloat16)])
def test_one_pass_gptq_equals_true_sequential_reference(family: str, compute_dtype: torch.dtype | None) -> None:
    """Also under bfloat16 forwards: the Hessians still take float32 products of the inputs
    (bfloat16 products lose the small directions of ill-conditioned Hessians)."""
    base = tiny_model(2, family)
    ids = calib_ids(6, 16)  # three batches of two
    model = copy.deepcopy(base)
    request = make_request("W4A16", "gptq", group_size=16, batch_size=2, compute_dtype=compute_dtype)
    result = quantize_model(model, request, ids, progress=False)
    reference_model = copy.deepcopy(base)
    reference = _true_sequential_gptq(reference_model, ids, "W4A16", 16, compute_dtype)
    assert len(result.weights) == len(reference) == 14
    for name, codes in reference.items():
        assert torch.equal(result.weights[name].codes, codes), name
    assert torch.equal(logits(model, ids), logits(reference_model, ids))


def test_a_failure_leaves_no_thread_state_behind() -> None:
    """Calls parked when another fails are unwound inside the caller's contexts, not later by
    the garbage collector (their autocast blocks would then switch autocast back on)."""
    import gc

    lockstep = Lockstep()

    def call() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lockstep.meet("p", lambda: (_ for _ in ()).throw(ValueError("solve failed")))

    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError) as caught:  # its traceback holds the run's frames
            lockstep.run([call, call])
    del caught
    gc.collect()
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("native", [True, False])
def test_calibration_forwards_use_bfloat16_only_where_native(monkeypatch, native: bool) -> None:
    """``compute_dtype="auto"``: bfloat16 autocast where the CPU computes it natively (AVX512-BF16,
    AMX), else the model's dtype (emulated bfloat16 matmuls are slower than float32); a streamed
    skeleton (meta parameters) is calibrated on the CPU, so it follows the CPU."""
    from accelerate import init_empty_weights
    from llmopt.quant.apply import auto_compute_dtype
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr("llmopt.core.hardware.cpu_has_bf16", lambda: native)
    want = torch.bfloat16 if native else None
    model = tiny_model(1, "llama")
    assert auto_compute_dtype(model, None) is want
    assert auto_compute_dtype(model, "cpu") is want
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(model.config)
    assert next(skeleton.parameters()).device.type == "meta"
    assert auto_compute_dtype(skeleton, None) is want
