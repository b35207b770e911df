"""Save and read quantized checkpoints in the compressed-tensors format (plus NF4 via bitsandbytes).

The tensors are laid out exactly as compressed-tensors' own compressors write them, so the
directories load with ``transformers`` (and vLLM). The integer codes written are exactly the
``QuantizedWeight.codes`` given: nothing is re-rounded on the way to disk.

Per Linear ``<name>``, by compression format (chosen by compressed-tensors' ``infer_module_format``):

* ``pack-quantized`` (integer weights, no activation quantization: W4A16, W4A16_ASYM, W8A16):
  ``<name>.weight_packed`` int32 ``[out, in*bits/32]`` (codes offset by ``2**(bits-1)``, lowest
  bits first), ``<name>.weight_shape`` int64 ``[2]``, ``<name>.weight_scale`` ``[out, n_groups]``
  and, when asymmetric, ``<name>.weight_zero_point`` packed the same way along the *output* dim:
  int32 ``[ceil(out*bits/32), n_groups]``.
* ``nvfp4-pack-quantized`` (NVFP4A16) / ``mxfp4-pack-quantized`` (MXFP4A16): ``<name>.weight_packed``
  uint8 ``[out, in/2]`` (E2M1 codes two a byte, :mod:`~llmopt.formats.fp4`), ``<name>.weight_scale``
  float8_e4m3fn ``[out, in/16]`` (times the global scale) / uint8 E8M0 exponents ``[out, in/32]``,
  and for NVFP4 ``<name>.weight_global_scale`` float32 ``[1]``.
* ``int-quantized`` (W8A8), ``float-quantized`` (FP8_DYNAMIC), ``naive-quantized`` (weight-only
  FP8): ``<name>.weight`` int8 / float8_e4m3fn ``[out, in]`` and ``<name>.weight_scale``
  (plus an int8 ``weight_zero_point`` ``[out, n_groups]`` for asymmetric schemes); weight-only
  integer codes with float zero points (llama.cpp's mins: Q4_1 / Q5_1 / Q4_K / Q5_K) are
  ``naive-quantized`` too, their ``weight_zero_point`` float32 (``zp_dtype``), since
  ``pack-quantized`` packs integer zero points only.

Scales are stored in 16 bits (the scheme's ``scale_dtype``: the source's bfloat16 / float16,
bfloat16 for a float32 source), float32 only for super-block scales (``k · d`` products, see
:mod:`~llmopt.formats.schemes`) or when asked (``scale_dtype``); the quantizers round them to that
dtype where they choose them, so reading back gives our scales bit for bit. Packing and sizes are
the weight format's (:mod:`llmopt.formats.registry`). Layers with different group sizes go to
different config groups, each targeting its modules by exact name.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.config import CompressionFormat
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    QuantizationStrategy,
    QuantizationType,
)
from compressed_tensors.utils.match import match_name
from safetensors.torch import save_file

from llmopt.core.atomic import atomic_dir
from llmopt.core.errors import LlmoptError
from llmopt.core.patterns import ignore_matches

from llmopt.formats.registry import format_for, format_of
from llmopt.formats.schemes import PRESETS, QuantizedWeight, QuantScheme, int_weight_scheme
from llmopt.checkpoints.moe import is_router
from llmopt.checkpoints.provenance import write_provenance

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 4 * 1024**3
_PACKED = CompressionFormat.pack_quantized.value

__all__ = [
    "save_compressed",
    "read_compressed",
    "build_quantization_config",
    "scheme_of_config",
    "compress_weight",
    "save_nf4",
    "nf4_dequantized_state",
    "load_dequantized",
]


# ---------------------------------------------------------------------------------------------
# Atomic output directories


# ---------------------------------------------------------------------------------------------
# Config: our schemes <-> compressed-tensors QuantizationScheme


FP4_PRESETS = {"e4m3": "NVFP4A16", "e8m0": "MXFP4A16"}  # our FP4 scale formats → compressed-tensors' presets


def loader_activation_rounding(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``x`` rounded as compressed-tensors' own forward (transformers' loader) rounds dynamic
    "per-token" activations: int8 with the symmetric scale ``|x|max / 127.5`` (half its 255-code
    range; vLLM's kernels and llmopt divide by 127), float8 as llmopt does; a 2-D input
    ``[tokens, features]`` (a MoE block's shared expert gets one) with a single scale for all its
    tokens, as the library keeps dims 0 and 1 of whatever it is given."""
    from llmopt.formats.schemes import fake_quantize_activations

    if x.dim() == 2:  # the library's per-token dims {0, 1} reduce over nothing: one scale for the tensor
        flat = loader_activation_rounding(x.reshape(1, 1, -1), kind)
        return flat.reshape(x.shape)
    if kind != "int8":
        return fake_quantize_activations(x, kind)
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127.5
    return (torch.round(xf / scale).clamp(-128, 127) * scale).to(x.dtype)


