"""Recipes mean what they say: their ``runtime:`` settings become the output's engine defaults,
and an interrupted stage resumes inside a recipe (kill -9, rerun, same weights)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file

from conftest import CORPORA, save_model, tiny_llama
from llmopt.cli.main import main

CALIB = str(CORPORA / "gutenberg" / "persuasion.txt")


def test_realtime_chat_output_benches_with_the_recipe_runtime(tmp_path, tiny_model_dir):
    """The bundled realtime-chat recipe, run on a tiny model: `bench` with no options uses its
    runtime block (output head in bf16, 16 sequences, 256-token prefill chunks)."""
    out = tmp_path / "chat"
    sets = [f"model={tiny_model_dir}", f"output={out}", f"calibration.dataset={CALIB}", "calibration.samples=4",
            "calibration.seq_len=32", "evaluate=false"]
    result = CliRunner().invoke(main, ["run", "realtime-chat", "--json", *[a for s in sets for a in ("--set", s)]])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    recipe_runtime = yaml.safe_load(Path(__file__).resolve().parents[1].joinpath("recipes/realtime-chat.yaml").read_text())["runtime"]
    assert len(recipe_runtime) >= 3 and record["runtime"] == recipe_runtime
    final = record["final"]
    assert json.loads((Path(final) / "llmopt.json").read_text())["runtime"] == recipe_runtime
    bench = CliRunner().invoke(main, ["bench", final, "--json", "--no-single", "-n", "2", "--prompt-len", "8:16", "--output-len", "4:8"])
    assert bench.exit_code == 0, bench.output
    figures = json.loads(bench.stdout)
    assert figures["saved_runtime_settings"] == recipe_runtime
    for key, value in recipe_runtime.items():
        assert figures["engine"][key] == value, key
    assert figures["lm_head_runs_as"].startswith("bf16")
    # a command-line option still overrides the saved setting
    override = CliRunner().invoke(main, ["bench", final, "--json", "--no-single", "-n", "1", "--prompt-len", "8", "--output-len", "4",
                                         "--lm-head", "auto", "--max-num-seqs", "4"])
    assert override.exit_code == 0, override.output
    figures = json.loads(override.stdout)
    assert figures["engine"]["lm_head"] == "auto" and figures["engine"]["max_num_seqs"] == 4
    assert figures["engine"]["max_num_batched_tokens"] == recipe_runtime["max_num_batched_tokens"]


def _recipe(tmp_path: Path, teacher: Path, output: Path) -> Path:
    recipe = {
        "model": str(teacher), "output": str(output),
        "stages": [{"distill": {"student_from": str(teacher), "drop_layers": 2, "calib": CALIB, "data": CALIB,
                                "validation": "none", "steps": 48, "seq_len": 32, "batch_size": 2, "save_every": 2,
                                "precision": "no", "lr": 3e-3}}],
    }
    path = tmp_path / f"{output.name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _run(recipe: Path, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "llmopt", "run", str(recipe), "--json"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def test_distill_stage_resumes_after_kill_9(tmp_path):
    teacher = save_model(tiny_llama(seed=0, num_hidden_layers=4), tmp_path / "teacher")
    full = _recipe(tmp_path, teacher, tmp_path / "full")
    assert _run(full).wait(timeout=600) == 0

    split = _recipe(tmp_path, teacher, tmp_path / "split")
    checkpoints = tmp_path / "split" / "01-distill.checkpoints"
    process = _run(split)
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        steps = sorted(checkpoints.glob("step-*")) if checkpoints.is_dir() else []
        if steps and int(steps[-1].name.split("-")[1]) >= 4:
            break
        time.sleep(0.02)  # a step of this tiny student takes milliseconds: look often, kill early
    assert process.poll() is None, "the run finished before it could be killed: make it longer"
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    kept = sorted(checkpoints.glob("step-*"))
    assert kept and not (tmp_path / "split" / "01-distill" / "llmopt.json").exists()

    resumed = _run(split)
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err.decode()[-2000:]
    record = json.loads((tmp_path / "split" / "01-distill" / "llmopt.json").read_text())
    assert record["resumed_from_step"] >= 2
    a = load_file(tmp_path / "full" / "01-distill" / "model.safetensors")
    b = load_file(tmp_path / "split" / "01-distill" / "model.safetensors")
    assert len(a) == len(b) > 0 and a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
