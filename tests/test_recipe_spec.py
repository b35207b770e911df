"""The realtime-chat-spec recipe: a ``draft:`` section makes a speculative-decoding draft from the
recipe's model, and the runtime block saved with the final checkpoint runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from conftest import CORPORA, save_model, tiny_llama
from llmopt.cli.main import main
from llmopt.pipeline.recipe import RecipeError, load_recipe
from llmopt.pipeline.runner import plan

CALIB = str(CORPORA / "gutenberg" / "persuasion.txt")
DRAFT = "draft:\n  stages:\n    - distill: {drop_layers: 1, steps: 2}\n"
SPEC = "runtime:\n  speculative_config: {method: draft, num_speculative_tokens: 3}\n"
MAIN = "model: demo\nstages:\n  - quantize: {scheme: W8A16}\n"


@pytest.mark.parametrize(
    "body, line, message",
    [
        (MAIN + DRAFT, 4, "the runtime block does not run it"),
        (MAIN + DRAFT + "runtime:\n  speculative_config: {method: ngram}\n", 4, "does not run it"),
        (MAIN + DRAFT + "runtime:\n  speculative_config: {method: draft, model: other}\n", 4, "does not run it"),
        (MAIN + SPEC, 5, "needs a draft model"),
        (MAIN + "draft:\n  stages: []\n" + SPEC, 5, "non-empty list"),
        (MAIN + "draft:\n  stages:\n    - export: {format: gguf}\n" + SPEC, 6, "'export' does not"),
        (MAIN + "draft:\n  stages:\n    - distill: {drop_layers: 1}\n" + SPEC, 6, "needs 'steps'"),
        (MAIN + "draft:\n  stages:\n    - quantize: {scheme: W8A16}\n    - distill: {steps: 2}\n" + SPEC, 7, "after stage 1 quantized"),
        (MAIN + DRAFT + "runtime:\n  speculative_config: {method: draft, num_speculative_tokens: 40}\n", 8, "num_speculative_tokens"),
        (MAIN + "draft: {stages: [{distill: {steps: 2}}], model: x}\n" + SPEC, 4, "only 'stages'"),
    ],
)
def test_draft_section_errors_name_file_and_line(tmp_path, body, line, message):
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    with pytest.raises(RecipeError) as info:
        load_recipe(str(path))
    text = str(info.value)
    assert f"{path}:{line}" in text and message in text, text


def test_bundled_recipe_describes_a_draft_of_under_a_third():
    recipe = load_recipe("realtime-chat-spec")
    assert [s.kind for s in recipe.draft] == ["distill", "quantize"]
    assert recipe.draft[0].options["drop_layers"] == 26  # 4 of the demo model's 30 blocks
    assert recipe.runtime["speculative_config"]["method"] == "draft" and "model" not in recipe.runtime["speculative_config"]
    assert "draft" in recipe.resolved() and len(recipe.resolved()["draft"]["stages"]) == 2


def _overrides(model: Path, out: Path) -> list[str]:
    sets = [f"model={model}", f"output={out}", f"calibration.dataset={CALIB}", "calibration.samples=4",
            "calibration.seq_len=32", "evaluate=false", "draft.stages.0.distill.drop_layers=2",
            "draft.stages.0.distill.steps=3", "draft.stages.0.distill.seq_len=32", "draft.stages.0.distill.batch_size=2",
            f"draft.stages.0.distill.data={CALIB}", "draft.stages.0.distill.validation=none",
            "draft.stages.0.distill.precision='no'"]
    return [a for s in sets for a in ("--set", s)]


def test_realtime_chat_spec_runs_end_to_end_on_a_tiny_model(tmp_path):
    """Draft (2 of 3 blocks dropped, distilled, W4A16 + int8 head) and target made by one run; the
    final checkpoint's saved runtime runs speculation with that draft, greedy output equal to plain."""
    from llmopt.runtime import LLM, SamplingParams

    model = save_model(tiny_llama(seed=5, num_hidden_layers=3), tmp_path / "tiny")
    out = tmp_path / "spec"
    result = CliRunner().invoke(main, ["run", "realtime-chat-spec", "--json", *_overrides(model, out)])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert len(record["draft_stages"]) == 2 and len(record["stages"]) == 1
    assert record["draft"] == str(out / "draft" / "02-quantize") and record["final"] == str(out / "01-quantize")
    draft_config = json.loads((out / "draft" / "02-quantize" / "config.json").read_text())
    assert draft_config["num_hidden_layers"] == 1
    distilled = json.loads((out / "draft" / "01-distill" / "llmopt.json").read_text())
    assert distilled["teacher"] == str(model) and distilled["steps"] == 3 and distilled["student"]["kind"] == "drop-layers"

    saved = json.loads((out / "01-quantize" / "llmopt.json").read_text())["runtime"]
    recipe_runtime = yaml.safe_load(Path(__file__).resolve().parents[1].joinpath("recipes/realtime-chat-spec.yaml").read_text())["runtime"]
    assert saved["speculative_config"] == {**recipe_runtime["speculative_config"], "model": "../draft/02-quantize"}
    assert {k: v for k, v in saved.items() if k != "speculative_config"} == {k: v for k, v in recipe_runtime.items() if k != "speculative_config"}

    prompts = [[7, 8, 9, 10, 11, 12, 7, 8, 9], [40, 41, 42, 43, 44]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    spec = LLM(out / "01-quantize")
    assert spec.engine.spec is not None and spec.engine.spec.proposer.engine.path == (out / "draft" / "02-quantize").resolve()
    # this tiny draft is most of its target's bytes, so adaptive k would rightly never propose:
    # fixed k makes the draft's proposals go through verification
    spec.engine.spec.adaptive.enabled = False
    outs = spec.generate(prompts, params)
    plain = LLM(out / "01-quantize", speculative_config=None).generate(prompts, params)
    assert len(outs) == len(plain) == 2
    for a, b in zip(outs, plain):
        assert len(a.token_ids) == len(b.token_ids) == 24 and a.token_ids == b.token_ids
    m = spec.metrics()
    assert m["spec_method"] == "draft" and m["spec_proposed_tokens"] > 0
    assert m["spec_accepted_tokens"] <= m["spec_proposed_tokens"]

    # a rerun finds every stage, draft ones included, done
    again = load_recipe("realtime-chat-spec", [o for o in _overrides(model, out) if o != "--set"])
    steps = plan(again)
    assert [p.draft for p in steps] == [True, True, False] and all(p.done for p in steps)
