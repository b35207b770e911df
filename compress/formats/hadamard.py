"""Online Hadamard transforms on Linear inputs (QuaRot / SpinQuant's R4), in compressed-tensors'
transform format.

Where activations are quantized, the input of an MLP's down projection keeps the outliers that an
offline rotation of the residual stream cannot reach. An orthogonal ``V`` on that input removes
them: the stored weight becomes ``W V`` (fused offline) and every consumer multiplies the input by
``V`` at run time, so ``(x V)(W V)ᵀ = x Wᵀ``. ``V`` is compressed-tensors' ``hadamard`` transform:
Sylvester's ±1 matrix of order ``B`` scaled by ``1 / √B``, block-diagonal over the input when
``B`` (its ``head_dim``) is smaller than the width. ``B`` here is the largest power of two that
divides the width, so a fast Walsh–Hadamard transform applies it in ``log2 B`` steps per value.

The same placement on the input of *every* decoder Linear (QuIP's input-side rotation, in block
form) spreads the weights' outliers over each group before weight-only quantization too:
:func:`plan_online` groups the Linears by block, one transform per block size.

The checkpoint says so in ``quantization_config.transform_config`` (one config group per transform,
each with an online ``input`` and a fused ``weight_input`` entry, as llm-compressor's SpinQuant R4
writes it); :func:`online_inputs` reads that back and refuses transforms llmopt cannot run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

DOWN_PROJ_TARGET = r"re:.*mlp\.down_proj$"  # dense MLPs' down projections (not per-expert ones)
MIN_BLOCK = 16  # a smaller power-of-two factor spreads outliers too little to be worth a transform


def block_for(width: int) -> int | None:
    """The transform's block: the largest power of two dividing ``width``; None below MIN_BLOCK."""
    block = width & -width
    return block if block >= MIN_BLOCK else None


@lru_cache(maxsize=16)
def _sylvester(block: int, dtype: torch.dtype) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / block ** 0.5).to(dtype)


