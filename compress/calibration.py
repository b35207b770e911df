"""Sequential, layer-by-layer calibration engine for Llama-family causal LMs.

The calibration batch is embedded once; then each decoder layer in turn is observed
(forward pre-hooks on its Linears), compressed by a callback, and re-run *compressed* on
its stored inputs to produce the next layer's inputs. Only one layer's activations are held
in memory at a time. Used by GPTQ, AWQ, SmoothQuant and the pruning algorithms::

    def layer_fn(index, layer, run_layer):
        with LinearStats(linear_modules(layer)) as stats:
            run_layer()                       # forward over all calibration samples
        ...                                   # modify layer weights using stats

    run_sequential(model, calib_ids, layer_fn, batch_size=8)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmopt.core.lockstep import Lockstep
from llmopt.float_reference import FloatReference
from llmopt.linear_stats import StopForward

RunLayer = Callable[..., None]
LayerFn = Callable[[int, nn.Module, RunLayer], None]



def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Llama-family model (``model.model.layers``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__} is not a supported Llama-family model: "
            "expected decoder layers at model.model.layers"
        )
    return layers


def linear_modules(module: nn.Module, prefix: str = "") -> dict[str, nn.Linear]:
    """All ``nn.Linear`` submodules by (prefixed) name, in registration order."""
    return {
        f"{prefix}{name}": m for name, m in module.named_modules() if isinstance(m, nn.Linear)
    }


# ---------------------------------------------------------------------------------------------
# The engine


@dataclass
class LayerInputs:
    """Stored inputs of the current decoder layer, one entry per calibration mini-batch."""

    hidden: list[torch.Tensor]
    kwargs: list[dict[str, Any]]


class _Captured(Exception):
    pass


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return a is b or a == b


def capture_layer_inputs(
    model: nn.Module, calib_ids: torch.Tensor, batch_size: int = 8
) -> LayerInputs:
    """Embed ``calib_ids`` [n, seq] and catch what decoder layer 0 receives, per mini-batch.

    Keyword arguments (position embeddings, attention mask, …) identical across batches are
    stored once and shared.
    """
    if calib_ids.dim() != 2:
        raise ValueError(f"calibration ids must be [n_samples, seq_len], got {tuple(calib_ids.shape)}")
    layers = decoder_layers(model)
    device = model.model.embed_tokens.weight.device
    hidden: list[torch.Tensor] = []
    kwargs_list: list[dict[str, Any]] = []

    def catch(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        kw = dict(kwargs)
        h = args[0] if args else kw.pop("hidden_states")
        kw.update({f"__arg{i}": a for i, a in enumerate(args[1:])})
        hidden.append(h)
        if kwargs_list and kwargs_list[-1].keys() == kw.keys() and all(
            _same(kwargs_list[-1][k], kw[k]) for k in kw
        ):
            kw = kwargs_list[-1]
        kwargs_list.append(kw)
        raise _Captured

    handle = layers[0].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        for start in range(0, calib_ids.shape[0], batch_size):
            ids = calib_ids[start : start + batch_size].to(device)
            try:
                model(input_ids=ids, use_cache=False)
            except _Captured:
                pass
    finally:
        handle.remove()
    return LayerInputs(hidden, kwargs_list)


def call_layer(layer: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """One decoder layer on ``hidden`` with the keyword arguments :func:`capture_layer_inputs` caught; its hidden output."""
    extra = [kwargs[k] for k in sorted(k for k in kwargs if k.startswith("__arg"))]
    kw = {k: v for k, v in kwargs.items() if not k.startswith("__arg")}
    out = layer(hidden, *extra, **kw)
    return out[0] if isinstance(out, (tuple, list)) else out


class LayerLifecycle:
    """How the engine gets and releases each decoder layer (a no-op for an in-memory model).

    The streaming path (:mod:`llmopt.checkpoints.streaming`) materializes a layer from the
    memory-mapped checkpoint in :meth:`before` and writes / frees it in :meth:`after`;
    :meth:`open_embeddings` / :meth:`close_embeddings` bracket the capture of layer 0's inputs.
    """

    def open_embeddings(self) -> None:
        pass

    def close_embeddings(self) -> None:
        pass

    def before(self, index: int, layer: nn.Module) -> None:
        pass

    def after(self, index: int, layer: nn.Module) -> None:
        pass

    def keep(self, weights: dict[str, Any]) -> bool:
        """Take a layer's quantized weights (name → QuantizedWeight) as they are made; True when
        taken (streaming writes them out), False when the caller keeps them (in memory)."""
        return False


IN_MEMORY = LayerLifecycle()


def resolve_device(device: str | torch.device | None) -> torch.device | None:
    """``cpu`` / ``cuda`` / ``auto`` (the GPU when there is one) → a device; None stays None."""
    if device is None:
        return None
    text = str(device)
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from llmopt.core.errors import LlmoptError

    try:
        dev = torch.device(text)
    except RuntimeError:
        raise LlmoptError(f"unknown --device {text!r}", "use cpu, cuda, cuda:N or auto") from None
    if dev.type not in ("cpu", "cuda"):
        raise LlmoptError(f"--device {text!r} is not supported", "use cpu, cuda, cuda:N or auto")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise LlmoptError("--device cuda was asked for but torch sees no CUDA GPU", "use --device cpu or auto")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise LlmoptError(f"--device {text} was asked for but torch sees {count} CUDA GPU{'s' if count != 1 else ''}",
                          f"use cuda:0 to cuda:{count - 1}, or auto")
    return dev


def _to_device(obj: Any, device: torch.device, memo: dict[int, Any]) -> Any:
    """``obj`` (tensors, tuples, lists, dicts of them) on ``device``; shared objects stay shared."""
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, torch.Tensor):
        out: Any = obj.to(device)
    elif isinstance(obj, (tuple, list)):
        out = type(obj)(_to_device(x, device, memo) for x in obj)
    elif isinstance(obj, dict):
        out = {k: _to_device(v, device, memo) for k, v in obj.items()}
    else:
        out = obj
    memo[id(obj)] = out
    return out


@dataclass
class EngineTimings:
    """Seconds spent per phase of :func:`run_sequential` (filled when passed in)."""

    capture: float = 0.0
    observe: float = 0.0  # layer_fn: calibration forwards + statistics + solves
    calibrate: float = 0.0  # of which in run_layer (calibration forwards + statistics hooks)
    forward: float = 0.0  # re-running each compressed layer to produce the next inputs
    load: float = 0.0  # lifecycle.before / after (materialize, write, free)
    layers: int = 0
    first_layer: float = 0.0  # wall seconds of layer 0 (all phases), for estimates

    def to_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.__dict__.items()}


def for_each_layer(
    model: nn.Module,
    layer_fn: Callable[[int, nn.Module], None],
    *,
    lifecycle: LayerLifecycle = IN_MEMORY,
    device: str | torch.device | None = None,
    timings: EngineTimings | None = None,
) -> None:
    """``layer_fn(index, layer)`` on every decoder layer in turn, without calibration data
    (RTN, magnitude pruning), through the same lifecycle and onloading as the engine;
    ``timings`` gets the seconds of ``layer_fn`` (``observe``) and of getting / releasing layers (``load``)."""
    target = resolve_device(device)
    timings = timings if timings is not None else EngineTimings()
    with torch.no_grad():
        for index, layer in enumerate(decoder_layers(model)):
            t0 = time.perf_counter()
            lifecycle.before(index, layer)
            home = _module_device(layer)
            if target is not None:
                layer.to(target)
            t1 = time.perf_counter()
            layer_fn(index, layer)
            t2 = time.perf_counter()
            if target is not None:
                layer.to(home)
            lifecycle.after(index, layer)
            t3 = time.perf_counter()
            timings.load += (t1 - t0) + (t3 - t2)
            timings.observe += t2 - t1
            timings.layers += 1
            if index == 0:
                timings.first_layer = t3 - t0


def _module_device(module: nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def run_sequential(
    model: nn.Module,
    calib_ids: torch.Tensor,
    layer_fn: LayerFn,
    *,
    batch_size: int = 8,
    progress: Any = None,
    description: str = "Calibrating",
    show_progress: bool = True,
    compute_dtype: torch.dtype | None = None,
    return_hidden: bool = True,
    lifecycle: LayerLifecycle = IN_MEMORY,
    device: str | torch.device | None = None,
    timings: EngineTimings | None = None,
    reference: FloatReference | None = None,
) -> torch.Tensor | None:
    """Calibrate ``model`` layer by layer; returns the last layer's outputs [n, seq, hidden]
    (before the final norm, on the CPU), or None with ``return_hidden=False``.

    ``layer_fn(index, layer, run_layer)`` observes and compresses one decoder layer;
    ``run_layer()`` runs it over all stored calibration inputs (outputs discarded; any hooks
    the callback registered fire, and :class:`StopForward` from a hook ends a batch early).
    Afterwards the (compressed) layer is re-run to produce the next layer's inputs, unless
    ``run_layer(keep_outputs=True)`` kept the outputs of a run (one that compressed the layer
    as it went: with ``lockstep=Lockstep()`` the batches run as threads taking turns, so a hook
    can wait for all of them, see :mod:`llmopt.core.lockstep`). ``run_layer(batches=k)`` runs the
    first ``k`` batches only.
    ``progress`` is an optional ``rich.progress.Progress`` to add a task to; otherwise a
    transient bar is shown unless ``show_progress`` is False. ``compute_dtype`` (e.g.
    ``torch.bfloat16``) runs the layers under autocast to that dtype — about twice as fast on
    CPUs with bf16 support; stored activations keep the model's dtype and
    :class:`LinearStats` still accumulates in float32. ``lifecycle`` gets and releases each
    layer (streaming from a checkpoint); ``device`` (cpu / cuda / auto) moves each layer there
    for its calibration and back afterwards, with the activations kept there (sequential
    onloading). ``timings`` is filled with the seconds spent per phase. ``reference`` runs the
    float model's hidden states alongside (each layer copied before ``layer_fn``, advanced
    after it), for statistics hooks to read float inputs from (asymmetric calibration).
    """
    layers = decoder_layers(model)
    target = resolve_device(device)
    timings = timings if timings is not None else EngineTimings()

    was_training = model.training
    model.eval()
    with torch.no_grad():
        t0 = time.perf_counter()
        lifecycle.open_embeddings()
        model_dtype = model.model.embed_tokens.weight.dtype
        inputs = capture_layer_inputs(model, calib_ids, batch_size)
        lifecycle.close_embeddings()
        run_device = target or inputs.hidden[0].device
        if target is not None:
            memo: dict[int, Any] = {}
            inputs = LayerInputs([h.to(target) for h in inputs.hidden], [_to_device(kw, target, memo) for kw in inputs.kwargs])
        use_autocast = compute_dtype is not None and compute_dtype != model_dtype
        if reference is not None:
            reference.start(inputs.hidden)
        timings.capture += time.perf_counter() - t0

        def call(layer: nn.Module, h: torch.Tensor, kw: dict[str, Any]) -> torch.Tensor:
            with torch.autocast(run_device.type, dtype=compute_dtype, enabled=use_autocast):
                return call_layer(layer, h, kw).to(model_dtype)

        def bar_context() -> Any:
            if progress is not None:
                task = progress.add_task(description, total=len(layers))
                return nullcontext(lambda: progress.advance(task))
            if not show_progress:
                return nullcontext(None)
            from llmopt.core.console import progress_task

            return progress_task(description, len(layers))

        with bar_context() as advance:
            for index, layer in enumerate(layers):
                t_layer = time.perf_counter()
                lifecycle.before(index, layer)
                home = _module_device(layer)
                if target is not None:
                    layer.to(target)
                if reference is not None:
                    reference.open_layer(layer, lambda module, h, b: call(module, h, inputs.kwargs[b]))
                t1 = time.perf_counter()
                timings.load += t1 - t_layer

                produced = False  # whether run_layer kept its outputs as the next inputs

                def run_layer(layer: nn.Module = layer, *, batches: int | None = None, keep_outputs: bool = False,
                              lockstep: Lockstep | None = None) -> None:
                    nonlocal produced
                    t_run = time.perf_counter()
                    pairs = list(enumerate(zip(inputs.hidden, inputs.kwargs)))[:batches]

                    def one(b: int, h: torch.Tensor, kw: dict[str, Any]) -> torch.Tensor | None:
                        if reference is not None:
                            reference.enter(b)
                        try:
                            out = call(layer, h, kw)
                        except StopForward:
                            out = None
                        if reference is not None:
                            reference.finish(b)
                        return out if keep_outputs else None  # (not held: memory)

                    calls = [lambda b=b, h=h, kw=kw: one(b, h, kw) for b, (h, kw) in pairs]
                    if lockstep is not None:  # the calls enter and leave autocast interleaved: keep it on around them
                        with torch.autocast(run_device.type, dtype=compute_dtype, enabled=use_autocast):
                            outs = lockstep.run(calls)
                    else:
                        outs = [c() for c in calls]
                    if keep_outputs:
                        if len(outs) != len(inputs.hidden) or any(o is None for o in outs):
                            raise ValueError("keep_outputs needs every batch run to its end")
                        inputs.hidden[:] = outs
                        produced = True
                    timings.calibrate += time.perf_counter() - t_run

                layer_fn(index, layer, run_layer)
                t2 = time.perf_counter()
                if not produced:
                    for b, (h, kw) in enumerate(zip(inputs.hidden, inputs.kwargs)):
                        inputs.hidden[b] = call(layer, h, kw)
                if reference is not None:
                    reference.close_layer()
                t3 = time.perf_counter()
                if target is not None:
                    layer.to(home)
                lifecycle.after(index, layer)
                t4 = time.perf_counter()
                timings.observe += t2 - t1
                timings.forward += t3 - t2
                timings.load += t4 - t3
                timings.layers += 1
                if index == 0:
                    timings.first_layer = t4 - t_layer
                if advance is not None:
                    advance()
    model.train(was_training)
    return torch.cat(inputs.hidden, dim=0).cpu() if return_hidden else None
