"""One quantization request, built once and passed whole down to the algorithms.

The stage (or a script, through :func:`make_request`) parses the scheme and the method once;
:func:`~llmopt.quant.apply.quantize_model` and :func:`~llmopt.quant.streaming.quantize_streaming`
read everything else from the request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from llmopt.formats.schemes import FP4_SCHEMES, GROUPED_SCHEMES, PRESETS, QuantScheme, get_scheme
from llmopt.quant.method import QuantMethod
from llmopt.quant.registry import build_method

DEFAULT_IGNORE = ("lm_head",)
FP4_ACTIVATION_SCHEMES = ("NVFP4", "MXFP4")  # compressed-tensors' presets with FP4 activations: refused


@dataclass(frozen=True)
class QuantizeRequest:
    """What to quantize and how.

    ``scheme``: the run's scheme (group size resolved; an AUTO ``plan`` gives each Linear its
    own, and Linears it does not name stay in float). ``ignore``: regexes of Linear names kept
    in float. ``strict_groups``: refuse Linears the group size does not divide instead of using
    the largest divisor. ``head`` / ``embedding``: their formats (:mod:`llmopt.quant.outer`;
    quantized by the streaming path). ``device``: where each layer is calibrated (cpu, cuda,
    auto). ``batch_size``: calibration windows per forward. ``compute_dtype``: the calibration
    forwards' autocast dtype (``auto``: bfloat16 where the device computes it natively).
    ``scale_dtype``: the 16-bit dtype scales are written in (bfloat16, float16; float32 if asked),
    carried by ``scheme``, the ``plan``'s schemes and the head / embedding formats alike.
    ``imatrix``: per Linear, the mean squared input of each column from a llama.cpp importance
    matrix (an uncalibrated method's range search weighs columns by it); ``record_inputs``: keep
    the calibrated Linears' sums of squared inputs in the result (``QuantizeResult.inputs``).
    """

    scheme: QuantScheme
    method: QuantMethod
    ignore: tuple[str, ...] = DEFAULT_IGNORE
    strict_groups: bool = False
    plan: Mapping[str, QuantScheme] | None = None
    head: str = "float"
    embedding: str = "float"
    device: str | None = None
    batch_size: int = 8
    compute_dtype: torch.dtype | str | None = "auto"
    scale_dtype: str = "bfloat16"
    imatrix: Mapping[str, torch.Tensor] | None = None  # Linear → mean squared input per column (llama.cpp's imatrix)
    record_inputs: bool = False  # keep each calibrated Linear's sum of squared inputs (for an imatrix file)

    def with_scale_dtype(self, dtype: str) -> "QuantizeRequest":
        """This request with every scale stored in ``dtype`` (super-block scales stay float32)."""
        plan = None if self.plan is None else {n: s.with_scale_dtype(dtype) for n, s in self.plan.items()}
        return replace(self, scheme=self.scheme.with_scale_dtype(dtype), plan=plan, scale_dtype=dtype)


def resolve_scheme(name: str, group_size: int | None = None) -> QuantScheme:
    """The preset ``name`` with ``group_size`` (None: its default; 0: per-channel), or ``ValueError``."""
    key = name.upper()
    if key in FP4_ACTIVATION_SCHEMES:
        raise ValueError(f"{key} (FP4 activations as well as weights) is not offered: llmopt quantizes FP4 weights only, "
                         f"use {'NVFP4A16' if key.startswith('NV') else 'MXFP4A16'}")
    if key not in PRESETS:
        raise ValueError(f"unknown scheme {name!r}: choose one of {', '.join(PRESETS)}")
    if group_size is not None and group_size < 0:
        raise ValueError(f"group size must be positive (or 0 for per-channel), got {group_size}")
    if key in FP4_SCHEMES and group_size is not None and group_size != PRESETS[key].group_size:
        raise ValueError(f"{key} quantizes in fixed groups of {PRESETS[key].group_size} input features "
                         f"(compressed-tensors' format); drop --group-size (got {group_size})")
    if group_size and key not in GROUPED_SCHEMES:
        raise ValueError(
            f"scheme {key} is per-channel and takes no group size (got {group_size}); "
            f"group sizes apply to {', '.join(sorted(GROUPED_SCHEMES))}"
        )
    return get_scheme(key, group_size)


def make_request(scheme: str | QuantScheme, method: str | QuantMethod = "rtn", *, group_size: int | None = None,
                 ignore: tuple[str, ...] | list[str] = DEFAULT_IGNORE, strict_groups: bool = False,
                 plan: Mapping[str, QuantScheme] | None = None, head: str = "float", embedding: str = "float",
                 device: str | None = None, batch_size: int = 8, compute_dtype: torch.dtype | str | None = "auto",
                 scale_dtype: str = "bfloat16", **method_options: Any) -> QuantizeRequest:
    """A request from names, as scripts and tests write it: ``make_request("W4A16", "gptq",
    group_size=32, act_order=False)``; method options by their field names."""
    if isinstance(method, QuantMethod) and method_options:
        raise ValueError("give method options to build_method, not beside a built method")
    parsed = scheme if isinstance(scheme, QuantScheme) else resolve_scheme(scheme, group_size)
    built = method if isinstance(method, QuantMethod) else build_method(method, method_options)
    request = QuantizeRequest(parsed, built, tuple(ignore), strict_groups, plan, head, embedding, device, batch_size,
                              compute_dtype)
    return request.with_scale_dtype(scale_dtype)
