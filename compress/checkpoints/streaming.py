"""A model whose decoder layers are read from a memory-mapped checkpoint one at a time.

:class:`StreamedModel` builds the transformers model without allocating weights (parameters on
the ``meta`` device, buffers such as the rotary frequencies real), then, as the calibration
engine's :class:`~llmopt.calibration.LayerLifecycle`:

- materializes the input embedding in float32 only while layer 0's inputs are captured;
- materializes each decoder layer in float32 from the mmap just before it is processed, and
  after it is done hands it to ``sink(index, prefix, layer)`` (which writes it) and frees it.

Everything outside the decoder layers is never materialized in float32: :meth:`outer_tensors`
returns it as stored (bf16 stays bf16). Peak memory therefore follows one layer, not the model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmopt.calibration import LayerLifecycle, decoder_layers
from llmopt.checkpoints.moe import canonical_key, split_fused_tensors, stored_key, unfuse_experts
from llmopt.checkpoints.lazy import LazyCheckpoint
from llmopt.core.errors import LlmoptError

Sink = Callable[[int, str, nn.Module], None]
_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


WEIGHTS_MMAP_THRESHOLD = 1 << 20  # while layers are read, written and freed
WORK_MMAP_THRESHOLD = 32 << 20  # while a layer calibrates (glibc's largest)


def fixed_mmap_threshold(nbytes: int = WEIGHTS_MMAP_THRESHOLD) -> None:
    """Serve every allocation of ``nbytes`` or more with its own mmap (glibc only; no-op elsewhere).

    glibc raises its mmap threshold each time a large block is freed, after which layer-sized
    tensors come from the heap, where the small tensors kept between layers (the output buffer)
    pin them: the heap then grows by about a layer per layer (3.4 GB instead of 0.8 GB peak for
    a 0.5B model). A fixed threshold returns each freed layer to the system. While a layer
    calibrates, :meth:`StreamedModel.before` raises it to ``WORK_MMAP_THRESHOLD``: the
    calibration forwards allocate and free thousands of activation-sized tensors, and an mmap
    each costs fresh page faults (on the demo model's GPTQ: 107 s of system time out of 188 s);
    :meth:`StreamedModel.after` lowers it again and trims the heap.
    """
    _libc_call("mallopt", _M_MMAP_THRESHOLD, nbytes)


def trim_heap() -> None:
    """Return the heap's free pages to the system (glibc's ``malloc_trim``)."""
    _libc_call("malloc_trim", 0)


def _libc_call(name: str, *args: int) -> None:
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        getattr(ctypes.CDLL("libc.so.6"), name)(*args)
    except (OSError, AttributeError):
        pass


class StreamedModel(LayerLifecycle):
    """The skeleton of the checkpoint at ``source`` plus its layer-by-layer materialization."""

    def __init__(self, source: Path | str, compute_dtype: torch.dtype = torch.float32) -> None:
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        fixed_mmap_threshold()
        self.source = Path(source)
        self.ckpt = LazyCheckpoint(self.source)
        self.stored_dtype = self.ckpt.floating_dtype()
        self.compute_dtype = compute_dtype
        config = AutoConfig.from_pretrained(self.source)
        with init_empty_weights(include_buffers=False):
            self.model = AutoModelForCausalLM.from_config(config, dtype=compute_dtype)
        unfuse_experts(self.model)  # one Linear per expert projection, named as checkpoints store them
        self.model.eval()
        self.model.config.dtype = self.stored_dtype  # what the written checkpoint holds
        self._tied = self._head_is_tied()
        self._retie()
        if (self.source / "generation_config.json").is_file():
            self.model.generation_config = GenerationConfig.from_pretrained(self.source)
        layers = decoder_layers(self.model)
        where = {id(m): n for n, m in self.model.named_modules()}
        self.prefixes = [f"{where[id(layers)]}.{i}." for i in range(len(layers))]
        self.sink: Sink | None = None  # gets each finished layer (its float tensors are written)
        self.output: Any = None  # takes each layer's quantized weights as they are made (``keep``)
        self.announce: Callable[[str], None] | None = None  # gets the time estimate after layer 0
        self._started = 0.0

    # -- the engine's lifecycle ------------------------------------------------------------------
    def open_embeddings(self) -> None:
        emb = self.model.get_input_embeddings()
        key = self._param_key(emb)
        emb.weight = nn.Parameter(self.ckpt.get(key).to(self.compute_dtype), requires_grad=False)

    def close_embeddings(self) -> None:
        self.model.get_input_embeddings().to("meta")
        self._retie()

    def _retie(self) -> None:
        if self._tied:
            self.model.get_output_embeddings().weight = self.model.get_input_embeddings().weight

    def before(self, index: int, layer: nn.Module) -> None:
        if index == 0:
            self._started = time.perf_counter()
        self.materialize(index, layer)
        fixed_mmap_threshold(WORK_MMAP_THRESHOLD)  # activations: reuse heap blocks (see fixed_mmap_threshold)

    def keep(self, weights: dict[str, Any]) -> bool:
        if self.output is None:
            return False
        self.output.keep(weights)
        return True

    def after(self, index: int, layer: nn.Module) -> None:
        fixed_mmap_threshold(WEIGHTS_MMAP_THRESHOLD)
        trim_heap()
        if self.sink is not None:
            self.sink(index, self.prefixes[index], layer)
        layer.to("meta")
        self.ckpt.close()  # unmap: file pages read for this layer stop counting as our memory
        if index == 0 and self.announce is not None:
            first = time.perf_counter() - self._started
            n = len(self.prefixes)
            self.announce(f"first of {n} layers took {first:.1f} s: estimated {first * n:.0f} s in all")

    # -- helpers ---------------------------------------------------------------------------------
    def materialize(self, index: int, layer: nn.Module) -> None:
        """Load decoder layer ``index`` from the checkpoint in the compute dtype (float32)."""
        prefix = self.prefixes[index]
        state = {}
        for key in self.ckpt.keys():  # one stored tensor at a time next to the float32 layer
            if key.startswith(prefix):
                v = self.ckpt.get(key)
                state[canonical_key(key)[len(prefix):]] = v.to(self.compute_dtype) if v.is_floating_point() else v
        state = split_fused_tensors(state)
        wanted = set(layer.state_dict())
        missing = wanted - set(state)
        if missing:
            raise LlmoptError(f"{self.source} lacks {self.prefixes[index]}{sorted(missing)[0]}",
                              "check that the checkpoint is complete")
        layer.load_state_dict({k: v for k, v in state.items() if k in wanted}, assign=True)
        for p in layer.parameters():
            p.requires_grad_(False)

    def stored_name(self, key: str) -> str:
        """The unfused model's tensor ``key`` as checkpoints of this architecture store it (Mixtral's
        experts and router under ``block_sparse_moe``, see :func:`~llmopt.checkpoints.moe.stored_key`)."""
        return stored_key(key, getattr(self.model.config, "model_type", None))

    def _param_key(self, module: nn.Module) -> str:
        where = {id(m): n for n, m in self.model.named_modules()}
        return f"{where[id(module)]}.weight"

    def tied_head(self) -> bool:
        return self._tied

    def _head_is_tied(self) -> bool:
        head = self.model.get_output_embeddings()
        text = getattr(self.model.config, "get_text_config", lambda: self.model.config)()
        return head is not None and bool(getattr(text, "tie_word_embeddings", False))

    def outer_keys(self) -> list[str]:
        """State-dict keys outside the decoder layers (embeddings, final norm, head unless tied)."""
        layer_root = self.prefixes[0].rsplit(".", 2)[0] + "." if self.prefixes else "\0"
        head = self.model.get_output_embeddings()
        skip = {self._param_key(head)} if head is not None and self.tied_head() else set()
        return [k for k in self.model.state_dict() if not k.startswith(layer_root) and k not in skip]

    def outer_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors outside the decoder layers, in their stored dtype."""
        return {k: self.ckpt.get(k) for k in self.outer_keys()}

    def stored_dtype_of(self, key: str) -> torch.dtype:
        return self.ckpt.dtype(key) if key in self.ckpt else self.stored_dtype

    def close(self) -> None:
        self.ckpt.close()
