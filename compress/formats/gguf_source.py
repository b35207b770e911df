"""The checkpoint a GGUF export reads: its tensors as stored (quantized Linears as
``QuantizedWeight``), its architecture's GGUF mapping and its per-layer widths, read from the
tensors themselves so pruned models are described as they are."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmopt.checkpoints.models import read_config
from llmopt.core.errors import LlmoptError


class UnsupportedArchitectureError(LlmoptError):
    """The checkpoint's architecture has no GGUF mapping here."""


class UnmappableTypeError(LlmoptError):
    """The requested GGUF type cannot hold the source's weights as asked."""



@dataclass(frozen=True)
class Arch:
    """How one transformers model type is written for llama.cpp.

    ``gguf``: GGUF architecture name; ``permute_qk``: q/k rows reordered for llama.cpp's
    interleaved rotary embedding; ``norm_shift``: added to every RMSNorm weight (Gemma scales by
    ``1 + w``, llama.cpp by the stored weight); ``norm_topk``: whether llama.cpp renormalises the
    chosen experts' router weights (None: no experts); ``output_required``: llama.cpp needs an
    ``output.weight`` even when the head is tied; ``output_ignored``: llama.cpp always uses the
    embedding as the head."""

    gguf: str
    permute_qk: bool
    norm_shift: float = 0.0
    norm_topk: bool | None = None
    output_required: bool = False
    output_ignored: bool = False


ARCHITECTURES = {
    "llama": Arch("llama", True),
    "mistral": Arch("llama", True),  # llama.cpp runs Mistral as llama
    "qwen2": Arch("qwen2", False),  # NEOX-style rotary: no permutation
    "qwen3": Arch("qwen3", False),
    "gemma2": Arch("gemma2", False, norm_shift=1.0, output_ignored=True),
    "gemma3_text": Arch("gemma3", False, norm_shift=1.0),
    "phi3": Arch("phi3", False),  # fused qkv_proj and gate_up_proj are llama.cpp's attn_qkv / ffn_up too
    "mixtral": Arch("llama", True, norm_topk=True),  # llama.cpp runs Mixtral as llama with experts
    "qwen2_moe": Arch("qwen2moe", False, norm_topk=False, output_required=True),
    "qwen3_moe": Arch("qwen3moe", False, norm_topk=True),
}
EXPERT_KEY = re.compile(r"^(.*\.experts)\.(\d+)\.(.+)$")

LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


@dataclass
class Source:
    """A checkpoint's tensors: dense ones, and the Linears we quantized (as QuantizedWeight)."""

    path: Path
    config: dict
    floats: dict[str, torch.Tensor]
    quantized: dict[str, Any]  # module name → QuantizedWeight
    kind: str  # "dense", "compressed-tensors", "bitsandbytes"

    @property
    def is_quantized(self) -> bool:
        return self.kind != "dense"


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    from llmopt.checkpoints.lazy import read_tensors, safetensors_files

    if not safetensors_files(path):
        raise LlmoptError(f"{path} has no safetensors weights", "export a checkpoint saved as safetensors")
    return read_tensors(path)


def read_source(path: Path) -> Source:
    """Read a checkpoint directory's tensors; quantized Linears come back as QuantizedWeights."""
    config = read_config(path)
    qconfig = config.get("quantization_config") or {}
    method = qconfig.get("quant_method")
    if method is None:
        return Source(path, config, _safetensors(path), {}, "dense")
    if method == "compressed-tensors":
        from llmopt.formats.compressed import read_compressed

        try:
            quantized, _ = read_compressed(path)
        except (ValueError, KeyError) as exc:
            raise UnmappableTypeError(f"cannot read the compressed-tensors checkpoint {path}: {exc}") from exc
        floats = {k: v for k, v in _safetensors(path).items()
                  if not (k.rpartition(".")[0] in quantized and k.rpartition(".")[2].startswith("weight"))}
        return Source(path, config, floats, quantized, "compressed-tensors")
    if method == "bitsandbytes":
        from llmopt.formats.compressed import nf4_dequantized_state

        return Source(path, config, nf4_dequantized_state(path), {}, "bitsandbytes")
    raise UnmappableTypeError(
        f"checkpoints quantized with '{method}' cannot be exported to GGUF",
        "export the float checkpoint, or one quantized by llmopt (compressed-tensors)",
    )


