"""Every command, fed input a user can get wrong: exit code 2, one line on stderr naming the
problem (no traceback), and no partial output left behind."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from click.testing import CliRunner

from conftest import CORPORA, save_model, tiny_llama
from llmopt.cli.main import main

CALIB = str(CORPORA / "gutenberg" / "persuasion.txt")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Good and broken inputs, made once."""
    root = tmp_path_factory.mktemp("bad-input")
    model = save_model(tiny_llama(seed=5), root / "tiny")
    other = save_model(tiny_llama(seed=6, vocab_size=300), root / "other-vocab")
    plain = root / "notes.txt"
    plain.write_text("not a model")
    (root / "empty.txt").write_text("")
    (root / "short.txt").write_text("a few words only")
    bad_magic = root / "bad.gguf"
    bad_magic.write_bytes(b"NOPE" + b"\0" * 64)
    truncated_gguf = root / "truncated.gguf"
    truncated_gguf.write_bytes(b"GGUF" + struct.pack("<I", 3) + b"\x01")
    bad_config = root / "bad-config"
    bad_config.mkdir()
    (bad_config / "config.json").write_text("{ not json")
    no_weights = root / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((model / "config.json").read_text())
    truncated = root / "truncated-weights"
    truncated.mkdir()
    for f in model.iterdir():
        data = f.read_bytes()
        (truncated / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".safetensors" else data)
    existing = root / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("keep")
    yaml_bad = root / "bad.yaml"
    yaml_bad.write_text("model: demo\nstages: [quantize: {scheme: W4A16}\n")
    yaml_key = root / "key.yaml"
    yaml_key.write_text("model: demo\ncolour: blue\nstages:\n  - quantize: {scheme: W4A16}\n")
    return {"model": str(model), "other": str(other), "plain": str(plain), "empty": str(root / "empty.txt"),
            "short": str(root / "short.txt"), "bad_magic": str(bad_magic), "truncated_gguf": str(truncated_gguf),
            "bad_config": str(bad_config), "no_weights": str(no_weights), "truncated": str(truncated),
            "existing": str(existing), "under_file": str(plain / "out"), "yaml_bad": str(yaml_bad),
            "yaml_key": str(yaml_key), "missing": str(root / "missing"), "root": root}


