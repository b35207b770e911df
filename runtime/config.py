"""Engine settings and the model architecture facts the runtime needs."""

from __future__ import annotations

import copy
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from llmopt.core.errors import LlmoptError

from .kernels.kv_quant import KV_CACHE_DTYPES

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
GIB = 1024**3
# the backends are the modules of runtime/backends (named, not imported, here)
KERNEL_CHOICES = ("auto", *sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent / "backends")]) if m.name != "base"))
LM_HEAD_CHOICES = ("auto", "bf16", "f16", "int8")
MODEL_IMPL_CHOICES = ("auto", "native", "transformers")
MATMUL_PRECISION_CHOICES = ("highest", "medium", "low")  # torch's float32 matmul precision names, and low


@dataclass
class EngineConfig:
    """Settings of one engine.

    ``num_kv_blocks`` (when given) fixes the KV cache size; otherwise ``kv_cache_gib`` is the
    budget, trimmed to what ``max_num_seqs`` sequences of ``max_model_len`` tokens could use.
    ``kv_cache_dtype``: ``auto`` stores K/V in the model's dtype; ``float16`` / ``bfloat16`` in
    that 16-bit float (half a float32 model's cache, llama.cpp's default is float16); ``fp8``
    (e4m3) and ``int8`` store one byte per value plus a float32 scale per token and KV head;
    ``int4`` half a byte per value plus a float16 scale and minimum per 32 values of a token and
    KV head (``int4_g16``: per 16), in a Hadamard-rotated basis with calibrated key scales and
    offsets, each sequence's first token also kept in float32 as its attention sink
    (``runtime.kv_cache``, ``runtime.kv_sinks``; the engine runs a 512-token calibration text at start-up).
    ``device``: ``cpu`` or ``cuda`` (``cuda:N``), where the weights and the KV cache live.
    ``kernels`` (the backend, chosen once, see ``runtime.backends``): ``auto`` is ``triton`` on
    CUDA, and on the CPU the C++ kernels when they build here (else the reference); ``cpu``
    requires the C++ kernels, ``triton`` the Triton ones, ``reference`` forces the plain-torch
    path (for comparison).
    ``lm_head``: ``auto`` runs the output head as the checkpoint stores it; ``bf16`` rounds a float32
    head to bfloat16 at load (``f16``: to float16, the values a GGUF export keeps) and ``int8`` quantizes it per output channel (symmetric round-to-nearest)
    for the int8 kernel: a half / a quarter of the bytes per token (the demo model's float32 head is
    113 MB, most of a W4A16 model's weight traffic), at a small accuracy cost (WikiText-2, demo
    model, against the float32 head: mean KLD 2.7e-4 / 9.3e-4 nats, top-1 agreement 98% / 97%;
    ``bench/results/lm_head.md``).
    ``matmul_precision`` (torch's names): ``highest`` computes every linear in float32;
    ``medium`` lets the C++ CPU kernels multiply bfloat16-rounded weights and activations with
    float32 sums in their panel path (prefill, and decode of more than 16 sequences at once) on
    CPUs with AVX512-BF16, as a W4A16 matmul on a GPU does; decode of few sequences stays exact
    (``bench/results/lm_head.md`` has its accuracy cost, ``serve_load.md`` its speed), and a float
    output head keeps a bfloat16 copy for more than 16 rows at once (``CpuBackend.prepare_head``); ``low``
    also rounds the activations of int4 weights (int8 and IQ4_NL-grid weights too with AVX-512
    VNNI) to int8 per block of at most 32 inputs, as llama.cpp's CPU kernels do (Q8_0), for
    integer dot products at every batch size (other weights run as with ``medium``).
    ``model_impl`` (vLLM's option): ``auto`` runs an architecture's native model when there is one
    (``runtime.models``), else transformers' modeling code with the runtime's paged attention and
    linears (``runtime.models.generic``); ``native`` refuses the latter, ``transformers`` forces it.
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
    matmul_precision: str = "highest"
    device: str = "cpu"
    model_impl: str = "auto"
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
            (self.matmul_precision in MATMUL_PRECISION_CHOICES,
             f"matmul_precision must be one of {', '.join(MATMUL_PRECISION_CHOICES)}, not {self.matmul_precision!r}"),
            (_is_device(self.device), f"device must be cpu, cuda or cuda:N, not {self.device!r}"),
            (self.model_impl in MODEL_IMPL_CHOICES, f"model_impl must be one of {', '.join(MODEL_IMPL_CHOICES)}, not {self.model_impl!r}"),
            (self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {self.kv_cache_dtype!r}"),
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
class MoeSpec:
    """A mixture-of-experts MLP: ``top_k`` of ``num_experts`` experts per token (softmax router,
    weights renormalised over the chosen ones when ``renormalize``), optionally a shared expert
    (with a sigmoid gate) added to every token; ``sparse_layers[i]`` says whether layer i has
    experts (the others have a dense MLP of the model's ``intermediate_size``)."""

    num_experts: int
    top_k: int
    renormalize: bool
    expert_intermediate: int
    shared_intermediate: int
    sparse_layers: tuple[bool, ...]


@dataclass
class ModelArch:
    """Shape and options of a decoder, read from its config (the fields after ``hf_config`` are
    the variations the native models implement: see ``runtime.models``)."""

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
    layer_windows: tuple[int | None, ...] = ()  # per layer: attend to the last N tokens, None: all
    query_scale: float | None = None  # attention scale (None: head_dim ** -0.5)
    attn_softcap: float | None = None  # attention scores -> c * tanh(s / c)
    final_softcap: float | None = None  # logits -> c * tanh(l / c)
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden))
    norm_offset: float = 0.0  # RMSNorm weight used as (offset + w) (Gemma: 1)
    activation: str = "silu"  # of the gated MLP: silu or gelu_tanh
    sandwich_norm: bool = False  # norms on the attention and MLP outputs too (Gemma 2 / 3)
    local_rope: dict | None = None  # RoPE parameters of the sliding-window layers when they differ (Gemma 3)
    moe: MoeSpec | None = None
    generic: bool = False  # run through transformers' modeling code (runtime.models.generic)

    @property
    def rope_type(self) -> str:
        params = getattr(self.hf_config, "rope_parameters", None) or {}
        return params.get("rope_type", "default")


GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")


def read_arch(path: Path, model_impl: str = "auto") -> ModelArch:
    """The architecture of the checkpoint at ``path`` (``model_impl``: see :class:`EngineConfig`);
    unsupported ones are a clear error."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        raise LlmoptError(f"cannot read {path}/config.json: {str(exc).splitlines()[0]}", "pass a Hugging Face checkpoint directory") from exc
    native = getattr(cfg, "model_type", None) in SUPPORTED_MODEL_TYPES
    if model_impl == "transformers" or (model_impl == "auto" and not native):
        return generic_arch(cfg, path)
    return arch_of(cfg, path)


def arch_of(cfg: Any, path: Path | str = "the model") -> ModelArch:
    """:class:`ModelArch` of a transformers config of a natively supported architecture."""
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise LlmoptError(
            f"the runtime does not support architecture '{model_type}' natively",
            f"native: {', '.join(SUPPORTED_MODEL_TYPES)} (SmolLM is llama)",
        )
    gemma = model_type in ("gemma2", "gemma3_text")
    act = getattr(cfg, "hidden_activation", None) if gemma else getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", *GELU_TANH):
        raise LlmoptError(f"unsupported activation '{act}' in {path}", "the runtime implements SwiGLU and GeLU-tanh gated MLPs")
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    local_rope = None
    if model_type == "gemma3_text" and "full_attention" in rope:  # RoPE per layer type
        cfg = copy.copy(cfg)
        local_rope = dict(rope.get("sliding_attention") or rope["full_attention"])
        cfg.rope_parameters = rope = dict(rope["full_attention"])
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise LlmoptError(f"unsupported RoPE type '{rope_type}'", f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise LlmoptError("partial rotary embeddings are not supported", "use a model that rotates the whole head")
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
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        sliding_window=_window(cfg, model_type),
        hf_config=cfg,
        layer_windows=_layer_windows(cfg, model_type),
        query_scale=cfg.query_pre_attn_scalar ** -0.5 if gemma else None,
        attn_softcap=getattr(cfg, "attn_logit_softcapping", None) if gemma else None,
        final_softcap=getattr(cfg, "final_logit_softcapping", None) if gemma else None,
        embed_scale=cfg.hidden_size ** 0.5 if gemma else None,
        norm_offset=1.0 if gemma else 0.0,
        activation="silu" if act == "silu" else "gelu_tanh",
        sandwich_norm=gemma,
        local_rope=local_rope,
        moe=_moe(cfg, model_type),
    )


def generic_arch(cfg: Any, path: Path | str = "the model") -> ModelArch:
    """:class:`ModelArch` of a causal LM run through transformers' modeling code with the runtime's
    paged attention (``runtime.models.generic``); one that path cannot run is refused with the
    reason. The attention shapes read here are checked against a probe forward at load."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    name = getattr(cfg, "model_type", None)
    fix = f"native: {', '.join(SUPPORTED_MODEL_TYPES)}; other causal LMs run when their transformers code supports custom attention"
    if getattr(cfg, "is_encoder_decoder", False):
        raise LlmoptError(f"the runtime cannot run '{name}' ({path}): it is an encoder-decoder model", fix)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(cfg), None)
    if model_class is None:
        raise LlmoptError(f"the runtime cannot run '{name}' ({path}): transformers has no causal-LM class for it", fix)
    if not getattr(model_class, "_supports_attention_backend", False):
        raise LlmoptError(f"the runtime cannot run '{name}' ({path}): its transformers modeling code ({model_class.__name__}) "
                          "does not support custom attention functions", fix)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if getattr(cfg, "multi_query", False):  # GPT-BigCode
        kv_heads = 1
    limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 2048
    return ModelArch(
        model_type=name, hidden_size=cfg.hidden_size, intermediate_size=getattr(cfg, "intermediate_size", 0) or 0,
        num_layers=cfg.num_hidden_layers, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, vocab_size=cfg.vocab_size, rms_norm_eps=0.0,
        max_position_embeddings=limit, tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qk_norm=False, sliding_window=None, hf_config=cfg, layer_windows=(None,) * cfg.num_hidden_layers, generic=True,
    )


