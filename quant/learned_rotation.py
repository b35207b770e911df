"""A learned residual rotation (SpinQuant's R1): an orthogonal matrix optimised on the calibration
set so that the rotated model, its Linears fake-quantized as the scheme will store them, stays
closest to the float model.

The model's norms are folded into the Linears that read them (as :class:`~llmopt.quant.rotation.Rotation`
does), so any orthogonal ``R`` leaves the float function unchanged; each step builds the rotated
weights (embedding ``E R``, residual readers ``W R``, writers ``Rᵀ W``, head ``W R``), rounds every
quantized Linear's weight to the scheme's grid with straight-through gradients (and its inputs
per token, for schemes that quantize activations), and measures the KL divergence of the result's
next-token distributions to the float model's on one calibration window. ``R`` moves by Cayley
SGD: the gradient ``G`` gives the skew-symmetric ``A = G Rᵀ - R Gᵀ``, and
``R ← (I + τ/2 A)⁻¹ (I - τ/2 A) R`` keeps it orthogonal (Wen & Yin's curvilinear search, as
SpinQuant). It starts from the randomized Hadamard matrix and ends re-orthogonalised in float64
(the polar factor). The per-head rotation (R2) stays Hadamard. The model is held in memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.func import functional_call
from llmopt.core.errors import LlmoptError
from llmopt.formats.schemes import QuantScheme, compute_qparams, effective_group_size, fake_quantize, fake_quantize_activations

from .apply import select_targets
from .rotation import _role

LAYER_NORMS = {"reads-attn": "input_layernorm", "reads-mlp": "post_attention_layernorm"}


def _fake_quant_ste(w: torch.Tensor, scheme: QuantScheme, group_size: int | None) -> torch.Tensor:
    """``w`` on the scheme's grid (min-max scales), gradients passed straight through."""
    group = effective_group_size(w.shape[1], group_size)
    with torch.no_grad():
        scale, zero = compute_qparams(w, scheme, group)
        rounded = fake_quantize(w, scale, zero, scheme, group)
    return w + (rounded - w).detach()


class _RotatedWeights:
    """The model's tensors with norms folded; ``at(R)`` the rotated (and fake-quantized) ones."""

    def __init__(self, model: torch.nn.Module, scheme: QuantScheme, group_size: int | None, ignore: tuple[str, ...]) -> None:
        self.scheme, self.group_size = scheme, group_size
        params = dict(model.named_parameters(remove_duplicate=False))
        self.embed_name = "model.embed_tokens.weight"
        self.embed = params[self.embed_name].detach().float()
        head = params.get("lm_head.weight", params[self.embed_name]).detach().float()
        self.head = head * params["model.norm.weight"].detach().float()[None, :]
        self.ones = {name: torch.ones_like(p) for name, p in params.items() if name.endswith("norm.weight")
                     and (name == "model.norm.weight" or any(n in name for n in LAYER_NORMS.values()))}
        self.readers: dict[str, torch.Tensor] = {}
        self.writers: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.quantized = set(select_targets(model, ignore))  # the Linears the quantizer will round
        for i, layer in enumerate(model.model.layers):
            prefix = f"model.layers.{i}."
            for rest, module in layer.named_modules():
                role = _role(rest) if isinstance(module, torch.nn.Linear) else None
                if role is None:
                    continue
                name = prefix + rest
                w = module.weight.detach().float()
                if role == "writes":
                    bias = None if module.bias is None else module.bias.detach().float()
                    self.writers[name] = (w, bias)
                else:
                    norm = getattr(layer, LAYER_NORMS[role]).weight.detach().float()
                    self.readers[name] = w * norm[None, :]

    def at(self, r: torch.Tensor, quantize: bool = True) -> dict[str, torch.Tensor]:
        """The model's tensors rotated by ``r`` (fake-quantized where the quantizer will round, with ``quantize``)."""
        rounded = self.quantized if quantize else set()

        def quant(name: str, w: torch.Tensor) -> torch.Tensor:
            return _fake_quant_ste(w, self.scheme, self.group_size) if name in rounded else w

        out = dict(self.ones)
        out[self.embed_name] = self.embed @ r
        out["lm_head.weight"] = self.head @ r
        for name, w in self.readers.items():
            out[name + ".weight"] = quant(name, w @ r)
        for name, (w, bias) in self.writers.items():
            out[name + ".weight"] = quant(name, r.T @ w)
            if bias is not None:
                out[name + ".bias"] = r.T @ bias
        return out


