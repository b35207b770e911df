"""Quantized weights whose codes train: the student of quantization-aware distillation.

Each quantized weight of a model becomes a :class:`FakeQuantWeight`: a latent float copy of its
codes (in code units, zero point included, starting exactly on the stored codes) and one
log-multiplier per scale (as :class:`~llmopt.quant.scale_tuning.TunableScales`). The forward
pass rounds the latent codes to the scheme's grid (integers in range, a restricted grid, FP8 or
FP4's E2M1 values) and multiplies by the scales; the rounding passes gradients straight
through (STE), so a code moves once its latent crosses half a step. Because the latent lives in
code units, one learning rate means the same for every layer and scheme.

:func:`attach` puts them on a float model holding the dequantized weights (each module's weight is
rebuilt from its codes before every forward); :func:`trained_weights` gives the result back as
:class:`QuantizedWeight` objects in the checkpoint's own format — codes on the grid, scales
rounded as they are stored — so the saved checkpoint has the same size, layout and speed, and a
GGUF export of it stays exact.
"""

from __future__ import annotations

import torch
from torch import nn

from llmopt.formats.schemes import QuantizedWeight, quantize
from llmopt.quant.scale_tuning import TunableScales

CODE_PARAMETER = "latent_codes"  # name of the latent codes' parameter (the optimizer gives them their own step)


def round_codes(latent: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """``latent`` (code units, zero point included) rounded to the codes ``qw``'s scheme can store,
    in its stored dtype (int8, or float8 for FP8 / FP4)."""
    groups = qw.scale.shape[1]
    unit = torch.ones(latent.shape[0], groups, device=latent.device)
    return quantize(latent.detach(), unit, None, qw.scheme, latent.shape[1] // groups)


class FakeQuantWeight(nn.Module):
    """One quantized weight with trainable latent codes and scale multipliers (see the module docstring)."""

    def __init__(self, qw: QuantizedWeight, per: str = "group") -> None:
        super().__init__()
        if qw.scheme.activations is not None:
            raise ValueError(f"{qw.scheme.name} quantizes activations: only weight-only schemes train")
        self.scales = TunableScales(qw, per=per)
        self.scales.codes = None  # its fixed float codes: the latent ones below replace them
        self.log_multiplier = nn.Parameter(self.scales.log_multiplier.detach().clone())
        self.scales.log_multiplier = self.log_multiplier
        self.register_parameter(CODE_PARAMETER, nn.Parameter(qw.codes.float()))
        zero = None if qw.zero_point is None else qw.zero_point.float().repeat_interleave(self.scales.group, dim=1)
        if self.scales.offset is not None:  # float zero points: unsigned codes times the scale, less the fixed mins
            zero = torch.full_like(qw.codes, -(2 ** (qw.scheme.num_bits - 1)), dtype=torch.float32)
        self.register_buffer("zero", zero)
        self.register_buffer("offset", self.scales.offset)
        self.register_buffer("scale", self.scales.scale)
        low, high = _code_range(qw)
        self.low, self.high = low, high

    @property
    def latent(self) -> nn.Parameter:
        return getattr(self, CODE_PARAMETER)

    def forward(self) -> torch.Tensor:
        """The weight at the current latent codes and multipliers (rounded codes, straight-through gradients)."""
        latent = self.latent
        codes = latent + (round_codes(latent, self.scales.original).float() - latent).detach()
        if self.zero is not None:
            codes = codes - self.zero
        w = codes * self.scales.weight_scale(self.scale)
        return w if self.offset is None else w - self.offset

    @torch.no_grad()
    def start_near(self, w: torch.Tensor, margin: float = 0.49) -> int:
        """Move each latent code towards ``w`` (a float weight of this shape, in code units through
        the current scales), at most ``margin`` of a step from its stored code: the rounded weight is
        unchanged, but a code the float weight sits near the edge of flips after a small step, not
        half a step. Returns how many latents moved."""
        unit = self.scales.weight_scale(self.scale)
        shifted = w.to(unit) if self.offset is None else w.to(unit) + self.offset
        target = shifted / torch.where(unit == 0, torch.ones_like(unit), unit)
        if self.zero is not None:
            target = target + self.zero
        stored = round_codes(self.latent, self.scales.original).float()
        step = torch.where(unit == 0, torch.zeros_like(target), (target - stored).clamp(-margin, margin))
        self.latent.copy_(stored + step)
        return int((step != 0).sum())

    @torch.no_grad()
    def clamp_(self) -> None:
        """Keep the latent codes within half a step of the grid's ends (beyond, they get no gradient back)."""
        self.latent.clamp_(self.low - 0.5, self.high + 0.5)

    @torch.no_grad()
    def quantized(self) -> QuantizedWeight:
        """The trained weight as stored: codes on the grid, scales rounded to their stored dtype."""
        codes = round_codes(self.latent, self.scales.original).cpu()
        qw = self.scales.tuned(codes)
        return QuantizedWeight(qw.codes, qw.scale.cpu(), qw.zero_point, qw.scheme, qw.group_size)


def _code_range(qw: QuantizedWeight) -> tuple[float, float]:
    scheme = qw.scheme
    if scheme.is_fp4:
        return -6.0, 6.0
    if scheme.is_float:
        return -448.0, 448.0
    if scheme.grid is not None:
        return float(min(scheme.grid)), float(max(scheme.grid))
    return float(scheme.qmin), float(scheme.qmax)


class FakeQuantModel:
    """The fake-quantized weights attached to a model, by module name."""

    def __init__(self, weights: dict[str, FakeQuantWeight]) -> None:
        self.weights = weights

    def trained_weights(self) -> dict[str, QuantizedWeight]:
        """Every weight as it would be stored now."""
        return {name: w.quantized() for name, w in self.weights.items()}


def attach(model: nn.Module, weights: dict[str, QuantizedWeight], per: str = "group") -> FakeQuantModel:
    """Make ``weights`` (by module name) trainable on ``model``, a float model holding their
    dequantized values: each module gets a ``fake_quant`` child and rebuilds its weight from it
    before every forward; every other parameter is frozen. A tied head that is not quantized on
    its own follows the embedding's codes."""
    modules = dict(model.named_modules())
    missing = [name for name in weights if name not in modules]
    if missing:
        raise ValueError(f"quantized weights with no module of that name in the model: {missing[:3]}")
    for p in model.parameters():
        p.requires_grad_(False)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied_head = head is not None and head.weight is embedding.weight
    names = {m: n for n, m in modules.items()}
    attached: dict[str, FakeQuantWeight] = {}
    for name, qw in weights.items():
        module = modules[name]
        device = module.weight.device
        fake = FakeQuantWeight(qw, per).to(device)
        module.fake_quant = fake
        del module._parameters["weight"]
        module.weight = fake().detach()
        module.register_forward_pre_hook(_rebuild(module, fake))
        attached[name] = fake
    if tied_head and names[embedding] in weights and names[head] not in weights:
        del head._parameters["weight"]
        head.weight = embedding.weight
        head.register_forward_pre_hook(_rebuild(head, attached[names[embedding]]))
    return FakeQuantModel(attached)


def _rebuild(module: nn.Module, fake: FakeQuantWeight):
    def hook(_module: nn.Module, _args) -> None:
        module.weight = fake()
    return hook
