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
from llmopt.quant.outer import quantize_matrix
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


def test_allocation_counts_gguf_bits():
    """With ``size="gguf"`` the budget counts each format's GGUF block size: a format that is
    smaller in the checkpoint but not in the file (g128 vs g32, both Q4_0) is never worth it."""
    sens = _synthetic()
    for t in sens.tensors:
        t.gguf = {"a": 4.5, "b": 4.5, "c": 8.5, "float": 16.0}
    plan = allocate(sens, target_bpw=6.0, size="gguf")
    assert plan.size == "gguf" and plan.to_dict()["size"] == "gguf"
    gguf_bpw, cost = totals(sens, plan.formats, "gguf")
    assert gguf_bpw <= 6.0 + 1e-9 and gguf_bpw == pytest.approx(plan.bpw)
    assert "a" not in plan.formats.values()  # same file size as b, higher cost
    assert cost == pytest.approx(plan.predicted_kld)
    nominal = allocate(sens, target_bpw=6.0)
    assert totals(sens, nominal.formats, "gguf")[0] > 6.0  # the nominal plan overshoots in the file


def test_format_bits_in_checkpoint_and_gguf():
    """What each candidate costs where it is stored: nl4 / nl4x hold int8 codes in a checkpoint
    (8.5 bits; nl4x's super-block scales in float32: 9) and IQ4_NL / IQ4_XS blocks in a GGUF file
    (4.5 / 4.25 bits, IQ4_XS only on rows that 256 divides); the uniform formats as their GGUF
    block types; scales in 16 bits."""
    from llmopt.quant.sensitivity import format_bits, gguf_bits

    assert [format_bits(f, 512, 16) for f in ("int4_g32", "int4_g128", "nl4_g32", "nl4x_g32", "int8")] == \
        [4.5, 4.125, 8.5, 9.0, 8 + 16 / 512]
    assert format_bits("int4a_g32", 512, 16) == 4 + (16 + 4) / 32 and format_bits("int5_g32", 512, 16) == 5.5
    assert {f: gguf_bits(f, 512) for f in ("int4_g128", "int4a_g32", "nl4_g32", "nl4x_g32", "int5a_g32", "int6_g32")} == \
        {"int4_g128": 4.5, "int4a_g32": 5.0, "nl4_g32": 4.5, "nl4x_g32": 4.25, "int5a_g32": 6.0, "int6_g32": 8.5}
    assert gguf_bits("nl4x_g32", 576) == 4.5 and gguf_bits("nl4", 576) == 4.5 and gguf_bits("float", 576) == 16.0
    # int6x: Q6_K (6 bits + an 8-bit scale per 16 + a float16 per 256) where 256 divides the rows, else F16;
    # its k·d scales are float32 in a checkpoint (no 16-bit float holds the products exactly)
    assert format_bits("int6x_g16", 512, 16) == 8.0 and gguf_bits("int6x_g16", 512) == 6.5625
    assert gguf_bits("int6x_g16", 576) == 16.0
    # int3x: Q3_K (3 bits + a 6-bit scale per 16 + a float16 per 256) likewise
    assert format_bits("int3x_g16", 512, 16) == 5.0 and gguf_bits("int3x_g16", 512) == 3.4375
    assert gguf_bits("int3x_g16", 576) == 16.0
    assert {f: gguf_bits(f, 576) for f in ("int5a", "int4a", "int5")} == {"int5a": 6.0, "int4a": 5.0, "int5": 5.5}


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


SECONDS = {"a": 1.0, "b": 1.0, "c": 2.0, "float": 8.0}  # b: as fast as a at the kernels, more bits


