"""Read a checkpoint's weights into the runtime's layers.

Dense safetensors (single file or sharded) load directly; compressed-tensors checkpoints keep
their quantized Linears quantized (``QuantLinear``); bitsandbytes NF4 checkpoints are
dequantized at load. Weights go to the backend's device; Q/K/V and gate/up projections are
merged so each is one matmul, then the backend lays every linear out for its kernels.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from llmopt.core.errors import LlmoptError
from safetensors import safe_open

from llmopt.formats.schemes import QuantizedWeight, dequantize

from .backends import Backend
from .config import ModelArch
from .layers import ConcatLinear, DenseLinear, Linear, QuantLinear, int8_rows, merge_linears


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    qk_norm: torch.Tensor | None  # [heads + kv_heads, head_dim] (Qwen3), else None


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
            total += sum(t.numel() * t.element_size() for t in (layer.input_norm, layer.post_norm, layer.qk_norm) if t is not None)
            total += sum(lin.nbytes() for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        return total + self.lm_head.nbytes()


def _dense_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor in the checkpoint's safetensors (or pytorch .bin) files."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                tensors[key] = handle.get_tensor(key)
    if not files:
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


def load_weights(path: Path, arch: ModelArch, dtype: torch.dtype, backend: Backend, lm_head: str = "auto") -> ModelWeights:
    """Load the decoder's weights from ``path`` for ``arch`` onto ``backend``'s device, laid out
    for its kernels. ``lm_head``: ``auto`` keeps the output head as the checkpoint stores it; ``bf16`` rounds a
    float head to bfloat16 (the float GEMV widens it in registers); ``int8`` quantizes it per
    output channel (symmetric round-to-nearest) for the int8 kernels."""
    config = json.loads((path / "config.json").read_text())
    quantized, dense, description = _quantized(path, config)
    device = backend.device

    def tensor(name: str, required: bool = True) -> torch.Tensor | None:
        if name not in dense:
            if required:
                raise LlmoptError(f"{path} has no tensor '{name}'", "the checkpoint does not fit its config.json; re-create it")
            return None
        t = dense[name]
        return t.to(device, dtype) if t.is_floating_point() else t.to(device)

    def quant(module: str, bias: torch.Tensor | None = None) -> QuantLinear:
        lin = QuantLinear.from_quantized(quantized[module], bias)
        lin.codes, lin.scale = lin.codes.to(device), lin.scale.to(device)
        lin.zero_point = None if lin.zero_point is None else lin.zero_point.to(device)
        return lin

    def linear(module: str) -> Linear:
        bias = tensor(f"{module}.bias", required=False)
        if module in quantized:
            return quant(module, bias)
        return DenseLinear.from_weight(tensor(f"{module}.weight"), bias)

    layers = []
    for i in range(arch.num_layers):
        p = f"model.layers.{i}"
        attn, mlp = f"{p}.self_attn", f"{p}.mlp"
        qk_norm = None
        if arch.qk_norm:
            qn, kn = tensor(f"{attn}.q_norm.weight"), tensor(f"{attn}.k_norm.weight")
            qk_norm = torch.cat([qn.expand(arch.num_heads, -1), kn.expand(arch.num_kv_heads, -1)]).contiguous()
        layers.append(LayerWeights(
            input_norm=tensor(f"{p}.input_layernorm.weight"),
            post_norm=tensor(f"{p}.post_attention_layernorm.weight"),
            qkv=merge_linears([linear(f"{attn}.{n}_proj") for n in "qkv"]),
            o=linear(f"{attn}.o_proj"),
            gate_up=merge_linears([linear(f"{mlp}.gate_proj"), linear(f"{mlp}.up_proj")]),
            down=linear(f"{mlp}.down_proj"),
            qk_norm=qk_norm,
        ))
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
    if head_kind in ("int8", "bf16"):
        if embed is None and embed_q is None:  # tied: lookups keep reading the float table
            embed = head.full_weight()
        head = int8_rows(head) if head_kind == "int8" else DenseLinear.from_weight(head.full_weight().to(torch.bfloat16), head.bias)
    weights = ModelWeights(embed, layers, tensor("model.norm.weight"), head, description, head_kind, embed_q)
    _check_shapes(weights, arch, path)
    for lin in _linears(weights):
        backend.prepare_linear(lin)
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
        todo += [layer.qkv, layer.o, layer.gate_up, layer.down]
    while todo:
        lin = todo.pop()
        if isinstance(lin, ConcatLinear):
            todo += lin.parts
        elif isinstance(lin, (DenseLinear, QuantLinear)):
            found.append(lin)
    return found


def _check_shapes(w: ModelWeights, arch: ModelArch, path: Path) -> None:
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    expected = [
        ("output head", w.lm_head.out_features, arch.vocab_size),
        ("q/k/v projections", w.layers[0].qkv.out_features, qkv),
        ("gate/up projections", w.layers[0].gate_up.out_features, 2 * arch.intermediate_size),
    ]
    for what, got, want in expected:
        if got != want:
            raise LlmoptError(f"{path}: {what} have shape {got}, config.json implies {want}", "the checkpoint does not fit its config; re-create it")
