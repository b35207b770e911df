"""Per-tensor sensitivity: the KL-divergence cost of storing one tensor in each candidate format.

Measured on calibration windows with one forward and one backward pass of the float model:

* every decoder Linear ``y = W x``: its mean input second moment ``H = E[x xᵀ]`` and the sampled
  Fisher of its output ``F_j = E[(∂ log p(ŷ) / ∂y_j)²]`` (``ŷ`` drawn from the model's own
  next-token distribution, so ``F`` estimates the Hessian of the KL divergence). Quantizing
  ``W`` to ``Ŵ`` costs ``½ Σ_j F_j (ΔW H ΔWᵀ)_jj`` nats per token (second order, ``ΔW = Ŵ - W``);
* the token embedding: ``½ E_t Σ_j g_tj² ΔE[id_t, j]²`` with the gradient ``g`` at its output;
* the output head: measured exactly — the mean KL divergence of the logits computed with the
  quantized head from the cached final hidden states.

A tied embedding/head is one matrix: its cost is the sum of both roles. Costs are assumed to
add across tensors (validated against end-to-end KLD in ``bench/mixed_precision.py``).
``ΔW`` is the round-to-nearest error (min-max ranges for Linears, the clipping search of
:func:`~llmopt.quant.outer.quantize_matrix` for the embedding/head, as each is applied by RTN;
with ``head_gptq`` the head's error is that of GPTQ on its inputs, its most probable rows on their
own KL-weighted Hessians, as a calibrated run stores it). With ``linear_gptq`` every Linear's
``ΔW`` is GPTQ's on ``H`` (activation order, static groups), so the costs rank formats by what
GPTQ leaves rather than by what RTN would; without it, GPTQ lowers every Linear's error and the
costs are an upper bound for GPTQ plans.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from llmopt.formats.schemes import (
    IQ4_NL_GRID,
    IQ4_XS_STEPS,
    K_GROUP,
    Q3_K_STEPS,
    Q6_K_STEPS,
    SUPERBLOCK,
    QuantScheme,
    compute_qparams,
    effective_group_size,
    fake_quantize,
    grid_scheme,
    int_weight_scheme,
)
from llmopt.core.console import progress_task
from llmopt.quant.gptq import gptq_quantize_weight
from llmopt.quant.head_fisher import HeadFisher
from llmopt.quant.outer import EMBED, HEAD, input_hessian, outer_scheme, quantize_head

# candidate formats of a decoder Linear: name → (bits, group size (None: one scale per row),
# symmetric, grid of allowed codes (None: all), super-block scale steps (None: free scales)).
# The GGUF block type each is exported to without rounding again is in ``gguf_bits``; int4a /
# int5a are asymmetric (a zero point per group: GGUF Q4_1 / Q5_1); nl4 holds IQ4_NL grid codes in
# int8 (8.5 bits in a checkpoint, 4.5 as GGUF IQ4_NL); nl4x also quantizes its scales per 256
# features (GGUF IQ4_XS, 4.25 bits; IQ4_NL on rows 256 does not divide); int6x is int6 in groups of
# 16 with 8-bit scale multiples per 256 features (GGUF Q6_K, 6.5625 bits; F16 where 256 does not
# divide the rows, so plans counted in GGUF bits take it only where it applies); int3x likewise
# with 3-bit codes and 6-bit multiples (GGUF Q3_K, 3.4375 bits).
LINEAR_FORMATS: dict[str, tuple[int, int | None, bool, tuple[int, ...] | None, int | None]] = {
    "int4_g128": (4, 128, True, None, None), "int4_g64": (4, 64, True, None, None), "int4_g32": (4, 32, True, None, None),
    "int4a_g32": (4, 32, False, None, None), "nl4x_g32": (8, 32, True, IQ4_NL_GRID, IQ4_XS_STEPS),
    "nl4_g32": (8, 32, True, IQ4_NL_GRID, None), "int5_g32": (5, 32, True, None, None),
    "int5a_g32": (5, 32, False, None, None), "int6_g32": (6, 32, True, None, None),
    "int6x_g16": (6, 16, True, None, Q6_K_STEPS), "int3x_g16": (3, 16, True, None, Q3_K_STEPS),
    "int8_g32": (8, 32, True, None, None),
    "int8": (8, None, True, None, None),
}
OUTER_FORMATS = ("int4", "nl4", "int4a", "int5", "int5a", "int6", "int8")
FLOAT = "float"
SIZES = ("checkpoint", "gguf")  # how bits are counted: codes + 16-bit scales, or the GGUF file's blocks
GGUF_FLOAT_BITS = 16  # float matrices of a quantized checkpoint are written as F16


def format_scheme(name: str, in_features: int) -> QuantScheme | None:
    """The scheme (group size resolved for ``in_features``) of a candidate format name; None: float."""
    if name == FLOAT:
        return None
    if name in LINEAR_FORMATS:
        bits, group, symmetric, grid, steps = LINEAR_FORMATS[name]
        if grid is not None:
            return grid_scheme(grid, effective_group_size(in_features, group), steps)
        return int_weight_scheme(bits, effective_group_size(in_features, group), symmetric, steps)
    return outer_scheme(name)


def format_bits(name: str, in_features: int, float_bits: int) -> float:
    """Stored bits per weight: codes plus 16-bit scales (as ``QuantScheme.bits_per_weight``)."""
    scheme = format_scheme(name, in_features)
    if scheme is None:
        return float(float_bits)
    if scheme.group_size is None:
        return scheme.num_bits + 16 / in_features
    return scheme.bits_per_weight


def gguf_bits(name: str, in_features: int) -> float:
    """Bits per weight of the format in a ``--type auto`` GGUF file: the block type that carries its
    codes (Q3_K 3.4375, IQ4_XS 4.25, Q4_0 / IQ4_NL 4.5, Q4_1 5, Q5_0 5.5, Q5_1 6, Q6_K 6.5625, Q8_0 8.5), F16 when none
    does or for float."""
    scheme = format_scheme(name, in_features)
    group = None if scheme is None else (scheme.group_size or in_features)
    if scheme is not None and scheme.grid is None and scheme.scale_steps in (Q3_K_STEPS, Q6_K_STEPS):
        k_quant = {(6, Q6_K_STEPS): 6.5625, (3, Q3_K_STEPS): 3.4375}.get((scheme.num_bits, scheme.scale_steps))
        fits = k_quant is not None and group == K_GROUP and in_features % SUPERBLOCK == 0
        return k_quant if fits else float(GGUF_FLOAT_BITS)
    if scheme is None or group % 32 or in_features % 32:
        return float(GGUF_FLOAT_BITS)
    if scheme.grid == IQ4_NL_GRID:
        return 4.25 if scheme.scale_steps == IQ4_XS_STEPS and in_features % SUPERBLOCK == 0 and group == 32 else 4.5
    if scheme.num_bits in (4, 5):
        return scheme.num_bits + (0.5 if scheme.symmetric else 1.0)
    return 8.5


@dataclass
class TensorCost:
    """One quantizable tensor: its size and the estimated KLD cost of each candidate format."""

    name: str
    kind: str  # linear, embedding, head, tied (embedding and head in one)
    shape: tuple[int, int]
    costs: dict[str, float]  # format name → nats per token
    bits: dict[str, float]  # format name → stored bits per weight
    gguf: dict[str, float] = field(default_factory=dict)  # format name → bits per weight in a GGUF file

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def sized(self, size: str) -> dict[str, float]:
        """Bits per weight of each format, counted as ``size`` (one of ``SIZES``)."""
        return self.gguf if size == "gguf" else self.bits

    def to_dict(self) -> dict:
        return {"kind": self.kind, "shape": list(self.shape), "costs": self.costs, "bits": self.bits, "gguf": self.gguf}


@dataclass
class Sensitivity:
    tensors: list[TensorCost]
    other_bits: int  # bits of everything else stored (norms …), counted in the average
    tokens: int
    other_params: int = 0
    notes: list[str] = field(default_factory=list)

    def other(self, size: str) -> int:
        """Bits of everything else: as stored, or F32 in a GGUF file (norms, biases)."""
        return 32 * self.other_params if size == "gguf" else self.other_bits

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "other_bits": self.other_bits, "other_params": self.other_params,
                "tensors": {t.name: t.to_dict() for t in self.tensors}}

    @classmethod
    def from_dict(cls, d: dict) -> "Sensitivity":
        tensors = [TensorCost(n, v["kind"], tuple(v["shape"]), v["costs"], v["bits"], v.get("gguf", {}))
                   for n, v in d["tensors"].items()]
        return cls(tensors, d["other_bits"], d["tokens"], d.get("other_params", 0))


def _decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    from llmopt.quant.apply import select_targets

    return select_targets(model, ())


@torch.no_grad()
def _weight_error(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    scale, zp = compute_qparams(w, scheme, scheme.group_size)
    return fake_quantize(w.float(), scale, zp, scheme, scheme.group_size) - w.float()


def _gptq_error(w: torch.Tensor, hessian: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """GPTQ's weight error on ``hessian`` (activation order, static groups), as a GPTQ run stores ``w``."""
    qw = gptq_quantize_weight(w.float(), hessian.double().clone(), scheme, scheme.group_size, act_order=True,
                              hessian_owned=True)
    return qw.dequantize() - w.float()


