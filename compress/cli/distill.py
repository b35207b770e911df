"""``llmopt distill``: teacher → student with logit and hidden-state losses, resumable."""

from __future__ import annotations

import sys

import click

from llmopt.cli.common import emit_json, hub_options, user_errors
from llmopt.cli.options import config_from_cli, stage_options
from llmopt.pipeline.stages.distill import DistillConfig


def _table(outcome) -> object:
    from llmopt.cli.tables import record_table

    record = outcome.record
    student = record["student"]
    rows = [
        ("teacher", record["teacher"]),
        ("student", f"{student.get('spec')} ({student.get('kind')}, {student.get('layers')} layers)"),
        ("dropped layers", ", ".join(map(str, student["dropped"])) if student.get("dropped") else None),
        ("codes changed", f"{record['codes_changed']:,} of {record['codes']:,} ({', '.join(student['schemes'])})"
         if "codes_changed" in record else None),
        ("steps / tokens", f"{record['steps']} / {record['tokens']:,}"),
        ("processes / precision", f"{record['world_size']} / {record['precision']}"),
        ("train time", f"{record['train_seconds']:.1f} s"),
    ]
    if record["loss_curve"]:
        last = record["loss_curve"][-1]
        rows.append(("final loss terms", "  ".join(f"{k} {v:.4f}" for k, v in last.items() if k not in ("step", "lr"))))
    if record["validation_curve"]:
        first, last = record["validation_curve"][0], record["validation_curve"][-1]
        for key in ("ppl", "kl"):
            if key in last:
                rows.append((f"validation {key} (step {first['step']} → {last['step']})", f"{first[key]:.4g} → {last[key]:.4g}"))
    return record_table(f"distilled → {outcome.output}", rows)


@click.command("distill")
@stage_options(DistillConfig)
@click.option("--json", "as_json", is_flag=True, help="Print the run record as JSON.")
@user_errors
@hub_options("teacher")
def distill_command(as_json: bool, **params):
    """Distil TEACHER into a student and save it as a Hugging Face checkpoint.

    Runs data-parallel when started by torchrun (e.g. torchrun --nproc_per_node 2 -m llmopt distill …).
    Ctrl-C saves a checkpoint; rerun the same command with --resume to continue.

    \b
    Examples:
      llmopt distill --teacher demo --student-from demo --drop-layers 8 --steps 300 --eval-every 50 -o out/student
      llmopt distill --teacher demo --student out/pruned --loss jsd --steps 1000 --save-every 100 -o out/jsd
    """
    from llmopt.core.console import err, out
    from llmopt.pipeline.stages.distill import run_distill_stage

    config = config_from_cli(DistillConfig, params)
    outcome = run_distill_stage(config, show_progress=not as_json)
    if outcome.interrupted:
        err.print(f"interrupted at step {outcome.result.steps_done} of {config.steps}; checkpoint saved in {outcome.result.checkpoint}; "
                  "rerun the same command with --resume to continue", highlight=False)
        sys.exit(130)
    from accelerate import PartialState

    if not PartialState().is_main_process:
        return
    if as_json:
        emit_json(outcome.record)
    else:
        out.print(_table(outcome))