def test_speed_objective_spends_decode_time_not_bits():
    """Under a KLD target the speed plan is the fastest assignment (brute force on a small case),
    takes b over a where both run at one speed, and an embedding's format costs no time."""
    import itertools

    from llmopt.quant.allocate import decode_seconds

    sens = _synthetic()
    sens.tensors = sens.tensors[:6]
    target = totals(sens, {t.name: "b" for t in sens.tensors})[1] * 0.6
    plan = allocate(sens, target_kld=target, seconds=SECONDS)
    assert len(plan.formats) == 6 and plan.objective == "speed" and plan.to_dict()["objective"] == "speed"
    assert plan.predicted_kld <= target and "a" not in plan.formats.values()
    assert plan.decode_ms == pytest.approx(1e3 * decode_seconds(sens, plan.formats, SECONDS))
    names = [t.name for t in sens.tensors]
    feasible = [dict(zip(names, combo)) for combo in itertools.product(SECONDS, repeat=6)]
    fastest = min(decode_seconds(sens, f, SECONDS) for f in feasible if totals(sens, f)[1] <= target)
    step = max(t.numel for t in sens.tensors) * (SECONDS["float"] - SECONDS["c"])
    assert decode_seconds(sens, plan.formats, SECONDS) <= fastest + step  # greedy: within one upgrade
    sized = allocate(sens, target_kld=target)
    assert decode_seconds(sens, plan.formats, SECONDS) <= decode_seconds(sens, sized.formats, SECONDS)
    sens.tensors[0].kind = "embedding"  # a row lookup a token: the most accurate format is free
    assert allocate(sens, target_kld=target, seconds=SECONDS).formats["t0"] == "float"
    with pytest.raises(ValueError, match="needs a KLD target"):
        allocate(sens, target_bpw=5.0, seconds=SECONDS)
    with pytest.raises(ValueError, match="no decode time measured for c"):
        allocate(sens, target_kld=target, seconds={"a": 1.0, "b": 1.0, "float": 8.0})


def test_format_speeds_are_measured_once_per_machine(tmp_path, monkeypatch):
    from llmopt.runtime import format_speed

    monkeypatch.setattr(format_speed, "MIN_BYTES", 1 << 20)
    cache = tmp_path / "speed.json"
    formats = {n: format_scheme(n, format_speed.IN_FEATURES) for n in ("int4_g32", "int8", "float")}
    formats["int4"] = format_scheme("int4", format_speed.IN_FEATURES)  # the head's int4: the same kernel as int4_g32
    first = format_speeds_with(format_speed, formats, cache)
    assert sorted(first) == sorted(formats) and all(v > 0 for v in first.values())
    assert first["int4"] == first["int4_g32"]
    stored = json.loads(cache.read_text())
    assert len(stored) == 1 and len(next(iter(stored.values()))) == 3  # one entry per kernel format
    monkeypatch.setattr(format_speed, "measure_formats", lambda *a, **k: pytest.fail("measured again"))
    assert format_speeds_with(format_speed, formats, cache) == first


def format_speeds_with(module, formats, cache):
    return module.format_speeds(formats, threads=1, cache=cache)