def measure_sensitivity(model: nn.Module, calib_ids: torch.Tensor, seed: int = 0,
                        head_chunk: int = 256, head_gptq: bool = False, linear_gptq: bool = False) -> Sensitivity:
    """Per-tensor costs of every candidate format on ``calib_ids`` ``[n, seq]`` (float model, CPU).
    ``head_gptq``: the head (and a tied embedding) quantized by GPTQ on its inputs' Hessian, as a
    calibrated quantization stores it, instead of RTN with the clipping search; ``linear_gptq``:
    the decoder Linears' errors likewise GPTQ's on their inputs' second moments."""
    model.eval()
    linears = _decoder_linears(model)
    dim = {n: m.in_features for n, m in linears.items()}
    hess = {n: torch.zeros(d, d, dtype=torch.float64) for n, d in dim.items()}
    fisher = {n: torch.zeros(m.out_features, dtype=torch.float64) for n, m in linears.items()}
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head.weight is embed.weight
    vocab, hidden = embed.weight.shape
    emb_grad = torch.zeros(vocab, hidden, dtype=torch.float64)  # Σ_t g_t² per token row
    finals: list[torch.Tensor] = []
    handles = []

    inputs: dict[int, tuple[torch.Tensor, str]] = {}  # this window's Linear inputs: q/k/v, gate/up share one
    shared: dict[str, str] = {}  # Linear → the Linear whose input second moment it shares

    def linear_hook(name):
        def hook(module, args, out):
            seen = inputs.get(id(args[0]))
            if seen is not None and seen[0] is args[0]:
                shared[name] = seen[1]
            else:
                inputs[id(args[0])] = (args[0], name)
                x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
                hess[name] += x.T @ x
            def grad_hook(g: torch.Tensor) -> None:
                fisher[name].add_(g.detach().reshape(-1, g.shape[-1]).double().pow(2).sum(0))

            out.register_hook(grad_hook)
        return hook

    current_ids: list[torch.Tensor] = []

    def embed_grad(g: torch.Tensor) -> None:
        emb_grad.index_add_(0, current_ids[0].reshape(-1), g.detach().reshape(-1, hidden).double().pow(2))

    def embed_hook(module, args, out):
        out.register_hook(embed_grad)

    def head_hook(module, args, out):
        finals.append(args[0].detach().reshape(-1, hidden).float())

    for name, m in linears.items():
        handles.append(m.register_forward_hook(linear_hook(name)))
    handles.append(embed.register_forward_hook(embed_hook))
    handles.append(head.register_forward_hook(head_hook))
    gen = torch.Generator().manual_seed(seed)
    tokens = 0
    params = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    embed.weight.requires_grad_(True)  # something must need a gradient for the hooks to fire
    try:
        for window in calib_ids:
            ids = window.unsqueeze(0)
            current_ids[:] = [ids]
            inputs.clear()
            logits = model(ids).logits.float()[0]
            sampled = torch.multinomial(torch.softmax(logits.detach(), -1), 1, generator=gen).squeeze(1)
            loss = torch.nn.functional.cross_entropy(logits, sampled, reduction="sum")
            loss.backward()
            tokens += ids.numel()
    finally:
        inputs.clear()
        for h in handles:
            h.remove()
        embed.weight.grad = None
        for p, flag in zip(model.parameters(), params):
            p.requires_grad_(flag)
    float_bits = embed.weight.element_size() * 8
    out: list[TensorCost] = []
    pricing = progress_task("pricing formats by GPTQ", len(linears)) if linear_gptq else nullcontext(lambda: None)
    with torch.no_grad(), pricing as advance:
        for name, m in linears.items():
            h = (hess[shared.get(name, name)] / tokens).float()
            f = (fisher[name] / tokens).float()
            costs, bits, gbits = {}, {}, {}
            for fmt in LINEAR_FORMATS:
                scheme = format_scheme(fmt, dim[name])
                dw = _gptq_error(m.weight, h, scheme) if linear_gptq else _weight_error(m.weight, scheme)
                costs[fmt] = 0.5 * float((f * ((dw @ h) * dw).sum(1)).sum())
                bits[fmt] = format_bits(fmt, dim[name], float_bits)
                gbits[fmt] = gguf_bits(fmt, dim[name])
            costs[FLOAT], bits[FLOAT], gbits[FLOAT] = 0.0, float(float_bits), gguf_bits(FLOAT, dim[name])
            out.append(TensorCost(name, "linear", tuple(m.weight.shape), costs, bits, gbits))
            advance()
    with torch.no_grad():
        final = torch.cat(finals)
        g2 = emb_grad.float() / tokens
        roles = ["tied"] if tied else ["embedding", "head"]
        for role in roles:
            w = (embed if role in ("tied", "embedding") else head).weight.float()
            # the outer matrices are quantized as quantize_outer does it: the head by GPTQ when
            # calibrated, otherwise (and an untied embedding always) RTN with the clipping search
            calibrated = head_gptq and role != "embedding"
            hessian = input_hessian(final) if calibrated else None
            fisher = HeadFisher.measure(final, w) if calibrated else None
            errors = {fmt: quantize_head(w, outer_scheme(fmt), hessian, fisher=fisher).dequantize() - w for fmt in OUTER_FORMATS}
            costs = {fmt: 0.0 for fmt in OUTER_FORMATS}
            if role in ("tied", "embedding"):
                for fmt, dw in errors.items():
                    costs[fmt] += 0.5 * float((g2 * dw.pow(2)).sum())
            if role in ("tied", "head"):
                for fmt, kld in _head_kld(final, w, {f: w + dw for f, dw in errors.items()}, head_chunk).items():
                    costs[fmt] += kld
            del errors
            bits = {fmt: format_bits(fmt, hidden, float_bits) for fmt in OUTER_FORMATS}
            gbits = {fmt: gguf_bits(fmt, hidden) for fmt in OUTER_FORMATS}
            costs[FLOAT], bits[FLOAT], gbits[FLOAT] = 0.0, float(float_bits), gguf_bits(FLOAT, hidden)
            name = EMBED if role in ("tied", "embedding") else HEAD
            out.append(TensorCost(name, role, (vocab, hidden), costs, bits, gbits))
    counted = {id(m.weight) for m in linears.values()} | {id(embed.weight), id(head.weight)}
    rest = [p for p in model.parameters() if id(p) not in counted]
    other = sum(p.numel() * p.element_size() * 8 for p in rest)
    return Sensitivity(out, other, tokens, sum(p.numel() for p in rest))


def _head_kld(final: torch.Tensor, w: torch.Tensor, quantized: dict[str, torch.Tensor], chunk: int) -> dict[str, float]:
    """Mean KL(float head ‖ quantized head) over the rows of ``final``, for each quantized head."""
    total = dict.fromkeys(quantized, 0.0)
    for x in torch.split(final, chunk):
        p = torch.log_softmax(x @ w.T, -1)
        for name, wq in quantized.items():
            q = torch.log_softmax(x @ wq.T, -1)
            total[name] += float((p.exp() * (p - q)).sum())
    return {name: t / final.shape[0] for name, t in total.items()}
