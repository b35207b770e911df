"""``llmopt run`` and ``llmopt recipes``: YAML pipelines from the command line."""

from __future__ import annotations

import click
from rich.syntax import Syntax
from rich.table import Table

from llmopt.cli.common import emit_json, hub_options, user_errors


@click.command("run")
@click.argument("recipe")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a recipe value, e.g. --set stages.0.quantize.group_size=64 (repeatable).")
@click.option("--model", help="Use this model instead of the recipe's (needed for llm-compressor recipes, which name none).")
@click.option("-o", "--output", help="Output directory instead of the recipe's.")
@click.option("--from-stage", type=click.IntRange(1), help="Rerun from this stage (1-based) even if finished.")
@click.option("--dry-run", is_flag=True, help="Validate and show the plan; do no work.")
@click.option("--json", "as_json", is_flag=True, help="Print the run record as JSON.")
@user_errors
@hub_options(None)
def run_command(recipe, overrides, model, output, from_stage, dry_run, as_json):
    """Run RECIPE (a YAML file or a bundled recipe name) stage by stage.

    Each stage writes its checkpoint under the output directory; rerunning skips stages whose
    input and settings are unchanged, so an interrupted run continues where it stopped.
    Accepts llm-compressor recipes too (QuantizationModifier, GPTQModifier, AWQModifier,
    SmoothQuantModifier, SparseGPTModifier, WandaPruningModifier).
    """
    from llmopt.core.console import out
    from llmopt.pipeline.recipe import load_recipe
    from llmopt.pipeline.runner import plan, run_recipe

    extra = list(overrides) + ([f"model={model}"] if model else []) + ([f"output={output}"] if output else [])
    loaded = load_recipe(recipe, extra)
    if dry_run:
        steps = plan(loaded, from_stage)
        if as_json:
            emit_json({"recipe": loaded.resolved(), "plan": [{"stage": p.index, "kind": p.stage.kind, "directory": str(p.directory), "skip": p.done,
                                                               **({"draft": True} if p.draft else {})} for p in steps]})
            return
        table = Table(title=f"{recipe}: {loaded.model} → {loaded.output}", title_justify="left")
        for column in ("#", "stage", "directory", "status"):
            table.add_column(column)
        for p in steps:
            table.add_row(p.label, p.stage.describe(), str(p.directory), "done, skip" if p.done else "run")
        out.print(table)
        return

    def announce(item):
        status = "[dim]unchanged, skipped[/dim]" if item.done else "running"
        total = len(loaded.draft if item.draft else loaded.stages)
        out.print(f"[bold]{'draft ' if item.draft else ''}stage {item.index}/{total}[/bold] {item.stage.describe()} — {status}")

    record = run_recipe(loaded, from_stage, on_stage=None if as_json else announce)
    if as_json:
        emit_json(record)
        return
    out.print(f"[green]done[/green]: final checkpoint {record['final']} (record: {loaded.output}/run.json)")
    if "draft" in record:
        out.print(f"speculative-decoding draft: {record['draft']} (the checkpoint's runtime settings run it)")
    if "evaluation" in record:
        from llmopt.cli.tables import eval_table

        out.print(eval_table(f"{record['final']} vs {loaded.model}", record["evaluation"]))


@click.group("recipes")
def recipes_group():
    """Bundled recipes: list them, show one."""


@recipes_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the recipes as JSON.")
@user_errors
def recipes_list(as_json):
    """The bundled recipes, with what each is for."""
    import yaml

    from llmopt.core.console import out
    from llmopt.pipeline.recipe import bundled_recipes

    rows = []
    for name, path in sorted(bundled_recipes().items()):
        data = yaml.safe_load(path.read_text()) or {}
        stages = " → ".join(next(iter(s)) for s in data.get("stages", []) if isinstance(s, dict))
        draft = (data.get("draft") or {}).get("stages") if isinstance(data.get("draft"), dict) else None
        if isinstance(draft, list):
            stages += " (draft: " + " → ".join(next(iter(s)) for s in draft if isinstance(s, dict)) + ")"
        rows.append({"name": name, "description": data.get("description", ""), "stages": stages})
    if as_json:
        emit_json(rows)
        return
    table = Table(title="bundled recipes (llmopt run NAME)", title_justify="left")
    for column in ("name", "stages", "description"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["name"], row["stages"], row["description"])
    out.print(table)


@recipes_group.command("show")
@click.argument("name")
@user_errors
def recipes_show(name):
    """Print a bundled recipe's YAML."""
    from llmopt.core.console import out
    from llmopt.core.errors import LlmoptError
    from llmopt.pipeline.recipe import bundled_recipes

    recipes = bundled_recipes()
    if name not in recipes:
        raise LlmoptError(f"no bundled recipe '{name}'", f"choose one of {', '.join(sorted(recipes))}")
    out.print(Syntax(recipes[name].read_text(), "yaml"))