def check_architecture(config: dict) -> Arch:
    """The GGUF mapping for the checkpoint's model type, or a clear error where llama.cpp would
    compute something else than transformers does."""
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF export does not support the '{model_type}' architecture",
            f"export a {', '.join(sorted(ARCHITECTURES))} model, or use --format hf",
        )
    arch = ARCHITECTURES[model_type]
    rope = rope_parameters(config)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in ("default", "linear"):
        raise UnsupportedArchitectureError(
            f"GGUF export does not support '{kind}' rope scaling",
            "export a model with default or linear rope scaling",
        )
    if arch.norm_topk is not None:
        _check_experts(config, arch)
    if arch.norm_shift:
        _check_gemma_scale(config)
    return arch


def _check_experts(config: dict, arch: Arch) -> None:
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step") or 1) != 1:
        raise UnsupportedArchitectureError(
            "GGUF export needs experts in every layer (mlp_only_layers / decoder_sparse_step set)",
            "export with --format hf; llama.cpp's qwen2moe / qwen3moe graphs have experts in every layer",
        )
    normalised = bool(config.get("norm_topk_prob", True))
    if normalised != arch.norm_topk:
        raise UnsupportedArchitectureError(
            f"norm_topk_prob={normalised} differs from llama.cpp's {arch.gguf} graph, which "
            f"{'renormalises' if arch.norm_topk else 'does not renormalise'} the chosen experts' weights",
            "export with --format hf",
        )


def _check_gemma_scale(config: dict) -> None:
    """llama.cpp scales Gemma attention by 1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 27B
    shapes); transformers by query_pre_attn_scalar**-0.5."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    layers = int(config.get("num_hidden_layers") or 0)
    big = layers == (46 if config.get("model_type") == "gemma2" else 62)
    theirs = hidden // heads if big else head_dim
    ours = config.get("query_pre_attn_scalar", head_dim)
    if abs(float(ours) - theirs) > 1e-6:
        raise UnsupportedArchitectureError(
            f"query_pre_attn_scalar {ours} differs from the {theirs} llama.cpp's Gemma graph scales attention by",
            "export with --format hf",
        )


def rope_parameters(config: dict) -> dict:
    """Rope settings of the full-attention layers from ``rope_parameters`` (transformers 5; Gemma 3
    nests them per layer type) or ``rope_scaling`` / ``rope_theta``."""
    params = dict(config.get("rope_parameters") or {})
    if isinstance(params.get("full_attention"), dict):
        params = dict(params["full_attention"])
    scaling = config.get("rope_scaling") or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    if "rope_theta" not in params and config.get("rope_theta") is not None:
        params["rope_theta"] = config["rope_theta"]
    return params


def local_rope_theta(config: dict) -> float | None:
    """The rope base of sliding-window layers when it differs from the full layers' (Gemma 3)."""
    params = config.get("rope_parameters") or {}
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    if isinstance(local, dict) and local.get("rope_theta") is not None:
        return float(local["rope_theta"])
    return float(config["rope_local_base_freq"]) if config.get("rope_local_base_freq") is not None else None


@dataclass
class Layout:
    """Per-layer shapes read from the tensors (pruned models may differ from the config)."""

    layers: int
    hidden: int
    vocab: int
    head_dim: int
    n_head: list[int]
    n_kv: list[int]
    ffn: list[int]
    layer_map: dict[int, int]  # source layer index → GGUF block index
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0


def _shape(source: Source, key: str) -> tuple[int, ...] | None:
    if key in source.floats:
        return tuple(source.floats[key].shape)
    module = key.rpartition(".")[0]
    if module in source.quantized and key.endswith(".weight"):
        return tuple(source.quantized[module].codes.shape)
    return None


