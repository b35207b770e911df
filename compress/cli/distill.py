"""``llmopt distill``: teacher → student with logit and hidden-state losses, resumable."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from llmopt.cli.main import emit_json, user_errors


def _table(outcome) -> object:
    from rich.table import Table

    record = outcome.record
    table = Table(title=f"distilled → {outcome.output}", title_justify="left", show_header=False)
    table.add_column("field")
    table.add_column("value")
    student = record["student"]
    rows = [
        ("teacher", record["teacher"]),
        ("student", f"{student.get('spec')} ({student.get('kind')}, {student.get('layers')} layers)"),
        ("dropped layers", ", ".join(map(str, student["dropped"])) if student.get("dropped") else None),
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
    for name, value in rows:
        if value is not None:
            table.add_row(name, value)
    return table


@click.command("distill")
@click.option("--teacher", required=True, metavar="MODEL", help="Teacher: 'demo', a Hugging Face directory, a .gguf file or a Hub id.")
@click.option("--student", metavar="MODEL", help="Student model (must share the teacher's tokenizer).")
@click.option("--student-from", metavar="MODEL", help="Make the student from this model (usually the teacher) with --drop-layers or --width.")
@click.option("--drop-layers", type=int, metavar="N", help="Drop the N least important decoder blocks (block influence on calibration text).")
@click.option("--width", metavar="SPEC", help="Width-prune the student: ffn=RATIO,heads=RATIO (fractions of MLP channels / attention heads to remove).")
@click.option("--layer-method", default="block-influence", show_default=True, type=click.Choice(["block-influence", "perplexity"]), help="How blocks are ranked for --drop-layers.")
@click.option("--calib", default="austen", show_default=True, help="Calibration text for ranking blocks.")
@click.option("--data", default="gutenberg", show_default=True, help="Training text: corpus name, text file, folder of .txt files, or hf:NAME[:CONFIG[:SPLIT]].")
@click.option("--validation", default="heldout", show_default=True, help="Held-out text for validation perplexity ('none' to skip).")
@click.option("--steps", required=True, type=int, help="Optimizer steps.")
@click.option("--seq-len", default=256, show_default=True, type=int, help="Tokens per packed training sequence.")
@click.option("--batch-size", default=4, show_default=True, type=int, help="Sequences per micro batch, per process.")
@click.option("--grad-accum", default=1, show_default=True, type=int, help="Micro batches per optimizer step.")
@click.option("--lr", default=2e-4, show_default=True, type=float, help="Peak learning rate (AdamW).")
@click.option("--warmup", type=int, help="Linear warmup steps before the cosine decay [default: 5% of --steps, at most 100].")
@click.option("--weight-decay", default=0.0, show_default=True, type=float)
@click.option("--max-grad-norm", default=1.0, show_default=True, type=float, help="Gradient clipping norm.")
@click.option("--loss", "loss_kind", default="fkl", show_default=True, type=click.Choice(["fkl", "rkl", "jsd"]), help="Logit loss: forward KL, reverse KL or generalized JSD.")
@click.option("--temperature", default=1.0, show_default=True, type=float, help="Softmax temperature of the logit loss (scaled by T²).")
@click.option("--beta", default=0.5, show_default=True, type=float, help="JSD interpolation weight.")
@click.option("--kd-weight", default=1.0, show_default=True, type=float, help="Weight of the logit loss.")
@click.option("--hidden-weight", type=float, help="Weight of the normalized hidden-state MSE [default: 1 for students made by --drop-layers/--width (exact layer map), else 0].")
@click.option("--ce-weight", default=0.0, show_default=True, type=float, help="Weight of cross-entropy on the data.")
@click.option("--teacher-top-k", default=0, show_default=True, type=int, help="Cache the teacher's top-k log-probs on disk and reuse them (0: compute on the fly).")
@click.option("--precision", default="auto", show_default=True, type=click.Choice(["auto", "bf16", "fp16", "no"]), help="Mixed precision (auto: bf16 where the hardware has it).")
@click.option("--save-every", default=0, show_default=True, type=int, help="Checkpoint every N steps (0: only on Ctrl-C).")
@click.option("--eval-every", default=0, show_default=True, type=int, help="Validation perplexity every N steps (0: never).")
@click.option("--val-samples", default=16, show_default=True, type=int, help="Held-out sequences scored at each validation.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--resume", is_flag=True, help="Continue from the last checkpoint of this output.")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False), help="Where checkpoints go [default: OUTPUT.checkpoints].")
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False), help="Output checkpoint directory.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output (and its checkpoints).")
@click.option("--json", "as_json", is_flag=True, help="Print the run record as JSON.")
@user_errors
def distill_command(teacher, student, student_from, drop_layers, width, layer_method, calib, data, validation, steps,
                    seq_len, batch_size, grad_accum, lr, warmup, weight_decay, max_grad_norm, loss_kind, temperature, beta,
                    kd_weight, hidden_weight, ce_weight, teacher_top_k, precision, save_every, eval_every, val_samples,
                    seed, resume, checkpoint_dir, output, overwrite, as_json):
    """Distil TEACHER into a student and save it as a Hugging Face checkpoint.

    Runs data-parallel when started by torchrun (e.g. torchrun --nproc_per_node 2 -m llmopt distill …).
    Ctrl-C saves a checkpoint; rerun the same command with --resume to continue.

    \b
    Examples:
      llmopt distill --teacher demo --student-from demo --drop-layers 8 --steps 300 --eval-every 50 -o out/student
      llmopt distill --teacher demo --student out/pruned --loss jsd --steps 1000 --save-every 100 -o out/jsd
    """
    from llmopt.distill.run import DistillRequest, run_distill
    from llmopt.distill.student import StudentRequest
    from llmopt.distill.trainer import TrainSettings

    from llmopt.core.console import err, out

    if warmup is None:
        warmup = min(100, max(steps, 0) // 20)
    settings = TrainSettings(
        steps=steps, batch_size=batch_size, grad_accum=grad_accum, lr=lr, warmup=warmup, weight_decay=weight_decay,
        max_grad_norm=max_grad_norm, loss=loss_kind, temperature=temperature, beta=beta, kd_weight=kd_weight,
        ce_weight=ce_weight, hidden_weight=hidden_weight, seed=seed, precision=precision, teacher_top_k=teacher_top_k,
        save_every=save_every, eval_every=eval_every, val_samples=val_samples,
    )
    request = DistillRequest(
        teacher=teacher, output=Path(output),
        student=StudentRequest(student=student, student_from=student_from, drop_layers=drop_layers, width=width,
                               layer_method=layer_method, calib=calib, seed=seed),
        settings=settings, data=data, validation=None if validation.lower() == "none" else validation,
        seq_len=seq_len, resume=resume, overwrite=overwrite,
        checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir else None, show_progress=not as_json,
    )
    outcome = run_distill(request)
    if outcome.interrupted:
        err.print(f"interrupted at step {outcome.result.steps_done} of {steps}; checkpoint saved in {outcome.result.checkpoint}; "
                  "rerun the same command with --resume to continue", highlight=False)
        sys.exit(130)
    from accelerate import PartialState

    if not PartialState().is_main_process:
        return
    if as_json:
        emit_json(outcome.record)
    else:
        out.print(_table(outcome))
