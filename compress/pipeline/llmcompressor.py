"""Map llm-compressor recipes (``*_stage`` → ``*_modifiers`` → ModifierName: args) onto our stages.

Supported modifiers and what they become:

| modifier                | stage                                                        |
|-------------------------|--------------------------------------------------------------|
| QuantizationModifier    | quantize, method rtn                                         |
| GPTQModifier            | quantize, method gptq (dampening_frac, actorder, block_size) |
| AWQModifier             | AWQ scaling: quantize method awq, or awq+gptq before GPTQ    |
| SmoothQuantModifier     | SmoothQuant pre-pass: smoothquant / smoothquant+gptq         |
| SparseGPTModifier       | prune, method sparsegpt (sparsity, mask_structure)           |
| WandaPruningModifier    | prune, method wanda                                          |
| SpinQuantModifier       | the next quantize stage's ``rotate`` and ``online_hadamard`` |
| QuIPModifier            | the next quantize stage's ``online_hadamard: all``           |

SpinQuantModifier's offline rotations R1 (residual stream) and R2 (value / output heads) are what
``--rotate`` fuses into the weights; llmopt applies both whenever R1 is asked for (R2 changes
nothing the model computes). R4 (a Hadamard on the down projections' inputs) is
``online_hadamard: on``; without it, ``off``. R3 (online, inside attention) and learned rotations
are refused by name, as is anything else.

QuIPModifier's input rotation (``v``: a Hadamard on every Linear's input, fused into its weight and
run online) is ``online_hadamard: all``, in llmopt's blocks (the largest power of two dividing each
input width, Sylvester's matrix; its ``hadamard`` and ``random-hadamard`` both map there); its
output rotation ``u``, a chosen block size, other targets, random matrices and learned or
randomized transforms are refused by name. With SpinQuantModifier as well, both apply.
"""

from __future__ import annotations

import re
from typing import Any

from llmopt.core.errors import LlmoptError

QUANT_MODIFIERS = {"QuantizationModifier": "rtn", "GPTQModifier": "gptq"}
PRUNE_MODIFIERS = {"SparseGPTModifier": "sparsegpt", "WandaPruningModifier": "wanda"}
SCALING_MODIFIERS = {"AWQModifier", "SmoothQuantModifier"}
ROTATION_MODIFIERS = {"SpinQuantModifier", "QuIPModifier"}
ROTATION_KINDS = {"hadamard": "hadamard", "random-hadamard": "hadamard", "random-matrix": "orthogonal"}
PASS_THROUGH = {"model", "output", "calibration", "evaluate", "benchmark", "runtime", "description"}


def is_llmcompressor_recipe(data: dict) -> bool:
    return any(isinstance(k, str) and k.endswith("_stage") for k in data)


def _modifiers(data: dict) -> list[tuple[str, dict, tuple]]:
    """(name, args, key path) of every modifier, in recipe order."""
    found = []
    for stage_key, stage in data.items():
        if not (isinstance(stage_key, str) and stage_key.endswith("_stage")):
            continue
        for group_key, group in (stage or {}).items():
            if not str(group_key).endswith("_modifiers") or not isinstance(group, dict):
                continue
            for name, args in group.items():
                found.append((name, args or {}, (stage_key, group_key, name)))
    return found


