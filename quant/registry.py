"""The quantization methods by name, and the one parser that reads those names.

A method is one registered class per line below (a :class:`~llmopt.quant.method.Quantizer` or a
:class:`~llmopt.quant.method.ScaleTransform`), imported on first use. A spec names a quantizer
(``gptq``), a transform (``awq``: then RTN quantizes) or a transform then a quantizer
(``awq+gptq``). Options are given by their field names; one that no part of the method has is
refused, naming the methods that take it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from llmopt.quant.method import QuantMethod, Quantizer, ScaleTransform, option_names

METHODS: dict[str, str] = {  # name → "module:class"
    "rtn": "llmopt.quant.rtn:Rtn",
    "gptq": "llmopt.quant.gptq:Gptq",
    "hqq": "llmopt.quant.hqq:Hqq",
    "awq": "llmopt.quant.awq:Awq",
    "smoothquant": "llmopt.quant.smoothquant:SmoothQuant",
}
DEFAULT_QUANTIZER = "rtn"  # what quantizes after a transform named alone


def _load(name: str) -> type[Quantizer] | type[ScaleTransform]:
    module, _, cls = METHODS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def method_class(name: str) -> type[Quantizer] | type[ScaleTransform]:
    """The registered class of one method name."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}: choose one of {', '.join(method_names())}")
    return _load(name)


def method_names() -> list[str]:
    """Every spec the parser takes: quantizers, transforms, and each transform+quantizer."""
    quantizers = [n for n in METHODS if issubclass(_load(n), Quantizer)]
    transforms = [n for n in METHODS if n not in quantizers]
    pairs = [f"{t}+{q}" for t in transforms for q in quantizers if q != DEFAULT_QUANTIZER]
    return [*quantizers, *transforms, *pairs]


def option_owners(option: str) -> list[str]:
    """The method names that take ``option``."""
    return [n for n in METHODS if option in option_names(_load(n))]


def build_method(spec: str, options: Mapping[str, Any] | None = None) -> QuantMethod:
    """The method object of ``spec`` (e.g. ``awq+gptq``) with ``options`` (field name → value;
    None: not given, the method's default). ``ValueError`` for an unknown or ill-formed spec and
    for options no part of the method takes."""
    parts = [p.strip() for p in spec.lower().split("+")]
    classes = [method_class(p) for p in parts]
    transforms = [c for c in classes if issubclass(c, ScaleTransform)]
    quantizers = [c for c in classes if issubclass(c, Quantizer)]
    if len(parts) > 2 or len(transforms) > 1 or len(quantizers) > 1 or (len(parts) == 2 and not (transforms and quantizers)) \
            or (transforms and quantizers and classes[0] is not transforms[0]):
        raise ValueError(f"method {spec!r} is not a transform then a quantizer: choose one of {', '.join(method_names())}")
    quantizer_cls = quantizers[0] if quantizers else method_class(DEFAULT_QUANTIZER)
    transform_cls = transforms[0] if transforms else None
    given = {k: v for k, v in (options or {}).items() if v is not None}
    taken = option_names(quantizer_cls) | (option_names(transform_cls) if transform_cls else set())
    for option in given:
        if option not in taken:
            flag = "--" + option.replace("_", "-")
            owners = option_owners(option)
            where = f"it is an option of {', '.join(owners)}" if owners else "no method takes it"
            raise ValueError(f"{flag} does not apply to method {spec}: {where}")
    q_options = {k: v for k, v in given.items() if k in option_names(quantizer_cls)}
    calibrated = transform_cls is not None or quantizer_cls.calibrated
    if "clip_search" in option_names(quantizer_cls) and "clip_search" not in q_options:
        q_options["clip_search"] = calibrated  # default: on where calibration statistics weigh the search
    transform = transform_cls(**{k: v for k, v in given.items() if k in option_names(transform_cls)}) if transform_cls else None
    return QuantMethod(quantizer_cls(**q_options), transform)
