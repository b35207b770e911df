"""Copy a checkpoint with some of its tensors replaced (tuned scales, norms …)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from llmopt.checkpoints.lazy import safetensors_files
from llmopt.core.atomic import atomic_dir

RECORD = "llmopt.json"


def rewrite_tensors(checkpoint: Path, output: Path, replacements: dict[str, torch.Tensor], record: dict,
                    overwrite: bool = False, card: bool = False) -> None:
    """Copy ``checkpoint`` to ``output`` with the tensors named in ``replacements`` replaced
    (each cast to its stored dtype, shapes checked) and ``record`` merged into its llmopt.json
    (``card``: its model card written again from the merged record)."""
    from safetensors.torch import load_file, save_file

    left = dict(replacements)
    with atomic_dir(output, overwrite) as tmp:
        shards = set(safetensors_files(checkpoint))
        for file in checkpoint.iterdir():
            if file.is_file() and file.name not in shards:
                shutil.copy2(file, tmp / file.name)
        for name in shards:
            tensors = load_file(checkpoint / name)
            for key in [k for k in tensors if k in left]:
                new = left.pop(key)
                if new.shape != tensors[key].shape:
                    raise ValueError(f"{key}: tuned shape {tuple(new.shape)} differs from the stored {tuple(tensors[key].shape)}")
                tensors[key] = new.to(tensors[key].dtype).contiguous()
            save_file(tensors, tmp / name, metadata={"format": "pt"})
        if left:
            raise ValueError(f"tuned tensors missing from the checkpoint: {sorted(left)[:3]}")
        path = tmp / RECORD
        previous = json.loads(path.read_text()) if path.is_file() else {}
        path.write_text(json.dumps({**previous, **record}, indent=2))
        if card:
            from llmopt.checkpoints.model_card import write_model_card

            write_model_card(tmp, {**previous, **record})