def _weight_args(scheme: QuantScheme, group_size: int | None) -> QuantizationArgs:
    """compressed-tensors weight QuantizationArgs for one layer's scheme and group size (FP4:
    compressed-tensors' own preset's, strategy, scale and zero-point dtypes included)."""
    if scheme.is_fp4:
        from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

        return PRESET_SCHEMES[FP4_PRESETS[scheme.scale_format]]["weights"].model_copy(deep=True)
    return QuantizationArgs(
        num_bits=scheme.num_bits,
        type=QuantizationType.FLOAT if scheme.is_float else QuantizationType.INT,
        strategy=QuantizationStrategy.CHANNEL if group_size is None else QuantizationStrategy.GROUP,
        group_size=group_size,
        symmetric=scheme.symmetric,
        dynamic=False,
        **({"zp_dtype": torch.float32} if scheme.float_zero else {}),
    )


def _activation_args(scheme: QuantScheme) -> QuantizationArgs | None:
    """Dynamic per-token symmetric input quantization (W8A8: int8, FP8_DYNAMIC: fp8)."""
    if scheme.activations is None:
        return None
    return QuantizationArgs(
        num_bits=8,
        type=QuantizationType.FLOAT if scheme.activations == "fp8" else QuantizationType.INT,
        strategy=QuantizationStrategy.TOKEN,
        symmetric=True,
        dynamic=True,
    )


def _ct_scheme(scheme: QuantScheme, group_size: int | None, targets: list[str]) -> QuantizationScheme:
    """A QuantizationScheme with its compression format set as compressed-tensors infers it."""
    ct = QuantizationScheme(
        targets=targets,
        weights=_weight_args(scheme, group_size),
        input_activations=_activation_args(scheme),
    )
    ct.format = CompressionFormat.naive_quantized.value if scheme.float_zero else infer_module_format(torch.nn.Linear, ct)
    return ct


def _group_key(qw: QuantizedWeight) -> tuple:
    """Layers sharing this key share one config group."""
    s = qw.scheme
    return (s.num_bits, s.weight_type, s.symmetric, s.activations, qw.group_size, s.scale_format, s.float_zero)


def build_quantization_config(
    weights: dict[str, QuantizedWeight], ignore: list[str], embeddings: Any = ()
) -> QuantizationConfig:
    """The compressed-tensors QuantizationConfig (status "compressed") describing ``weights``.

    One config group for all layers targets ``"Linear"`` (the usual llm-compressor layout);
    with several (e.g. mixed group sizes), or with a quantized embedding (names in
    ``embeddings``, not a Linear), each group targets its module names exactly.
    """
    by_key: dict[tuple, list[str]] = defaultdict(list)
    for name in sorted(weights):
        by_key[_group_key(weights[name])].append(name)
    single = len(by_key) == 1 and not any(name in weights for name in embeddings)
    groups = {}
    for i, names in enumerate(by_key.values()):
        qw = weights[names[0]]
        groups[f"group_{i}"] = _ct_scheme(qw.scheme, qw.group_size, ["Linear"] if single else names)
    formats = {g.format for g in groups.values()}
    fmt = formats.pop() if len(formats) == 1 else CompressionFormat.mixed_precision.value
    return QuantizationConfig(
        config_groups=groups,
        format=_fmt(fmt),
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=list(ignore),
    )