def _activation_hooks(model: torch.nn.Module, names: set[str], kind: str, active: list[bool]) -> list:
    """Per-token fake quantization of the inputs of ``names`` (straight-through) while ``active[0]``."""
    def hook(_module, args):
        if not active[0]:
            return None
        x = args[0]
        return (x + (fake_quantize_activations(x, kind) - x).detach(), *args[1:])

    return [module.register_forward_pre_hook(hook) for name, module in model.named_modules() if name in names]


@torch.no_grad()
def _check_rotates_exactly(model: torch.nn.Module, weights: _RotatedWeights, r: torch.Tensor, ids: torch.Tensor) -> None:
    """Refuse a model whose rotated float weights do not compute its function (a layout the
    rotation does not reach, such as experts stored as fused 3-D tensors)."""
    want = model(ids).logits.float().log_softmax(-1)
    got = functional_call(model, weights.at(r.detach(), quantize=False), (ids,), tie_weights=False, strict=False).logits
    gap = float(_kld(want, got))
    if not gap < 1e-3:
        raise LlmoptError(f"--rotate learned: this model's rotated weights do not reproduce it (KLD {gap:.3g}); its layers "
                          "hold tensors the in-memory rotation does not reach (e.g. mixture-of-experts weights stored fused)",
                          "use --rotate hadamard for this model")


def _kld(teacher_logp: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    return F.kl_div(logits.float().log_softmax(-1), teacher_logp, log_target=True, reduction="none").sum(-1).mean()


def learn_residual_rotation(model: torch.nn.Module, start: torch.Tensor, windows: torch.Tensor, scheme: QuantScheme,
                            group_size: int | None, steps: int, lr: float, ignore: tuple[str, ...] = (),
                            progress: Callable[[int, float], None] | None = None) -> tuple[torch.Tensor, dict]:
    """The learned ``hidden × hidden`` float64 rotation and a record of the run.

    ``model``: a float Llama-style causal LM (its weights are not changed); ``start``: the initial
    orthogonal matrix; ``windows`` ``[n, seq]`` calibration token ids, one per step in turn;
    ``steps`` Cayley-SGD steps of size ``lr``; ``ignore``: the quantizer's patterns (those Linears stay
    float; the head and embedding always do); ``progress(step, kld)`` after each.
    """
    model = model.float().eval()
    weights = _RotatedWeights(model, scheme, group_size, ignore)
    r = start.float().clone().requires_grad_(True)
    eye = torch.eye(r.shape[0])
    _check_rotates_exactly(model, weights, r, windows[0][None])
    active = [False]  # the student's inputs are rounded, the teacher's are not
    handles = _activation_hooks(model, weights.quantized, scheme.activations, active) if scheme.activations else []
    history = []
    try:
        for param in model.parameters():
            param.requires_grad_(False)
        for step in range(steps):
            ids = windows[step % len(windows)][None]
            with torch.no_grad():
                teacher = model(ids).logits.float().log_softmax(-1)[0]
            active[0] = True
            logits = functional_call(model, weights.at(r), (ids,), tie_weights=False, strict=False).logits[0]
            active[0] = False
            loss = _kld(teacher, logits)
            grad, = torch.autograd.grad(loss, r)
            with torch.no_grad():
                a = grad @ r.T - r @ grad.T
                r.copy_(torch.linalg.solve(eye + lr / 2 * a, (eye - lr / 2 * a) @ r))
            history.append(float(loss.detach()))
            if progress is not None:
                progress(step + 1, history[-1])
    finally:
        for h in handles:
            h.remove()
    u, _, vh = torch.linalg.svd(r.detach().double())
    learned = u @ vh  # the nearest orthogonal matrix (float32 steps drift by rounding)
    tail = max(1, len(history) // 10)
    record = {"method": "cayley-sgd", "steps": steps, "lr": lr, "windows": int(len(windows)), "seq_len": int(windows.shape[1]),
              "kld_first_steps": sum(history[:tail]) / tail, "kld_last_steps": sum(history[-tail:]) / tail,
              "objective": "KL(float || rotated, fake-quantized) on the calibration windows"
                           + (f", inputs rounded per token ({scheme.activations})" if scheme.activations else "")}
    return learned, record