def test_auto_speed_objective_end_to_end(tmp_path, calib_text, monkeypatch):
    from llmopt.runtime import format_speed

    monkeypatch.setattr(format_speed, "MIN_BYTES", 1 << 20)
    monkeypatch.setenv("LLMOPT_CACHE", str(tmp_path / "cache"))
    src = save_model(tiny_llama(seed=8), tmp_path / "src")
    config = QuantizeConfig(model=str(src), output=str(tmp_path / "a"), scheme="AUTO", target_kld=0.05, objective="speed",
                            calib=str(calib_text), calib_samples=4, calib_seq_len=64)
    plan = run_quantize(config)["plan"]
    assert len(plan["formats"]) == 2 * 7 + 1 and plan["objective"] == "speed"
    assert plan["predicted_kld"] <= 0.05 and plan["predicted_decode_ms"] > 0
    assert set(plan["decode_seconds_per_weight"]) >= set(plan["formats"].values())
    assert (tmp_path / "cache" / "format_speed" / "format_speed.json").is_file()


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
    linear = sens.tensors[0]
    assert linear.kind == "linear" and set(linear.gguf) == set(linear.bits) == set(linear.costs)
    # the block types' bits, plus each tensor's GGUF index entry and alignment (a few % of a 64 x 64 tensor)
    assert [linear.gguf[f] for f in ("int4_g128", "int4_g32", "int4a_g32", "int5_g32", "int5a_g32", "int6_g32", "int8", "float")] == \
        pytest.approx([4.5, 4.5, 5.0, 5.5, 6.0, 8.5, 8.5, 16.0], rel=0.05)
    # more bits, less error: each width's cost below the narrower one's
    assert linear.costs["int8_g32"] < linear.costs["int6_g32"] < linear.costs["int5_g32"] < linear.costs["int4_g32"]
    with torch.no_grad():
        ref_logp = torch.log_softmax(model(ids).logits.float(), -1)
    predicted, true = [], []
    for t in sens.tensors:
        module = model.get_submodule(t.name)
        fmt = "int4_g32" if t.kind == "linear" else "int4"
        scheme = format_scheme(fmt, t.shape[1])
        w = module.weight.data.clone()
        if t.kind == "linear":
            scale, zp = compute_qparams(w, scheme, scheme.group_size)
            module.weight.data = fake_quantize(w, scale, zp, scheme, scheme.group_size)
        else:  # the embedding / head: as quantize_outer quantizes them (with the clipping search)
            module.weight.data = quantize_matrix(w, scheme).dequantize()
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


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_auto_checkpoint_loads_and_plan_is_reused(tmp_path, calib_text, method):
    """An AUTO checkpoint (formats priced by RTN, or by GPTQ for a GPTQ method) loads in our loader
    and the runtime alike, and its saved plan reproduces the same formats and codes."""
    src = save_model(tiny_llama(seed=8), tmp_path / "src")
    config = QuantizeConfig(model=str(src), output=str(tmp_path / "a"), scheme="AUTO", target_bpw=5.5, method=method,
                            calib=str(calib_text), calib_samples=4, calib_seq_len=64)
    record = run_quantize(config)
    plan = record["plan"]
    assert plan["bpw"] <= 5.5 and len(plan["formats"]) == 2 * 7 + 1  # tied: one embedding/head entry
    assert plan["linears_priced_by"] == ("gptq" if "gptq" in config.method else "rtn")
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
    again = run_quantize(QuantizeConfig(model=str(src), output=str(tmp_path / "b"), scheme="AUTO", method=method,
                                        plan=str(tmp_path / "a" / "llmopt.json"), calib=str(calib_text), calib_samples=4,
                                        calib_seq_len=64))
    assert again["plan"]["formats"] == plan["formats"]
    w2, _ = read_compressed(tmp_path / "b")
    assert sorted(w2) == sorted(weights)
    for name in weights:
        assert torch.equal(w2[name].codes, weights[name].codes), name


