"""llama.cpp's quantization mixtures by name (``--scheme Q4_K_M`` …): the GGUF type llama-quantize
gives each tensor of a model for that mixture, and the llmopt format that holds the same type's
codes, so a calibrated quantizer (GPTQ, AWQ …) finds codes on exactly llama.cpp's grids and a GGUF
export carries them unchanged.

The per-tensor rules follow llama.cpp's ``llama_tensor_get_type`` (src/llama-quant.cpp): the
output head (and a tied embedding) in Q6_K, ``attn_v`` / ``ffn_down`` of some layers in more bits
(``use_more_bits``: the first and last eighth and every third layer between), 8-expert models'
attention in Q8_0 / Q5_K, and its fallbacks where a row is not a multiple of 256 (Q4_K → Q5_0,
Q5_K → Q5_1, Q6_K → Q8_0, Q2_K / Q3_K → Q4_0, IQ4_XS → IQ4_NL). Not reproduced: its 70B-only rule
and the rules of the IQ1–IQ3 mixtures (not offered here).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from llmopt.formats.registry import GGUF_TYPE_CANDIDATES as TYPE_FORMATS
from llmopt.formats.schemes import QuantScheme

# mixture name → the type of the tensors no rule singles out (llama_ftype_get_default_type)
DEFAULT_TYPES = {
    "Q2_K": T.Q2_K, "Q3_K_S": T.Q3_K, "Q3_K_M": T.Q3_K, "Q3_K_L": T.Q3_K, "Q4_K_S": T.Q4_K, "Q4_K_M": T.Q4_K,
    "Q5_K_S": T.Q5_K, "Q5_K_M": T.Q5_K, "Q6_K": T.Q6_K, "IQ4_XS": T.IQ4_XS, "IQ4_NL": T.IQ4_NL, "Q8_0": T.Q8_0,
}
MIXTURES = tuple(DEFAULT_TYPES)
FALLBACKS = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0, T.IQ4_XS: T.IQ4_NL}

# llama.cpp's tensor categories, from Hugging Face module names (the last one or two parts)
_CATEGORIES = (
    ("attn_qkv", r"(qkv_proj|query_key_value|c_attn|Wqkv)"),
    ("attn_v", r"(v_proj|value)"),
    ("attn_k", r"(k_proj|key)"),
    ("attn_q", r"(q_proj|query)"),
    ("attn_output", r"(o_proj|out_proj|(attn|attention)\.(c_proj|dense))"),
    ("ffn_down", r"(down_proj|w2|fc2|dense_4h_to_h|mlp\.c_proj)"),
    ("ffn_gate", r"(gate_proj|w1)"),
    ("ffn_up", r"(up_proj|gate_up_proj|w3|fc1|dense_h_to_4h|mlp\.c_fc)"),
)
_LAYER = re.compile(r"\.(?:layers|h|blocks|block|decoder_layers)\.(\d+)\.")


@dataclass(frozen=True)
class ModelFacts:
    """What llama.cpp's rules read from a model besides tensor names: layers, heads (grouped-query
    ratio), experts, and whether it is Falcon (its own rules)."""

    n_layer: int
    n_head: int = 1
    n_kv_head: int = 1
    n_expert: int = 0
    falcon: bool = False

    @property
    def n_gqa(self) -> int:
        return max(1, self.n_head // max(1, self.n_kv_head))

    @classmethod
    def of_config(cls, config: dict) -> "ModelFacts":
        text = config.get("text_config") or config
        heads = text.get("num_attention_heads") or text.get("n_head") or 1
        experts = text.get("num_local_experts") or text.get("num_experts") or text.get("n_routed_experts") or 0
        return cls(int(text.get("num_hidden_layers") or text.get("n_layer") or 1), int(heads),
                   int(text.get("num_key_value_heads") or heads), int(experts), text.get("model_type") == "falcon")


def category(name: str) -> str | None:
    """llama.cpp's category of the Linear ``name`` (``attn_v``, ``ffn_down`` …), None for others."""
    for cat, pattern in _CATEGORIES:
        if re.search(rf"(^|\.){pattern}$", name):
            return cat
    return None


