"""Quantize a model object in memory: the quantize stage's config, request and record, the
streamed path's engine (:func:`~llmopt.quant.in_memory.quantize_in_memory`)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from torch import nn

from llmopt.core.errors import LlmoptError
from llmopt.pipeline.objects.common import calibration, finish, layer_device, no_dataset, prepare
from llmopt.pipeline.rotate import fuse_online_in_memory
from llmopt.pipeline.stages.quantize import AUTO, NF4, QuantizeConfig, result_record

PASS_A_PATH = "pass the model's path instead (llmopt.save(model, path) writes the float model first)"
REFUSALS = (
    ("scheme", lambda v: str(v).upper() == AUTO, "scheme AUTO measures each tensor's sensitivity on a checkpoint on disk",
     f"choose a fixed scheme such as W4A16, or {PASS_A_PATH}"),
    ("scheme", lambda v: str(v).upper() == NF4, "NF4 is written by bitsandbytes from a float checkpoint",
     f"choose W4A16 (or load the model with transformers' BitsAndBytesConfig), or {PASS_A_PATH}"),
    ("tune_steps", bool, "scale tuning (tune_steps) rewrites a quantized checkpoint on disk", PASS_A_PATH),
    ("rotate", lambda v: v not in (None, "none"), "rotate rewrites the float checkpoint on disk (norms folded, head untied)",
     PASS_A_PATH),
    ("online_hadamard", lambda v: v in ("on", "off"), "online_hadamard on / off go with rotate, which needs a checkpoint on disk",
     f"use online_hadamard='all' (every Linear, in memory), or {PASS_A_PATH}"),
    ("eval", bool, "eval compares checkpoints on disk",
     "llmopt.save(model, path, tokenizer=tokenizer), then llmopt.evaluate(path, baseline=...)"),
)


def quantize_object(model: nn.Module, tokenizer: Any, values: dict, dataset: Any = None, progress: Any = None) -> nn.Module:
    """Quantize ``model`` in place with the options ``values`` (as ``llmopt quantize`` takes them)
    on calibration ``dataset``; returns it, its codes and scales attached for
    :func:`~llmopt.checkpoints.attached.save_model` (and written to ``values['output']`` if given)."""
    from llmopt.checkpoints.attached import describe
    from llmopt.checkpoints.in_memory import floating_dtype
    from llmopt.formats.compressed import add_activation_quantization
    from llmopt.formats.schemes import scale_dtype_for
    from llmopt.quant.in_memory import quantize_in_memory

    config: QuantizeConfig = prepare(model, QuantizeConfig, values, REFUSALS, "quantized", "quantized again")
    start = time.perf_counter()
    record = config.record(describe(model), describe(model))
    request = config.request()
    calib = None
    if config.needs_calibration:
        calib, record["calibration"] = calibration(config, values, dataset, tokenizer, model, config.calib_samples)
    else:
        no_dataset(dataset, f"method {config.method}")
    request = config.prepared(request, record, scale_dtype_for(floating_dtype(model)))
    if config.online_mode == "all":  # before calibration: the quantizer sees the transformed inputs
        record["rotation"] = fuse_online_in_memory(model, "all")
    try:
        done = quantize_in_memory(model, replace(request, device=layer_device(model, config.device)), calib,
                                  progress=progress)
    except ValueError as exc:
        raise LlmoptError(str(exc)) from exc
    weights = done.result.weights
    record.update(result_record(done.result, request.method), memory_estimate=None)
    add_activation_quantization(model, weights)  # W8A8 / W4A8 / FP8_DYNAMIC inputs, per token, as engines run them
    return finish(model, record, start, config, values, tokenizer, weights, list(request.ignore))