@pytest.mark.parametrize("args,message", [
    (["--scheme", "AUTO"], "exactly one of"),
    (["--scheme", "AUTO", "--target-bpw", "5", "--target-kld", "0.1"], "exactly one of"),
    (["--scheme", "W4A16", "--target-bpw", "5"], "only apply to --scheme AUTO"),
    (["--scheme", "W4A16", "--size-of", "gguf"], "only apply to --scheme AUTO"),
    (["--scheme", "AUTO", "--plan", "missing.json", "--size-of", "gguf"], "--plan reuses a plan"),
    (["--scheme", "AUTO", "--target-bpw", "5", "--method", "smoothquant"], "method smoothquant quantizes one scheme for all"),
    (["--scheme", "AUTO", "--target-bpw", "5", "--head", "int8"], "chooses the head"),
    (["--scheme", "AUTO", "--plan", "missing.json"], "does not exist"),
    (["--scheme", "W4A16", "--objective", "speed"], "only apply to --scheme AUTO"),
    (["--scheme", "AUTO", "--target-bpw", "5", "--objective", "speed"], "fastest plan under a KLD target"),
    (["--scheme", "W4A16", "--price-by", "rtn"], "only apply to --scheme AUTO"),
    (["--scheme", "AUTO", "--plan", "missing.json", "--price-by", "rtn"], "--plan reuses a plan"),
    (["--scheme", "AUTO", "--target-bpw", "5", "--method", "rtn", "--price-by", "gptq"], "method rtn prices its formats by rtn only"),
    (["--scheme", "W4A16", "--for", "vllm"], "only apply to --scheme AUTO"),
    (["--scheme", "AUTO", "--target-bpw", "5", "--for", "sglang"], "Invalid value"),
])
def test_bad_auto_options(tmp_path, args, message):
    src = save_model(tiny_llama(seed=9), tmp_path / "src")
    result = CliRunner().invoke(main, ["quantize", str(src), "-o", str(tmp_path / "out"), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("consumer", ["vllm", "llama.cpp", "transformers"])
def test_auto_plans_only_what_the_consumer_runs(tmp_path, calib_text, consumer):
    """--for restricts the plan to the consumer's formats (vLLM: symmetric int4 groups, float
    embedding and head; llama.cpp: formats a GGUF block holds at that row length;
    transformers: symmetric formats, float embedding) and still meets the budget; a saved plan
    with a format the consumer lacks is refused for it."""
    from llmopt.quant.consumers import VLLM_LINEAR, allows

    src = save_model(tiny_llama(seed=8, tie_word_embeddings=False), tmp_path / "src")
    budget = {"vllm": 13.0, "transformers": 9.5}.get(consumer, 6.5)  # float embedding (and head): the tiny model's smallest plans are 11.7 and 8.2 bits
    record = run_quantize(QuantizeConfig(model=str(src), output=str(tmp_path / "a"), scheme="AUTO", target_bpw=budget,
                                         method="rtn", calib=str(calib_text), calib_samples=4, calib_seq_len=64,
                                         for_consumer=consumer))["plan"]
    assert record["consumer"] == consumer and record["bpw"] <= budget
    formats, kinds, shapes = record["formats"], record["kinds"], record["shapes"]
    assert len(formats) == 2 * 7 + 2
    for name, fmt in formats.items():
        assert allows(consumer, fmt, kinds[name], shapes[name][1]), (name, fmt)
    if consumer == "vllm":
        assert formats["model.embed_tokens"] == formats["lm_head"] == "float"
        assert {f for n, f in formats.items() if kinds[n] == "linear"} <= {*VLLM_LINEAR, "float"}
        assert set(formats.values()) - {"float"}  # something is quantized
        for i in range(2):  # the shards vLLM fuses share one format ("vLLM requires all to use the same scheme")
            layer = f"model.layers.{i}"
            assert len({formats[f"{layer}.self_attn.{p}_proj"] for p in "qkv"}) == 1
            assert formats[f"{layer}.mlp.gate_proj"] == formats[f"{layer}.mlp.up_proj"]
    if consumer == "transformers":
        assert formats["model.embed_tokens"] == "float"
    # a saved plan with one format this consumer lacks (vLLM: or shards of one fused layer that differ) is refused for it
    lacking = {"vllm": "int5_g32", "llama.cpp": "int6x_g16", "transformers": "int4a_g32"}[consumer]
    assert not allows(consumer, lacking, "linear", 64)
    saved = json.loads((tmp_path / "a" / "llmopt.json").read_text())
    saved["plan"]["formats"]["model.layers.0.self_attn.q_proj"] = lacking
    (tmp_path / "plan.json").write_text(json.dumps(saved["plan"]))
    result = CliRunner().invoke(main, ["quantize", str(src), "-o", str(tmp_path / "b"), "--scheme", "AUTO", "--plan",
                                       str(tmp_path / "plan.json"), "--for", consumer])
    assert result.exit_code != 0 and f"formats {consumer} cannot run" in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "b").exists()


EXPECTED_GGUF = {"int4_g128": "Q4_0", "int4_g64": "Q4_0", "int4_g32": "Q4_0", "int4a_g32": "Q4_1", "int5_g32": "Q5_0",
                 "int5a_g32": "Q5_1", "int6_g32": "Q8_0", "int8_g32": "Q8_0", "int8": "Q8_0", "int5": "Q5_0",
                 "int5a": "Q5_1", "nl4_g32": "IQ4_NL", "nl4": "IQ4_NL",
                 "nl4x_g32": "IQ4_NL", "int6x_g16": "F16", "int3x_g16": "F16",  # the tiny rows: 256 does not divide them
                 # K-quants with mins on rows 256 does not divide: float16 scales and mins per group, as Q4_1 / Q5_1 hold them
                 "int4km_g32": "Q4_1", "int5km_g32": "Q5_1"}


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq+gptq"])
def test_every_format_saved_loaded_run_and_exported(tmp_path, calib_text, method):
    """A plan using every candidate format (and an int5, int5a or nl4 tied embedding/head): the codes saved
    are on each format's grid, our loader and the runtime agree, and the GGUF export carries each
    tensor's codes in the block type of its format."""
    from gguf import GGUFReader
    from llmopt.formats.gguf_export import export_gguf
    from llmopt.quant.sensitivity import LINEAR_FORMATS

    model = tiny_llama(seed=11)
    src = save_model(model, tmp_path / "src")
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    formats = {n: list(LINEAR_FORMATS)[i % len(LINEAR_FORMATS)] for i, n in enumerate(names)}
    formats["model.embed_tokens"] = {"gptq": "nl4", "rtn": "int5"}.get(method, "int5a")
    shapes = {n: list(model.get_submodule(n).weight.shape) for n in formats}
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"formats": formats, "shapes": shapes, "kinds": {"model.embed_tokens": "tied"}}))
    run_quantize(QuantizeConfig(model=str(src), output=str(tmp_path / "q"), scheme="AUTO", plan=str(plan), method=method,
                                calib=str(calib_text), calib_samples=4, calib_seq_len=64))
    weights, _ = read_compressed(tmp_path / "q")
    assert sorted(weights) == sorted(formats)
    for name, fmt in formats.items():
        qw = weights[name]
        scheme = format_scheme(fmt, shapes[name][1])
        assert (qw.scheme.num_bits, qw.group_size, qw.scheme.symmetric) == (scheme.num_bits, scheme.group_size, scheme.symmetric), name
        assert qw.codes.shape == tuple(shapes[name])
        assert int(qw.codes.min()) >= scheme.qmin and int(qw.codes.max()) <= scheme.qmax, name
        if scheme.num_bits > 4:  # the extra levels are used
            assert int(qw.codes.min()) < -8 or int(qw.codes.max()) > 7, name
        if scheme.grid is not None:  # every code on the grid, and most of the grid used
            assert set(qw.codes.unique().tolist()) <= set(scheme.grid), name
            assert len(qw.codes.unique()) >= 12, name
    ours = load_dequantized(tmp_path / "q")
    for name in names:
        assert torch.equal(ours.get_submodule(name).weight.data, weights[name].dequantize()), name
    assert torch.equal(ours.lm_head.weight.data, weights["model.embed_tokens"].dequantize())
    prompt = [1, 5, 9, 30, 44, 2, 7]
    llm = LLM(tmp_path / "q")
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1))[0]
    assert len(out.token_ids) == 6
    with torch.no_grad():
        logp = torch.log_softmax(ours(torch.tensor([prompt + out.token_ids])).logits[0].float(), -1)
    for i, tok in enumerate(out.token_ids):
        row = logp[len(prompt) - 1 + i]
        top2 = torch.topk(row, 2).values
        assert tok == int(row.argmax()) or float(top2[0] - top2[1]) < 1e-3
        assert out.logprobs[i][tok] == pytest.approx(float(row[tok]), abs=2e-3)
    report = export_gguf(tmp_path / "q", tmp_path / "q.gguf")
    assert all(v["codes_identical"] for v in report.by_type.values() if v["codes_identical"] is not None)
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(tmp_path / "q.gguf")).tensors}
    assert types["token_embd.weight"] == EXPECTED_GGUF[formats["model.embed_tokens"]] and "output.weight" not in types
    gguf_names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                  "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    for name in names:
        layer, kind = name.split(".")[2], name.rsplit(".", 1)[1]
        assert types[f"blk.{layer}.{gguf_names[kind]}.weight"] == EXPECTED_GGUF[formats[name]], name