def _first(source: Source, layer: int, *names: str) -> tuple[int, ...] | None:
    for name in names:
        shape = _shape(source, f"model.layers.{layer}.{name}.weight")
        if shape is not None:
            return shape
    return None


def read_layout(source: Source) -> Layout:
    """Layer count and widths from the tensors, checked against the config."""
    keys = list(source.floats) + [f"{m}.weight" for m in source.quantized]
    indices = sorted({int(m.group(1)) for k in keys if (m := LAYER_KEY.match(k))})
    embed = _shape(source, "model.embed_tokens.weight")
    if embed is None:
        raise UnsupportedArchitectureError("the checkpoint has no model.embed_tokens.weight", "export a Llama-family checkpoint")
    vocab, hidden = embed
    cfg = source.config
    heads_cfg = cfg.get("num_attention_heads") or 1
    kv_cfg = cfg.get("num_key_value_heads") or heads_cfg
    head_dim = cfg.get("head_dim") or hidden // heads_cfg
    n_head, n_kv, ffn = [], [], []
    for i in indices:
        q, k = _first(source, i, "self_attn.q_proj"), _first(source, i, "self_attn.k_proj")
        qkv = _first(source, i, "self_attn.qkv_proj")
        if q is None and qkv is not None:  # fused (Phi-3): split as the config's head counts say
            if qkv[0] != (heads_cfg + 2 * kv_cfg) * head_dim:
                raise UnsupportedArchitectureError(f"layer {i}: qkv_proj has {qkv[0]} rows, not (heads + 2 kv heads) × head_dim",
                                                   "check the checkpoint's config")
            q, k = (heads_cfg * head_dim, qkv[1]), (kv_cfg * head_dim, qkv[1])
        gate = _first(source, i, "mlp.gate_proj", "mlp.experts.0.gate_proj", "block_sparse_moe.experts.0.w1")
        gate_up = _first(source, i, "mlp.gate_up_proj")
        if gate is None and gate_up is not None:
            gate = (gate_up[0] // 2, gate_up[1])
        if q is None or k is None or gate is None:
            raise UnsupportedArchitectureError(f"layer {i} lacks q/k/gate projections", "export a Llama-family checkpoint")
        if q[0] % head_dim or k[0] % head_dim:
            raise UnsupportedArchitectureError(f"layer {i}: q/k rows are not a multiple of head_dim {head_dim}", "check the checkpoint's config")
        n_head.append(q[0] // head_dim)
        n_kv.append(k[0] // head_dim)
        ffn.append(gate[0])
    layout = Layout(len(indices), hidden, vocab, head_dim, n_head, n_kv, ffn, {old: new for new, old in enumerate(indices)})
    experts = {int(m.group(2)) for k in keys if (m := EXPERT_KEY.match(k))}
    if experts and indices:
        layout.experts = len(experts)
        layout.experts_used = int(cfg.get("num_experts_per_tok") or 0)
        layout.expert_ffn = ffn[0]
        shared = _first(source, indices[0], "mlp.shared_expert.gate_proj")
        layout.shared_ffn = shared[0] if shared else 0
        layout.ffn = [int(cfg.get("intermediate_size") or f) for f in ffn] if shared else ffn
    return layout


def source_model(source: Source, fold_online: bool = False) -> Any:
    """The source checkpoint as a float32 transformers model (quantized Linears dequantized by us;
    ``fold_online``: online input transforms folded back into their weights, no hooks)."""
    from transformers import AutoModelForCausalLM

    if source.kind == "compressed-tensors":
        from llmopt.formats.compressed import load_dequantized

        return load_dequantized(source.path, torch.float32, fold_online)
    if source.kind == "bitsandbytes":
        from llmopt.formats.compressed import load_nf4_dequantized

        return load_nf4_dequantized(source.path, torch.float32)
    return AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
