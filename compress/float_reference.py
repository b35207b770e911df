"""The float model's own activations, run next to the calibration stream (asymmetric calibration).

Sequential calibration feeds each decoder layer the outputs of the already-quantized layers
before it, so a Linear is usually fitted to reproduce *its own* float output on those drifted
inputs ``x̃``. Asymmetric calibration (GPTAQ, Li et al. 2025) fits it to what the float model
computes instead, ``W x`` on the float model's inputs ``x``: the quantized weights then also
undo part of the error that earlier layers left in ``x̃``. That needs, per calibration token,
both inputs. :class:`FloatReference` keeps the float model's hidden states for every
calibration batch and a float copy of the current decoder layer; :meth:`FloatReference.input_of`
gives, for the batch that is running, the float input of a Linear of that layer, so statistics
hooks can add ``Σ (x − x̃) x̃ᵀ`` token by token.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from greenlet import greenlet
from torch import nn

from llmopt.core.lockstep import current_context

_AUTOCAST_DEVICES = ("cpu", "cuda")


def _autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES]


def _set_autocast_state(state: list[tuple[str, bool, torch.dtype]]) -> None:
    for device, enabled, dtype in state:
        torch.set_autocast_enabled(device, enabled)
        torch.set_autocast_dtype(device, dtype)


def _switch(target: greenlet, *value: Any) -> Any:
    """``target.switch(*value)``, keeping this side's autocast state (thread state that the two
    sides of a switch would otherwise share)."""
    state = _autocast_state()
    try:
        return target.switch(*value)
    finally:
        _set_autocast_state(state)


class FloatReference:
    """Float hidden states per calibration batch, advanced layer by layer with float copies of
    the layers (see the module docstring).

    Each batch's float forward runs once per layer, as a coroutine (greenlet) that pauses at
    every Linear and hands over its input when asked: :meth:`input_of` resumes it up to the
    Linear asked for, so the Linears of a layer are served in forward order without re-running
    the layer. The engine drives it: :meth:`start` with layer 0's inputs, :meth:`open_layer`
    before a layer is compressed, :meth:`enter` as each batch's forward begins and
    :meth:`finish` as it ends, :meth:`close_layer` after the layer (the float outputs become
    the next float inputs)."""

    def __init__(self, skip: Callable[[str], bool] | None = None) -> None:
        self.skip = skip  # Linear names (in the layer) with no token-aligned float input, e.g. routed experts
        self.hidden: list[torch.Tensor] = []
        self._layer: nn.Module | None = None
        self._twins: dict[int, tuple[str, nn.Module]] = {}  # id(live module) -> (name in layer, float copy)
        self._hooks: list[Any] = []
        self._batch: dict[Any, int] = {}
        self._runs: dict[int, greenlet] = {}  # batch -> its float forward, paused at a Linear
        self._outputs: dict[int, torch.Tensor] = {}  # batch -> its float layer output
        self._call: Callable[[nn.Module, torch.Tensor, int], torch.Tensor] | None = None

    def start(self, hidden: list[torch.Tensor]) -> None:
        """Layer 0's inputs: the same for both streams (the layers are still float)."""
        self.hidden = list(hidden)

    def open_layer(self, layer: nn.Module, call: Callable[[nn.Module, torch.Tensor, int], torch.Tensor]) -> None:
        """Copy ``layer`` while it is still float; ``call(layer, hidden, batch)`` runs a layer
        on one batch (with that batch's keyword arguments)."""
        self._layer = copy.deepcopy(layer)
        self._twins = {id(live): (name, twin) for (name, live), (_, twin)
                       in zip(layer.named_modules(), self._layer.named_modules())}
        self._hooks = [m.register_forward_pre_hook(self._pause) for m in self._layer.modules() if isinstance(m, nn.Linear)]
        self._call = call

    def refresh_layer(self, layer: nn.Module) -> None:
        """Copy the open ``layer`` again after an exact rewrite of it (AWQ's folded scales): the
        float inputs then come in the coordinates its Linears now read. Every batch's forward is
        first run to its end."""
        if self._call is None:
            raise ValueError("no layer is open")
        for b in list(self._runs):
            self.finish(b)
        for handle in self._hooks:
            handle.remove()
        self.open_layer(layer, self._call)

    def _pause(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """In a batch's float forward: hand this Linear's input to whoever resumed it."""
        me = greenlet.getcurrent()
        if any(me is run for run in self._runs.values()):
            _switch(me.parent, (module, args[0]))

    def enter(self, batch: int) -> None:
        """The running forward (this greenlet or thread) is calibration batch ``batch``."""
        self._batch[current_context()] = batch

    def input_of(self, module: nn.Module) -> torch.Tensor | None:
        """The float model's input of ``module`` (a module of the open layer) for the running
        batch, or None when there is none token for token (skipped names, no open layer, or
        its float forward is already past it)."""
        found = self._twins.get(id(module))
        batch = self._batch.get(current_context())
        if found is None or batch is None or self._call is None or (self.skip is not None and self.skip(found[0])):
            return None
        run = self._runs.get(batch)
        if run is None:
            if batch in self._outputs:  # finished earlier in this layer (a second calibration pass): run again
                del self._outputs[batch]
            layer, hidden, call = self._layer, self.hidden[batch], self._call
            run = self._runs[batch] = greenlet(lambda: call(layer, hidden, batch))
        while not run.dead:
            run.parent = greenlet.getcurrent()
            got = _switch(run)
            if run.dead:
                self._outputs[batch] = got
                del self._runs[batch]
                return None
            reached, x = got
            if reached is found[1]:
                return x
        return None

    def finish(self, batch: int) -> None:
        """Batch ``batch``'s forward ended: run its float forward to the end (freeing what it holds)."""
        run = self._runs.pop(batch, None)
        while run is not None and not run.dead:
            run.parent = greenlet.getcurrent()
            got = _switch(run)
            if run.dead:
                self._outputs[batch] = got

    def close_layer(self) -> None:
        """Every batch's float output becomes its next float input; the float layer is dropped."""
        if self._layer is None or self._call is None:
            return
        for b in list(self._runs):
            self.finish(b)
        for b, h in enumerate(self.hidden):
            out = self._outputs.pop(b, None)
            self.hidden[b] = out if out is not None else self._call(self._layer, h, b)
        for handle in self._hooks:
            handle.remove()
        self._layer, self._twins, self._hooks = None, {}, []
        self._batch.clear()

    def release(self) -> None:
        """Free the float hidden states (calibration ended)."""
        for b in list(self._runs):
            self.finish(b)
        self.hidden, self._layer, self._twins, self._call = [], None, {}, None
        self._batch.clear()
        self._outputs.clear()
