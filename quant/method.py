"""What a quantization method is: an optional scale transform, then a quantizer.

A :class:`Quantizer` chooses the codes and scales of a layer's Linears (RTN, GPTQ, HQQ …); a
:class:`ScaleTransform` migrates per-channel scales into the weights before they are quantized
(AWQ, SmoothQuant). Each is a frozen dataclass in its own module whose fields are its options
(the same names as the CLI's and recipes' keys). A :class:`QuantMethod` composes one of each
(``awq+gptq`` is ``QuantMethod(Awq(), Gptq())``); the calibration engine
(:mod:`llmopt.quant.apply`) asks it what it needs and hands it each layer. Names are read in one
place only: :mod:`llmopt.quant.registry`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from torch import nn

from llmopt.formats.schemes import QuantizedWeight, QuantScheme
from llmopt.linear_stats import LinearStats

PRICED_BY_RTN = "rtn"  # an AUTO plan prices formats by round-to-nearest's error
PRICED_BY_GPTQ = "gptq"  # … by the error GPTQ leaves (one solve per Linear and format)
Schemes = Mapping[str, QuantScheme]  # per Linear
GroupSizes = Mapping[str, "int | None"]  # per Linear, the group size used


@dataclass(frozen=True)
class Quantizer:
    """Chooses a layer's codes and scales; subclasses are frozen dataclasses of their options."""

    name: ClassVar[str]
    calibrated: ClassVar[bool] = False  # reads the calibration engine's input Hessians
    one_pass: ClassVar[bool] = False  # solves each input group as the calibration forward reaches it
    prices: ClassVar[tuple[str, ...]] = (PRICED_BY_RTN,)  # how an AUTO plan can price its formats, default first

    @property
    def pricing(self) -> str:
        """How an AUTO plan prices this quantizer's formats by default."""
        return self.prices[0]

    def check(self, scheme: QuantScheme) -> None:
        """Raise ``ValueError`` if this quantizer cannot produce ``scheme``."""

    @property
    def needs_hessian(self) -> bool:
        return self.calibrated

    @property
    def uses_float_reference(self) -> bool:
        """Whether the float model's hidden states must run alongside (asymmetric calibration)."""
        return False

    @property
    def head_refit(self) -> bool:
        """Whether a quantized output head / embedding re-solves its scales after rounding."""
        return True

    def quantize(self, mods: Mapping[str, nn.Linear], schemes: Schemes, group_sizes: GroupSizes,
                 stats: LinearStats | None) -> dict[str, QuantizedWeight]:
        """Quantize ``mods`` (their dequantized weights written back in place); ``stats``: the
        layer's calibration statistics, None without calibration."""
        raise NotImplementedError

    def options(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ScaleTransform:
    """Folds per-channel scales into a layer before it is quantized (the model stays float)."""

    name: ClassVar[str]
    weight_only: ClassVar[bool] = True  # prepares weight-only schemes (else activation quantization)
    takes_plan: ClassVar[bool] = True  # works with a different scheme per Linear
    needs_hessian: ClassVar[bool] = False

    @property
    def sample_every(self) -> int:
        """Calibration tokens between the input rows the statistics keep for :meth:`apply` (0: none)."""
        return 0

    def for_llama_cpp(self) -> ScaleTransform:
        """This transform for a checkpoint llama.cpp will run (itself unless it models llama.cpp's arithmetic)."""
        return self

    def check(self, scheme: QuantScheme) -> None:
        """Raise ``ValueError`` if this transform does not prepare ``scheme``."""

    def apply(self, mappings: list[Any], stats: LinearStats, scheme: QuantScheme, schemes: Schemes,
              group_sizes: GroupSizes, calibrated: Mapping[str, nn.Linear]) -> list[Any]:
        """Search and fold the scales of a layer's ``mappings`` (:mod:`llmopt.quant.mappings`),
        keeping ``stats`` consistent; ``calibrated``: the Linears the calibration reached.
        Returns one record per mapping."""
        raise NotImplementedError

    def options(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class QuantMethod:
    """A quantization method: ``transform`` (optional) then ``quantizer``."""

    quantizer: Quantizer
    transform: ScaleTransform | None = None

    @property
    def name(self) -> str:
        if self.transform is None:
            return self.quantizer.name
        return f"{self.transform.name}+{self.quantizer.name}"

    @property
    def calibrated(self) -> bool:
        """Whether the method runs the calibration engine (needs calibration windows)."""
        return self.transform is not None or self.quantizer.calibrated

    @property
    def needs_hessian(self) -> bool:
        return self.quantizer.needs_hessian or (self.transform is not None and self.transform.needs_hessian)

    @property
    def one_pass(self) -> bool:
        """GPTQ in lockstep with the calibration forward (after a weight-only transform's own pass)."""
        return self.quantizer.one_pass and (self.transform is None or self.transform.weight_only)

    @property
    def takes_plan(self) -> bool:
        """Whether a different scheme per Linear (an AUTO plan) can be quantized with it."""
        return self.transform is None or self.transform.takes_plan

    def check(self, scheme: QuantScheme, has_calibration: bool) -> QuantScheme:
        """``scheme`` if this method can produce it, else ``ValueError`` saying why."""
        if self.transform is not None:
            self.transform.check(scheme)
        self.quantizer.check(scheme)
        if self.calibrated and not has_calibration:
            raise ValueError(f"method {self.name} needs calibration data (token ids [n_samples, seq_len])")
        return scheme

    def record(self) -> dict[str, Any]:
        """The method and its options, for provenance."""
        parts = [self.quantizer] if self.transform is None else [self.transform, self.quantizer]
        return {"name": self.name, **{p.name: p.options() for p in parts}}


def option_names(cls: type) -> set[str]:
    """The option fields of a quantizer or transform class."""
    return {f.name for f in fields(cls)}
