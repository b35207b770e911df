"""Depth pruning: rank decoder blocks by importance and remove whole blocks.

Two importance measures, both on calibration token windows:

- ``block-influence`` (ShortGPT): ``1 - mean cosine similarity`` between a block's input and
  output hidden states, over every token. A block that barely changes its input scores low.
- ``perplexity``: the model's perplexity on the calibration windows with that one block
  skipped. A block whose removal barely hurts scores low.

:func:`drop_layers` removes blocks physically and updates the config (``num_hidden_layers``,
``layer_types``) and every module's ``layer_idx`` so the saved checkpoint loads in
transformers and runs with a KV cache. :func:`kept_layers` gives the map student layer ``i`` ←
teacher layer ``kept[i]`` that distillation uses to pair hidden states.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from llmopt.calibration import decoder_layers as engine_decoder_layers
from llmopt.core.errors import LlmoptError
from torch import nn

METHODS = ("block-influence", "perplexity")


@dataclass
class LayerRanking:
    """Importance of each decoder block (higher = more important) under one method."""

    method: str
    scores: list[float]
    tokens: int = 0

    @property
    def order(self) -> list[int]:
        """Block indices from least to most important."""
        return sorted(range(len(self.scores)), key=lambda i: (self.scores[i], i))

    def least_important(self, n: int) -> list[int]:
        """The ``n`` least important blocks, in ascending index order."""
        check_drop_count(len(self.scores), n)
        return sorted(self.order[:n])

    def to_dict(self) -> dict:
        return {"method": self.method, "scores": [round(s, 6) for s in self.scores], "order": self.order, "tokens": self.tokens}


@dataclass
class DepthPruneResult:
    """What :func:`prune_depth` did: the ranking, the dropped blocks and the kept-layer map."""

    ranking: LayerRanking
    dropped: list[int]
    kept: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"ranking": self.ranking.to_dict(), "dropped": self.dropped, "kept": self.kept}


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks (the calibration engine's lookup), refused with a one-line error."""
    try:
        return engine_decoder_layers(model)
    except ValueError as exc:
        raise LlmoptError(f"cannot find the decoder blocks of {type(model).__name__}", "use a Llama-family model (Llama, Mistral, Qwen, SmolLM)") from exc


def _batches(ids: torch.Tensor, batch_size: int) -> Iterator[torch.Tensor]:
    for start in range(0, ids.shape[0], batch_size):
        yield ids[start : start + batch_size]


def _first_tensor(value):
    return value[0] if isinstance(value, (tuple, list)) else value


