"""A transformers model already in memory, as the calibration engine's layer source.

:class:`InMemoryModel` is :class:`~llmopt.checkpoints.streaming.StreamedModel`'s twin for a model
object: the engine gets each decoder layer from it, and writers read it the same way (layer
prefixes, the tensors outside the layers, the names a checkpoint stores them under). A streamed
layer is computed in float32 whatever the checkpoint stores; so that a model object gives the
codes and scales a checkpoint of it gives, each layer here (and the embedding while layer 0's
inputs are captured) is cast to float32 while it is calibrated and put back in its own dtypes
afterwards (one layer in float32 at a time; a float32 model is not copied at all).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmopt.calibration import LayerLifecycle, decoder_layers
from llmopt.checkpoints.moe import stored_key
from llmopt.core.errors import LlmoptError


class InMemoryModel(LayerLifecycle):
    """The layers of ``model`` (in place), computed in ``compute_dtype`` while the engine holds them."""

    def __init__(self, model: nn.Module, compute_dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self.compute_dtype = compute_dtype
        layers = decoder_layers(model)
        where = {id(m): n for n, m in model.named_modules()}
        self.prefixes = [f"{where[id(layers)]}.{i}." for i in range(len(layers))]
        self._restore: dict[Any, list[tuple[torch.Tensor, torch.dtype]]] = {}
        self._stored_dtypes: dict[str, torch.dtype] | None = None

    # -- the engine's lifecycle ------------------------------------------------------------------
    def open_embeddings(self) -> None:
        self._restore["embed"] = _cast(self.model.get_input_embeddings(), self.compute_dtype)

    def close_embeddings(self) -> None:
        _put_back(self._restore.pop("embed", []))

    def before(self, index: int, layer: nn.Module) -> None:
        self._restore[index] = _cast(layer, self.compute_dtype)

    def after(self, index: int, layer: nn.Module) -> None:
        _put_back(self._restore.pop(index, []))

    # -- what writers read -----------------------------------------------------------------------
    def tied_head(self) -> bool:
        head, embed = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        return head is not None and embed is not None and head.weight is embed.weight

    def outer_keys(self) -> list[str]:
        """State-dict keys outside the decoder layers (embeddings, final norm, head unless tied)."""
        layer_root = self.prefixes[0].rsplit(".", 2)[0] + "." if self.prefixes else "\0"
        head = self.model.get_output_embeddings()
        where = {id(m): n for n, m in self.model.named_modules()}
        skip = {f"{where[id(head)]}.weight"} if head is not None and self.tied_head() else set()
        return [k for k in self.model.state_dict() if not k.startswith(layer_root) and k not in skip]

    def outer_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors outside the decoder layers, as the model holds them."""
        state = self.model.state_dict()
        return {k: state[k] for k in self.outer_keys()}

    def stored_name(self, key: str) -> str:
        """The model's tensor ``key`` as checkpoints of its architecture store it."""
        return stored_key(key, getattr(self.model.config, "model_type", None))

    def stored_dtype_of(self, key: str) -> torch.dtype:
        """Tensors are written in the dtypes the model holds them in (read once, when first asked)."""
        if self._stored_dtypes is None:
            self._stored_dtypes = {self.stored_name(k): v.dtype for k, v in self.model.state_dict().items()}
        return self._stored_dtypes.get(key) or floating_dtype(self.model)


def _cast(module: nn.Module, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.dtype]]:
    """Cast ``module``'s floating parameters and buffers to ``dtype`` in place; what to put back."""
    changed = []
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_floating_point() and tensor.dtype != dtype:
            changed.append((tensor, tensor.dtype))
            tensor.data = tensor.data.to(dtype)
    return changed


def _put_back(changed: list[tuple[torch.Tensor, torch.dtype]]) -> None:
    for tensor, dtype in changed:
        tensor.data = tensor.data.to(dtype)


def floating_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of ``model``'s floating-point tensors (the most common one by bytes), as
    :meth:`~llmopt.checkpoints.lazy.LazyCheckpoint.floating_dtype` reads a checkpoint's."""
    sizes: dict[torch.dtype, int] = {}
    for tensor in model.state_dict().values():
        if tensor.is_floating_point():
            sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + tensor.numel() * tensor.element_size()
    return max(sizes, key=sizes.get) if sizes else torch.float32


def check_model_object(model: Any, verb: str = "compressed") -> None:
    """Refuse what is not a transformers causal LM whose weights are all in memory."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise LlmoptError(f"a {type(model).__name__} cannot be {verb}: llmopt takes a transformers model or a model path",
                          "pass e.g. AutoModelForCausalLM.from_pretrained(...) or a checkpoint folder, 'demo' or a Hub id")
    try:
        decoder_layers(model)
    except ValueError as exc:
        raise LlmoptError(str(exc), "pass a causal LM such as Llama, Mistral, Qwen2/3 or Gemma") from exc
    if any(p.device.type == "meta" for p in model.parameters()):
        raise LlmoptError("the model's weights are not all in memory (offloaded by its device map)",
                          "pass the checkpoint's path instead: llmopt streams it from disk one layer at a time")
