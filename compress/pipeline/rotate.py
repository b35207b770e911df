"""A checkpoint rewritten with an offline rotation (:mod:`llmopt.quant.rotation`), tensor by
tensor: bounded memory whatever the model's size."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from llmopt.core.errors import LlmoptError
from llmopt.quant.rotation import Rotation

LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
TOP = ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")


def _tied(source: Path) -> bool:
    """Whether the head is the embedding (transformers' effective setting, defaults included)."""
    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(source)
    return bool(getattr(loaded.get_text_config(), "tie_word_embeddings", False))


def rotate_checkpoint(source: Path, output: Path, kind: str, seed: int = 0, online_down: bool = False,
                      residual: tuple | None = None) -> dict:
    """Write ``source`` rotated by ``kind`` (hadamard / orthogonal) to the new folder ``output``:
    norms folded, every tensor rotated, the head untied; returns what was done, for llmopt.json.
    ``online_down``: also fuse an online Hadamard into the down projections (the record's
    ``online`` says which; whoever runs the output must apply it to their inputs). ``residual``: the
    learned rotation and its record for ``kind`` ``learned``."""
    import torch

    from llmopt.checkpoints.lazy import LazyCheckpoint, safetensors_files
    from llmopt.checkpoints.models import read_config
    from llmopt.checkpoints.writer import ShardedWriter

    rotation = Rotation.for_config(read_config(source), kind, seed, online_down, residual)
    tied = _tied(source)
    output.mkdir(parents=True)
    shards = set(safetensors_files(source))
    for file in source.iterdir():
        if file.is_file() and file.name not in shards and not file.name.endswith(".index.json"):
            shutil.copy2(file, output / file.name)
    writer = ShardedWriter(output)
    with LazyCheckpoint(source) as ckpt:
        keys = list(ckpt.keys())
        if "model.norm.weight" not in keys or "model.embed_tokens.weight" not in keys:
            raise LlmoptError(f"{source} has no model.norm / model.embed_tokens weights", "rotate a Llama-style checkpoint")
        if rotation.online is not None and not any(rotation.online.applies_to(k.removesuffix(".weight")) for k in keys):
            rotation.online = None  # MoE layers: the experts' down projections are not transformed
            rotation.record["online"] = "none: the model has no dense MLP down_proj (experts are not transformed)"
        embed, final_norm = ckpt.get("model.embed_tokens.weight"), ckpt.get("model.norm.weight")
        writer.add("model.embed_tokens.weight", rotation.embedding(embed))
        head = ckpt.get("lm_head.weight") if "lm_head.weight" in keys and not tied else embed
        writer.add("lm_head.weight", rotation.head(head, final_norm))
        writer.add("model.norm.weight", torch.ones_like(final_norm))
        for key in keys:
            if not LAYER.match(key) and key not in TOP:
                writer.add(key, ckpt.get(key))
        for i in sorted({int(m.group(1)) for k in keys if (m := LAYER.match(k))}):
            prefix = f"model.layers.{i}."
            norms = {"reads-attn": ckpt.get(prefix + "input_layernorm.weight").double(),
                     "reads-mlp": ckpt.get(prefix + "post_attention_layernorm.weight").double()}
            for key in [k for k in keys if k.startswith(prefix)]:
                rest, _, part = key[len(prefix):].rpartition(".")
                writer.add(key, rotation.layer_tensor(rest, part, ckpt.get(key), norms))
    writer.close()
    config = json.loads((output / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (output / "config.json").write_text(json.dumps(config, indent=2))
    return {**rotation.record, "untied_head": tied}