def test_head_costs_with_gptq_are_exact_and_lower():
    """``head_gptq``: the head's cost of each format is the exact KLD of the head GPTQ-quantized on
    the Hessian of its inputs, and below the RTN head's cost; the Linears' costs do not change."""
    from llmopt.quant.outer import gptq_matrix, outer_scheme
    from llmopt.quant.head_fisher import HeadFisher

    model = tiny_llama(seed=7, tie_word_embeddings=False)
    ids = torch.randint(3, 259, (8, 64), generator=torch.Generator().manual_seed(1))
    rtn = {t.name: t for t in measure_sensitivity(model, ids).tensors}
    gptq = {t.name: t for t in measure_sensitivity(model, ids, head_gptq=True).tensors}
    assert sorted(gptq) == sorted(rtn) and len(gptq) == 2 * 7 + 2
    assert all(gptq[n].costs == rtn[n].costs for n in gptq if gptq[n].kind == "linear")
    assert gptq["model.embed_tokens"].costs == rtn["model.embed_tokens"].costs  # untied: the embedding stays RTN
    assert gptq["lm_head"].costs["int4"] < rtn["lm_head"].costs["int4"]
    finals = []
    hook = model.lm_head.register_forward_hook(lambda m, a, o: finals.append(a[0].detach().reshape(-1, 64)))
    with torch.no_grad():
        ref_logp = torch.log_softmax(model(ids).logits.float(), -1)
    hook.remove()
    x = torch.cat(finals).double()
    w = model.lm_head.weight.data.clone()
    fisher = HeadFisher.measure(x.float(), w)  # the likely rows on their own Hessians, as a calibrated run stores them
    model.lm_head.weight.data = gptq_matrix(w, outer_scheme("int4"), x.T @ x * (2.0 / x.shape[0]), fisher=fisher).dequantize()
    true = _kld(model, ids, ref_logp)
    model.lm_head.weight.data = w
    assert gptq["lm_head"].costs["int4"] == pytest.approx(true, rel=1e-3)


