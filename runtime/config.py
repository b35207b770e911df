"""Engine settings and the model architecture facts the runtime needs."""

from __future__ import annotations

import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from llmopt.core.errors import LlmoptError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
GIB = 1024**3
# the backends are the modules of runtime/backends (named, not imported, here)
KERNEL_CHOICES = ("auto", *sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent / "backends")]) if m.name != "base"))
LM_HEAD_CHOICES = ("auto", "bf16", "int8")


@dataclass
class EngineConfig:
    """Settings of one engine.

    ``num_kv_blocks`` (when given) fixes the KV cache size; otherwise ``kv_cache_gib`` is the
    budget, trimmed to what ``max_num_seqs`` sequences of ``max_model_len`` tokens could use.
    ``kv_cache_dtype``: ``auto`` stores K/V in the model's dtype; ``fp8`` (e4m3) and ``int8``
    store one byte per value plus a float32 scale per token and KV head.
    ``device``: ``cpu`` or ``cuda`` (``cuda:N``), where the weights and the KV cache live.
    ``kernels`` (the backend, chosen once, see ``runtime.backends``): ``auto`` is ``triton`` on
    CUDA, and on the CPU the C++ kernels when they build here (else the reference); ``cpu``
    requires the C++ kernels, ``triton`` the Triton ones, ``reference`` forces the plain-torch
    path (for comparison).
    ``lm_head``: ``auto`` runs the output head as the checkpoint stores it; ``bf16`` rounds a float32
    head to bfloat16 at load and ``int8`` quantizes it per output channel (symmetric round-to-nearest)
    for the int8 kernel: a half / a quarter of the bytes per token (the demo model's float32 head is
    113 MB, most of a W4A16 model's weight traffic), at a small accuracy cost (WikiText-2, demo
    model, against the float32 head: mean KLD 2.7e-4 / 9.5e-4 nats, top-1 agreement 98% / 97%;
    ``bench/results/lm_head.md``).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    kv_cache_gib: float = 2.0
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    threads: int | None = None
    enable_prefix_caching: bool = True
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    seed: int = 0
    kernels: str = "auto"
    lm_head: str = "auto"
    device: str = "cpu"
    # speculative decoding (vLLM's shape): {"method": "ngram" | "draft", "model": DRAFT,
    # "num_speculative_tokens": k, ...}; see runtime.speculative.SpeculativeConfig. None: off
    speculative_config: dict[str, Any] | None = None

    def validate(self) -> None:
        checks = [
            (self.max_num_seqs >= 1, "max_num_seqs must be at least 1"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be at least 1"),
            (self.block_size >= 1, "block_size must be at least 1"),
            (self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks must be at least 1"),
            (self.kv_cache_gib > 0, "kv_cache_gib must be positive"),
            (self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be at least 2"),
            (self.threads is None or self.threads >= 1, "threads must be at least 1"),
            (self.dtype in ("float32", "bfloat16", "float16"), f"dtype must be float32, bfloat16 or float16, not {self.dtype!r}"),
            (self.kernels in KERNEL_CHOICES, f"kernels must be one of {', '.join(KERNEL_CHOICES)}, not {self.kernels!r}"),
            (self.lm_head in LM_HEAD_CHOICES, f"lm_head must be one of {', '.join(LM_HEAD_CHOICES)}, not {self.lm_head!r}"),
            (_is_device(self.device), f"device must be cpu, cuda or cuda:N, not {self.device!r}"),
            (self.kv_cache_dtype in ("auto", "fp8", "int8"), f"kv_cache_dtype must be auto, fp8 or int8, not {self.kv_cache_dtype!r}"),
        ]
        for ok, problem in checks:
            if not ok:
                raise LlmoptError(f"invalid engine setting: {problem}", "fix the value passed to LLM / LLMEngine")


def _is_device(name: str) -> bool:
    try:
        return torch.device(name).type in ("cpu", "cuda")
    except (RuntimeError, TypeError):
        return False


@dataclass
class ModelArch:
    """Shape and options of a Llama-family decoder, read from its config."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    sliding_window: int | None
    hf_config: Any  # the transformers config object (RoPE init functions read it)

    @property
    def rope_type(self) -> str:
        params = getattr(self.hf_config, "rope_parameters", None) or {}
        return params.get("rope_type", "default")


def read_arch(path: Path) -> ModelArch:
    """The architecture of the checkpoint at ``path``; unsupported ones are a clear error."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        raise LlmoptError(f"cannot read {path}/config.json: {str(exc).splitlines()[0]}", "pass a Hugging Face checkpoint directory") from exc
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise LlmoptError(
            f"the runtime does not support architecture '{model_type}'",
            f"it runs the Llama family: {', '.join(SUPPORTED_MODEL_TYPES)} (SmolLM is llama)",
        )
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise LlmoptError(f"unsupported activation '{act}' in {path}", "the runtime implements SwiGLU (silu) MLPs only")
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise LlmoptError(f"unsupported RoPE type '{rope_type}'", f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise LlmoptError("partial rotary embeddings are not supported", "use a model that rotates the whole head")
    window = getattr(cfg, "sliding_window", None)
    if model_type in ("qwen2", "qwen3") and not getattr(cfg, "use_sliding_window", False):
        window = None
    return ModelArch(
        model_type=model_type,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab_size=cfg.vocab_size,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qk_norm=model_type == "qwen3",
        sliding_window=window,
        hf_config=cfg,
    )


def resolve_max_model_len(arch: ModelArch, asked: int | None) -> int:
    """The longest sequence (prompt + output) the engine accepts.

    Dynamic NTK RoPE extends the context by its factor; sliding-window attention is not
    implemented, so a model with a window is limited to it.
    """
    limit = arch.max_position_embeddings
    if arch.rope_type == "dynamic":
        limit = int(limit * float(arch.hf_config.rope_parameters.get("factor", 1.0)))
    if arch.sliding_window:
        limit = min(limit, arch.sliding_window)
    if asked is None:
        return limit
    if asked > limit:
        reason = "its sliding window" if arch.sliding_window and arch.sliding_window < arch.max_position_embeddings else "max_position_embeddings"
        raise LlmoptError(f"max_model_len {asked} exceeds the model's limit of {limit} tokens ({reason})", f"use max_model_len <= {limit}")
    return asked


def saved_settings(path: Path) -> dict[str, Any]:
    """Engine settings saved with a checkpoint (the ``runtime`` block of its ``llmopt.json``,
    written by a recipe's ``runtime:`` section): the defaults of an engine on that checkpoint."""
    import dataclasses

    from llmopt.checkpoints.provenance import PROVENANCE_FILE, read_provenance

    saved = read_provenance(path).get("runtime") or {}
    if not isinstance(saved, dict):
        raise LlmoptError(f"{Path(path) / PROVENANCE_FILE}: 'runtime' must be a mapping", "fix or remove it")
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(saved) - known)
    if unknown:
        raise LlmoptError(f"{Path(path) / PROVENANCE_FILE}: unknown runtime setting '{unknown[0]}'",
                          f"known settings: {', '.join(sorted(known))}")
    return dict(saved)

