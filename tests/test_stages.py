"""The stage registry is the one definition of every stage: the CLI's options, the recipe schema
and the Python API all come from it and behave the same."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import llmopt
from conftest import CORPORA, save_model, tiny_llama
from llmopt.cli.main import main
from llmopt.core.errors import LlmoptError
from llmopt.pipeline.recipe import RecipeError, validate
from llmopt.pipeline.registry import PIPELINE_STAGES, STAGES
from llmopt.pipeline.stages.base import fields_of, recipe_keys

CALIB = str(CORPORA / "gutenberg" / "persuasion.txt")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_model(tiny_llama(seed=3), tmp_path_factory.mktemp("stages") / "tiny")


def _cli_options(name: str) -> set[str]:
    command = main.commands[name]
    return {p.name for p in command.params if p.name not in ("as_json", "help", "revision", "trust_remote_code")}  # hub options: the command's, not the stage's


@pytest.mark.parametrize("name", sorted(STAGES))
def test_cli_options_are_the_config_fields(name):
    spec = STAGES[name]
    fields = {f.name for f in fields_of(spec.config) if f.meta.get("cli", True)}
    assert len(fields) >= 5
    assert _cli_options(name) == fields


@pytest.mark.parametrize("name", PIPELINE_STAGES)
def test_recipe_keys_are_the_cli_options(name):
    """Every option a recipe stage takes is a CLI option of the same name, and every CLI option
    that is not the runner's (input, output, overwrite) is a recipe key."""
    spec = STAGES[name]
    keys = set(recipe_keys(spec.config).values())
    owned = {f.name for f in fields_of(spec.config) if f.meta.get("runner_owned")}
    assert keys == _cli_options(name) - owned
    assert {"output", "overwrite"} <= owned


def test_recipe_checks_values_with_the_config():
    base = {"model": "demo", "stages": [{"quantize": {"scheme": "W4A16", "group_size": -1}}]}
    with pytest.raises(RecipeError, match="group_size.*at least 0"):
        validate(base, "r.yaml", {}, default_output="out")
    base["stages"] = [{"quantize": {"scheme": "W4A16", "colour": 1}}]
    with pytest.raises(RecipeError, match="unknown option 'colour'"):
        validate(base, "r.yaml", {}, default_output="out")
    base["stages"] = [{"export": {"type": "Q9_9"}}]
    with pytest.raises(RecipeError, match="must be one of"):
        validate(base, "r.yaml", {}, default_output="out")


def test_python_api_equals_the_cli(tmp_path, tiny_dir):
    """llmopt.quantize writes exactly what `llmopt quantize` writes, and returns its record."""
    api_out, cli_out = tmp_path / "api", tmp_path / "cli"
    record = llmopt.quantize(str(tiny_dir), scheme="W4A16", method="gptq", group_size=32, output=api_out,
                             calib=CALIB, calib_samples=4, calib_seq_len=32)
    result = CliRunner().invoke(main, ["quantize", str(tiny_dir), "--scheme", "W4A16", "--method", "gptq", "--group-size", "32",
                                       "--calib", CALIB, "--calib-samples", "4", "--calib-seq-len", "32", "-o", str(cli_out), "--json"])
    assert result.exit_code == 0, result.output
    cli_record = json.loads(result.stdout)
    assert record["scheme"] == cli_record["scheme"] == "W4A16"
    assert record["group_sizes"] == cli_record["group_sizes"] == {"32": 14}
    a, b = load_file(api_out / "model.safetensors"), load_file(cli_out / "model.safetensors")
    assert len(a) == len(b) > 0 and a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert json.loads((api_out / "config.json").read_text())["quantization_config"] == \
        json.loads((cli_out / "config.json").read_text())["quantization_config"]


def test_python_api_prune_evaluate_and_recipe(tmp_path, tiny_dir):
    record = llmopt.prune(str(tiny_dir), method="magnitude", pattern="2:4", output=tmp_path / "sparse")
    assert record["sparsity"]["pattern_valid"] is True
    figures = llmopt.evaluate(str(tmp_path / "sparse"), baseline=str(tiny_dir), dataset=CALIB, seq_len=64, max_windows=2)
    assert figures["windows"] == 2 and figures["kld_mean"] > 1e-3  # 2:4 magnitude changes the model
    run = llmopt.run_recipe({"model": str(tiny_dir), "output": str(tmp_path / "recipe"),
                             "stages": [{"quantize": {"scheme": "W8A16"}}, {"export": {"format": "hf"}}]})
    assert [s["stage"].split("(")[0] for s in run["stages"]] == ["quantize", "export"]
    assert (tmp_path / "recipe" / "02-export" / "model" / "config.json").is_file()


def test_python_api_refuses_bad_options(tmp_path, tiny_dir):
    with pytest.raises(LlmoptError, match="unknown option 'groupsize'"):
        llmopt.quantize(str(tiny_dir), scheme="W4A16", groupsize=32, output=tmp_path / "x")
    with pytest.raises(LlmoptError, match="only apply to calibrated methods"):
        llmopt.quantize(str(tiny_dir), scheme="W4A16", calib_samples=8, output=tmp_path / "x")
    with pytest.raises(LlmoptError, match="apply to --format gguf only"):
        llmopt.export(str(tiny_dir), format="hf", type="Q8_0", output=tmp_path / "x")
    assert not (tmp_path / "x").exists()