def layer_of(name: str) -> int | None:
    found = _LAYER.search(f".{name}.")
    return int(found.group(1)) if found else None


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's layers given more bits: the first and last eighth, and every third between."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def with_fallback(qtype: T, cols: int) -> T | None:
    """``qtype``, or llama.cpp's fallback when rows of ``cols`` do not tile its blocks (None: float)."""
    if cols % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    fallback = FALLBACKS.get(qtype)
    return fallback if fallback is not None and cols % GGML_QUANT_SIZES[fallback][0] == 0 else None


def output_type(mixture: str, cols: int) -> T | None:
    """The type of the output head (and of a tied embedding)."""
    default = DEFAULT_TYPES[mixture]
    if cols % GGML_QUANT_SIZES[default][0] != 0:
        return with_fallback(T.Q8_0, cols)
    return with_fallback(default if default == T.Q8_0 else T.Q6_K, cols)


def _attn_v(mixture: str, i: int, n: int, facts: ModelFacts) -> T | None:
    if facts.n_expert == 8:
        return T.Q8_0
    if mixture == "Q2_K":
        return T.Q4_K if facts.n_gqa >= 4 else T.Q3_K
    if mixture == "Q3_K_M":
        return T.Q5_K if i < 2 else T.Q4_K
    if mixture == "Q3_K_L":
        return T.Q5_K
    if mixture in ("IQ4_NL", "IQ4_XS") and facts.n_gqa >= 4:
        return T.Q5_K
    if mixture in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n):
        return T.Q6_K
    if mixture == "Q4_K_S" and i < 4:
        return T.Q5_K
    return None


def _ffn_down(mixture: str, i: int, n: int, facts: ModelFacts) -> T | None:
    if mixture == "Q2_K":
        return T.Q3_K
    if mixture == "Q3_K_M":
        return T.Q5_K if i < n // 16 else T.Q4_K if not facts.falcon or use_more_bits(i, n) else T.Q3_K
    if mixture == "Q3_K_L":
        return T.Q4_K if facts.falcon else T.Q5_K
    if mixture == "Q4_K_M":
        if facts.falcon:
            return T.Q6_K if i < n // 16 else T.Q5_K if use_more_bits(i, n) else T.Q4_K
        return T.Q6_K if use_more_bits(i, n) else None
    if mixture in ("IQ4_NL", "IQ4_XS") and i < n // 8:
        return T.Q5_K  # llama.cpp's rule without an importance matrix
    if mixture == "Q5_K_M" and use_more_bits(i, n):
        return T.Q6_K
    if mixture == "Q4_K_S" and not facts.falcon and i < n // 8:
        return T.Q5_K
    return None


