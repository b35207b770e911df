"""Per-tensor sensitivity: the KL-divergence cost of storing one tensor in each candidate format.

Measured on calibration windows with one forward and one backward pass of the float model:

* every decoder Linear ``y = W x``: its mean input second moment ``H = E[x xᵀ]`` and the sampled
  Fisher of its output ``F_j = E[(∂ log p(ŷ) / ∂y_j)²]`` (``ŷ`` drawn from the model's own
  next-token distribution, so ``F`` estimates the Hessian of the KL divergence). Quantizing
  ``W`` to ``Ŵ`` costs ``½ Σ_j F_j (ΔW H ΔWᵀ)_jj`` nats per token (second order, ``ΔW = Ŵ - W``);
* the token embedding: ``½ E_t Σ_j g_tj² ΔE[id_t, j]²`` with the gradient ``g`` at its output;
* the output head: measured exactly — the mean KL divergence of the logits computed with the
  quantized head from the cached final hidden states.

A tied embedding/head is one matrix: its cost is the sum of both roles. A mixture-of-experts
model's fused experts are first unfused (:func:`~llmopt.checkpoints.moe.unfuse_experts`, as the
quantizer does) so each expert projection is a Linear priced on the tokens routed to it: ``H``
is its inputs' mean over those ``n_e`` tokens and ``F`` is summed over them but divided by all
``n`` tokens, so the cost is the expected cost per token (the expert runs on ``n_e / n`` of them);
an expert no window routes to costs nothing. Costs are assumed to
add across tensors (validated against end-to-end KLD in ``bench/mixed_precision.py``). Second
order misses a routing choice flipped by an earlier tensor's error: on tiny random MoE models
the last layer's experts cost what is predicted, earlier tensors about twice as much.
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
from pathlib import Path

import torch
from torch import nn

from llmopt.checkpoints.moe import stored_key, unfuse_experts
from llmopt.core.console import progress_task
from llmopt.formats.file_sizes import (
    SAFETENSORS_FIXED,
    SourceLayout,
    gguf_data_bytes,
    gguf_index_bytes,
    safetensors_entry_bytes,
    source_layout,
)
from llmopt.formats.registry import GGUF_FLOAT_BITS, LINEAR_CANDIDATES, OUTER_CANDIDATES, Candidate, candidate
from llmopt.formats.schemes import QuantScheme, compute_qparams, fake_quantize, scale_dtype_for
from llmopt.formats.weight_format import SHAPE_BYTES
from llmopt.quant.gptq import gptq_quantize_weight
from llmopt.quant.head_fisher import HeadFisher
from llmopt.quant.outer import EMBED, HEAD, input_hessian, outer_scheme, quantize_head

# The candidate formats are the registry's (:mod:`llmopt.formats.registry`): a decoder Linear's
# (name → a format in groups of a size: int4 in groups of 128, 64 or 32; int4a / int5a with zero
# points (GGUF Q4_1 / Q5_1); nl4 (IQ4_NL grid codes in int8: 8.5 bits in a checkpoint, 4.5 as GGUF
# IQ4_NL); nl4x (its scales k·d per 256 features: GGUF IQ4_XS, float32 scales in a checkpoint);
# int6x / int3x (GGUF Q6_K / Q3_K, likewise) …) and the embedding's / head's.
LINEAR_FORMATS: dict[str, Candidate] = LINEAR_CANDIDATES
OUTER_FORMATS = tuple(OUTER_CANDIDATES)
FLOAT = "float"
SIZES = ("checkpoint", "gguf")  # how bits are counted: as the checkpoint stores them, or the GGUF file's blocks


def format_scheme(name: str, in_features: int, scale_dtype: str = "bfloat16") -> QuantScheme | None:
    """The scheme (group size resolved for ``in_features``) of a candidate format name; None: float."""
    if name == FLOAT:
        return None
    if name in LINEAR_FORMATS:
        return LINEAR_FORMATS[name].scheme(in_features, scale_dtype)
    return outer_scheme(name)


def format_bits(name: str, in_features: int, float_bits: int, out_features: int | None = None) -> float:
    """Stored bits per weight in a checkpoint: codes as packed, scales in their stored dtype (16
    bits; float32 for super-block scales), zero points packed; float at ``float_bits``. With
    ``out_features`` the tensor's exact size, else the per-weight size of a tall matrix."""
    if name == FLOAT:
        return float(float_bits)
    rows = out_features or 32  # 32 rows pack the zero points without a partial word
    nbytes = candidate(name).checkpoint_bytes((rows, in_features)) - (0 if out_features else SHAPE_BYTES)
    return nbytes * 8 / (rows * in_features)


