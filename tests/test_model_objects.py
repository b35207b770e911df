"""Compressing a transformers model object in memory (``llmopt.quantize(model, tokenizer, ...)``).

The in-memory route quantizes with the CLI's own engine and writes through the CLI's own
writer, so ``llmopt.save`` of a model quantized in memory gives bit-identical tensors to
``llmopt quantize`` of a checkpoint of the same model; every calibration form converts through
one function; prune, distill and oneshot work on the object; what needs a checkpoint on disk is
refused in one line.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import byte_tokenizer, save_model, tiny_llama
from safetensors.torch import load_file

import llmopt
from llmopt.cli.main import main
from llmopt.core.errors import LlmoptError

pytestmark = pytest.mark.usefixtures("one_thread")

README = Path(__file__).resolve().parents[1] / "README.md"
TEXTS = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.",
    "However little known the feelings or views of such a man may be on his first entering a neighbourhood, this truth "
    "is so well fixed in the minds of the surrounding families, that he is considered the rightful property of some one "
    "or other of their daughters.",
    "My dear Mr. Bennet, said his lady to him one day, have you heard that Netherfield Park is let at last?",
]
CALIB = {"calib_samples": 4, "calib_seq_len": 32}


@pytest.fixture
def tok():
    return byte_tokenizer()


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def assert_same_checkpoint(a: Path, b: Path) -> None:
    """Every tensor (names, shapes, dtypes, values) and the quantization config are identical."""
    ta, tb = checkpoint_tensors(a), checkpoint_tensors(b)
    assert ta.keys() == tb.keys() and len(ta) > 0
    for key in ta:
        assert (ta[key].dtype, ta[key].shape) == (tb[key].dtype, tb[key].shape), key
        assert torch.equal(ta[key], tb[key]), key
    ca, cb = (json.loads((p / "config.json").read_text()) for p in (a, b))
    assert ca["quantization_config"] == cb["quantization_config"]


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def cli(*args: str) -> None:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output


# -- (a) the notebook flow -----------------------------------------------------------------------


def test_notebook_flow_quantize_generate_save_reload(tmp_path, tok):
    from transformers import AutoModelForCausalLM

    model = tiny_llama(seed=0)
    quantized = llmopt.quantize(model, tok, scheme="W4A16", method="gptq", dataset=TEXTS)
    assert quantized is model  # in place
    prompt = tok("It is a truth", return_tensors="pt").input_ids
    out = quantized.generate(prompt, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, prompt.shape[1] + 6)
    path = llmopt.save(quantized, tmp_path / "w4", tokenizer=tok)
    assert not list(tmp_path.glob(".w4.tmp-*"))  # written through a temporary folder, renamed
    record = json.loads((path / "llmopt.json").read_text())
    assert record["scheme"] == "W4A16" and record["method"] == "gptq" and record["scale_dtype"] == "bfloat16"
    assert record["calibration"]["name"] == "3 texts" and record["calibration"]["samples"] == 1  # all it holds
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    ids = torch.randint(3, 259, (2, 12))
    reloaded, _ = llmopt.load_model(path)
    torch.testing.assert_close(logits(reloaded, ids), logits(quantized, ids), rtol=1e-5, atol=1e-5)
    theirs = AutoModelForCausalLM.from_pretrained(path).eval()  # transformers' compressed-tensors loader
    torch.testing.assert_close(logits(theirs, ids), logits(quantized, ids), rtol=1e-4, atol=1e-4)
    quantized.save_pretrained(tmp_path / "sp")  # transformers' name for the same writer
    assert_same_checkpoint(path, tmp_path / "sp")
    quantized.save_pretrained(tmp_path / "sharded", max_shard_size="2GB")  # a size as text, as transformers takes it
    assert_same_checkpoint(path, tmp_path / "sharded")


# -- (b) tensors equal to the CLI's --------------------------------------------------------------


@pytest.mark.parametrize("scheme, method, dtype, extra", [
    ("W4A16", "rtn", torch.float32, {}),
    ("W4A16", "gptq", torch.float32, {"group_size": 32}),
    ("W4A16", "gptq", torch.float32, {"group_size": 32, "online_hadamard": "all"}),  # fused and hooked in memory
    ("W8A16", "gptq", torch.bfloat16, {"head": "int8"}),  # a bf16 model, its head by GPTQ (untied)
    ("W8A8", "smoothquant", torch.float32, {}),
])
def test_save_equals_the_cli_tensor_for_tensor(tmp_path, tok, scheme, method, dtype, extra):
    from transformers import AutoModelForCausalLM

    source = save_model(tiny_llama(seed=1).to(dtype), tmp_path / "tiny", tok)
    # as a notebook loads it (Module.to(bfloat16) would round the rotary frequencies too, unlike loading)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).eval()
    calib_file = tmp_path / "calib.txt"
    calib_file.write_text("\n\n".join(TEXTS))  # a list of strings is one text joined by blank lines
    calibrated = method != "rtn"
    options = {**extra, **(CALIB if calibrated else {})}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    cli("quantize", str(source), "--scheme", scheme, "--method", method, *flags,
        *(["--calib", str(calib_file)] if calibrated else []), "-o", str(tmp_path / "cli"))
    in_memory = llmopt.quantize(model, tok, scheme=scheme, method=method, dataset=TEXTS if calibrated else None, **options)
    llmopt.save(in_memory, tmp_path / "api", tokenizer=tok)
    assert_same_checkpoint(tmp_path / "cli", tmp_path / "api")
    ours, theirs = (json.loads((tmp_path / p / "llmopt.json").read_text()) for p in ("api", "cli"))
    assert ours.keys() == theirs.keys()
    assert ours["group_sizes"] == theirs["group_sizes"] and ours["options"] == theirs["options"]
    if calibrated:  # and the path route's dataset= is --calib
        llmopt.quantize(source, scheme=scheme, method=method, dataset=str(calib_file), output=tmp_path / "path", **options)
        assert_same_checkpoint(tmp_path / "cli", tmp_path / "path")
    ids = torch.randint(3, 259, (1, 12))
    reloaded, _ = llmopt.load_model(tmp_path / "cli", dtype=str(dtype).removeprefix("torch."))
    torch.testing.assert_close(logits(reloaded, ids), logits(in_memory, ids), rtol=1e-5, atol=1e-5)


# -- (c) every dataset form ----------------------------------------------------------------------


def test_every_dataset_form_converts_through_one_function(tmp_path, tok, monkeypatch):
    import datasets

    from llmopt.core.calibration_data import calibration_windows
    from llmopt.core.data import calibration_ids

    file = tmp_path / "calib.txt"
    file.write_text("\n\n".join(TEXTS))
    expected, _ = calibration_ids(tok, str(file), 3, 32, 0)
    as_list, record = calibration_windows(TEXTS, tok, samples=3, seq_len=32)
    assert torch.equal(as_list, expected) and record["samples"] == 3  # the CLI's windows of the same text
    monkeypatch.setenv("LLMOPT_DATA", str(tmp_path / "data"))  # a short text under a bundled corpus's name
    (tmp_path / "data" / "gutenberg").mkdir(parents=True)
    (tmp_path / "data" / "gutenberg" / "war-of-the-worlds.txt").write_text(" ".join(TEXTS))
    named, record = calibration_windows("heldout", tok, samples=2, seq_len=16)
    assert torch.equal(named, calibration_ids(tok, "heldout", 2, 16, 0)[0]) and record["name"] == "heldout"
    table = datasets.Dataset.from_dict({"text": TEXTS, "n": [1, 2, 3]})
    ids, record = calibration_windows(table, tok, samples=2, seq_len=16)
    assert ids.shape == (2, 16) and record["column"] == "text" and record["rows"] == 3
    _, record = calibration_windows(datasets.Dataset.from_dict({"content": TEXTS, "n": [1, 2, 3]}), tok)
    assert record["column"] == "content"  # the only string column
    with pytest.raises(LlmoptError, match=r"no 'text' column \(columns: a, b\)"):
        calibration_windows(datasets.Dataset.from_dict({"a": TEXTS, "b": TEXTS}), tok)
    windows = torch.randint(3, 259, (4, 24))
    ids, record = calibration_windows(windows)
    assert torch.equal(ids, windows) and record["samples"] == 4  # a 2-D tensor: the windows themselves
    stream = torch.randint(3, 259, (100,))
    for form in (stream, stream.tolist(), [stream[:50].tolist(), stream[50:].tolist()], [stream[:60], stream[60:]],
                 {"input_ids": [stream[:50].tolist(), stream[50:].tolist()]}):
        ids, record = calibration_windows(form, samples=3, seq_len=20)
        assert ids.shape == (3, 20) and record["seq_len"] == 20
        assert all(any(torch.equal(row, stream[i:i + 20]) for i in range(81)) for row in ids)  # windows of the stream
    total = sum(len(t.encode()) for t in TEXTS)  # (one byte, one token)
    ids, _ = calibration_windows(tok(TEXTS))  # a tokenizer's output, sized to what it holds
    assert ids.shape == (1, total)
    ids, _ = calibration_windows(tok(TEXTS)["input_ids"], defaults=(8, 64))
    assert ids.shape == (min(8, total // 64), 64)
    model = tiny_llama(seed=2)
    llmopt.quantize(model, tok, scheme="W4A16", method="gptq", dataset=table, **CALIB)
    assert model.llmopt_compression.record["calibration"]["column"] == "text"


@pytest.mark.parametrize("data, message", [
    (42, "calibration data of type int is not one llmopt reads"),
    ({"a": 1}, "calibration data of type dict"),
    ([1.5, 2.5], "calibration data of type list of float"),
    (torch.randn(2, 8), "must be integers"),
    (torch.tensor([[5, 300]]), "token id 300 is outside the model's vocabulary"),
    (["a", 1], "calibration data of type list of str"),
])
def test_a_dataset_of_the_wrong_type_is_one_line(tok, data, message):
    with pytest.raises(LlmoptError, match=re.escape(message)) as caught:
        llmopt.quantize(tiny_llama(seed=0), tok, scheme="W4A16", method="gptq", dataset=data)
    assert "\n" not in str(caught.value)


# -- (d) prune on an object ----------------------------------------------------------------------


def test_prune_an_object_as_the_cli_prunes_a_checkpoint(tmp_path, tok):
    model = tiny_llama(seed=3)
    source = save_model(model, tmp_path / "tiny", tok)
    (tmp_path / "calib.txt").write_text("\n\n".join(TEXTS))
    cli("prune", str(source), "--method", "sparsegpt", "--pattern", "2:4", "--calib", str(tmp_path / "calib.txt"),
        "--calib-samples", "4", "--calib-seq-len", "32", "-o", str(tmp_path / "cli"))
    pruned = llmopt.prune(model, tok, method="sparsegpt", pattern="2:4", dataset=TEXTS, **CALIB)
    down = pruned.model.layers[0].mlp.down_proj.weight
    assert (down.reshape(-1, 4) != 0).sum(dim=1).max() <= 2  # 2:4 in place
    llmopt.save(pruned, tmp_path / "api", tokenizer=tok)
    ta, tb = checkpoint_tensors(tmp_path / "cli"), checkpoint_tensors(tmp_path / "api")
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    llmopt.quantize(pruned, tok, scheme="W8A16")  # then quantized: the zeros stay
    assert (pruned.model.layers[0].mlp.down_proj.weight.reshape(-1, 4) != 0).sum(dim=1).max() <= 2
    llmopt.save(pruned, tmp_path / "w8", tokenizer=tok)
    record = json.loads((tmp_path / "w8" / "llmopt.json").read_text())
    assert record["scheme"] == "W8A16" and record["source_record"]["method"] == "sparsegpt"


def test_prune_structure_on_an_object(tmp_path, tok):
    model = tiny_llama(seed=4, num_hidden_layers=3)
    llmopt.prune(model, tok, method="drop-layers", num=1, dataset=TEXTS)
    assert model.config.num_hidden_layers == 2 and len(model.model.layers) == 2
    llmopt.prune(model, method="width", ffn_ratio=0.25, dataset=TEXTS, tokenizer=tok)
    assert model.model.layers[0].mlp.up_proj.out_features == 144
    model.generate(torch.tensor([[5, 6]]), max_new_tokens=2)
    llmopt.save(model, tmp_path / "small", tokenizer=tok)
    reloaded, _ = llmopt.load_model(tmp_path / "small")
    ids = torch.randint(3, 259, (1, 8))
    torch.testing.assert_close(logits(reloaded, ids), logits(model, ids))


def test_distill_into_an_object(tmp_path, tok):
    teacher = tiny_llama(seed=5)
    student = copy.deepcopy(teacher)
    llmopt.prune(student, tok, method="drop-layers", num=1, dataset=TEXTS)
    before = student.model.layers[0].mlp.up_proj.weight.clone()
    trained = llmopt.distill(student, tok, teacher=teacher, steps=2, dataset=TEXTS * 4, seq_len=16, batch_size=2,
                             validation="none")
    assert trained is student and not torch.equal(before, student.model.layers[0].mlp.up_proj.weight)
    record = student.llmopt_compression.record
    assert record["steps"] == 2 and record["student"]["kind"] == "drop-layers" and record["layer_map"]
    assert record["settings"]["hidden_weight"] == 1.0  # the exact layer map of a student pruned in memory
    assert not student.training and all(p.requires_grad for p in teacher.parameters())
    assert "forward" not in vars(student)  # no mixed-precision wrapper left behind


# -- (e) oneshot ---------------------------------------------------------------------------------


def test_oneshot_with_a_dict_recipe_and_a_modifier_list(tmp_path, tok):
    model = tiny_llama(seed=6)
    recipe = {"calibration": {"samples": 4, "seq_len": 32},
              "stages": [{"prune": {"method": "wanda", "sparsity": 0.5}}, {"quantize": {"scheme": "W4A16", "method": "gptq"}}],
              "runtime": {"max_num_seqs": 4}}
    out = llmopt.oneshot(model, recipe, dataset=TEXTS, tokenizer=tok)
    record = out.llmopt_compression.record
    assert out is model and record["method"] == "gptq" and record["source_record"]["method"] == "wanda"
    assert record["calibration"]["samples"] == 4 and record["runtime"] == {"max_num_seqs": 4}
    llmopt.save(out, tmp_path / "one", tokenizer=tok)
    assert json.loads((tmp_path / "one" / "llmopt.json").read_text())["runtime"] == {"max_num_seqs": 4}
    other = llmopt.oneshot(tiny_llama(seed=6), [{"GPTQModifier": {"scheme": "W4A16", "ignore": ["lm_head"]}}],
                           dataset=TEXTS, tokenizer=tok)
    assert other.llmopt_compression.record["method"] == "gptq"
    with pytest.raises(LlmoptError, match=r"stage 2 \(export\) works on a checkpoint on disk"):
        llmopt.oneshot(tiny_llama(seed=6), {"stages": [{"quantize": {"scheme": "W8A16"}}, {"export": {"format": "gguf"}}]})


def test_oneshot_with_a_yaml_recipe_that_prunes_distills_and_quantizes(tmp_path, tok, capsys):
    (tmp_path / "train.txt").write_text(" ".join(TEXTS * 4))
    (tmp_path / "recipe.yaml").write_text(
        "model: demo\n"
        "calibration: {seq_len: 32}\n"
        "stages:\n"
        "  - prune: {method: drop-layers, num: 1}\n"
        f"  - distill: {{steps: 2, seq_len: 16, batch_size: 2, data: {tmp_path / 'train.txt'}, validation: none}}\n"
        "  - quantize: {scheme: W8A16, method: gptq}\n"
        "evaluate: {max_windows: 2}\n")
    model = tiny_llama(seed=8, num_hidden_layers=3)
    llmopt.oneshot(model, tmp_path / "recipe.yaml", dataset=TEXTS, tokenizer=tok)
    record = model.llmopt_compression.record
    assert record["scheme"] == "W8A16" and record["calibration"]["seq_len"] == 32
    distilled = record["source_record"]
    assert distilled["steps"] == 2 and distilled["student"]["kind"] == "drop-layers"  # from a copy of the model as given
    assert distilled["source_record"]["depth"]["layers"] == [3, 2]
    assert "evaluate block compares checkpoints on disk" in capsys.readouterr().err


# -- (f) bad inputs ------------------------------------------------------------------------------


@pytest.mark.parametrize("call, message", [
    (lambda m, t: llmopt.quantize({"not": "a model"}, scheme="W4A16"), "a dict cannot be quantized"),
    (lambda m, t: llmopt.quantize(torch.nn.Linear(2, 2), scheme="W4A16"), "a Linear cannot be quantized"),
    (lambda m, t: llmopt.quantize(m, t, scheme="AUTO", target_bpw=4.5), "pass the model's path instead"),
    (lambda m, t: llmopt.quantize(m, t, scheme="NF4"), "NF4 is written by bitsandbytes"),
    (lambda m, t: llmopt.quantize(m, t, scheme="W4A16", tune_steps=4), "rewrites a quantized checkpoint on disk"),
    (lambda m, t: llmopt.quantize(m, t, scheme="W8A8", rotate="hadamard"), "rotate rewrites the float checkpoint on disk"),
    (lambda m, t: llmopt.quantize(m, t, scheme="W8A8", online_hadamard="on"), "online_hadamard on / off go with rotate"),
    (lambda m, t: llmopt.quantize(m, t, scheme="W4A16", method="gptq", calib="self"), "sampled from a checkpoint"),
    (lambda m, t: llmopt.quantize(m, t, scheme="W4A16", dataset=TEXTS), "method rtn takes no calibration data"),
    (lambda m, t: llmopt.quantize(m, None, scheme="W4A16", method="gptq", dataset=TEXTS), "needs the model's tokenizer"),
    (lambda m, t: llmopt.quantize(m, t, scheme="W4A16", method="gptq", dataset=TEXTS, calib="austen"), "both name"),
    (lambda m, t: llmopt.quantize("demo", t, scheme="W4A16", output="x"), "tokenizer= goes with a model object"),
    (lambda m, t: llmopt.quantize("demo", scheme="W4A16"), "output= is missing"),
    (lambda m, t: llmopt.quantize("demo", scheme="W4A16", method="gptq", dataset=TEXTS, output="x"),
     "a checkpoint is calibrated on a corpus name or text file"),
    (lambda m, t: llmopt.prune(m, t, method="magnitude", sparsity=0.5, eval=True), "eval compares checkpoints"),
    (lambda m, t: llmopt.distill(m, t, steps=2, teacher=m), "the student is its own teacher"),
    (lambda m, t: llmopt.distill(m, t, steps=2, teacher=m, drop_layers=1), "makes a student from a checkpoint"),
    (lambda m, t: llmopt.oneshot(m, 42), "a recipe of type int"),
    (lambda m, t: llmopt.save([], "x"), "a list cannot be saved"),
])
def test_bad_inputs_are_one_line(tok, call, message):
    with pytest.raises(LlmoptError, match=re.escape(message)) as caught:
        call(tiny_llama(seed=0), tok)
    assert "\n" not in str(caught.value)


def test_a_quantized_object_is_not_requantized_nor_saved_stale(tmp_path, tok):
    model = llmopt.quantize(tiny_llama(seed=7), tok, scheme="W4A16")
    with pytest.raises(LlmoptError, match="already quantized"):
        llmopt.quantize(model, tok, scheme="W8A16")
    with pytest.raises(LlmoptError, match="already quantized"):
        llmopt.prune(model, tok, method="magnitude", sparsity=0.5)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("keep me")
    with pytest.raises(LlmoptError, match="exists and is not an empty folder"):
        model.save_pretrained(tmp_path / "full")
    with pytest.raises(LlmoptError, match="push_to_hub"):
        model.save_pretrained(tmp_path / "new", push_to_hub=True)
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight.add_(0.01)  # trained after quantizing
    with pytest.raises(LlmoptError, match=r"q_proj's weights changed after llmopt quantized them"):
        llmopt.save(model, tmp_path / "stale")
    assert not (tmp_path / "stale").exists() and (tmp_path / "full" / "notes.txt").read_text() == "keep me"
    cli("quantize", str(save_model(tiny_llama(seed=7), tmp_path / "tiny", tok)), "--scheme", "W8A16", "-o", str(tmp_path / "q"))
    reloaded, _ = llmopt.load_model(tmp_path / "q")  # float weights on a quantized grid
    with pytest.raises(LlmoptError, match="loaded from a quantized checkpoint"):
        llmopt.quantize(reloaded, tok, scheme="W4A16")


# -- the README's notebook example ---------------------------------------------------------------


def test_readme_notebook_example_runs(tmp_path, tok, monkeypatch):
    from test_readme import fenced_blocks

    blocks = [body for language, body in fenced_blocks(README.read_text()) if language == "python" and "llmopt.save(" in body]
    assert len(blocks) == 1, "README.md should show the notebook flow in one python block"
    code = blocks[0]
    hub_id = re.search(r'from_pretrained\("([^"]+)"', code).group(1)
    source = save_model(tiny_llama(seed=0), tmp_path / "tiny", tok)
    monkeypatch.chdir(tmp_path)
    printed: list = []
    exec(compile(code.replace(hub_id, str(source)), "README.md (notebook block)", "exec"),
         {"print": lambda *p, **_: printed.append(p)})
    assert printed
    for out in re.findall(r'"(out/[^"]+)"', code):
        assert (tmp_path / out / "llmopt.json").is_file(), f"the README's notebook block wrote no {out}"
