"""Recipes: validation (with file and line), llm-compressor mapping, resumable runs, bundled recipes."""

from __future__ import annotations

import json
import re
import textwrap

import pytest
from click.testing import CliRunner

from conftest import CORPORA
from llmopt.cli.main import main
from llmopt.core.errors import LlmoptError
from llmopt.formats.compressed import read_compressed
from llmopt.pipeline.recipe import RecipeError, bundled_recipes, load_recipe
from llmopt.pipeline.runner import plan, run_recipe

CALIB = CORPORA / "gutenberg" / "persuasion.txt"


def write(tmp_path, text: str, name: str = "r.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


@pytest.mark.parametrize(
    "body, line, message",
    [
        ("model: demo\nstages:\n  - quantize: {scheme: W4A16}\nbogus: 1\n", 4, "unknown key 'bogus'"),
        ("model: demo\nstages:\n  - quantise: {scheme: W4A16}\n", 3, "unknown stage 'quantise'"),
        ("model: demo\nstages:\n  - quantize:\n      scheme: W4A16\n      group_sise: 32\n", 5, "unknown option 'group_sise'"),
        ("model: demo\nstages:\n  - quantize:\n      scheme: W4A16\n      group_size: lots\n", 5, "group_size"),
        ("model: demo\nstages:\n  - quantize: {method: gptq}\n", 3, "needs 'scheme'"),
        ("model: demo\nstages: []\n", 2, "non-empty list"),
        ("model: demo\nevaluate: {max_windows: many}\nstages:\n  - quantize: {scheme: W8A16}\n", 2, "must be int"),
        ("model: demo\nstages:\n  - quantize: {scheme: W8A16}\n  - quantize: {scheme: W4A16, method: awq}\n", 4, "already quantized"),
        ("model: demo\nstages:\n  - quantize: {scheme: W8A16, output: x}\n", 3, "set by the recipe runner"),
        ("model: demo\nstages:\n  - quantize: {scheme: W8A16}\nruntime: {max_seqs: 3}\n", 4, "unknown runtime setting"),
        ("model: demo\nstages:\n  - quantize: {scheme: [W8A16\n", 4, "not valid YAML"),
    ],
)
def test_validation_errors_name_file_line_and_key(tmp_path, body, line, message):
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    with pytest.raises(RecipeError) as info:
        load_recipe(str(path))
    text = str(info.value)
    assert f"{path}:{line}" in text and message in text, text


def test_awq_after_quantization_is_named(tmp_path):
    path = write(tmp_path, """
        model: demo
        stages:
          - quantize: {scheme: W8A16}
          - quantize: {scheme: W4A16, method: awq}
    """)
    with pytest.raises(RecipeError, match="awq scales weights that are already quantized"):
        load_recipe(str(path))


def test_bundled_recipes_all_validate():
    names = set(bundled_recipes())
    assert {"realtime-chat", "throughput", "edge", "w4a16-gptq", "w4a16-awq", "w8a8-smoothquant", "fp8-dynamic",
            "sparse-2of4", "gguf-mixed"} <= names
    for name in names:
        recipe = load_recipe(name)
        assert recipe.stages and recipe.model == "demo"


def test_stage_keys_accept_cli_option_names(tmp_path):
    """Stage keys are the CLI's long option names (``--format`` → ``format``, ``--eval``)."""
    path = write(tmp_path, """
        model: demo
        stages:
          - prune: {method: wanda, sparsity: 0.5, eval: true}
          - export: {format: gguf, type: q8_0, dense-type: f16}
    """)
    recipe = load_recipe(str(path))
    assert recipe.stages[0].options["eval"] is True
    assert {k: str(v).lower() for k, v in recipe.stages[1].options.items()} == {"format": "gguf", "type": "q8_0", "dense_type": "f16"}
    older = write(tmp_path, "model: demo\nstages:\n  - quantize: {scheme: W8A8, method: smoothquant, smooth_alpha: 0.7, run_evaluation: true}\n", "old.yaml")
    assert load_recipe(str(older)).stages[0].options == {"scheme": "W8A8", "method": "smoothquant", "alpha": 0.7, "eval": True}
    bad = write(tmp_path, "model: demo\nstages:\n  - export: {fromat: gguf}\n", "bad.yaml")
    with pytest.raises(RecipeError, match="unknown option 'fromat'.*format"):
        load_recipe(str(bad))


def test_overrides_apply_and_are_validated(tmp_path):
    recipe = load_recipe("w4a16-gptq", ["stages.0.quantize.group_size=64", "model=/somewhere"])
    assert recipe.stages[0].options["group_size"] == 64 and recipe.model == "/somewhere"
    with pytest.raises(RecipeError, match="group_size"):
        load_recipe("w4a16-gptq", ["stages.0.quantize.group_size=big"])
    with pytest.raises(LlmoptError, match="not key=value"):
        load_recipe("w4a16-gptq", ["oops"])


def test_llmcompressor_recipe_mapping(tmp_path):
    path = write(tmp_path, """
        quant_stage:
          quant_modifiers:
            SmoothQuantModifier:
              smoothing_strength: 0.8
            GPTQModifier:
              ignore: ["lm_head", "re:.*mlp.down_proj$"]
              scheme: W8A8
              dampening_frac: 0.05
              targets: Linear
    """)
    recipe = load_recipe(str(path), ["model=demo"])
    (stage,) = recipe.stages
    assert stage.kind == "quantize"
    assert stage.options["method"] == "smoothquant+gptq" and stage.options["scheme"] == "W8A8"
    assert stage.options["alpha"] == 0.8 and stage.options["damp"] == 0.05
    assert list(stage.options["ignore"]) == [".*mlp.down_proj$"]

    groups = write(tmp_path, """
        first_stage:
          first_modifiers:
            AWQModifier: {}
            QuantizationModifier:
              config_groups:
                group_0:
                  targets: [Linear]
                  weights: {num_bits: 4, type: int, symmetric: false, strategy: group, group_size: 64}
    """, "groups.yaml")
    (stage,) = load_recipe(str(groups), ["model=demo"]).stages
    assert (stage.options["scheme"], stage.options["method"], stage.options["group_size"]) == ("W4A16_ASYM", "awq", 64)

    w4a8 = write(tmp_path, """
        w_stage:
          w_modifiers:
            GPTQModifier:
              config_groups:
                group_0:
                  targets: [Linear]
                  weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 128}
                  input_activations: {num_bits: 8, type: int, symmetric: true, strategy: token, dynamic: true}
    """, "w4a8.yaml")
    (stage,) = load_recipe(str(w4a8), ["model=demo"]).stages
    assert (stage.options["scheme"], stage.options["method"], stage.options["group_size"]) == ("W4A8", "gptq", 128)

    spin = write(tmp_path, """
        s_stage:
          s_modifiers:
            SpinQuantModifier: {rotations: [R1, R2], transform_type: random-hadamard}
            GPTQModifier: {scheme: W4A16, targets: Linear, ignore: [lm_head]}
    """, "spin.yaml")
    (stage,) = load_recipe(str(spin), ["model=demo"]).stages
    assert (stage.options["scheme"], stage.options["method"], stage.options["rotate"]) == ("W4A16", "gptq", "hadamard")
    assert stage.options["online_hadamard"] == "off"  # no R4 asked: none added, even for schemes with activations
    r4 = write(tmp_path, """
        s_stage:
          s_modifiers:
            SpinQuantModifier: {rotations: [R1, R2, R4]}
            QuantizationModifier: {scheme: W8A8, targets: Linear, ignore: [lm_head]}
    """, "r4.yaml")
    (stage,) = load_recipe(str(r4), ["model=demo"]).stages
    assert (stage.options["scheme"], stage.options["rotate"], stage.options["online_hadamard"]) == ("W8A8", "hadamard", "on")
    for body, message in [("SpinQuantModifier: {rotations: [R1, R2, R3]}", "it has no R3"),
                          ("SpinQuantModifier: {learnable: true}", "no learned rotations"),
                          ("SpinQuantModifier: {transform_type: dct}", "transform_type 'dct'"),
                          ("QuIPModifier: {rotations: [v, u]}", "it has no output rotation u"),
                          ("QuIPModifier: {transform_type: random-matrix}", "transform_type 'random-matrix'"),
                          ("QuIPModifier: {transform_block_size: 64}", "transform_block_size: 64 is not supported"),
                          ("QuIPModifier: {targets: [re:.*mlp.*]}", "llmopt transforms every decoder Linear's input")]:
        bad = write(tmp_path, f"""
            s_stage:
              s_modifiers:
                {body}
                GPTQModifier: {{scheme: W4A16, targets: Linear}}
        """, "bad.yaml")
        with pytest.raises(LlmoptError, match=re.escape(message)):
            load_recipe(str(bad), ["model=demo"])
    quip = write(tmp_path, """
        s_stage:
          s_modifiers:
            QuIPModifier: {rotations: [v], transform_type: random-hadamard}
            GPTQModifier: {scheme: W4A16, targets: Linear, ignore: [lm_head]}
    """, "quip.yaml")
    (stage,) = load_recipe(str(quip), ["model=demo"]).stages
    assert (stage.options["scheme"], stage.options["method"], stage.options["online_hadamard"]) == ("W4A16", "gptq", "all")
    assert "rotate" not in stage.options  # QuIP alone: no offline rotation
    both = write(tmp_path, """
        s_stage:
          s_modifiers:
            QuIPModifier: {}
            SpinQuantModifier: {rotations: [R1, R2]}
            GPTQModifier: {scheme: W4A16, targets: Linear, ignore: [lm_head]}
    """, "both.yaml")
    (stage,) = load_recipe(str(both), ["model=demo"]).stages
    assert (stage.options["rotate"], stage.options["online_hadamard"]) == ("hadamard", "all")
    alone = write(tmp_path, """
        s_stage:
          s_modifiers:
            SpinQuantModifier: {}
    """, "alone.yaml")
    with pytest.raises(LlmoptError, match="not followed by a quantization modifier"):
        load_recipe(str(alone), ["model=demo"])


def test_run_resumes_and_skips_unchanged_stages(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    path = write(tmp_path, f"""
        model: {tiny_model_dir}
        output: {out}
        calibration: {{dataset: {CALIB}, samples: 4, seq_len: 32}}
        stages:
          - quantize: {{scheme: W4A16, method: gptq, group_size: 32}}
    """)
    recipe = load_recipe(str(path))
    first = run_recipe(recipe)
    assert first["stages"][0]["skipped"] is False
    stage_dir = out / "01-quantize"
    codes = read_compressed(stage_dir)[0]
    assert (out / "recipe.resolved.json").is_file() and (out / "run.json").is_file()

    again = run_recipe(load_recipe(str(path)))
    assert again["stages"][0]["skipped"] is True  # same input and settings: nothing to do

    # an interrupted stage (output written, marker missing) is redone; results are identical
    (stage_dir / "llmopt-stage.json").unlink()
    assert plan(load_recipe(str(path)))[0].done is False
    redo = run_recipe(load_recipe(str(path)))
    assert redo["stages"][0]["skipped"] is False
    for name, qw in read_compressed(stage_dir)[0].items():
        assert (qw.codes == codes[name].codes).all()

    # changed settings rerun the stage
    changed = load_recipe(str(path), ["stages.0.quantize.group_size=64"])
    assert plan(changed)[0].done is False


def test_cli_run_and_recipes_commands(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    path = write(tmp_path, f"""
        model: {tiny_model_dir}
        output: {out}
        stages:
          - quantize: {{scheme: W8A16}}
    """)
    runner = CliRunner()
    dry = runner.invoke(main, ["run", str(path), "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.stdout)["plan"][0]["skip"] is False and not out.exists()
    done = runner.invoke(main, ["run", str(path), "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["final"] == str(out / "01-quantize")
    listed = runner.invoke(main, ["recipes", "list", "--json"])
    assert {"realtime-chat", "throughput"} <= {r["name"] for r in json.loads(listed.stdout)}
    shown = runner.invoke(main, ["recipes", "show", "w4a16-gptq"])
    assert shown.exit_code == 0 and "gptq" in shown.stdout
    bad = runner.invoke(main, ["run", str(tmp_path / "missing.yaml")])
    assert bad.exit_code == 2 and "recipe not found" in bad.stderr


def test_demo_variants_validate(tmp_path):
    from llmopt.evaluation.demo import VARIANTS, variant_recipes

    recipes = variant_recipes("demo", tmp_path)
    assert list(recipes) == list(VARIANTS)
    distill = recipes["drop 6 layers + distill"].stages[0]
    assert distill.kind == "distill" and distill.options["drop_layers"] == 6