def gguf_bits(name: str, in_features: int) -> float:
    """Bits per weight of the format in a ``--type auto`` GGUF file: the block type that carries its
    codes (Q3_K 3.4375, IQ4_XS 4.25, Q4_0 / IQ4_NL 4.5, Q4_1 5, Q5_0 5.5, Q5_1 6, Q6_K 6.5625, Q8_0 8.5), F16 when none
    does or for float."""
    return float(GGUF_FLOAT_BITS) if name == FLOAT else candidate(name).gguf_bits(in_features)


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
    other_bits: int  # bits of everything else in the checkpoint (norms …, the files' headers), counted in the average
    tokens: int
    other_params: int = 0
    notes: list[str] = field(default_factory=list)
    other_gguf_bits: int | None = None  # the same in a GGUF file (F32 norms, metadata and tokenizer, tensor index)

    def other(self, size: str) -> int:
        """Bits of everything else: as stored in the checkpoint, or in a GGUF file (F32 norms and
        biases, plus the file's metadata when measured)."""
        if size != "gguf":
            return self.other_bits
        return 32 * self.other_params if self.other_gguf_bits is None else self.other_gguf_bits

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "other_bits": self.other_bits, "other_params": self.other_params,
                "other_gguf_bits": self.other_gguf_bits, "tensors": {t.name: t.to_dict() for t in self.tensors}}

    @classmethod
    def from_dict(cls, d: dict) -> "Sensitivity":
        tensors = [TensorCost(n, v["kind"], tuple(v["shape"]), v["costs"], v["bits"], v.get("gguf", {}))
                   for n, v in d["tensors"].items()]
        return cls(tensors, d["other_bits"], d["tokens"], d.get("other_params", 0), other_gguf_bits=d.get("other_gguf_bits"))


class FileSizes:
    """Exact bits of each tensor as the written files hold it, per candidate format: in the
    checkpoint (codes, scales and zero points as packed, float tensors in their stored dtype, each
    tensor's safetensors header entry) and in the ``--type auto`` GGUF file (the block type
    carrying the format, F16 float matrices, F32 vectors, alignment and the tensor index)."""

    def __init__(self, layout: SourceLayout, model: nn.Module) -> None:
        self.layout = layout
        self.fallback = next(model.parameters()).dtype
        floats = [d for d in layout.dtypes.values() if d.is_floating_point]
        self.scale_dtype = scale_dtype_for(max(set(floats), key=floats.count) if floats else self.fallback)
        self.model_type = getattr(getattr(model, "config", None), "model_type", None)

    def _key(self, key: str) -> str:
        """The name the files store the model's tensor ``key`` under (Mixtral's experts and router:
        ``block_sparse_moe.…``, :func:`~llmopt.checkpoints.moe.stored_key`)."""
        return stored_key(key, self.model_type)

    def _stored(self, key: str) -> torch.dtype:
        return self.layout.dtypes.get(key, self.fallback)

    def checkpoint(self, module: str, shape: tuple[int, ...], fmt: str) -> float:
        """Bits per weight of ``module``'s weight in format ``fmt`` (``float``: as the source stores it)."""
        numel = shape[0] * shape[1]
        if fmt == FLOAT:
            key = self._key(f"{module}.weight")
            nbytes = numel * self._stored(key).itemsize + safetensors_entry_bytes(key, self._stored(key), shape)
            return nbytes * 8 / numel
        cand = candidate(fmt)
        nbytes = cand.checkpoint_bytes(shape, self.scale_dtype)
        nbytes += sum(safetensors_entry_bytes(self._key(f"{module}.{local}"), torch.int32, shape)
                      for local in cand.format.checkpoint_tensors())
        return nbytes * 8 / numel

    def gguf(self, module: str, shape: tuple[int, ...], fmt: str) -> float:
        """Bits per weight of ``module``'s weight in format ``fmt`` in the GGUF file."""
        numel = shape[0] * shape[1]
        carrier = None
        if fmt != FLOAT:
            cand = candidate(fmt)
            carrier = cand.format.gguf_carrier(shape[1], cand.scheme(shape[1]).group_size)
        data = numel * GGUF_FLOAT_BITS // 8 if carrier is None else shape[0] * (shape[1] // carrier.block) * carrier.type_bytes
        key = self._key(f"{module}.weight")
        name = self.layout.gguf_names.get(key, key)
        return (gguf_data_bytes(data) + gguf_index_bytes(name, 2)) * 8 / numel

    def others(self, params: dict[str, torch.Tensor]) -> tuple[int, int]:
        """(checkpoint bits, GGUF bits) of the tensors outside the candidates (norms, biases), the
        files' fixed bytes included (GGUF: header, metadata and tokenizer, tensor index)."""
        checkpoint = 8 * SAFETENSORS_FIXED
        gguf = 8 * (self.layout.gguf_fixed_bytes or 0)
        for key, p in ((self._key(k), p) for k, p in params.items()):
            dtype = self._stored(key)
            checkpoint += 8 * (p.numel() * dtype.itemsize + safetensors_entry_bytes(key, dtype, tuple(p.shape)))
            element = 4 if p.dim() < 2 else GGUF_FLOAT_BITS // 8  # vectors F32, matrices F16
            name = self.layout.gguf_names.get(key, key)
            gguf += 8 * (gguf_data_bytes(p.numel() * element) + gguf_index_bytes(name, p.dim()))
        return checkpoint, gguf


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


