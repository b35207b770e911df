"""Training checkpoints: everything needed to continue a run exactly where it stopped.

A checkpoint is a folder ``step-NNNNNNN`` holding the student's weights, the optimizer and
scheduler states, ``state.json`` (step, data position, loss curve, settings) and one RNG-state
file per process. It is built in a temporary folder and renamed, so a crash while saving
leaves the previous checkpoint intact; older checkpoints are then removed.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from llmopt.core.errors import LlmoptError

PREFIX = "step-"


def rng_state() -> dict:
    """This process's random-number generator states (Python, NumPy, torch, CUDA)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root``, if any."""
    root = Path(root)
    if not root.is_dir():
        return None
    done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "state.json").is_file())
    return done[-1] if done else None


def save(root: Path, accelerator, model, optimizer, scheduler, state: dict, keep: int = 1) -> Path:
    """Write a checkpoint of step ``state['step']`` (collective: every process must call it)."""
    root = Path(root)
    final = root / f"{PREFIX}{state['step']:07d}"
    staging = root / f".{final.name}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    torch.save(rng_state(), staging / f"rng-{accelerator.process_index}.pt")
    if accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), staging / "model.pt")
        torch.save(optimizer.state_dict(), staging / "optimizer.pt")
        torch.save(scheduler.state_dict(), staging / "scheduler.pt")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (staging / "state.json").write_text(json.dumps(state, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        for old in sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def read_state(path: Path) -> dict:
    """The ``state.json`` of a checkpoint: step, data position, curves, settings."""
    return json.loads((Path(path) / "state.json").read_text())


def load(path: Path, accelerator, model, optimizer, scheduler) -> dict:
    """Restore a checkpoint into the (prepared) model, optimizer and scheduler; return its state."""
    path = Path(path)
    state = read_state(path)
    weights = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
    try:
        accelerator.unwrap_model(model).load_state_dict(weights)
    except RuntimeError as exc:
        raise LlmoptError(
            f"checkpoint {path} holds a different student ({str(exc).splitlines()[0]})",
            "resume with the same student options, or start over with --overwrite",
        ) from exc
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    rng_file = path / f"rng-{accelerator.process_index}.pt"
    if not rng_file.is_file():
        raise LlmoptError(
            f"checkpoint {path} has no RNG state for process {accelerator.process_index}",
            f"resume with the same number of processes as the run that saved it ({len(list(path.glob('rng-*.pt')))})",
        )
    set_rng_state(torch.load(rng_file, weights_only=False))
    return state