def _scheme_from_ct(ct: QuantizationScheme) -> tuple[QuantScheme, int | None]:
    """Our QuantScheme (named after the matching preset) and group size for a config group."""
    w = ct.weights
    if w is None:
        raise ValueError(f"config group targeting {ct.targets} has no weight quantization")
    if w.type == QuantizationType.FLOAT and w.num_bits == 4:
        return _fp4_scheme(ct), w.group_size
    if w.strategy not in (QuantizationStrategy.GROUP, QuantizationStrategy.CHANNEL):
        raise ValueError(f"unsupported weight strategy {w.strategy!r}")
    group_size = w.group_size if w.strategy == QuantizationStrategy.GROUP else None
    act = ct.input_activations
    acts = None if act is None else ("fp8" if act.type == QuantizationType.FLOAT else "int8")
    wtype = "float" if w.type == QuantizationType.FLOAT else "int"
    float_zero = wtype == "int" and not w.symmetric and w.zp_dtype is not None and w.zp_dtype.is_floating_point
    if float_zero:
        if acts is not None:
            raise ValueError(f"config group targeting {ct.targets}: float zero points with quantized activations are not read")
        return int_weight_scheme(w.num_bits, group_size, False, float_zero=True), group_size
    for preset in PRESETS.values():
        candidate = preset.with_group_size(group_size)
        if candidate.grid is None and (candidate.num_bits, candidate.weight_type, candidate.symmetric, candidate.activations) == (
            w.num_bits, wtype, w.symmetric, acts
        ):
            return candidate, group_size
    name = f"{'FP' if wtype == 'float' else 'W'}{w.num_bits}{'' if acts else 'A16'}"
    return QuantScheme(name, w.num_bits, wtype, group_size, w.symmetric, acts), group_size


def _fp4_scheme(ct: QuantizationScheme) -> QuantScheme:
    """NVFP4A16 / MXFP4A16 for an FP4 config group, chosen by its group size as compressed-tensors
    chooses the compressor (16: nvfp4-pack-quantized, 32: mxfp4-pack-quantized)."""
    w = ct.weights
    if ct.input_activations is not None:
        raise ValueError(f"config group targeting {ct.targets} quantizes activations to FP4 (NVFP4 / MXFP4 with "
                         "activations): llmopt reads weight-only FP4 (NVFP4A16, MXFP4A16) only")
    for preset in (PRESETS["NVFP4A16"], PRESETS["MXFP4A16"]):
        if w.group_size == preset.group_size and w.symmetric:
            return preset
    raise ValueError(f"config group targeting {ct.targets}: FP4 weights in groups of {w.group_size} are neither "
                     "NVFP4 (16) nor MXFP4 (32)")


def scheme_of_config(quantization_config: dict | QuantizationConfig) -> dict[str, tuple[QuantScheme, int | None, str]]:
    """Per config group name: our scheme, its group size and the group's compression format."""
    qc = _as_qconfig(quantization_config)
    out = {}
    for gname, ct in qc.config_groups.items():
        scheme, group_size = _scheme_from_ct(ct)
        out[gname] = (scheme, group_size, _fmt(ct.format or qc.format))
    return out


def module_schemes(quantization_config: dict, names: list[str]) -> dict[str, tuple[QuantScheme, int | None]]:
    """Scheme and group size that the config assigns to each quantized Linear in ``names``."""
    qc = _as_qconfig(quantization_config)
    by_group = scheme_of_config(qc)
    return {name: by_group[_group_of(name, qc)][:2] for name in names}


def _fmt(value: Any) -> str:
    """A compression format as its plain string value (``"pack-quantized"``)."""
    return str(getattr(value, "value", value))


def _as_qconfig(quantization_config: dict | QuantizationConfig) -> QuantizationConfig:
    if isinstance(quantization_config, QuantizationConfig):
        return quantization_config
    return QuantizationConfig.model_validate(quantization_config)


# ---------------------------------------------------------------------------------------------
# Tensors: QuantizedWeight <-> compressed-tensors layout