def _linear_costs(w: torch.Tensor, hessian: torch.Tensor | None, fisher: torch.Tensor, gptq: bool,
                  formats: tuple[str, ...]) -> dict[str, float]:
    """Nats per token of each Linear format (of ``formats``) of ``w``: ``½ Σ_j F_j (ΔW H ΔWᵀ)_jj``
    (``hessian`` None: the Linear saw no token, an expert nothing was routed to, and costs nothing)."""
    if hessian is None:
        return dict.fromkeys(formats, 0.0)
    costs = {}
    for fmt in formats:
        scheme = format_scheme(fmt, w.shape[1])
        dw = _gptq_error(w, hessian, scheme) if gptq else _weight_error(w, scheme)
        costs[fmt] = 0.5 * float((fisher * ((dw @ hessian) * dw).sum(1)).sum())
    return costs


def measure_sensitivity(model: nn.Module, calib_ids: torch.Tensor, seed: int = 0,
                        head_chunk: int = 256, head_gptq: bool = False, linear_gptq: bool = False,
                        source: Path | str | None = None, linear_formats: tuple[str, ...] | None = None) -> Sensitivity:
    """Per-tensor costs of every candidate format on ``calib_ids`` ``[n, seq]`` (float model, CPU).
    ``head_gptq``: the head (and a tied embedding) quantized by GPTQ on its inputs' Hessian, as a
    calibrated quantization stores it, instead of RTN with the clipping search; ``linear_gptq``:
    the decoder Linears' errors likewise GPTQ's on their inputs' second moments. ``source``: the
    checkpoint directory the model was loaded from (default: the model's ``name_or_path``), whose
    stored dtypes and tokenizer the sizes are counted with (:class:`FileSizes`); ``linear_formats``:
    the Linear formats to price (default: every candidate). Fused experts
    of ``model`` are unfused in place (one Linear per expert projection, each priced)."""
    model.eval()
    unfuse_experts(model)
    sizes = FileSizes(source_layout(source if source is not None else getattr(model, "name_or_path", None)), model)
    linears = _decoder_linears(model)
    hess: dict[str, torch.Tensor] = {}  # Σ x xᵀ over the tokens each Linear saw (allocated on its first input)
    rows: dict[str, int] = {}  # how many tokens: all of them, or those routed to an expert
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
                if name in hess:
                    hess[name] += x.T @ x
                else:
                    hess[name] = x.T @ x
                rows[name] = rows.get(name, 0) + x.shape[0]
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
    out: list[TensorCost] = []
    pricing = progress_task("pricing formats by GPTQ", len(linears)) if linear_gptq else nullcontext(lambda: None)
    with torch.no_grad(), pricing as advance:
        for name, m in linears.items():
            seen = shared.get(name, name)  # the Linear whose inputs' moments this one shares
            h = (hess[seen] / rows[seen]).float() if seen in hess else None
            costs = _linear_costs(m.weight, h, (fisher[name] / tokens).float(), linear_gptq,
                                  tuple(linear_formats or LINEAR_FORMATS))
            shape = tuple(m.weight.shape)
            costs[FLOAT] = 0.0
            bits = {fmt: sizes.checkpoint(name, shape, fmt) for fmt in costs}
            gbits = {fmt: sizes.gguf(name, shape, fmt) for fmt in costs}
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
            costs[FLOAT] = 0.0
            name = EMBED if role in ("tied", "embedding") else HEAD
            bits = {fmt: sizes.checkpoint(name, (vocab, hidden), fmt) for fmt in costs}
            gbits = {fmt: sizes.gguf(name, (vocab, hidden), fmt) for fmt in costs}
            out.append(TensorCost(name, role, (vocab, hidden), costs, bits, gbits))
    counted = {id(m.weight) for m in linears.values()} | {id(embed.weight), id(head.weight)}
    rest = {n: p for n, p in model.named_parameters() if id(p) not in counted}
    other, other_gguf = sizes.others(rest)
    return Sensitivity(out, other, tokens, sum(p.numel() for p in rest.values()), other_gguf_bits=other_gguf)


def _head_kld(final: torch.Tensor, w: torch.Tensor, quantized: dict[str, torch.Tensor], chunk: int) -> dict[str, float]:
    """Mean KL(float head ‖ quantized head) over the rows of ``final``, for each quantized head."""
    total = dict.fromkeys(quantized, 0.0)
    for x in torch.split(final, chunk):
        p = torch.log_softmax(x @ w.T, -1)
        for name, wq in quantized.items():
            q = torch.log_softmax(x @ wq.T, -1)
            total[name] += float((p.exp() * (p - q)).sum())
    return {name: t / final.shape[0] for name, t in total.items()}