def _window(cfg: Any, model_type: str) -> int | None:
    window = getattr(cfg, "sliding_window", None) or None
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not getattr(cfg, "use_sliding_window", False):
        return None
    return window


def _layer_windows(cfg: Any, model_type: str) -> tuple[int | None, ...]:
    """The attention window of every layer: ``layer_types`` when the config has them (Gemma,
    Qwen), else the one window (Mistral, Phi-3) everywhere."""
    window = _window(cfg, model_type)
    types = getattr(cfg, "layer_types", None)
    if window is None:
        return (None,) * cfg.num_hidden_layers
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (window,) * cfg.num_hidden_layers


def _moe(cfg: Any, model_type: str) -> MoeSpec | None:
    if model_type == "mixtral":
        n = cfg.num_local_experts
        return MoeSpec(n, cfg.num_experts_per_tok, True, cfg.intermediate_size, 0, (True,) * cfg.num_hidden_layers)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        n = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 0)
        step, dense = getattr(cfg, "decoder_sparse_step", 1) or 1, set(getattr(cfg, "mlp_only_layers", None) or [])
        sparse = tuple(i not in dense and n > 0 and (i + 1) % step == 0 for i in range(cfg.num_hidden_layers))
        shared = getattr(cfg, "shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
        return MoeSpec(n, cfg.num_experts_per_tok, bool(cfg.norm_topk_prob), cfg.moe_intermediate_size, shared, sparse)
    return None


def resolve_max_model_len(arch: ModelArch, asked: int | None) -> int:
    """The longest sequence (prompt + output) the engine accepts.

    Dynamic NTK RoPE extends the context by its factor; sliding-window layers attend to their
    window only (``ModelArch.layer_windows``), so a window does not limit the length.
    """
    limit = arch.max_position_embeddings
    if arch.rope_type == "dynamic":
        limit = int(limit * float(arch.hf_config.rope_parameters.get("factor", 1.0)))
    if asked is None:
        return limit
    if asked > limit:
        raise LlmoptError(f"max_model_len {asked} exceeds the model's limit of {limit} tokens (max_position_embeddings)",
                          f"use max_model_len <= {limit}")
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
    spec = saved.get("speculative_config")
    draft = spec.get("model") if isinstance(spec, dict) else None
    if isinstance(draft, str) and not Path(draft).is_absolute() and (Path(path) / draft).exists():
        # a recipe's draft is saved relative to the checkpoint (see pipeline.runner)
        saved = {**saved, "speculative_config": {**spec, "model": str((Path(path) / draft).resolve())}}
    return dict(saved)