def test_linear_costs_priced_by_gptq():
    """``linear_gptq``: each Linear's cost is ``½ Σ_j F_j (ΔW H ΔWᵀ)_jj`` with GPTQ's error on the
    pass's own ``H`` (recomputed here from hooks and the RTN costs' Fisher), below RTN's for every
    4-bit format; the embedding and head keep their costs."""
    from llmopt.quant.gptq import gptq_quantize_weight

    model = tiny_llama(seed=7, tie_word_embeddings=False)
    ids = torch.randint(3, 259, (8, 64), generator=torch.Generator().manual_seed(1))
    rtn = {t.name: t for t in measure_sensitivity(model, ids).tensors}
    gptq = {t.name: t for t in measure_sensitivity(model, ids, linear_gptq=True).tensors}
    assert sorted(gptq) == sorted(rtn) and len(gptq) == 2 * 7 + 2
    for name in ("model.embed_tokens", "lm_head"):
        assert gptq[name].costs == rtn[name].costs
    linears = [n for n in gptq if gptq[n].kind == "linear"]
    assert len(linears) == 2 * 7
    for n in linears:
        for fmt in ("int4_g128", "int4_g32", "nl4_g32"):
            assert 0 < gptq[n].costs[fmt] < rtn[n].costs[fmt], (n, fmt)
        assert gptq[n].bits == rtn[n].bits and gptq[n].gguf == rtn[n].gguf
    # the cost of one Linear recomputed from its inputs: H from a hook, F from RTN's cost of int8
    name = "model.layers.1.mlp.down_proj"
    module = model.get_submodule(name)
    xs = []
    hook = module.register_forward_hook(lambda m, a, o: xs.append(a[0].detach().reshape(-1, a[0].shape[-1]).double()))
    with torch.no_grad():
        model(ids)
    hook.remove()
    x = torch.cat(xs)
    h = (x.T @ x / x.shape[0]).float()
    w = module.weight.data.float()
    scheme = format_scheme("int4_g32", w.shape[1])
    dw = gptq_quantize_weight(w, h.double(), scheme, scheme.group_size, act_order=True).dequantize() - w
    per_row = ((dw @ h) * dw).sum(1)
    # F is not exposed: two formats' costs pin it only as a weighted sum, so check the ratio to RTN
    # against the same rows' unweighted errors bounds instead
    scale, zp = compute_qparams(w, scheme, scheme.group_size)
    dr = fake_quantize(w, scale, zp, scheme, scheme.group_size) - w
    rtn_rows = ((dr @ h) * dr).sum(1)
    ratio = gptq[name].costs["int4_g32"] / rtn[name].costs["int4_g32"]
    assert float((per_row / rtn_rows).min()) * 0.999 <= ratio <= float((per_row / rtn_rows).max()) * 1.001


