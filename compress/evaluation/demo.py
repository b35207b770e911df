"""``llmopt demo``: build the standard variants of the bundled model and compare them.

Every variant is a small recipe run by the recipe runner (so a second run skips finished
stages), then ``compare`` measures them all in one run. Evaluation figures are cached by
checkpoint contents; speed is measured afresh each time.
"""

from __future__ import annotations

import time
from pathlib import Path

from llmopt.evaluation.compare import CompareSettings, compare, write_report
from llmopt.pipeline.recipe import Recipe, validate
from llmopt.pipeline.runner import plan, run_recipe

CALIBRATION = {"dataset": "austen", "samples": 64, "seq_len": 512, "seed": 0}

# label → stages (each a recipe of its own, all starting from the demo model)
VARIANTS: dict[str, list[dict]] = {
    "W8A16 rtn": [{"quantize": {"scheme": "W8A16", "method": "rtn"}}],
    "FP8 rtn": [{"quantize": {"scheme": "FP8", "method": "rtn"}}],
    "W4A16 g32 gptq": [{"quantize": {"scheme": "W4A16", "method": "gptq", "group_size": 32}}],
    "2:4 sparsegpt": [{"prune": {"method": "sparsegpt", "pattern": "2:4"}}],
    # a short distillation (about 3 minutes on 2 CPU cores) keeps the demo under 25 minutes
    "drop 6 layers + distill": [{"distill": {"student_from": "demo", "drop_layers": 6, "steps": 40, "seq_len": 256,
                                             "batch_size": 2, "hidden_weight": 1.0}}],
}


def variant_recipes(model: str, output: Path, only: list[str] | None = None) -> dict[str, Recipe]:
    recipes = {}
    for label, stages in VARIANTS.items():
        if only and label not in only:
            continue
        name = label.replace(" ", "-").replace(":", "of").replace("+", "and")
        data = {"model": model, "output": str(output / name), "calibration": CALIBRATION, "stages": stages}
        if model != "demo":
            data["stages"] = [{k: {**v, **({"student_from": model} if "student_from" in v else {})}} for s in stages for k, v in s.items()]
        recipes[label] = validate(data, "llmopt demo", {}, default_output=str(output / name))
    return recipes


def run_demo(output: Path, model: str = "demo", settings: CompareSettings | None = None, on_step=None) -> dict:
    """Build (or reuse) every variant, compare them with the model, write the report."""
    start = time.perf_counter()
    recipes = variant_recipes(model, output)
    finals, labels, built = [], [f"float ({model})"], {}
    for label, recipe in recipes.items():
        if on_step:
            on_step(label, all(p.done for p in plan(recipe)))
        t0 = time.perf_counter()
        record = run_recipe(recipe)
        finals.append(record["final"])
        labels.append(label)
        built[label] = {"seconds": round(time.perf_counter() - t0, 1), "reused": all(s["skipped"] for s in record["stages"])}
    settings = settings or CompareSettings(max_windows=4, repetitions=3, serving_requests=8)
    settings.labels = labels
    if on_step:
        on_step("compare", False)
    report = compare(model, finals, settings)
    report["build"] = built
    report["wall_seconds"] = round(time.perf_counter() - start, 1)
    report["files"] = {k: str(v) for k, v in write_report(report, output).items()}
    return report
