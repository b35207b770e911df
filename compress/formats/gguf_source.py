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
    """How one transformers model type is written: GGUF architecture name, q/k permutation."""

    gguf: str
    permute_qk: bool


ARCHITECTURES = {
    "llama": Arch("llama", True),
    "mistral": Arch("llama", True),  # llama.cpp runs Mistral as llama
    "qwen2": Arch("qwen2", False),  # NEOX-style rotary: no permutation
    "qwen3": Arch("qwen3", False),
}

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
    """The GGUF mapping for the checkpoint's model type, or a clear error."""
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF export does not support the '{model_type}' architecture",
            f"export a {', '.join(sorted(ARCHITECTURES))} model, or use --format hf",
        )
    rope = rope_parameters(config)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in ("default", "linear"):
        raise UnsupportedArchitectureError(
            f"GGUF export does not support '{kind}' rope scaling",
            "export a model with default or linear rope scaling",
        )
    return ARCHITECTURES[model_type]


def rope_parameters(config: dict) -> dict:
    """Rope settings from ``rope_parameters`` (transformers 5) or ``rope_scaling`` / ``rope_theta``."""
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    if "rope_theta" not in params and config.get("rope_theta") is not None:
        params["rope_theta"] = config["rope_theta"]
    return params


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


def _shape(source: Source, key: str) -> tuple[int, ...] | None:
    if key in source.floats:
        return tuple(source.floats[key].shape)
    module = key.rpartition(".")[0]
    if module in source.quantized and key.endswith(".weight"):
        return tuple(source.quantized[module].codes.shape)
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
    head_dim = cfg.get("head_dim") or hidden // heads_cfg
    n_head, n_kv, ffn = [], [], []
    for i in indices:
        q = _shape(source, f"model.layers.{i}.self_attn.q_proj.weight")
        k = _shape(source, f"model.layers.{i}.self_attn.k_proj.weight")
        gate = _shape(source, f"model.layers.{i}.mlp.gate_proj.weight")
        if q is None or k is None or gate is None:
            raise UnsupportedArchitectureError(f"layer {i} lacks q/k/gate projections", "export a Llama-family checkpoint")
        if q[0] % head_dim or k[0] % head_dim:
            raise UnsupportedArchitectureError(f"layer {i}: q/k rows are not a multiple of head_dim {head_dim}", "check the checkpoint's config")
        n_head.append(q[0] // head_dim)
        n_kv.append(k[0] // head_dim)
        ffn.append(gate[0])
    return Layout(len(indices), hidden, vocab, head_dim, n_head, n_kv, ffn, {old: new for new, old in enumerate(indices)})


def source_model(source: Source) -> Any:
    """The source checkpoint as a float32 transformers model (quantized Linears dequantized by us)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if source.kind == "compressed-tensors":
        from llmopt.formats.compressed import load_dequantized

        return load_dequantized(source.path, torch.float32)
    if source.kind == "bitsandbytes":
        config = AutoConfig.from_pretrained(source.path)
        del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict({k: v.float() for k, v in source.floats.items()}, strict=False)
        model.tie_weights()
        return model.eval()
    return AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
