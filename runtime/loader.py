"""Read a checkpoint's weights into the runtime's layers.

Dense safetensors (single file or sharded) load directly; compressed-tensors checkpoints keep
their quantized Linears quantized (``QuantLinear``); bitsandbytes NF4 checkpoints are
dequantized at load. Weights go to the backend's device; Q/K/V and gate/up projections are
merged so each is one matmul, then the backend lays every linear out for its kernels.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from llmopt.core.errors import LlmoptError

from llmopt.formats.schemes import QuantizedWeight, dequantize

from .backends import Backend
from .config import ModelArch
from .layers import ConcatLinear, DenseLinear, Linear, QuantLinear, SparseMoE, HALF_HEADS, TransformedLinear, merge_linears, smaller_head


@dataclass
class LayerWeights:
    """One decoder layer. ``post_norm`` is the norm before the MLP; a dense MLP is ``gate_up`` /
    ``down``, a mixture of experts ``moe`` (then those are None); Gemma's extra norms on the
    attention and MLP outputs are ``attn_out_norm`` / ``mlp_out_norm``."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Linear
    o: Linear
    gate_up: Linear | None
    down: Linear | None
    qk_norm: torch.Tensor | None  # [heads + kv_heads, head_dim] (Qwen3, Gemma 3), else None
    moe: SparseMoE | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None

    def norms(self) -> list[torch.Tensor]:
        return [t for t in (self.input_norm, self.post_norm, self.qk_norm, self.attn_out_norm, self.mlp_out_norm) if t is not None]

    def linears(self) -> list[Linear]:
        found = [self.qkv, self.o] + [lin for lin in (self.gate_up, self.down) if lin is not None]
        return found + (self.moe.linears() if self.moe is not None else [])


@dataclass
class ModelWeights:
    """``embed`` is ``[vocab, hidden]``, or ``None`` when tied to a dense head: the lookup then
    reads the head's weight, so the matrix is held once. A tied head quantized at load
    (``lm_head`` ``bf16`` / ``int8``) keeps the float table in ``embed`` for lookups."""

    embed: torch.Tensor | None
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: Linear
    quantization: str | None  # e.g. "compressed-tensors W4A16", None when dense
    head_kind: str = "float"  # how the output head runs: float (as stored), bf16, int8, or quantized (by the checkpoint)
    embed_quantized: QuantizedWeight | None = None  # a quantized embedding table (rows dequantized per lookup)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_quantized is not None:
            return embedding_rows(self.embed_quantized, ids, self.norm.dtype)
        if self.embed is not None:
            return torch.nn.functional.embedding(ids, self.embed)
        return self.lm_head.rows(ids)

    def nbytes(self) -> int:
        """Bytes of weights in memory."""
        q = self.embed_quantized
        total = sum(t.numel() * t.element_size() for t in (self.embed, self.norm) if t is not None)
        if q is not None:
            total += sum(t.numel() * t.element_size() for t in (q.codes, q.scale, q.zero_point) if t is not None)
        for layer in self.layers:
            total += sum(t.numel() * t.element_size() for t in layer.norms())
            total += sum(lin.nbytes() for lin in layer.linears())
        return total + self.lm_head.nbytes()