def _scheme(args: dict, where: str) -> tuple[str, int | None]:
    """Our preset name and group size from a modifier's ``scheme`` or ``config_groups``."""
    scheme = args.get("scheme")
    if isinstance(scheme, dict) and len(scheme) == 1:
        scheme = next(iter(scheme))
    if isinstance(scheme, str):
        return scheme.upper(), None
    groups = args.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise LlmoptError(f"{where}: needs 'scheme' or exactly one entry in 'config_groups'", "use a preset such as scheme: W4A16")
    group = next(iter(groups.values()))
    weights = group.get("weights") or {}
    acts = group.get("input_activations")
    bits, kind, sym = weights.get("num_bits"), weights.get("type", "int"), weights.get("symmetric", True)
    group_size = weights.get("group_size") if weights.get("strategy") == "group" else None
    if kind == "int" and bits == 4 and not acts:
        return ("W4A16" if sym else "W4A16_ASYM"), (group_size or 0)
    if kind == "int" and bits == 4 and sym and acts.get("type", "int") == "int" and acts.get("num_bits") == 8:
        return "W4A8", (group_size or 0)
    if kind == "int" and bits == 8:
        return ("W8A8" if acts else "W8A16"), None
    if kind == "float" and bits == 8:
        return ("FP8_DYNAMIC" if acts else "FP8"), None
    raise LlmoptError(f"{where}: config group {weights} has no llmopt equivalent", "use W4A16, W4A16_ASYM, W8A16, W8A8, W4A8, FP8 or FP8_DYNAMIC")


def _ignore(args: dict) -> list[str]:
    out = []
    for item in args.get("ignore") or []:
        if item == "lm_head":
            continue
        out.append(item[3:] if item.startswith("re:") else f"^{re.escape(item)}$")
    return out


def map_llmcompressor(data: dict, source: str, lines: dict[tuple, int]) -> dict:
    """Translate an llm-compressor recipe into our recipe layout (top-level model/output kept)."""
    stages: list[dict[str, Any]] = []
    pending_scaling: tuple[str, dict] | None = None
    pending_rotation: dict[str, str] | None = None
    for name, args, path in _modifiers(data):
        where = f"{source}:{lines.get(path, 0)}"
        if name in ROTATION_MODIFIERS:
            found = _rotation(args, where) if name == "SpinQuantModifier" else _quip(args, where)
            before = (pending_rotation or {}).get("online_hadamard")
            pending_rotation = {**(pending_rotation or {}), **found}
            if before == "all":  # QuIP's transforms include SpinQuant's R4
                pending_rotation["online_hadamard"] = "all"
            continue
        if name in SCALING_MODIFIERS:
            pending_scaling = (name, args)
            if name == "AWQModifier" and (args.get("scheme") or args.get("config_groups")):
                continue  # may still be followed by a quantization modifier; resolved below
            continue
        if name in QUANT_MODIFIERS:
            scheme, group = _scheme(args, where)
            options: dict[str, Any] = {"scheme": scheme, "method": QUANT_MODIFIERS[name]}
            if group is not None:
                options["group_size"] = group
            if name == "GPTQModifier":
                if "dampening_frac" in args:
                    options["damp"] = float(args["dampening_frac"])
                if args.get("actorder") not in (None, False, "static", "none"):
                    options["act_order"] = True
            options.update(_scaling_options(pending_scaling, options["method"]))
            pending_scaling = None
            if pending_rotation is not None:
                options.update(pending_rotation)
                pending_rotation = None
            ignore = _ignore(args)
            if ignore:
                options["ignore"] = ignore
            stages.append({"quantize": options})
        elif name in PRUNE_MODIFIERS:
            options = {"method": PRUNE_MODIFIERS[name]}
            structure = str(args.get("mask_structure", "0:0"))
            if structure not in ("0:0", "unstructured"):
                options["pattern"] = structure
            else:
                options["sparsity"] = float(args.get("sparsity", 0.5))
            stages.append({"prune": options})
        else:
            raise LlmoptError(
                f"{where}: llm-compressor modifier '{name}' is not supported by llmopt",
                f"supported: {', '.join(sorted([*QUANT_MODIFIERS, *PRUNE_MODIFIERS, *SCALING_MODIFIERS, *ROTATION_MODIFIERS]))}",
            )
    if pending_rotation is not None and (pending_scaling is None or pending_scaling[0] != "AWQModifier"):
        raise LlmoptError(f"{source}: a rotation modifier (SpinQuantModifier, QuIPModifier) is not followed by a quantization modifier",
                          "add QuantizationModifier or GPTQModifier after it")
    if pending_scaling is not None:
        name, args = pending_scaling
        if name != "AWQModifier" or not (args.get("scheme") or args.get("config_groups")):
            raise LlmoptError(f"{source}: {name} is not followed by a quantization modifier", "add QuantizationModifier or GPTQModifier after it")
        scheme, group = _scheme(args, source)
        options = {"scheme": scheme, "method": "awq"}
        if group is not None:
            options["group_size"] = group
        if pending_rotation is not None:
            options.update(pending_rotation)
        stages.append({"quantize": options})
    if not stages:
        raise LlmoptError(f"{source}: no modifiers found", "an llm-compressor recipe lists modifiers under <name>_stage: <name>_modifiers:")
    out = {k: v for k, v in data.items() if k in PASS_THROUGH}
    out["stages"] = stages
    return out


