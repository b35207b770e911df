"""What a checkpoint's tensors and settings are called in GGUF, per architecture: tensor names
from gguf's own ``TensorNameMap`` (the table llama.cpp's converter uses), experts merged into one
3-D tensor per projection, and the ``{arch}.*`` metadata llama.cpp's graph for that architecture
reads (experts, sliding windows, soft-capping, partial rotary dimensions)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from gguf import LlamaFileType

from llmopt.core.errors import LlmoptError
from llmopt.formats.gguf_source import (
    EXPERT_KEY,
    LAYER_KEY,
    Arch,
    Layout,
    Source,
    UnsupportedArchitectureError,
    local_rope_theta,
    rope_parameters,
)

IGNORED_KEYS = re.compile(r"(rotary_emb\.inv_freq|\.weight_shape)$")
SUFFIXES = (".weight", ".bias")


class TensorNames:
    """Source key → GGUF tensor name for one checkpoint (layers renumbered as its layout says)."""

    def __init__(self, arch: Arch, layout: Layout, tied: bool) -> None:
        import gguf

        self.arch, self.layout, self.tied = arch, layout, tied
        arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch.gguf)
        self.table = gguf.get_tensor_name_map(arch_id, max(layout.layers, 1))

    def __call__(self, key: str) -> str | None:
        """The GGUF name (``blk.0.ffn_gate_exps.weight``), None for a tensor not written, or an error."""
        if IGNORED_KEYS.search(key):
            return None
        if key == "lm_head.weight":
            if self.tied:
                return None
            if self.arch.output_ignored:
                raise UnsupportedArchitectureError(
                    f"llama.cpp's {self.arch.gguf} graph always uses the embedding as the output head; this checkpoint has its own lm_head",
                    "export with --format hf",
                )
        m = LAYER_KEY.match(key)
        if m:
            key = f"model.layers.{self.layout.layer_map[int(m.group(1))]}.{m.group(2)}.{m.group(3)}"
        expert = EXPERT_KEY.match(key)
        if expert:
            key = f"{expert.group(1)}.{expert.group(3)}"
        name = self.table.get_name(key, try_suffixes=SUFFIXES)
        if name is None:
            raise UnsupportedArchitectureError(f"no GGUF name for tensor '{key}' in llama.cpp's {self.arch.gguf} architecture",
                                               "export with --format hf")
        return name

    @staticmethod
    def expert(key: str) -> int | None:
        """The expert index of a per-expert tensor (``…experts.3.w1.weight`` → 3)."""
        m = EXPERT_KEY.match(key)
        return int(m.group(2)) if m else None


def write_metadata(writer: Any, source: Source, layout: Layout, file_type: LlamaFileType, arch: Arch) -> None:
    """General and architecture keys (``llama.block_count`` …) from the config and the tensors."""
    cfg = source.config
    rope = rope_parameters(cfg)

    def scalar_or_list(values: list[int]) -> int | list[int]:
        return values[0] if len(set(values)) == 1 else values

    name = cfg.get("_name_or_path") or source.path.name
    writer.add_name(str(name).rstrip("/").rpartition("/")[2] or source.path.name)
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(2)
    _add_origin(writer, source.path)
    writer.add_block_count(layout.layers)
    writer.add_context_length(int(cfg.get("max_position_embeddings") or 2048))
    writer.add_embedding_length(layout.hidden)
    writer.add_feed_forward_length(scalar_or_list(layout.ffn))
    writer.add_head_count(scalar_or_list(layout.n_head))
    writer.add_head_count_kv(scalar_or_list(layout.n_kv))
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(layout.vocab)
    writer.add_rope_dimension_count(int(layout.head_dim * float(cfg.get("partial_rotary_factor") or 1.0)))
    if arch.norm_shift or (layout.n_head and layout.head_dim * max(layout.n_head) != layout.hidden):
        writer.add_key_length(layout.head_dim)
        writer.add_value_length(layout.head_dim)
    if (rope.get("rope_type") or rope.get("type")) == "linear":
        from gguf import RopeScalingType

        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    if layout.experts:
        _add_experts(writer, layout, arch)
    if arch.norm_shift:
        _add_gemma(writer, cfg, layout)


def _add_experts(writer: Any, layout: Layout, arch: Arch) -> None:
    if not layout.experts_used:
        raise LlmoptError("the config names no num_experts_per_tok for a checkpoint with experts", "add it to config.json")
    writer.add_expert_count(layout.experts)
    writer.add_expert_used_count(layout.experts_used)
    if arch.gguf != "llama":  # llama (Mixtral) reads the experts' width from feed_forward_length
        writer.add_expert_feed_forward_length(layout.expert_ffn)
    if layout.shared_ffn:
        writer.add_expert_shared_feed_forward_length(layout.shared_ffn)


def _add_gemma(writer: Any, cfg: dict, layout: Layout) -> None:
    """Soft-capping, the sliding window and which layers use it, the local layers' rope base."""
    if cfg.get("attn_logit_softcapping") is not None:
        writer.add_attn_logit_softcapping(float(cfg["attn_logit_softcapping"]))
    if cfg.get("final_logit_softcapping") is not None:
        writer.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if window:
        writer.add_sliding_window(int(window))
        if layer_types:
            kept = [layer_types[i] for i in sorted(layout.layer_map)]
            writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in kept])
    theta = local_rope_theta(cfg)
    if theta is not None:
        writer.add_rope_freq_base_swa(theta)


def _add_origin(writer: Any, path: Path) -> None:
    """general.* keys on where the weights come from: quantized_by, the base model (the source's own
    base when it is an llmopt checkpoint, its Hub id when it came from the Hub) and its license."""
    from llmopt.checkpoints.model_card import base_model, source_license
    from llmopt.checkpoints.provenance import read_provenance

    record = read_provenance(path)
    writer.add_quantized_by("llmopt")
    base = base_model(record or {"source": str(path)})
    if base:
        writer.add_base_model_count(1)
        writer.add_base_model_name(0, base.rpartition("/")[2])
        writer.add_base_model_organization(0, base.rpartition("/")[0] or base)
        writer.add_base_model_repo_url(0, f"https://huggingface.co/{base}")
    license_ = source_license(path, record)
    if license_:
        writer.add_license(license_)
