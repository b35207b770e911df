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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from llmopt.formats.schemes import QuantScheme, compute_qparams, effective_group_size, fake_quantize, get_scheme
from llmopt.quant.outer import EMBED, HEAD, outer_scheme

# candidate formats: name → (preset, group size); float is the stored dtype
LINEAR_FORMATS = {"int4_g128": ("W4A16", 128), "int4_g64": ("W4A16", 64), "int4_g32": ("W4A16", 32), "int8": ("W8A16", 0)}
OUTER_FORMATS = ("int4", "int8")
FLOAT = "float"


def format_scheme(name: str, in_features: int) -> QuantScheme | None:
    """The scheme (group size resolved for ``in_features``) of a candidate format name; None: float."""
    if name == FLOAT:
        return None
    if name in LINEAR_FORMATS:
        preset, group = LINEAR_FORMATS[name]
        scheme = get_scheme(preset, group)
        return scheme.with_group_size(effective_group_size(in_features, scheme.group_size))
    return outer_scheme(name)


def format_bits(name: str, in_features: int, float_bits: int) -> float:
    """Stored bits per weight: codes plus 16-bit scales (as ``QuantScheme.bits_per_weight``)."""
    scheme = format_scheme(name, in_features)
    if scheme is None:
        return float(float_bits)
    if scheme.group_size is None:
        return scheme.num_bits + 16 / in_features
    return scheme.bits_per_weight


@dataclass
class TensorCost:
    """One quantizable tensor: its size and the estimated KLD cost of each candidate format."""

    name: str
    kind: str  # linear, embedding, head, tied (embedding and head in one)
    shape: tuple[int, int]
    costs: dict[str, float]  # format name → nats per token
    bits: dict[str, float]  # format name → stored bits per weight

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def to_dict(self) -> dict:
        return {"kind": self.kind, "shape": list(self.shape), "costs": self.costs, "bits": self.bits}


@dataclass
class Sensitivity:
    tensors: list[TensorCost]
    other_bits: int  # bits of everything else stored (norms …), counted in the average
    tokens: int
    other_params: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "other_bits": self.other_bits, "other_params": self.other_params,
                "tensors": {t.name: t.to_dict() for t in self.tensors}}

    @classmethod
    def from_dict(cls, d: dict) -> "Sensitivity":
        tensors = [TensorCost(n, v["kind"], tuple(v["shape"]), v["costs"], v["bits"]) for n, v in d["tensors"].items()]
        return cls(tensors, d["other_bits"], d["tokens"], d.get("other_params", 0))


def _decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    from llmopt.quant.apply import select_targets

    return select_targets(model, ())


@torch.no_grad()
def _weight_error(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    scale, zp = compute_qparams(w, scheme, scheme.group_size)
    return fake_quantize(w.float(), scale, zp, scheme, scheme.group_size) - w.float()


def measure_sensitivity(model: nn.Module, calib_ids: torch.Tensor, seed: int = 0,
                        head_chunk: int = 256) -> Sensitivity:
    """Per-tensor costs of every candidate format on ``calib_ids`` ``[n, seq]`` (float model, CPU)."""
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

    def linear_hook(name):
        def hook(module, args, out):
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
            logits = model(ids).logits.float()[0]
            sampled = torch.multinomial(torch.softmax(logits.detach(), -1), 1, generator=gen).squeeze(1)
            loss = torch.nn.functional.cross_entropy(logits, sampled, reduction="sum")
            loss.backward()
            tokens += ids.numel()
    finally:
        for h in handles:
            h.remove()
        embed.weight.grad = None
        for p, flag in zip(model.parameters(), params):
            p.requires_grad_(flag)
    float_bits = embed.weight.element_size() * 8
    out: list[TensorCost] = []
    with torch.no_grad():
        for name, m in linears.items():
            h = (hess[name] / tokens).float()
            f = (fisher[name] / tokens).float()
            costs, bits = {}, {}
            for fmt in LINEAR_FORMATS:
                scheme = format_scheme(fmt, dim[name])
                dw = _weight_error(m.weight, scheme)
                costs[fmt] = 0.5 * float((f * ((dw @ h) * dw).sum(1)).sum())
                bits[fmt] = format_bits(fmt, dim[name], float_bits)
            costs[FLOAT], bits[FLOAT] = 0.0, float(float_bits)
            out.append(TensorCost(name, "linear", tuple(m.weight.shape), costs, bits))
        final = torch.cat(finals)
        base_logp = None
        emb_w = embed.weight.float()
        g2 = emb_grad.float() / tokens
        for role in (["tied"] if tied else ["embedding", "head"]):
            costs, bits = {}, {}
            for fmt in OUTER_FORMATS:
                scheme = outer_scheme(fmt)
                cost = 0.0
                if role in ("tied", "embedding"):
                    dw = _weight_error(emb_w, scheme)
                    cost += 0.5 * float((g2 * dw.pow(2)).sum())
                if role in ("tied", "head"):
                    hw = head.weight.float()
                    cost += _head_kld(final, hw, hw + _weight_error(hw, scheme), head_chunk)
                costs[fmt] = cost
                bits[fmt] = format_bits(fmt, hidden, float_bits)
            costs[FLOAT], bits[FLOAT] = 0.0, float(float_bits)
            name = EMBED if role in ("tied", "embedding") else HEAD
            out.append(TensorCost(name, role, (vocab, hidden), costs, bits))
        del base_logp
    counted = {id(m.weight) for m in linears.values()} | {id(embed.weight), id(head.weight)}
    rest = [p for p in model.parameters() if id(p) not in counted]
    other = sum(p.numel() * p.element_size() * 8 for p in rest)
    return Sensitivity(out, other, tokens, sum(p.numel() for p in rest))


def _head_kld(final: torch.Tensor, w: torch.Tensor, wq: torch.Tensor, chunk: int) -> float:
    """Mean KL(float head ‖ quantized head) over the rows of ``final``."""
    total = 0.0
    for x in torch.split(final, chunk):
        p = torch.log_softmax(x @ w.T, -1)
        q = torch.log_softmax(x @ wq.T, -1)
        total += float((p.exp() * (p - q)).sum())
    return total / final.shape[0]
