"""A checkpoint rewritten with an offline rotation (:mod:`llmopt.quant.rotation`), tensor by
tensor: bounded memory whatever the model's size."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from llmopt.core.errors import LlmoptError
from llmopt.quant.rotation import Rotation, transformable_linears

LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
TOP = ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")


def _tied(source: Path) -> bool:
    """Whether the head is the embedding (transformers' effective setting, defaults included)."""
    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(source)
    return bool(getattr(loaded.get_text_config(), "tie_word_embeddings", False))


def rotate_checkpoint(source: Path, output: Path, kind: str, seed: int = 0, online: str = "off",
                      residual: tuple | None = None) -> dict:
    """Write ``source`` rotated by ``kind`` (hadamard / orthogonal / learned) to the new folder
    ``output``: norms folded, every tensor rotated, the head untied; returns what was done, for
    llmopt.json. ``online``: also fuse online Hadamards into the weights of the dense MLPs' down
    projections (``down``, R4) or of every decoder Linear (``all``); the record's ``online`` lists
    them, and whoever runs the output must apply them to those Linears' inputs. ``kind`` ``none``
    fuses the online transforms alone (no residual rotation: norms and head stay as they are).
    ``residual``: the learned rotation and its record for ``kind`` ``learned``."""
    import torch

    from llmopt.checkpoints.lazy import LazyCheckpoint, safetensors_files
    from llmopt.checkpoints.models import read_config
    from llmopt.checkpoints.writer import ShardedWriter
    from llmopt.formats.hadamard import fuse_into_weight

    config = read_config(source)
    rotation = Rotation.for_config(config, kind, seed, residual) if kind != "none" else None
    record = dict(rotation.record) if rotation is not None else {"kind": "none"}
    tied = rotation is not None and _tied(source)
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
        layers = sorted({int(m.group(1)) for k in keys if (m := LAYER.match(k))})
        blocks = _online_blocks(ckpt, keys, layers, online, record) if online != "off" else {}
        if rotation is not None:
            embed, final_norm = ckpt.get("model.embed_tokens.weight"), ckpt.get("model.norm.weight")
            writer.add("model.embed_tokens.weight", rotation.embedding(embed))
            head = ckpt.get("lm_head.weight") if "lm_head.weight" in keys and not tied else embed
            writer.add("lm_head.weight", rotation.head(head, final_norm))
            writer.add("model.norm.weight", torch.ones_like(final_norm))
        for key in keys:
            if not LAYER.match(key) and (rotation is None or key not in TOP):
                writer.add(key, ckpt.get(key))
        for i in layers:
            prefix = f"model.layers.{i}."
            norms = None if rotation is None else {
                "reads-attn": ckpt.get(prefix + "input_layernorm.weight").double(),
                "reads-mlp": ckpt.get(prefix + "post_attention_layernorm.weight").double()}
            for key in [k for k in keys if k.startswith(prefix)]:
                rest, _, part = key[len(prefix):].rpartition(".")
                block = blocks.get(rest) if part == "weight" else None
                tensor = ckpt.get(key)
                if rotation is not None:
                    tensor = rotation.layer_tensor(rest, part, tensor, norms, block)
                elif block is not None:
                    tensor = fuse_into_weight(tensor, block)
                writer.add(key, tensor)
    writer.close()
    if rotation is None:
        return record
    config = json.loads((output / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (output / "config.json").write_text(json.dumps(config, indent=2))
    return {**record, "untied_head": tied}


def _online_blocks(ckpt, keys: list[str], layers: list[int], mode: str, record: dict) -> dict[str, int]:
    """Plan ``mode``'s online transforms over the checkpoint's decoder Linears; their records go to
    ``record["online"]`` (a line saying why when there are none). Returns each transformed
    Linear's block by its path in the layer."""
    from llmopt.formats.hadamard import plan_online

    widths = _widths({k[len(p):]: ckpt.shape(k) for k in keys if k.startswith(p)} for p in (f"model.layers.{i}." for i in layers))
    transforms, left_out = plan_online(widths, mode)
    if transforms:
        record.update(_online_record(transforms, left_out))
    elif mode == "down" and not any(n.endswith("down_proj") for n in widths):
        record["online"] = "none: the model has no dense MLP down_proj (experts are not transformed)"
    else:
        record["online"] = f"none: no power-of-two factor of at least 16 in the input width of {', '.join(left_out) or 'any decoder Linear'}"
    if not transforms and record["kind"] == "none":
        raise LlmoptError(f"--online-hadamard {mode} finds no decoder Linear to transform ({record['online'][6:]})",
                          "drop --online-hadamard")
    return _blocks(transforms, widths)


def fuse_online_in_memory(model, mode: str) -> dict:
    """``rotate_checkpoint``'s online transforms (kind ``none``) on a model object, in place: each
    transformed Linear's weight becomes ``W V`` and a hook gives it ``x V``, so the model computes
    what it did. Returns the rotation record (its ``online`` lists the transforms for the writer)."""
    import torch

    from llmopt.calibration import decoder_layers
    from llmopt.formats.hadamard import add_input_hooks, fuse_into_weight, plan_online

    layers = decoder_layers(model)
    widths = _widths({f"{n}.weight": m.weight.shape for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
                     for layer in layers)
    transforms, left_out = plan_online(widths, mode)
    if not transforms:
        raise LlmoptError(f"online_hadamard {mode} finds no decoder Linear to transform (no power-of-two factor of at "
                          "least 16 in their input widths)", "drop online_hadamard")
    blocks = _blocks(transforms, widths)
    with torch.no_grad():
        for layer in layers:
            for rest, module in layer.named_modules():
                if rest in blocks:
                    module.weight.copy_(fuse_into_weight(module.weight, blocks[rest]))
    add_input_hooks(model, transforms)
    return {"kind": "none", **_online_record(transforms, left_out)}


def _widths(layers) -> dict[str, int]:
    """The input width of each transformable decoder Linear (by its path in the layer) over
    ``layers`` (each: its tensors' shapes by path and part); one name with two widths is refused."""
    widths: dict[str, int] = {}
    for shapes in layers:
        for rest, width in transformable_linears(shapes).items():
            if widths.setdefault(rest, width) != width:
                raise LlmoptError(f"{rest} reads {widths[rest]} features in one layer and {width} in another",
                                  "drop the online Hadamard: one transform per Linear name needs one width")
    return widths


def _blocks(transforms: list, widths: dict[str, int]) -> dict[str, int]:
    """Each transformed Linear's block, by its path in the layer."""
    return {rest: t.block for t in transforms for rest in widths if t.applies_to(rest)}


def _online_record(transforms: list, left_out: list[str]) -> dict:
    record = {"online": [t.record() for t in transforms]}
    if left_out:
        record["online_left_out"] = f"{', '.join(left_out)}: no power-of-two factor of at least 16 in their input widths"
    return record
