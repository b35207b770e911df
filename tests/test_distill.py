"""Distillation and depth pruning on tiny random models: losses against direct computations,
block ranking and removal, training, resume, the teacher cache, errors and 2-process DDP."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from conftest import CORPORA, save_model, tiny_llama
from llmopt.cli.main import main
from llmopt.distillation.data import DataOrder
from llmopt.distillation.hidden import layer_map_from_kept, uniform_layer_map
from llmopt.distillation.losses import (
    TopK,
    cross_entropy,
    forward_kl,
    generalized_jsd,
    hidden_mse,
    kd_loss,
    reverse_kl,
)
from llmopt.core.errors import LlmoptError
from llmopt.pruning.depth import (
    block_influence,
    drop_layers,
    kept_layers,
    prune_depth,
    removal_perplexity,
)

GUTENBERG = CORPORA / "gutenberg" / "persuasion.txt"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> dict[str, Path]:
    """A small training text and a separate validation text (real English, bytes as tokens)."""
    root = tmp_path_factory.mktemp("texts")
    text = GUTENBERG.read_text()
    body = text[5000:45000]
    (root / "train.txt").write_text(body[:32000])
    (root / "val.txt").write_text(body[32000:])
    return {"train": root / "train.txt", "val": root / "val.txt"}


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    return save_model(tiny_llama(seed=0, num_hidden_layers=4), tmp_path_factory.mktemp("teacher") / "t")


def _ref_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(p_logits.double(), -1)
    q = torch.softmax(q_logits.double(), -1)
    return (p * (p.log() - q.log())).sum(-1).mean()


# -- losses ------------------------------------------------------------------------------------

def test_divergences_of_identical_distributions_are_zero():
    logits = torch.randn(2, 5, 11)
    for loss in (forward_kl, reverse_kl, generalized_jsd):
        assert loss(logits, logits.clone(), 2.0).abs() < 1e-6


def test_forward_and_reverse_kl_match_direct_computation():
    student, teacher = torch.randn(2, 5, 11), torch.randn(2, 5, 11) * 2
    assert torch.allclose(forward_kl(student, teacher).double(), _ref_kl(teacher, student), atol=1e-5)
    assert torch.allclose(reverse_kl(student, teacher).double(), _ref_kl(student, teacher), atol=1e-5)


def test_temperature_scales_by_t_squared():
    student, teacher = torch.randn(3, 4, 9), torch.randn(3, 4, 9)
    t = 3.0
    expected = _ref_kl(teacher / t, student / t) * t**2
    assert torch.allclose(kd_loss(student, teacher, "fkl", temperature=t).double(), expected, atol=1e-5)


def test_jsd_is_symmetric_at_half_and_matches_definition():
    a, b = torch.randn(2, 3, 7), torch.randn(2, 3, 7) * 3
    assert torch.allclose(generalized_jsd(a, b, beta=0.5), generalized_jsd(b, a, beta=0.5), atol=1e-6)
    beta = 0.3
    p, q = torch.softmax(b.double(), -1), torch.softmax(a.double(), -1)
    m = beta * p + (1 - beta) * q
    ref = (beta * (p * (p / m).log()).sum(-1) + (1 - beta) * (q * (q / m).log()).sum(-1)).mean()
    assert torch.allclose(generalized_jsd(a, b, beta=beta).double(), ref, atol=1e-6)
    assert generalized_jsd(a, b, beta=0.5) <= math.log(2) + 1e-6


def test_top_k_teacher_with_full_vocabulary_equals_dense():
    student, teacher = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    logp = torch.log_softmax(teacher / 2.0, -1)
    full = TopK(*reversed(logp.topk(8, -1)), temperature=2.0)
    full = TopK(full.log_probs, full.indices, 2.0) if full.indices.dtype.is_floating_point else full
    for kind in ("fkl", "rkl", "jsd"):
        assert torch.allclose(kd_loss(student, full, kind, 2.0), kd_loss(student, teacher, kind, 2.0), atol=1e-5)
    values, idx = logp.topk(3, -1)
    assert kd_loss(student, TopK(idx, values, 2.0), "fkl", 2.0) <= kd_loss(student, teacher, "fkl", 2.0) + 1e-6


def test_hidden_mse_and_cross_entropy_match_direct_computation():
    s = [torch.randn(2, 4, 6) for _ in range(2)]
    t = [torch.randn(2, 4, 6) * 3 for _ in range(3)]
    expected = ((s[0] - t[1]).pow(2).mean() / t[1].pow(2).mean() + (s[1] - t[2]).pow(2).mean() / t[2].pow(2).mean()) / 2
    assert torch.allclose(hidden_mse(s, t, [(0, 1), (1, 2)]), expected, atol=1e-6)
    logits, ids = torch.randn(2, 5, 9), torch.randint(0, 9, (2, 5))
    assert torch.allclose(cross_entropy(logits, ids), F.cross_entropy(logits[:, :-1].reshape(-1, 9), ids[:, 1:].reshape(-1)))


def test_loss_arguments_are_checked():
    x = torch.randn(1, 2, 5)
    with pytest.raises(LlmoptError, match="unknown distillation loss"):
        kd_loss(x, x, "mse")
    with pytest.raises(LlmoptError, match="temperature"):
        kd_loss(x, x, "fkl", temperature=0)
    with pytest.raises(LlmoptError, match="beta"):
        generalized_jsd(x, x, beta=1.0)
    with pytest.raises(LlmoptError, match="vocabulary"):
        kd_loss(x, torch.randn(1, 2, 6))


# -- depth pruning -----------------------------------------------------------------------------

def test_block_influence_matches_direct_cosine():
    model = tiny_llama(seed=1, num_hidden_layers=3)
    ids = torch.randint(3, 259, (2, 16))
    ranking = block_influence(model, ids)
    hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    layer0 = model.model.layers[0]
    out0 = model.model(input_ids=ids, output_hidden_states=True).hidden_states[1]
    cos = F.cosine_similarity(hidden[0], out0, dim=-1).mean().detach()
    assert ranking.scores[0] == pytest.approx(1 - float(cos), abs=1e-5)
    assert layer0 is model.model.layers[0] and len(ranking.scores) == 3 and sorted(ranking.order) == [0, 1, 2]
    by_ppl = removal_perplexity(model, ids)
    assert len(by_ppl.scores) == 3 and all(s > 1 for s in by_ppl.scores)


def test_drop_layers_checkpoint_loads_and_generates_with_kv_cache(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    drop_layers(model, [1])
    assert model.config.num_hidden_layers == 3
    assert model.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == [0, 1, 2]
    save_model(model, tmp_path / "pruned")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned").eval()
    assert len(loaded.model.layers) == 3 and loaded.config.layer_types == model.config.layer_types
    prompt = torch.randint(3, 259, (1, 6))
    generated = loaded.generate(prompt, max_new_tokens=12, do_sample=False)
    ids = prompt
    for _ in range(12):  # greedy without a cache must agree with the cached generation
        ids = torch.cat([ids, loaded(input_ids=ids, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(generated, ids)


def test_drop_layers_refuses_bad_indices():
    model = tiny_llama(seed=0, num_hidden_layers=3)
    for bad, message in (([0, 1, 2], "cannot drop 3"), ([3], "invalid layer"), ([-1], "invalid layer"), ([1, 1], "repeat")):
        with pytest.raises(LlmoptError, match=message):
            drop_layers(model, bad)
    with pytest.raises(LlmoptError, match="cannot drop 4"):
        prune_depth(model, torch.randint(3, 259, (1, 8)), 4)
    assert len(model.model.layers) == 3


def test_layer_maps_and_data_order():
    assert kept_layers(6, [3, 4]) == [0, 1, 2, 5]
    assert layer_map_from_kept([0, 1, 2, 5], 6) == [(0, 0), (1, 1), (2, 4), (3, 5)]
    assert uniform_layer_map(2, 4) == [(0, 1), (1, 3)]
    order = DataOrder(10, seed=3)
    shards = [order.micro_batch(0, 0, rank, 2, 3, 1) for rank in range(2)]
    assert not set(shards[0]) & set(shards[1])
    stream = [order.sample(p) for p in range(20)]
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))


# -- training ----------------------------------------------------------------------------------

def _request(teacher_dir, texts, out: Path, steps: int = 12, **settings):
    from llmopt.distillation.run import DistillRequest
    from llmopt.distillation.student import StudentRequest
    from llmopt.distillation.trainer import TrainSettings

    options = dict(steps=steps, batch_size=4, lr=3e-3, warmup=2, precision="no", log_every=1000)
    options.update(settings)
    return DistillRequest(
        teacher=str(teacher_dir), output=out,
        student=StudentRequest(student_from=str(teacher_dir), drop_layers=2, calib=str(texts["train"]), calib_samples=4, calib_seq_len=64),
        settings=TrainSettings(**options), data=str(texts["train"]), validation=str(texts["val"]), seq_len=64, show_progress=False,
    )


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def test_distillation_lowers_kl_to_teacher_via_cli(teacher_dir, texts, tmp_path):
    out = tmp_path / "student"
    args = ["distill", "--teacher", str(teacher_dir), "--student-from", str(teacher_dir), "--drop-layers", "2",
            "--calib", str(texts["train"]), "--data", str(texts["train"]), "--validation", str(texts["val"]),
            "--steps", "40", "--seq-len", "64", "--lr", "3e-3", "--hidden-weight", "1", "--ce-weight", "0.1",
            "--eval-every", "40", "--precision", "no", "--json", "-o", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    record = json.loads((out / "llmopt.json").read_text())
    first, last = record["validation_curve"][0], record["validation_curve"][-1]
    assert last["step"] == 40 and last["kl"] < 0.85 * first["kl"]
    assert record["student"]["layers"] == 2 and len(record["loss_curve"]) == 40
    assert {"loss", "fkl", "hidden", "ce", "lr"} <= set(record["loss_curve"][0])
    assert not Path(f"{out}.checkpoints").exists()
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.config.num_hidden_layers == 2
    assert loaded.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False).shape == (1, 7)


def test_quantized_teacher_is_distilled_from_its_dequantized_outputs(teacher_dir, texts, tmp_path):
    """An int4 checkpoint of ours as the teacher: the KL recorded before training is KL(int4 teacher,
    dequantized || student), computed here directly on the same validation windows."""
    from llmopt.checkpoints.models import load_model
    from llmopt.distillation.data import pack_text, spread

    int4 = tmp_path / "int4"
    done = CliRunner().invoke(main, ["quantize", str(teacher_dir), "--scheme", "W4A16", "--group-size", "32",
                                     "--method", "rtn", "--json", "-o", str(int4)])
    assert done.exit_code == 0, done.output
    assert json.loads((int4 / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"
    out = tmp_path / "student"
    args = ["distill", "--teacher", str(int4), "--student", str(teacher_dir), "--data", str(texts["train"]),
            "--validation", str(texts["val"]), "--steps", "2", "--seq-len", "64", "--batch-size", "4", "--val-samples", "8",
            "--eval-every", "2", "--precision", "no", "--json", "-o", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    record = json.loads((out / "llmopt.json").read_text())
    assert len(record["validation_curve"]) == 2 and record["validation_curve"][0]["step"] == 0

    teacher, tokenizer = load_model(int4)
    student, _ = load_model(teacher_dir)
    val = spread(pack_text(tokenizer, str(texts["val"]), 64), 8)
    with torch.no_grad():
        t_logits, s_logits = teacher(input_ids=val).logits.float(), student(input_ids=val).logits.float()
    expected = sum(float(kd_loss(s_logits[i : i + 4], t_logits[i : i + 4], "fkl")) * val[i : i + 4].numel()
                   for i in range(0, len(val), 4)) / val.numel()
    assert expected > 1e-3  # the int4 teacher differs from the float model it came from
    assert record["validation_curve"][0]["kl"] == pytest.approx(expected, rel=1e-4)


def test_ctrl_c_checkpoints_and_resume_matches_uninterrupted_run(teacher_dir, texts, tmp_path):
    from llmopt.distillation.run import run_distill

    full = run_distill(_request(teacher_dir, texts, tmp_path / "full", hidden_weight=0.5, grad_accum=2))
    assert full.output is not None

    def ctrl_c(step, terms):
        if step == 5:
            os.kill(os.getpid(), signal.SIGINT)

    request = _request(teacher_dir, texts, tmp_path / "split", hidden_weight=0.5, grad_accum=2, save_every=3)
    stopped = run_distill(request, on_step=ctrl_c)
    assert stopped.interrupted and stopped.result.steps_done == 5
    assert not request.output.exists() and Path(stopped.result.checkpoint).name == "step-0000005"
    request.resume = True
    changed = _request(teacher_dir, texts, tmp_path / "split", hidden_weight=0.5, grad_accum=2, lr=1e-3)
    changed.resume = True
    with pytest.raises(LlmoptError, match=r"settings changed \(lr: 0.003 → 0.001\)"):
        run_distill(changed)
    resumed = run_distill(request)
    assert not resumed.interrupted and resumed.record["steps"] == 12
    a, b = _weights(full.output), _weights(resumed.output)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.record["loss_curve"] == full.record["loss_curve"]


def test_teacher_cache_is_filled_and_reused(teacher_dir, texts, tmp_path):
    from llmopt.distillation.run import run_distill

    first = run_distill(_request(teacher_dir, texts, tmp_path / "a", steps=4, teacher_top_k=259, temperature=2.0))
    cache = Path(first.record["teacher_cache"])
    files = sorted(cache.glob("sample-*.pt"))
    assert len(files) == 16
    stamps = [f.stat().st_mtime_ns for f in files]
    second = run_distill(_request(teacher_dir, texts, tmp_path / "b", steps=4, teacher_top_k=259, temperature=2.0))
    assert [f.stat().st_mtime_ns for f in files] == stamps  # read, not recomputed
    assert second.record["loss_curve"] == first.record["loss_curve"]
    dense = run_distill(_request(teacher_dir, texts, tmp_path / "c", steps=4, temperature=2.0))
    for x, y in zip(first.record["loss_curve"], dense.record["loss_curve"]):
        assert x["fkl"] == pytest.approx(y["fkl"], abs=1e-4)


def test_live_display_shows_step_losses_lr_speed_and_eta():
    from io import StringIO

    from rich.console import Console

    from llmopt.distillation.display import Progress, TrainDisplay

    buffer = StringIO()
    console = Console(file=buffer, force_terminal=True, width=100)
    with TrainDisplay(console) as display:
        assert display.live
        display.update(Progress(3, 10, {"loss": 1.5, "fkl": 1.25}, 2e-4, 1234.0, 75.0, {"ppl": 42.0}))
    text = buffer.getvalue()
    for expected in ("3/10", "fkl", "1.2500", "2.00e-04", "1,234", "1:15", "validation ppl", "42"):
        assert expected in text


# -- errors ------------------------------------------------------------------------------------

def _cli(*args: str):
    return CliRunner().invoke(main, ["distill", *args])


def test_vocabulary_mismatch_is_refused(teacher_dir, texts, tmp_path):
    other = save_model(tiny_llama(seed=0, num_hidden_layers=2, vocab_size=300), tmp_path / "other")
    result = _cli("--teacher", str(teacher_dir), "--student", str(other), "--data", str(texts["train"]), "--steps", "2", "-o", str(tmp_path / "o"))
    assert result.exit_code == 2
    assert "vocabulary (300 tokens) differs from the teacher's (259)" in result.output


@pytest.mark.parametrize("args, message", [
    (["--student", "X", "--student-from", "Y"], "exactly one of --student and --student-from"),
    ([], "exactly one of --student and --student-from"),
    (["--student-from", "T"], "needs one of --drop-layers"),
    (["--student-from", "T", "--width", "50%"], "cannot read --width '50%'"),
    (["--student-from", "T", "--width", "ffn=0.5", "--drop-layers", "1"], "needs one of --drop-layers"),
    (["--student-from", "T", "--drop-layers", "4"], "cannot drop 4 of the model's 4 layers"),
    (["--student-from", "T", "--drop-layers", "1", "--steps", "0"], "--steps 0"),
    (["--student-from", "T", "--drop-layers", "1", "--temperature", "0"], "--temperature 0"),
    (["--student-from", "T", "--drop-layers", "1", "--kd-weight", "0", "--hidden-weight", "0"], "all loss weights are 0"),
    (["--student-from", "T", "--drop-layers", "1", "--hidden-weight", "1", "--teacher-top-k", "8"], "hidden states"),
    (["--student-from", "T", "--drop-layers", "1", "--data", "/nonexistent.txt"], "dataset not found"),
])
def test_bad_arguments_give_clear_errors(teacher_dir, texts, tmp_path, args, message):
    args = [str(teacher_dir) if a == "T" else a for a in args]
    base = ["--teacher", str(teacher_dir), "--steps", "2", "--calib", str(texts["train"]), "--validation", "none", "-o", str(tmp_path / "o")]
    if "--data" not in args:
        base += ["--data", str(texts["train"])]
    result = _cli(*base, *args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_width_pruning_is_refused_while_missing(monkeypatch):
    from llmopt.distillation import student

    monkeypatch.setattr(student.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(LlmoptError, match="not available yet"):
        student.StudentRequest(student_from="demo", width="ffn=0.5").validate()


def test_width_pruned_student_distils(teacher_dir, texts, tmp_path):
    from llmopt.distillation import student
    from llmopt.distillation.run import run_distill

    try:
        student.width_pruning()
    except LlmoptError:
        pytest.skip("llmopt.pruning.width is not available")
    request = _request(teacher_dir, texts, tmp_path / "w", steps=3, hidden_weight=1.0)
    request.student = student.StudentRequest(student_from=str(teacher_dir), width="ffn=0.5", calib=str(texts["train"]),
                                             calib_samples=4, calib_seq_len=64)
    outcome = run_distill(request)
    assert outcome.record["student"]["kind"] == "width"
    assert [tuple(pair) for pair in outcome.record["layer_map"]] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(outcome.output).intermediate_size == 96


def test_existing_output_and_stale_checkpoints_are_refused(teacher_dir, texts, tmp_path):
    (tmp_path / "o").mkdir()
    result = _cli("--teacher", str(teacher_dir), "--student-from", str(teacher_dir), "--drop-layers", "1", "--steps", "2", "-o", str(tmp_path / "o"))
    assert result.exit_code == 2 and "already exists" in result.output
    (tmp_path / "p.checkpoints" / "step-0000001").mkdir(parents=True)
    (tmp_path / "p.checkpoints" / "step-0000001" / "state.json").write_text("{}")
    result = _cli("--teacher", str(teacher_dir), "--student-from", str(teacher_dir), "--drop-layers", "1", "--steps", "2", "-o", str(tmp_path / "p"))
    assert result.exit_code == 2 and "--resume" in result.output


# -- data parallel -----------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_torchrun_shards_data_and_keeps_weights_identical(teacher_dir, texts, tmp_path):
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LLMOPT_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(_free_port()), "-m", "llmopt", "distill", "--teacher", str(teacher_dir),
               "--student-from", str(teacher_dir), "--drop-layers", "2", "--calib", str(texts["train"]),
               "--data", str(texts["train"]), "--validation", str(texts["val"]), "--steps", "6", "--seq-len", "64",
               "--batch-size", "2", "--hidden-weight", "1", "--eval-every", "6", "--precision", "no", "--json", "-o", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((out / "llmopt.json").read_text())
    assert record["world_size"] == 2 and record["tokens"] == 6 * 2 * 2 * 64
    ranks = {shard["rank"]: shard for shard in record["shards"]}
    assert set(ranks) == {0, 1}
    assert not set(ranks[0]["first_samples"]) & set(ranks[1]["first_samples"])
    assert ranks[0]["samples_sha256"] != ranks[1]["samples_sha256"]
    assert ranks[0]["weights_sha256"] == ranks[1]["weights_sha256"]


def test_generated_data_is_the_teachers_own_greedy_answers(teacher_dir, texts, tmp_path, monkeypatch):
    """``--data generated:CORPUS:N``: N transcripts written once by the runtime, each a request
    about a passage of CORPUS followed by the teacher's greedy answer (checked against
    transformers); the run trains on them and records where they came from; a rerun reuses them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmopt.distillation import generated
    from llmopt.distillation.run import run_distill

    monkeypatch.setenv("LLMOPT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(generated, "ANSWER_TOKENS", 12)
    monkeypatch.setattr(generated, "PASSAGE_TOKENS", 40)
    request = _request(teacher_dir, texts, tmp_path / "student", steps=2)
    request.data = f"generated:{texts['train']}:5"
    record = run_distill(request).record
    assert record["data"]["generated"] == request.data
    folder = Path(record["data"]["name"])
    files = sorted(folder.glob("*.txt"))
    assert len(files) == 5 and folder.parent == tmp_path / "cache" / "distill-generated"
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    prompts = generated._prompts(tokenizer, str(texts["train"]), 5, 0)
    assert len(prompts) == 5 and all(len(p) > 40 for p in prompts)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    with torch.no_grad():
        answer = teacher.generate(torch.tensor([prompts[0]]), max_new_tokens=12, do_sample=False,
                                  pad_token_id=0).tolist()[0]
    stop = tokenizer.eos_token_id
    answer = answer[: answer.index(stop, len(prompts[0])) + 1] if stop in answer[len(prompts[0]):] else answer
    assert files[0].read_text() == tokenizer.decode(answer, skip_special_tokens=False)
    assert "Summarize this passage" in files[0].read_text()
    monkeypatch.setattr(generated, "atomic_dir", lambda *a, **k: pytest.fail("written again"))
    assert generated.generated_corpus(request.data, teacher_dir, tokenizer) == str(folder)
    with pytest.raises(LlmoptError, match="must be positive"):
        generated.parse("generated:austen:0")
    assert generated.parse("generated:austen") == ("austen", generated.DEFAULT_REQUESTS)
    assert generated.parse("generated:hf:wikitext:wikitext-2-raw-v1:7") == ("hf:wikitext:wikitext-2-raw-v1", 7)