def hadamard_matrix(block: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Sylvester's Hadamard matrix of order ``block`` (a power of two), scaled to be orthogonal."""
    if block <= 0 or block & (block - 1):
        raise ValueError(f"a Hadamard block must be a power of two, not {block}")
    return _sylvester(block, dtype)


def transform_inputs(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x V`` with ``V`` block-diagonal Sylvester blocks of order ``block`` over ``x``'s last axis
    (the reference: one matrix product in float64, so the result is ``x V`` rounded once to
    ``x``'s dtype and activation quantization after it rounds as an exact transform would)."""
    h = hadamard_matrix(block, torch.float64).to(x.device)
    return (x.double().unflatten(-1, (-1, block)) @ h).flatten(-2).to(x.dtype)


def fast_transform_inputs(x: torch.Tensor, block: int) -> torch.Tensor:
    """:func:`transform_inputs` as a fast Walsh–Hadamard transform in float32 torch operations
    (``log2 block`` butterfly passes, no matrix): for devices where a float64 product is slow."""
    hadamard_matrix(block)  # checks the block
    shape = x.shape
    y = x.float().reshape(-1, block)
    half = 1
    while half < block:
        pairs = y.view(y.shape[0], block // (2 * half), 2, half)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2).view(-1, block)
        half *= 2
    return (y * block ** -0.5).view(shape).to(x.dtype)


def fuse_into_weight(weight: torch.Tensor, block: int) -> torch.Tensor:
    """A Linear weight ``[out, in]`` that reads transformed inputs: ``W V`` (in float64, cast back)."""
    return transform_inputs(weight.double(), block).to(weight.dtype)


@dataclass(frozen=True)
class OnlineHadamard:
    """An online Hadamard on the inputs of the Linears ``targets`` matches (compressed-tensors
    target strings: a module name, or ``re:`` and a regular expression)."""

    targets: tuple[str, ...]
    block: int

    @classmethod
    def from_record(cls, record: dict | list | str | None) -> list[OnlineHadamard]:
        """The transforms a provenance record's ``rotation.online`` holds: a list of records, one
        record (older checkpoints: R4 alone), or a string saying why there is none."""
        records = record if isinstance(record, list) else [record] if isinstance(record, dict) else []
        return [cls(tuple(r["targets"]), int(r["block"])) for r in records]

    @classmethod
    def of_provenance(cls, record: dict) -> list[OnlineHadamard]:
        """The transforms a checkpoint's provenance (``llmopt.json``) says its rotation added."""
        return cls.from_record((record.get("rotation") or {}).get("online"))

    def record(self) -> dict:
        return {"transform": "hadamard", "location": "input", "block": self.block, "targets": list(self.targets)}

    def applies_to(self, module: str) -> bool:
        return any(_matches(module, t) for t in self.targets)

    def scheme(self) -> Any:
        """This transform as a compressed-tensors ``TransformScheme``: online on the input, its
        inverse fused into the weight."""
        from compressed_tensors.transform import TransformArgs, TransformScheme

        targets = list(self.targets)
        return TransformScheme(type="hadamard", head_dim=self.block, apply=[
            TransformArgs(targets=targets, location="input"),
            TransformArgs(targets=targets, location="weight_input", inverse=True),
        ])


def transform_config(transforms: list[OnlineHadamard]) -> dict:
    """The compressed-tensors ``transform_config`` that records ``transforms`` (validated by that
    library): R4 alone keeps SpinQuant's group name, otherwise one group per block size."""
    from compressed_tensors.transform import TransformConfig

    if [t.targets for t in transforms] == [(DOWN_PROJ_TARGET,)]:
        groups = {"R4": transforms[0].scheme()}
    else:
        groups = {f"online_input_{t.block}" + (f"_{i}" if sum(u.block == t.block for u in transforms) > 1 else ""): t.scheme()
                  for i, t in enumerate(transforms)}
    return TransformConfig(config_groups=groups).model_dump(mode="json")


def plan_online(linears: dict[str, int], mode: str) -> tuple[list[OnlineHadamard], list[str]]:
    """The online transforms ``mode`` puts on ``linears`` (decoder-layer module names relative to
    their layer, ``self_attn.q_proj`` …, with their input widths): ``down`` R4 on the dense MLPs'
    down projections, ``all`` every one of them, one transform per block size. Also returns the
    names left out because their width has no block of at least :data:`MIN_BLOCK`."""
    if mode == "down":
        linears = {n: w for n, w in linears.items() if re.match(DOWN_PROJ_TARGET[3:], n)}
    elif mode != "all":
        raise ValueError(f"online Hadamard mode '{mode}': down or all")
    by_block: dict[int, list[str]] = {}
    left_out = []
    for name, width in sorted(linears.items()):
        block = block_for(width)
        if block is None:
            left_out.append(name)
        else:
            by_block.setdefault(block, []).append(name)
    if mode == "down":
        return [OnlineHadamard((DOWN_PROJ_TARGET,), block) for block in sorted(by_block)], left_out
    return [OnlineHadamard((_layer_target(names),), block) for block, names in sorted(by_block.items())], left_out


def _layer_target(names: list[str]) -> str:
    """A compressed-tensors target matching ``names`` (relative to a layer) in every decoder layer,
    with or without the layer's prefix in front (``model.layers.3.`` …)."""
    return r"re:(?:.*\.layers\.\d+\.)?(?:" + "|".join(re.escape(n) for n in names) + ")$"


def _matches(module: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target


def online_inputs(qconfig: dict | None) -> list[OnlineHadamard]:
    """The online input transforms a checkpoint's ``quantization_config`` records; a transform llmopt
    cannot apply (another type, an output / KV-cache location, a permutation) raises ValueError."""
    groups = ((qconfig or {}).get("transform_config") or {}).get("config_groups") or {}
    found = []
    for name, group in groups.items():
        online = [a for a in group.get("apply") or [] if a.get("location") not in ("weight_input", "weight_output")]
        if not online:
            continue  # fused into the weights: nothing to do at run time
        if group.get("type") != "hadamard" or group.get("randomize") or any(a.get("location") != "input" for a in online):
            kinds = sorted({str(a.get("location")) for a in online})
            raise ValueError(f"transform group '{name}' is a {group.get('type')} transform at {', '.join(kinds)}"
                             f"{' (randomized)' if group.get('randomize') else ''}: llmopt runs online Hadamard "
                             "transforms on Linear inputs only")
        block = group.get("head_dim")
        if not block:
            raise ValueError(f"transform group '{name}' has no head_dim: llmopt runs block Hadamards of a stated size only")
        for args in online:
            if args.get("ignore"):
                raise ValueError(f"transform group '{name}' ignores {args['ignore']}: not supported")
            found.append(OnlineHadamard(tuple(args["targets"]), int(block)))
    return found


def add_input_hooks(model: torch.nn.Module, transforms: list[OnlineHadamard]) -> list:
    """Forward pre-hooks applying ``transforms`` to the inputs of the Linears they target (register
    them before any other input hook: activation quantization must see the transformed input).
    Returns the hook handles; a transform that matches no Linear raises ValueError."""
    handles = []
    for t in transforms:
        hit = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and t.applies_to(n)]
        if not hit:
            raise ValueError(f"the online Hadamard's targets {list(t.targets)} match no Linear of the model")
        for _, module in hit:
            handles.append(module.register_forward_pre_hook(
                lambda _m, args, block=t.block: (transform_inputs(args[0], block), *args[1:])))
    return handles