Q = ["quantize", "{model}", "-o", "{out}"]
P = ["prune", "{model}", "-o", "{out}"]
E = ["export", "{model}", "-o", "{out}"]
CASES = [
    # quantize: inputs
    (["quantize", "{missing}", "--scheme", "W4A16", "-o", "{out}"], "no such folder"),
    (["quantize", "{plain}", "--scheme", "W4A16", "-o", "{out}"], "is a file, not a model"),
    (["quantize", "{bad_magic}", "--scheme", "W4A16", "-o", "{out}"], "bad magic"),
    (["quantize", "{truncated_gguf}", "--scheme", "W4A16", "-o", "{out}"], "gguf"),
    (["quantize", "{bad_config}", "--scheme", "W4A16", "-o", "{out}"], "config.json"),
    (["quantize", "{no_weights}", "--scheme", "W4A16", "-o", "{out}"], "weights"),
    (["quantize", "{truncated}", "--scheme", "W4A16", "-o", "{out}"], "safetensors"),
    # quantize: options
    (Q + ["--scheme", "W3A16"], "unknown scheme 'W3A16'"),
    (Q + ["--scheme", "W4A16", "--method", "magic"], "unknown method 'magic'"),
    (Q + ["--scheme", "W4A16", "--group-size", "-1"], "--group-size"),
    (Q + ["--scheme", "W8A16", "--group-size", "32"], "takes no group size"),
    (Q + ["--scheme", "W4A16", "--method", "smoothquant"], "needs scheme W8A8"),
    (Q + ["--scheme", "W8A8", "--method", "awq"], "AWQ"),
    (Q + ["--scheme", "NF4", "--method", "gptq"], "NF4"),
    (Q + ["--scheme", "NF4", "--group-size", "64"], "NF4 (bitsandbytes) takes no --group-size"),
    (Q + ["--scheme", "W4A16", "--calib-samples", "8"], "only apply to calibrated methods"),
    (Q + ["--scheme", "W4A16", "--act-order"], "act-order"),
    (Q + ["--scheme", "W4A16", "--method", "awq", "--float-targets"], "--float-targets does not apply to method awq: it is an option of gptq"),
    (Q + ["--scheme", "W4A16", "--ignore", "("], "invalid ignore pattern"),
    (Q + ["--scheme", "W4A16", "--ignore", ".*"], "no Linear layers left"),
    (Q + ["--scheme", "NF4", "--ignore", "re:.*"], "no Linear layers left"),
    (Q + ["--scheme", "W4A16", "--ignore", "head", "--head", "int4"], "keeps lm_head in float"),  # found in the name
    (Q + ["--scheme", "W4A16", "--ignore", "re:lm_", "--head", "int8"], "keeps lm_head in float"),  # matched from the start
    (Q + ["--scheme", "W4A16", "--device", "tpu"], "unknown --device 'tpu'"),
    (Q + ["--scheme", "W4A16", "--device", "cuda"], "no CUDA GPU"),
    (P + ["--method", "drop-layers", "--num", "1", "--device", "cpu:0"], "not drop-layers"),
    (Q + ["--scheme", "W4A16", "--method", "gptq", "--calib", "{empty}"], "calibration"),
    (Q + ["--scheme", "W4A16", "--method", "gptq", "--calib", "{missing}"], "not found"),
    # quantize: outputs
    (["quantize", "{model}", "--scheme", "W8A16", "-o", "{existing}"], "exists"),
    (["quantize", "{model}", "--scheme", "W8A16", "-o", "{under_file}"], "cannot"),
    # prune
    (P + ["--method", "shears"], "unknown"),
    (P + ["--method", "magnitude", "--sparsity", "1.5"], "sparsity"),
    (P + ["--method", "magnitude", "--pattern", "5:4"], "0 < N < M"),
    (P + ["--method", "magnitude", "--pattern", "2-4"], "malformed"),
    (P + ["--method", "magnitude", "--sparsity", "0.5", "--pattern", "2:4"], "sparsity"),
    (P + ["--method", "drop-layers", "--num", "9"], "layers"),
    (P + ["--method", "width"], "ratio"),
    (P + ["--method", "magnitude", "--sparsity", "0.5", "--calib-samples", "4"], "only apply to calibrated pruning"),
    # export
    (E + ["--format", "hf", "--type", "Q8_0"], "apply to --format gguf only"),
    (["export", "{model}", "-o", "{out}.gguf", "--dtype", "float16"], "--dtype applies to --format hf only"),
    (E + ["--type", "Q9_9"], "--type"),
    (["export", "{model}", "-o", "{existing}", "--format", "hf"], "exists"),
    (["export", "{bad_magic}", "-o", "{out}.gguf"], "bad magic"),
    # eval
    (["eval", "{missing}"], "no such folder"),
    (["eval", "{model}", "--seq-len", "1"], "--seq-len"),
    (["eval", "{model}", "--dataset", "{empty}", "--seq-len", "64"], "empty"),
    (["eval", "{model}", "--seq-len", "4096"], "exceeds the model's 512 positions"),
    (["eval", "{model}", "--dataset", "{short}", "--seq-len", "256"], "fewer than one window"),
    (["eval", "{model}", "--baseline", "{other}", "--dataset", CALIB, "--seq-len", "64", "--max-windows", "1"], "vocabularies"),
    (["eval", "{model}", "--dataset", CALIB, "--seq-len", "64", "--max-windows", "1", "-o", "{under_file}"], "cannot"),
    # inspect
    (["inspect", "{missing}"], "no such folder"),
    (["inspect", "{truncated}"], "safetensors"),
    # generate / bench
    (["generate", "{missing}", "hi"], "no such folder"),
    (["generate", "{model}", "hi", "--max-tokens", "0"], "--max-tokens"),
    (["generate", "{model}", "hi", "--device", "cuda"], "CUDA"),
    (["bench", "{model}", "--prompt-len", "abc"], "--prompt-len"),
    (["bench", "{model}", "--output-len", "10:5"], "not a valid range"),
    # recipes
    (["run", "no-such-recipe"], "recipe not found"),
    (["run", "{yaml_bad}"], "not valid YAML"),
    (["run", "{yaml_key}"], "unknown key 'colour'"),
    (["run", "w4a16-gptq", "--set", "nokeyvalue"], "key=value"),
    (["run", "w4a16-gptq", "--set", "stages.0.quantize.group_size=-3", "--dry-run"], "at least 0"),
    (["recipes", "show", "no-such-recipe"], "no-such-recipe"),
    # distill
    (["distill", "--teacher", "{model}", "--student", "{model}", "--student-from", "{model}", "--steps", "1", "-o", "{out}"], "exactly one of"),
    (["distill", "--teacher", "{model}", "--student-from", "{model}", "--drop-layers", "1", "--steps", "0", "-o", "{out}"], "--steps 0"),
    # compare
    (["compare", "{model}", "{missing}", "-o", "{out}"], "no such folder"),
]