def test_vllm_fused_groups_and_tied_planning():
    from llmopt.quant.consumers import fused_groups, tie, untie

    names = ["m.layers.0.self_attn.q_proj", "m.layers.0.self_attn.k_proj", "m.layers.0.self_attn.v_proj",
             "m.layers.0.self_attn.o_proj", "m.layers.0.mlp.gate_proj", "m.layers.0.mlp.up_proj", "m.layers.0.mlp.down_proj",
             "m.layers.1.mlp.experts.0.gate_proj", "m.layers.1.mlp.experts.0.down_proj", "m.layers.1.mlp.experts.1.up_proj"]
    groups = sorted(sorted(g) for g in fused_groups(names))
    assert groups == sorted([sorted(names[:3]), sorted(names[4:6]), sorted(names[7:])])
    tensors = [TensorCost(n, "linear", (64, 128), {"int4_g32": 1.0 + i, "float": 0.0}, {"int4_g32": 4.5, "float": 16.0})
               for i, n in enumerate(names)]
    tied, members = tie(Sensitivity(tensors, other_bits=0, tokens=1), "vllm")
    assert len(tied.tensors) == len(names) - 2 - 1 - 2
    merged = next(t for t in tied.tensors if t.name == "|".join(names[:3]))
    assert merged.shape == (192, 128) and merged.costs["int4_g32"] == 1.0 + 2.0 + 3.0 and merged.bits["int4_g32"] == 4.5
    formats = untie({t.name: "int4_g32" for t in tied.tensors}, members)
    assert sorted(formats) == sorted(names)


def test_expert_projections_planned_as_one_tensor():
    """Each projection of a layer's experts is one planning unit for every consumer (vLLM: all the
    layer's experts); a saved plan whose experts of one projection differ is run by llmopt but
    refused for llama.cpp (one GGUF type per stacked tensor) and vLLM."""
    from llmopt.quant.consumers import expert_groups, refused, tie, untie

    experts = [f"m.layers.0.mlp.experts.{j}.{p}" for j in range(3) for p in ("gate_proj", "up_proj", "down_proj")]
    names = [*experts, "m.layers.0.self_attn.q_proj", "m.layers.0.mlp.shared_expert.gate_proj"]
    assert sorted(sorted(g) for g in expert_groups(names)) == [sorted(experts[i::3]) for i in (2, 0, 1)]
    tensors = [TensorCost(n, "linear", (64, 128), {"int4_g32": 1.0 + i, "float": 0.0}, {"int4_g32": 4.5, "float": 16.0},
                          {"int4_g32": 4.5, "float": 16.0}) for i, n in enumerate(names)]
    sens = Sensitivity(tensors, other_bits=0, tokens=1)
    for consumer, units in (("llmopt", 5), ("llama.cpp", 5), ("transformers", 5), ("vllm", 3)):
        tied, members = tie(sens, consumer)
        assert len(tied.tensors) == units, consumer
        assert sorted(untie({t.name: "int4_g32" for t in tied.tensors}, members)) == sorted(names)
    gate = next(t for t in tie(sens, "llmopt")[0].tensors if t.name == "|".join(experts[0::3]))
    assert gate.shape == (192, 128) and gate.costs["int4_g32"] == 1.0 + 4.0 + 7.0 and gate.gguf["int4_g32"] == 4.5
    formats = {**dict.fromkeys(names, "int4_g32"), experts[0]: "int4_g128"}
    shapes = dict.fromkeys(names, [64, 128])
    assert refused(formats, {}, shapes, "llmopt") == []
    for consumer in ("llama.cpp", "vllm"):
        assert [r for r in refused(formats, {}, shapes, consumer) if experts[0] in r], consumer