def _rotation(args: dict, where: str) -> dict[str, str]:
    """The quantize stage's ``rotate`` / ``online_hadamard`` for a SpinQuantModifier's arguments, or
    a refusal naming what does not map."""
    rotations = [str(r).upper() for r in args.get("rotations", ["R1", "R2"])]
    unknown = [r for r in rotations if r not in ("R1", "R2", "R4")]
    if unknown or "R1" not in rotations:
        raise LlmoptError(f"{where}: SpinQuantModifier rotations {rotations}: llmopt fuses R1 (with R2) into the weights "
                          "and runs R4 online; it has no R3 (the attention's online rotation)", "use rotations: [R1, R2] or [R1, R2, R4]")
    if args.get("learnable"):
        raise LlmoptError(f"{where}: SpinQuantModifier learnable: true — llmopt has no learned rotations",
                          "drop learnable (a randomized Hadamard is used)")
    kind = str(args.get("transform_type", "hadamard"))
    if kind not in ROTATION_KINDS:
        raise LlmoptError(f"{where}: SpinQuantModifier transform_type '{kind}' is not supported",
                          f"use one of {', '.join(ROTATION_KINDS)}")
    return {"rotate": ROTATION_KINDS[kind], "online_hadamard": "on" if "R4" in rotations else "off"}


def _quip(args: dict, where: str) -> dict[str, str]:
    """The quantize stage's ``online_hadamard`` for a QuIPModifier's arguments, or a refusal naming
    what does not map."""
    rotations = [str(r).lower() for r in args.get("rotations", ["v"])]
    if rotations != ["v"]:
        raise LlmoptError(f"{where}: QuIPModifier rotations {rotations}: llmopt runs the input rotation v only (an online "
                          "Hadamard on every Linear's input); it has no output rotation u", "use rotations: [v]")
    kind = str(args.get("transform_type", "random-hadamard"))
    if kind not in ("hadamard", "random-hadamard"):
        raise LlmoptError(f"{where}: QuIPModifier transform_type '{kind}' is not supported", "use hadamard or random-hadamard")
    for key, default in (("randomize", False), ("learnable", False), ("transform_block_size", None)):
        if args.get(key, default) != default:
            raise LlmoptError(f"{where}: QuIPModifier {key}: {args[key]} is not supported: llmopt picks each Linear's "
                              "block (the largest power of two dividing its input width)", f"drop {key}")
    targets = args.get("targets", "Linear")
    ignore = args.get("ignore", "lm_head")
    if targets not in ("Linear", ["Linear"]) or ignore not in ("lm_head", ["lm_head"]):
        raise LlmoptError(f"{where}: QuIPModifier targets {targets} / ignore {ignore}: llmopt transforms every decoder "
                          "Linear's input and nothing else", "drop targets and ignore")
    return {"online_hadamard": "all"}


def _scaling_options(pending: tuple[str, dict] | None, method: str) -> dict[str, Any]:
    if pending is None:
        return {}
    name, args = pending
    if name == "SmoothQuantModifier":
        options: dict[str, Any] = {"method": "smoothquant" if method == "rtn" else "smoothquant+gptq"}
        if "smoothing_strength" in args:
            options["alpha"] = float(args["smoothing_strength"])
        return options
    return {"method": "awq" if method == "rtn" else "awq+gptq"}