def _dense_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor in the checkpoint: its safetensors (through the one checkpoint reader), else
    pytorch ``.bin`` files."""
    from llmopt.checkpoints.lazy import LazyCheckpoint, safetensors_files

    if safetensors_files(path):
        with LazyCheckpoint(path) as checkpoint:
            return checkpoint.load_all()
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("pytorch_model*.bin")):
        tensors.update(torch.load(file, map_location="cpu", weights_only=True))
    return tensors


def _quantized(path: Path, config: dict) -> tuple[dict, dict[str, torch.Tensor], str | None]:
    """(quantized weights by module, dense tensors, description) for any supported format."""
    qconfig = config.get("quantization_config") or {}
    method = qconfig.get("quant_method")
    if not method:
        return {}, _dense_tensors(path), None
    if method == "compressed-tensors":
        from llmopt.formats.compressed import read_compressed

        weights, _ = read_compressed(path)
        dense = {k: v for k, v in _dense_tensors(path).items()
                 if not (k.rpartition(".")[0] in weights and k.rpartition(".")[2].startswith("weight"))}
        names = sorted({qw.scheme.name for qw in weights.values()})
        return weights, dense, f"compressed-tensors {'/'.join(names)}"
    if method == "bitsandbytes":
        from llmopt.formats.compressed import nf4_dequantized_state

        return {}, nf4_dequantized_state(path), "bitsandbytes NF4 (dequantized at load)"
    raise LlmoptError(f"the runtime cannot read '{method}' checkpoints", "use a dense or compressed-tensors checkpoint (llmopt quantize writes those)")


def _online_transforms(path: Path, config: dict) -> list:
    """The online input transforms the checkpoint's ``transform_config`` (in its ``config``) asks
    for (refused in one line when the runtime cannot run them)."""
    from llmopt.formats.hadamard import online_inputs

    try:
        return online_inputs(config.get("quantization_config"))
    except ValueError as exc:
        raise LlmoptError(f"{path}: {exc}", "quantize the model with llmopt (--rotate hadamard), or without online transforms") from exc


class Reader:
    """The tensors of one checkpoint, handed out on ``device`` in ``dtype``: norms and other
    plain tensors (``tensor``) and linears (``linear``: quantized ones stay quantized)."""

    def __init__(self, path: Path, quantized: dict, dense: dict[str, torch.Tensor], dtype: torch.dtype, backend: Backend,
                 config: dict) -> None:
        self.path, self.quantized, self.dense, self.dtype = path, quantized, dense, dtype
        self.backend, self.device = backend, backend.device
        self.online = _online_transforms(path, config)

    def has(self, module: str) -> bool:
        """Whether ``module`` is a linear (quantized, or with a ``weight``) of the checkpoint."""
        return module in self.quantized or f"{module}.weight" in self.dense

    def tensor(self, name: str, required: bool = True) -> torch.Tensor | None:
        if name not in self.dense:
            if required:
                raise LlmoptError(f"{self.path} has no tensor '{name}'", "the checkpoint does not fit its config.json; re-create it")
            return None
        t = self.dense[name]
        return t.to(self.device, self.dtype) if t.is_floating_point() else t.to(self.device)

    def quant(self, module: str, bias: torch.Tensor | None = None) -> QuantLinear:
        lin = QuantLinear.from_quantized(self.quantized[module], bias)
        lin.codes, lin.scale = lin.codes.to(self.device), lin.scale.to(self.device)
        lin.zero_point = None if lin.zero_point is None else lin.zero_point.to(self.device)
        return lin

    def linear(self, module: str) -> Linear:
        """A linear as stored; one whose input the checkpoint transforms online is wrapped so it does."""
        bias = self.tensor(f"{module}.bias", required=False)
        lin = self.quant(module, bias) if module in self.quantized else DenseLinear.from_weight(self.tensor(f"{module}.weight"), bias)
        for t in self.online:
            if t.applies_to(module):
                return TransformedLinear(lin, t.block, self.backend.input_transform)
        return lin

    def norm(self, name: str, offset: float = 0.0) -> torch.Tensor:
        """An RMSNorm weight, as ``offset + w`` (Gemma's ``1 + w``) so every kernel multiplies by it."""
        w = self.tensor(name)
        return w if not offset else (w.float() + offset).to(w.dtype)


def llama_layer(r: Reader, arch: ModelArch, i: int) -> LayerWeights:
    """A Llama-family decoder layer's weights (``model.layers.i.{self_attn,mlp}.*``)."""
    p = f"model.layers.{i}"
    attn, mlp = f"{p}.self_attn", f"{p}.mlp"
    return LayerWeights(
        input_norm=r.norm(f"{p}.input_layernorm.weight"),
        post_norm=r.norm(f"{p}.post_attention_layernorm.weight"),
        qkv=merge_linears([r.linear(f"{attn}.{n}_proj") for n in "qkv"]),
        o=r.linear(f"{attn}.o_proj"),
        gate_up=merge_linears([r.linear(f"{mlp}.gate_proj"), r.linear(f"{mlp}.up_proj")]),
        down=r.linear(f"{mlp}.down_proj"),
        qk_norm=qk_norms(r, arch, attn),
    )


def qk_norms(r: Reader, arch: ModelArch, attn: str) -> torch.Tensor | None:
    """Per-head q and k norm weights stacked ``[heads + kv_heads, head_dim]`` (None without)."""
    if not arch.qk_norm:
        return None
    qn, kn = r.norm(f"{attn}.q_norm.weight", arch.norm_offset), r.norm(f"{attn}.k_norm.weight", arch.norm_offset)
    return torch.cat([qn.expand(arch.num_heads, -1), kn.expand(arch.num_kv_heads, -1)]).contiguous()


LayerLoader = Callable[[Reader, ModelArch, int], "LayerWeights"]


def load_weights(path: Path, arch: ModelArch, dtype: torch.dtype, backend: Backend, lm_head: str = "auto",
                 layer: LayerLoader = llama_layer) -> ModelWeights:
    """Load the decoder's weights from ``path`` for ``arch`` onto ``backend``'s device, laid out
    for its kernels; ``layer`` reads one decoder layer (the architecture's naming, see
    ``runtime.models``). ``lm_head``: ``auto`` keeps the output head as the checkpoint stores it; ``bf16`` rounds a
    float head to bfloat16 (the float GEMV widens it in registers); ``int8`` quantizes it per
    output channel (symmetric round-to-nearest) for the int8 kernels."""
    config = json.loads((path / "config.json").read_text())
    quantized, dense, description = _quantized(path, config)
    device = backend.device
    r = Reader(path, quantized, dense, dtype, backend, config)
    tensor, quant = r.tensor, r.quant
    layers = [layer(r, arch, i) for i in range(arch.num_layers)]
    embed_q = _on_device(quantized.get(EMBED_MODULE), device)
    embed = None if embed_q is not None else tensor("model.embed_tokens.weight").contiguous()
    if "lm_head" in quantized:
        head: Linear = quant("lm_head")
    elif embed_q is not None and arch.tie_word_embeddings:  # the tied head runs the embedding's codes
        head = quant(EMBED_MODULE)
    elif arch.tie_word_embeddings or "lm_head.weight" not in dense:
        if not arch.tie_word_embeddings:
            raise LlmoptError(f"{path} has no lm_head.weight and its embeddings are not tied", "re-create the checkpoint")
        head, embed = DenseLinear.from_weight(embed), None
    else:
        head = DenseLinear.from_weight(tensor("lm_head.weight"))
    head_kind = "quantized" if not isinstance(head, DenseLinear) else "float" if lm_head == "auto" else lm_head
    if head_kind in ("int8", *HALF_HEADS):
        if embed is None and embed_q is None:  # tied: lookups keep reading the float table
            embed = head.full_weight()
        head = smaller_head(head, head_kind)
    weights = ModelWeights(embed, layers, r.norm("model.norm.weight", arch.norm_offset), head, description, head_kind, embed_q)
    _check_shapes(weights, arch, path)
    for lin in _linears(weights):
        backend.prepare_linear(lin)
    backend.prepare_head(weights.lm_head)
    return weights


EMBED_MODULE = "model.embed_tokens"


def _on_device(qw: QuantizedWeight | None, device: torch.device) -> QuantizedWeight | None:
    if qw is None:
        return None
    zp = None if qw.zero_point is None else qw.zero_point.to(device)
    return QuantizedWeight(qw.codes.to(device), qw.scale.to(device), zp, qw.scheme, qw.group_size)


def embedding_rows(qw: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of a quantized embedding table, dequantized (only those rows are read)."""
    flat = ids.reshape(-1)
    zp = None if qw.zero_point is None else qw.zero_point[flat]
    rows = dequantize(qw.codes[flat], qw.scale[flat], zp, qw.group_size, dtype)
    return rows.reshape(*ids.shape, rows.shape[-1])


def _linears(weights: ModelWeights) -> list[DenseLinear | QuantLinear]:
    found: list[DenseLinear | QuantLinear] = []
    todo: list[Linear] = [weights.lm_head]
    for layer in weights.layers:
        todo += layer.linears()
    while todo:
        lin = todo.pop()
        if isinstance(lin, ConcatLinear):
            todo += lin.parts
        elif isinstance(lin, TransformedLinear):
            todo.append(lin.inner)
        elif isinstance(lin, (DenseLinear, QuantLinear)):
            found.append(lin)
    return found


def _check_shapes(w: ModelWeights, arch: ModelArch, path: Path) -> None:
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    expected = [
        ("output head", w.lm_head.out_features, arch.vocab_size),
        ("q/k/v projections", w.layers[0].qkv.out_features, qkv),
    ]
    if w.layers[0].gate_up is not None:
        expected.append(("gate/up projections", w.layers[0].gate_up.out_features, 2 * arch.intermediate_size))
    for what, got, want in expected:
        if got != want:
            raise LlmoptError(f"{path}: {what} have shape {got}, config.json implies {want}", "the checkpoint does not fit its config; re-create it")