def compress_weight(qw: QuantizedWeight, fmt: str | None = None, scale_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The serialized tensors (local names, e.g. ``weight_packed``) of one layer, packed by its
    weight format (``fmt``, the compression format, follows from the scheme); scales in
    ``scale_dtype`` (None: the scheme's stored dtype)."""
    if fmt == _PACKED and qw.scheme.is_float:
        raise ValueError("pack-quantized holds integer codes only")
    return format_of(qw).pack(qw, scale_dtype)


def _decompress_weight(
    tensors: dict[str, torch.Tensor], scheme: QuantScheme, group_size: int | None, fmt: str
) -> QuantizedWeight:
    """Inverse of :func:`compress_weight`."""
    return format_for(scheme).unpack(tensors, scheme, group_size)


# ---------------------------------------------------------------------------------------------
# Saving


def _dense_state(model: torch.nn.Module, skip: set[str]) -> dict[str, torch.Tensor]:
    """Model parameters and persistent buffers, minus ``skip``, with tied copies dropped."""
    seen: set[tuple] = set()
    out = {}
    for key, tensor in model.state_dict().items():
        if key in skip:
            continue
        ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.numel() and ident in seen:
            continue  # tied weight (e.g. lm_head sharing embed_tokens): save once
        seen.add(ident)
        out[key] = tensor.detach().cpu().contiguous()
    return out


def _check_layers(model: torch.nn.Module, weights: dict[str, QuantizedWeight]) -> None:
    modules = dict(model.named_modules())
    for name, qw in weights.items():
        module = modules.get(name)
        if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            raise KeyError(f"{name} is not a Linear or Embedding module of the model")
        if tuple(qw.codes.shape) != tuple(module.weight.shape):
            raise ValueError(f"{name}: codes {tuple(qw.codes.shape)} vs weight {tuple(module.weight.shape)}")


def _unquantized_linears(model: torch.nn.Module, weights: dict[str, QuantizedWeight]) -> list[str]:
    """Linears left in float, and MoE routers: transformers 5 holds those as modules of their own
    (``Qwen3MoeTopKRouter`` …), not Linears, but vLLM builds some as Linear layers that a
    ``"Linear"`` target claims, so they must be named in the ignore list."""
    return [n for n, m in model.named_modules() if n not in weights and (
        isinstance(m, torch.nn.Linear) or (is_router(n) and isinstance(getattr(m, "weight", None), torch.Tensor)
                                           and m.weight.dim() == 2))]


def _write_safetensors(state: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> None:
    """Write ``state`` as one file, or as shards plus the usual index when it is large."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(state):
        nbytes = state[key].numel() * state[key].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = state[key]
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / WEIGHTS_NAME), metadata=meta)
        return
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata=meta)
        for key, t in shard.items():
            weight_map[key] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))


def write_side_files(model: Any, tokenizer: Any, out: Path, qconfig: dict, provenance: dict | None) -> None:
    """config.json (with ``quantization_config``), generation config, tokenizer, llmopt.json."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    if getattr(config, "dtype", None) is None:
        config.dtype = model.dtype
    config.quantization_config = qconfig
    config.save_pretrained(out)
    if getattr(model, "_auto_class", None):  # a trusted checkpoint's own code goes with it, as save_pretrained does
        from transformers.dynamic_module_utils import custom_object_save

        custom_object_save(model, out, config=config)
    _write_extras(model, tokenizer, out, provenance)


def _write_extras(model: Any, tokenizer: Any, out: Path, provenance: dict | None) -> None:
    """Generation config, tokenizer files and llmopt.json (the provenance dict)."""
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    write_provenance(out, provenance or {})


def save_compressed(
    model: Any,
    tokenizer: Any,
    out_dir: Path,
    weights: dict[str, QuantizedWeight],
    ignore: list[str],
    provenance: dict | None = None,
    *,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    scale_dtype: torch.dtype | None = None,
) -> None:
    """Write a compressed-tensors checkpoint of ``model`` with the Linears in ``weights`` quantized.

    ``ignore`` lists modules left in float (names or ``re:`` patterns); Linears that are neither
    quantized nor matched by it are added, so that a ``"Linear"`` target never claims them.
    ``scale_dtype``: the scales' dtype on disk (None: each weight's scheme says, 16-bit unless
    its scales are super-block products).
    """
    if not weights:
        raise ValueError("no quantized weights to save")
    if Path(out_dir).exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists (pass overwrite=True to replace it)")
    _check_layers(model, weights)
    qconfig = final_quantization_config(model, weights, ignore)
    state = _dense_state(model, _quantized_keys(model, weights))
    state.update(quantized_tensors(weights, scale_dtype))
    with atomic_dir(Path(out_dir), overwrite) as tmp:
        _write_safetensors(state, tmp, max_shard_bytes)
        write_side_files(model, tokenizer, tmp, qconfig, provenance)


def _quantized_keys(model: Any, weights: dict[str, QuantizedWeight]) -> set[str]:
    """Float keys replaced by quantized tensors: each quantized module's ``.weight``, and a tied
    head's too when the embedding it shares is quantized."""
    skip = {f"{name}.weight" for name in weights}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if head is not None and embed is not None and head.weight is embed.weight:
        names = {id(m): n for n, m in model.named_modules()}
        if names.get(id(embed)) in weights:
            skip.add(f"{names[id(head)]}.weight")
    return skip


def _embedding_names(model: Any) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)]


def final_quantization_config(model: Any, weights: dict[str, QuantizedWeight], ignore: list[str]) -> dict:
    """The ``quantization_config`` for config.json: the quantized Linears' groups, and ``ignore``
    plus every other Linear of ``model`` (so a ``"Linear"`` target never claims them). Only
    the schemes and group sizes of ``weights`` are used (the streaming path keeps no codes)."""
    ignore = list(ignore)
    clash = [n for n in weights if any(match_name(n, pattern) for pattern in ignore)]
    if clash:
        raise ValueError(f"quantized layers matched by the ignore list: {clash}")
    for name in _unquantized_linears(model, weights):
        if not any(match_name(name, pattern) for pattern in ignore):
            ignore.append(name)
    return build_quantization_config(weights, ignore, _embedding_names(model)).model_dump(mode="json")


def sparsity_config(pattern: str, sparsity: float, ignore: list[str]) -> dict:
    """compressed-tensors' ``sparsity_config`` of a checkpoint whose quantized Linears keep an N:M
    pattern (``2:4``) from pruning: stored dense (the codes hold the zeros), the structure and the
    overall sparsity recorded; ``ignore``: the Linears outside it (the quantization config's ignore
    list). ``targets`` stays empty: vLLM 0.32 removed its sparse kernels and refuses any checkpoint
    whose sparsity config targets layers (measured by bench/interop.py), while an empty list loads
    as the dense model it is, in vLLM and in transformers."""
    from compressed_tensors.config import SparsityCompressionConfig, SparsityStructure

    known = {s.value for s in SparsityStructure}
    structure = pattern if pattern in known else "unstructured"
    config = SparsityCompressionConfig.load_from_registry("dense", global_sparsity=round(float(sparsity), 6),
                                                          sparsity_structure=structure, targets=[], ignore=list(ignore))
    return config.model_dump(mode="json")


def quantized_tensors(weights: dict[str, QuantizedWeight], scale_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The serialized tensors (full names) of quantized Linears, each packed by its weight format
    (:mod:`llmopt.formats.registry`) as compressed-tensors' compressor for its config group packs
    it; scales in ``scale_dtype`` (None: each scheme's stored dtype, 16-bit unless super-block)."""
    out: dict[str, torch.Tensor] = {}
    for name, qw in weights.items():
        for local, tensor in compress_weight(qw, scale_dtype=scale_dtype).items():
            out[f"{name}.{local}"] = tensor
    return out


# ---------------------------------------------------------------------------------------------
# Reading


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file or sharded with an index)."""
    from llmopt.checkpoints.lazy import read_tensors, safetensors_files

    return read_tensors(path) if safetensors_files(path) else {}


_LINEAR_CLASSES = ("Linear", "torch.nn.Linear", "nn.Linear")


def _group_of(name: str, qc: QuantizationConfig) -> str:
    """Config group targeting Linear ``name``: exact names/regexes first, then class targets."""
    if any(match_name(name, pattern) for pattern in qc.ignore or []):
        raise ValueError(f"{name} has quantized tensors but is in the ignore list")
    groups = qc.config_groups.items()
    for gname, ct in groups:
        if any(t not in _LINEAR_CLASSES and match_name(name, t) for t in ct.targets):
            return gname
    for gname, ct in groups:
        if any(t in _LINEAR_CLASSES for t in ct.targets):
            return gname
    raise ValueError(f"no config group targets {name}")


def read_compressed(path: Path) -> tuple[dict[str, QuantizedWeight], dict]:
    """Read a compressed-tensors checkpoint into QuantizedWeights (keyed by module name).

    Works on safetensors directly, without building the model. Returns the weights and the
    ``quantization_config`` dict from config.json.
    """
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    qdict = config.get("quantization_config")
    if not qdict or qdict.get("quant_method") != "compressed-tensors":
        raise ValueError(f"{path} is not a compressed-tensors checkpoint")
    qc = _as_qconfig(qdict)
    schemes = scheme_of_config(qc)
    tensors = _load_tensors(path)
    per_module: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for key, tensor in tensors.items():
        module, _, local = key.rpartition(".")
        if local.startswith("weight_"):
            per_module[module][local] = tensor
    for key, tensor in tensors.items():
        module, _, local = key.rpartition(".")
        if local == "weight" and module in per_module:
            per_module[module]["weight"] = tensor
    out = {}
    for module, parts in per_module.items():
        if "weight_scale" not in parts:
            continue
        scheme, group_size, fmt = schemes[_group_of(module, qc)]
        out[module] = _decompress_weight(parts, scheme, group_size, fmt)
    return out, qdict


def load_dequantized(path: Path, dtype: torch.dtype | None = None, fold_online: bool = False) -> Any:
    """A plain float transformers model from a compressed-tensors checkpoint, dequantized by us.

    Independent of transformers' compressed-tensors loader (which, in transformers 5.24 with
    compressed-tensors 0.20, cannot load asymmetric checkpoints with mixed group sizes). The
    dequantized tensors go through transformers' own loading, so every conversion it applies
    between the stored and the in-memory layout (per-expert MoE tensors fused into 3-D experts,
    renamed keys) applies here too.

    Online input transforms (``transform_config``) run as hooks before the activation
    quantization; ``fold_online`` folds them back into their weights instead (``W V V = W``), for
    a plain float model that needs no hooks (a dense export).
    """
    from llmopt.formats.hadamard import add_input_hooks, fuse_into_weight, online_inputs

    path = Path(path)
    weights, qdict = read_compressed(path)
    online = online_inputs(qdict)
    config = float_config(path)
    target = dtype or config.dtype or torch.float32
    # a quantized Linear's packed tensors are replaced by its dequantized weight; its bias stays
    state = {k: v.to(target) if v.is_floating_point() else v for k, v in _load_tensors(path).items()
             if k.rpartition(".")[0] not in weights or k.rpartition(".")[2] == "bias"}
    for name, qw in weights.items():
        state[f"{name}.weight"] = qw.dequantize(target)
    if fold_online:
        for t in online:
            for key in [k for k in state if k.endswith(".weight") and t.applies_to(k.removesuffix(".weight"))]:
                state[key] = fuse_into_weight(state[key], t.block)
        online = []
    model = _float_model(config, state, target)
    add_input_hooks(model, online)  # first: activation quantization reads the transformed inputs
    add_activation_quantization(model, _in_memory_names(model, weights))
    return model.eval()


def float_config(path: Path) -> Any:
    """The checkpoint's config without its quantization_config: a plain float model's."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def _float_model(config: Any, state: dict[str, torch.Tensor], dtype: torch.dtype) -> Any:
    """``config``'s model built from ``state`` (the stored layout) through transformers' own loading,
    refusing a state that does not fit it."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.auto_factory import _get_model_class

    model_class = _get_model_class(config, AutoModelForCausalLM._model_mapping)
    model, info = model_class.from_pretrained(None, config=config, state_dict=state, dtype=dtype, output_loading_info=True)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    missing = [k for k in info.get("missing_keys", []) if k not in tied]
    unexpected = list(info.get("unexpected_keys", []))
    mismatched = list(info.get("mismatched_keys", []))
    if missing or unexpected or mismatched:
        raise ValueError(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}, "
                         f"mismatched {mismatched}")
    return model


def load_nf4_dequantized(path: Path, dtype: torch.dtype | None = None) -> Any:
    """A plain float transformers model from an NF4 (bitsandbytes) checkpoint, its 4-bit weights
    dequantized once. bitsandbytes' own CPU matmul multiplies in reduced precision (outputs of
    magnitude 9 off by 0.04, measured by bench/interop.py), so the exact weights are used instead."""
    path = Path(path)
    config = float_config(path)
    target = dtype or config.dtype or torch.float32
    state = {k: v.to(target) if v.is_floating_point() else v for k, v in nf4_dequantized_state(path, target).items()}
    return _float_model(config, state, target).eval()


def _in_memory_names(model: Any, weights: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
    """``weights`` keyed by the model's own module names. Where activations are quantized at run time
    and the model fused some stored Linears (MoE experts held as 3-D tensors), the experts are unfused
    into one Linear each so every quantized input gets its hook; weight-only schemes need no hooks."""
    from llmopt.checkpoints.moe import canonical_key, unfuse_experts

    by_name = {canonical_key(f"{name}.weight").rpartition(".")[0]: qw for name, qw in weights.items()
               if qw.scheme.activations}
    modules = dict(model.named_modules())
    if any(name not in modules for name in by_name):
        unfuse_experts(model)
        modules = dict(model.named_modules())
    lost = sorted(name for name in by_name if name not in modules)
    if lost:
        raise ValueError(f"checkpoint does not fit the model: no module {lost[0]} for its activation quantization")
    return by_name


def add_activation_quantization(model: Any, weights: dict[str, QuantizedWeight]) -> None:
    """Quantize the inputs of W8A8 / FP8_DYNAMIC Linears per token at run time, as inference
    engines do (int8 with absmax / 127, fp8 with absmax / 448)."""
    from llmopt.formats.schemes import fake_quantize_activations

    for name, qw in weights.items():
        kind = qw.scheme.activations
        if kind:
            model.get_submodule(name).register_forward_pre_hook(
                lambda module, args, kind=kind: (fake_quantize_activations(args[0], kind), *args[1:])
            )


# ---------------------------------------------------------------------------------------------
# NF4 (bitsandbytes)


def _nf4_skip_names(model: Any, ignore: list[str]) -> list[str]:
    """Linear modules left in float: the output embedding, MoE routers (float with every method;
    bitsandbytes' CPU kernel also fails on a one-row gate) and those matched by ``ignore``."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if module is head or is_router(name) or any(ignore_matches(name, pattern) for pattern in ignore):
            names.append(name)
    return names


def save_nf4(
    model: Any,
    tokenizer: Any,
    out_dir: Path,
    ignore: list[str],
    provenance: dict | None = None,
    overwrite: bool = False,
    *,
    double_quant: bool = False,
) -> None:
    """Quantize every Linear but the output head and ``ignore`` to NF4 with bitsandbytes (CPU).

    The model is written in float to a scratch directory and re-loaded through transformers'
    ``BitsAndBytesConfig`` path, whose ``save_pretrained`` writes the bitsandbytes layout
    (``.weight`` packed uint8, ``.weight.absmax``, ``.weight.quant_map``,
    ``.weight.quant_state.bitsandbytes__nf4``) and ``quant_method: bitsandbytes`` config.
    Blocks of 64 weights, float32 absmax (``double_quant`` quantizes the absmax too).
    """
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    skipped = _nf4_skip_names(model, list(ignore))
    if len(skipped) == sum(isinstance(m, torch.nn.Linear) for m in model.modules()):
        raise LlmoptError("no Linear layers left to quantize: the ignore patterns match all of them",
                          "narrow --ignore so it leaves some Linear to quantize")
    skip = [re.escape(name) for name in skipped]
    bnb_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=model.dtype,
        bnb_4bit_use_double_quant=double_quant,
        llm_int8_skip_modules=skip,
    )
    with atomic_dir(Path(out_dir), overwrite) as tmp:
        scratch = tmp / ".float"
        model.save_pretrained(scratch)
        qmodel = AutoModelForCausalLM.from_pretrained(
            scratch, quantization_config=bnb_config, device_map="cpu", dtype=model.dtype
        )
        shutil.rmtree(scratch)
        qmodel.save_pretrained(tmp)
        _write_extras(model, tokenizer, tmp, provenance)


def nf4_dequantized_state(path: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The state dict of an NF4 (bitsandbytes) checkpoint with every 4-bit weight dequantized."""
    import bitsandbytes.functional as bnbf

    tensors = _load_tensors(Path(path))
    marker = ".quant_state.bitsandbytes__"
    quantized = {key.split(marker)[0] for key in tensors if marker in key}
    out = {}
    for key, tensor in tensors.items():
        if key in quantized:
            parts = {k[len(key) + 1:]: v for k, v in tensors.items() if k.startswith(f"{key}.")}
            state = bnbf.QuantState.from_dict(parts, device=torch.device("cpu"))
            out[key] = bnbf.dequantize_4bit(tensor, state).to(dtype)
        elif not _is_companion(key, quantized):
            out[key] = tensor
    return out


def _is_companion(key: str, quantized: set[str]) -> bool:
    """Whether ``key`` is a quant-state tensor (``absmax``, ``quant_map`` …) of a 4-bit weight."""
    return any(key.startswith(f"{w}.") for w in quantized)