@pytest.mark.parametrize("args, expected", CASES, ids=[" ".join(a[:3]) + f" [{i}]" for i, (a, _) in enumerate(CASES)])
def test_bad_input_gives_one_line_and_exit_2(files, tmp_path, args, expected):
    out = tmp_path / "out"
    values = {**files, "out": str(out)}
    argv = [a.format(**values) for a in args]
    before = sorted(p.name for p in files["root"].rglob("*"))
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 2, (argv, result.exit_code, result.output, result.exception)
    stderr = result.stderr.strip()
    assert "Traceback" not in result.output and not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)
    # one error line (click's usage errors add the usage and a hint; notices such as a memory
    # estimate may precede it)
    lines = [line for line in stderr.splitlines() if line.lower().startswith("error")]
    assert len(lines) == 1, stderr
    assert expected.lower() in lines[0].lower(), (expected, lines[0])
    assert not out.exists() and not (tmp_path / "out.gguf").exists(), "partial output left behind"
    assert sorted(p.name for p in files["root"].rglob("*")) == before, "an input folder was changed"
    assert (files["root"] / "existing" / "keep.txt").read_text() == "keep"


def test_there_are_at_least_40_cases_over_every_command():
    assert len(CASES) >= 40
    commands = {args[0] for args, _ in CASES}
    assert {"quantize", "prune", "export", "eval", "inspect", "generate", "bench", "run", "recipes", "distill", "compare"} <= commands


def test_a_bug_still_shows_its_traceback(files, tmp_path, monkeypatch):
    """The boundary maps user-caused failures only: a genuine bug is not hidden."""
    import llmopt.pipeline.stages.quantize as stage

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(stage, "float_source", broken)
    result = CliRunner().invoke(main, ["quantize", files["model"], "--scheme", "W8A16", "-o", str(tmp_path / "o")])
    assert isinstance(result.exception, ZeroDivisionError)
    assert json.dumps(result.exit_code) == "1"


@pytest.mark.parametrize("args, where", [
    (["prune", "{model}", "--method", "sparsegpt", "--sparsity", "0.5"], "decoder layer 0: SparseGPT on self_attn.q_proj"),
    (["quantize", "{model}", "--scheme", "W4A16", "--group-size", "32", "--method", "gptq"], "GPTQ on model.layers.0.self_attn.q_proj"),
])
def test_numerical_failure_names_the_layer_and_the_fix(files, tmp_path, monkeypatch, args, where):
    """A Hessian that no dampening makes positive definite (here: NaN activations) stops the run
    with one line naming the module and suggesting --damp, and leaves nothing behind."""
    import llmopt.linear_stats as linear_stats

    # every Hessian (copied or taken in place) is read through _xtx
    monkeypatch.setattr(linear_stats.LinearStats, "_xtx", lambda self, name: torch.full((64, 64), float("nan"), dtype=torch.float64))
    out = tmp_path / "out"
    argv = [a.format(**files) for a in args] + ["--calib", CALIB, "--calib-samples", "2", "--calib-seq-len", "32", "-o", str(out)]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 2, (result.output, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and where in lines[0] and "--damp" in lines[0], result.stderr
    assert not out.exists()