@torch.inference_mode()
def block_influence(model: nn.Module, ids: torch.Tensor, batch_size: int = 4) -> LayerRanking:
    """ShortGPT block influence of every decoder block on ``ids`` ``[n, seq_len]``."""
    layers = decoder_layers(model)
    sums = [0.0] * len(layers)
    count = 0
    device = next(model.parameters()).device

    def hook(index: int):
        def record(module, args, kwargs, output):
            x = args[0] if args else kwargs["hidden_states"]
            y = _first_tensor(output)
            cos = torch.nn.functional.cosine_similarity(x.float(), y.float(), dim=-1)
            sums[index] += float(cos.sum())
        return record

    handles = [layer.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        for batch in _batches(ids, batch_size):
            model(input_ids=batch.to(device), use_cache=False)
            count += batch.numel()
    finally:
        for handle in handles:
            handle.remove()
    return LayerRanking("block-influence", [1.0 - s / count for s in sums], count)


@contextmanager
def _skipping(model: nn.Module, index: int) -> Iterator[None]:
    """Temporarily run ``model`` without decoder block ``index`` (no KV cache involved)."""
    parent = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    original = decoder_layers(model)
    parent.layers = nn.ModuleList([layer for i, layer in enumerate(original) if i != index])
    try:
        yield
    finally:
        parent.layers = original


@torch.inference_mode()
def calibration_perplexity(model: nn.Module, ids: torch.Tensor, batch_size: int = 4) -> float:
    """Mean next-token perplexity of ``model`` over the windows ``ids``."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for batch in _batches(ids, batch_size):
        batch = batch.to(device)
        logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")
        total += float(nll)
        count += batch[:, 1:].numel()
    return math.exp(total / count)


def removal_perplexity(model: nn.Module, ids: torch.Tensor, batch_size: int = 4) -> LayerRanking:
    """Perplexity on ``ids`` with each block removed alone (one pass per block)."""
    scores = []
    for index in range(len(decoder_layers(model))):
        with _skipping(model, index):
            scores.append(calibration_perplexity(model, ids, batch_size))
    return LayerRanking("perplexity", scores, int(ids.numel()))


def rank_layers(model: nn.Module, ids: torch.Tensor, method: str = "block-influence", batch_size: int = 4) -> LayerRanking:
    """Rank the decoder blocks of ``model`` on calibration windows ``ids`` with ``method``."""
    if method == "block-influence":
        return block_influence(model, ids, batch_size)
    if method == "perplexity":
        return removal_perplexity(model, ids, batch_size)
    raise LlmoptError(f"unknown layer-importance method '{method}'", f"use one of {', '.join(METHODS)}")


def check_drop_count(n_layers: int, n_drop: int) -> None:
    """Refuse a negative count, or dropping as many layers as the model has (or more)."""
    if n_drop < 0:
        raise LlmoptError(f"cannot drop {n_drop} layers", "pass a positive number of layers")
    if n_drop >= n_layers:
        raise LlmoptError(f"cannot drop {n_drop} of the model's {n_layers} layers", f"drop at most {n_layers - 1}")


def kept_layers(n_layers: int, dropped: list[int]) -> list[int]:
    """The kept-layer map: entry ``i`` is the original index of the new block ``i``."""
    removed = set(dropped)
    return [i for i in range(n_layers) if i not in removed]


def _check_indices(n_layers: int, indices) -> list[int]:
    values = list(indices)
    bad = [i for i in values if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layers]
    if bad:
        raise LlmoptError(f"invalid layer indices {bad} for a model with {n_layers} layers", f"use indices from 0 to {n_layers - 1}")
    if len(set(values)) != len(values):
        raise LlmoptError(f"layer indices repeat: {values}", "name each layer to drop once")
    check_drop_count(n_layers, len(values))
    return sorted(values)


def drop_layers(model: nn.Module, indices) -> nn.Module:
    """Remove the decoder blocks ``indices`` from ``model`` in place and return it.

    Updates ``config.num_hidden_layers``, ``config.layer_types`` (when present) and the
    ``layer_idx`` of every module inside the kept blocks, so KV caches index correctly.
    """
    layers = decoder_layers(model)
    dropped = _check_indices(len(layers), indices)
    keep = kept_layers(len(layers), dropped)
    parent = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    parent.layers = nn.ModuleList([layers[j] for j in keep])
    for new_index, layer in enumerate(parent.layers):
        for module in layer.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = new_index
    config = model.config
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and len(layer_types) == len(layers):
        config.layer_types = [layer_types[j] for j in keep]
    config.num_hidden_layers = len(keep)
    return model


def prune_depth(model: nn.Module, ids: torch.Tensor, n_drop: int, method: str = "block-influence", batch_size: int = 4) -> DepthPruneResult:
    """Rank blocks on ``ids``, drop the ``n_drop`` least important ones from ``model`` (in place)."""
    check_drop_count(len(decoder_layers(model)), n_drop)
    ranking = rank_layers(model, ids, method, batch_size)
    dropped = ranking.least_important(n_drop)
    n_layers = len(ranking.scores)
    drop_layers(model, dropped)
    return DepthPruneResult(ranking, dropped, kept_layers(n_layers, dropped))