def _attn_output(mixture: str, facts: ModelFacts) -> T | None:
    if facts.falcon:
        return T.Q4_K if mixture == "Q3_K_L" else None
    if facts.n_expert == 8:
        return T.Q5_K if mixture in ("Q2_K", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ4_XS") else None
    return {"Q2_K": T.Q3_K, "Q3_K_M": T.Q4_K, "Q3_K_L": T.Q5_K}.get(mixture)


def linear_types(mixture: str, shapes: dict[str, tuple[int, int]], facts: ModelFacts) -> dict[str, T | None]:
    """The type of every decoder Linear (``shapes``: name → ``[out, in]``) for ``mixture`` (None: float,
    where not even the fallback tiles the row). Routers are not Linears quantized by llama.cpp and
    should not be passed."""
    default = DEFAULT_TYPES[mixture]
    v_names = sorted((n for n in shapes if category(n) == "attn_v"), key=lambda n: (layer_of(n) or 0, n))
    v_index = {name: i for i, name in enumerate(v_names)}
    out: dict[str, T | None] = {}
    for name, (_, cols) in shapes.items():
        cat, layer = category(name), layer_of(name) or 0
        chosen = None
        if cat == "attn_v":
            chosen = _attn_v(mixture, v_index[name], len(v_names), facts)
        elif cat == "attn_k" and facts.n_expert == 8:
            chosen = T.Q8_0
        elif cat == "ffn_down":
            chosen = _ffn_down(mixture, layer, facts.n_layer, facts)
        elif cat == "attn_output":
            chosen = _attn_output(mixture, facts)
        elif cat == "attn_qkv":
            chosen = {"Q3_K_M": T.Q4_K, "Q3_K_L": T.Q4_K, "Q4_K_M": T.Q5_K, "Q5_K_M": T.Q6_K}.get(mixture)
        out[name] = with_fallback(chosen or default, cols)
    return out


def embedding_type(mixture: str, cols: int, tied: bool) -> T | None:
    """The token embedding's type: the output's when tied, else the mixture's own type."""
    return output_type(mixture, cols) if tied else with_fallback(DEFAULT_TYPES[mixture], cols)


def scheme_of(qtype: T | None, scale_dtype: str = "bfloat16") -> QuantScheme | None:
    """The llmopt scheme holding ``qtype``'s codes (None: float)."""
    if qtype is None:
        return None
    candidate = TYPE_FORMATS[qtype]
    return candidate.format.scheme(candidate.group_size, scale_dtype)


def outer_name(qtype: T | None) -> str:
    """The embedding / head format name of ``qtype`` (``float`` for None)."""
    return "float" if qtype is None else TYPE_FORMATS[qtype].name


def checkpoint_shapes(source: Path) -> tuple[dict[str, tuple[int, int]], tuple[int, int], tuple[int, int] | None]:
    """``(decoder Linears: name → [out, in], embedding shape, head shape or None when tied)`` of a float
    checkpoint, read from its safetensors headers (nothing loaded). Names are the unfused model's
    (one Linear per expert); routers are left out (llmopt keeps them in float)."""
    from llmopt.checkpoints.lazy import LazyCheckpoint
    from llmopt.checkpoints.moe import canonical_key, is_router
    from llmopt.quant.outer import EMBED, HEAD

    linears: dict[str, tuple[int, int]] = {}
    embedding = head = None
    with LazyCheckpoint(source) as ckpt:
        for key in ckpt.keys():
            shape = ckpt.shape(key)
            name = canonical_key(key).removesuffix(".weight")
            if not key.endswith(".weight") or len(shape) not in (2, 3):
                continue
            if name == EMBED:
                embedding = (shape[0], shape[1])
            elif name == HEAD:
                head = (shape[0], shape[1])
            elif len(shape) == 3 and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                base, proj = name.rsplit(".", 1)
                for j in range(shape[0]):
                    rows = shape[1] // 2 if proj == "gate_up_proj" else shape[1]
                    for part in ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",):
                        linears[f"{base}.{j}.{part}"] = (rows, shape[2])
            elif len(shape) == 2 and not is_router(name):
                linears[name] = (shape[0], shape[1])
    if embedding is None:
        raise ValueError(f"{source} has no {EMBED}.weight: llama.cpp's mixtures need the token embedding's shape")
    return linears, embedding, head


def mixture_plan(source: Path, mixture: str, scale_dtype: str = "bfloat16") -> tuple[dict, dict]:
    """``(options, record)`` for quantizing ``source`` as llama.cpp's ``mixture``: options as an AUTO
    plan gives them (``plan``: per-Linear schemes, ``head`` / ``embedding`` format names), the record
    naming every tensor's GGUF type."""
    from llmopt.checkpoints.models import read_config

    config = read_config(Path(source))
    facts = ModelFacts.of_config(config)
    linears, embedding, head = checkpoint_shapes(Path(source))
    types = linear_types(mixture, linears, facts)
    tied = head is None
    embed_type = embedding_type(mixture, embedding[1], tied)
    head_type = embed_type if tied else output_type(mixture, head[1])
    plan = {name: scheme for name, qtype in types.items() if (scheme := scheme_of(qtype, scale_dtype)) is not None}
    names = {**{n: t.name if t else "F16" for n, t in types.items()}, "model.embed_tokens": embed_type.name if embed_type else "F16"}
    if not tied:
        names["lm_head"] = head_type.name if head_type else "F16"
    options = {"plan": plan, "head": outer_name(head_type), "embedding": outer_name(embed_type)}
    return options, {"mixture": mixture, "types": names}
