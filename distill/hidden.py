"""Hidden states of decoder blocks, captured with forward hooks, and which student block
output is paired with which teacher block output for the hidden-state loss."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from llmopt.pruning.depth import decoder_layers
from torch import nn


@contextmanager
def capture_hidden(model: nn.Module, indices: set[int] | None = None) -> Iterator[dict[int, torch.Tensor]]:
    """Yield a dict filled, on each forward, with the outputs of decoder blocks ``indices`` (all by default)."""
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(decoder_layers(model)):
        if indices is None or i in indices:
            def record(module, args, output, i=i):
                captured[i] = output[0] if isinstance(output, (tuple, list)) else output
            handles.append(layer.register_forward_hook(record))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def layer_map_from_kept(kept: list[int], n_teacher: int) -> list[tuple[int, int]]:
    """Pairs (student block, teacher block) for a student made by dropping teacher blocks.

    Student block ``i`` is teacher block ``kept[i]``; its output feeds student block ``i + 1``,
    which in the teacher reads the output of block ``kept[i + 1] - 1``, so that is its target
    (the last student block targets the teacher's last block).
    """
    targets = [kept[i + 1] - 1 for i in range(len(kept) - 1)] + [n_teacher - 1]
    return list(enumerate(targets))


def uniform_layer_map(n_student: int, n_teacher: int) -> list[tuple[int, int]]:
    """Pairs (student block, teacher block) spreading the student's blocks evenly over the teacher's."""
    return [(i, round((i + 1) * n_teacher / n_student) - 1) for i in range(n_student)]
