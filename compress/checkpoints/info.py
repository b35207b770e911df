"""What a checkpoint holds, read from its files without building the model (``llmopt inspect``)."""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from llmopt.checkpoints.models import read_config
from llmopt.checkpoints.provenance import read_provenance

LAYER = re.compile(r"^(.*layers)\.(\d+)\.(.+)$")
# Tensors that describe a quantized weight rather than being parameters of their own.
AUX_SUFFIXES = ("weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "weight_global_scale", "input_scale",
                "input_zero_point")
BNB_AUX = re.compile(r"\.weight\.(absmax|quant_map|nested_absmax|nested_quant_map|quant_state\..*)$")


@dataclass
class ModuleInfo:
    name: str
    format: str  # dense, int4, int8, fp8, nf4
    dtype: str
    shape: list[int]
    group_size: int | None = None
    symmetric: bool | None = None
    activations: str | None = None
    sparsity: float | None = None
    pattern_2_4: bool | None = None
    pattern: str | None = None  # the tightest N:M pattern (recorded, 2:4 or 4:8) every group satisfies
    pattern_valid: bool | None = None  # whether the pattern recorded in llmopt.json holds here
    bytes: int = 0

    def label(self) -> str:
        if self.format == "dense":
            text = f"dense {self.dtype.lower()}"
        elif self.format == "nf4":
            text = f"nf4 block {self.group_size}"
        else:
            group = "per-channel" if self.group_size is None else f"g{self.group_size}"
            sym = "" if self.symmetric is None else (" sym" if self.symmetric else " asym")
            text = f"{self.format} {group}{sym}"
        if self.activations:
            text += f" + {self.activations} act"
        return text


@dataclass
class ModelInfo:
    path: str
    architecture: str
    model_type: str
    parameters: int
    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    vocab_size: int
    quantization: str | None
    bytes_on_disk: int
    bytes_in_memory: int
    modules: list[ModuleInfo] = field(default_factory=list)
    pruning: dict | None = None  # what llmopt.json records about pruning (method, sparsity, pattern …)
    runs_with: dict[str, str] = field(default_factory=dict)  # consumer → "loads" or why not (the model card's table)
    online_transforms: list[dict] | str | None = None  # transform_config's online Hadamards: block, Linears; or why unreadable

    def to_dict(self) -> dict:
        return asdict(self)


def _safetensor_headers(path: Path) -> dict[str, tuple[str, list[int], Path]]:
    """name → (dtype, shape, file) for every tensor in the directory's safetensors files."""
    headers = {}
    for file in sorted(path.glob("*.safetensors")):
        with file.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
        for name, meta in header.items():
            if name != "__metadata__":
                headers[name] = (meta["dtype"], meta["shape"], file)
    return headers


DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}


def _nbytes(dtype: str, shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * DTYPE_BYTES.get(dtype, 4)


def _activation_label(config: dict) -> str | None:
    for group in (config.get("quantization_config") or {}).get("config_groups", {}).values():
        act = group.get("input_activations")
        if act:
            return f"{act.get('type', 'int')}{act.get('num_bits', 8)}".replace("float8", "fp8")
    return None


def _read_tensor(file: Path, name: str):
    from safetensors import safe_open

    with safe_open(str(file), "pt") as handle:
        return handle.get_tensor(name)


COMMON_PATTERNS = ("2:4", "4:8")


def _dense_stats(file: Path, name: str, info: ModuleInfo, recorded: str | None) -> None:
    """Fill in a dense module's sparsity, 2:4 validity, the N:M pattern it satisfies, and whether
    the pattern recorded in ``llmopt.json`` holds."""
    from llmopt.formats.sparsity import nm_valid, parse_pattern

    w = _read_tensor(file, name)
    info.sparsity = float((w == 0).float().mean())
    candidates = list(dict.fromkeys(([recorded] if recorded else []) + list(COMMON_PATTERNS)))
    for text in candidates:
        pattern = parse_pattern(text)
        if w.dim() != 2 or w.shape[1] % pattern.m or info.sparsity < pattern.sparsity - 0.01:
            valid = None if text != recorded else False
        else:
            valid = nm_valid(w, pattern)
        if text == "2:4":
            info.pattern_2_4 = valid
        if text == recorded:
            info.pattern_valid = bool(valid)
        if valid and info.pattern is None:
            info.pattern = text


def _pruning_record(path: Path) -> dict | None:
    """The pruning part of ``llmopt.json`` (without the per-module list), if any."""
    record = read_provenance(path)
    if not any(k in record for k in ("sparsity", "depth", "width")):
        return None
    out = {"method": record.get("method"), "settings": record.get("settings"), "parameters": record.get("parameters")}
    if "sparsity" in record:
        out["sparsity"] = {k: v for k, v in record["sparsity"].items() if k != "modules"}
    for key in ("depth", "width"):
        if key in record:
            out[key] = {k: v for k, v in record[key].items() if k not in ("ranking", "kept_heads")}
    return out


def inspect_checkpoint(path: Path, sparsity: bool = True) -> ModelInfo:
    """Describe a Hugging Face checkpoint directory from its config and tensor headers."""
    from llmopt.checkpoints.model_card import consumers

    config = read_config(path)
    headers = _safetensor_headers(path)
    qconfig = config.get("quantization_config") or {}
    activations = _activation_label(config)
    pruning = _pruning_record(path)
    recorded = ((pruning or {}).get("sparsity") or {}).get("pattern")
    modules: list[ModuleInfo] = []
    parameters = 0
    for name, (dtype, shape, file) in sorted(headers.items(), key=lambda item: _natural(item[0])):
        if name.endswith(AUX_SUFFIXES) or BNB_AUX.search(name):
            continue
        module = name.rsplit(".", 1)[0]
        info = None
        if name.endswith(".weight_packed") and dtype == "U8":  # FP4 (E2M1) codes two a byte, no weight_shape
            info = _quantized(module, "fp4", dtype, [shape[0], shape[1] * 2], headers, activations)
            info.bytes = _nbytes(dtype, shape)
        elif name.endswith(".weight_packed"):
            true_shape = [int(x) for x in _read_tensor(file, f"{module}.weight_shape").tolist()]
            info = _quantized(module, "int4", dtype, true_shape, headers, activations)
            info.bytes = _nbytes(dtype, shape)
        elif name.endswith(".weight") and f"{module}.weight_scale" in headers:
            fmt = "fp8" if dtype.startswith("F8") else "int8"
            info = _quantized(module, fmt, dtype, shape, headers, activations)
            info.bytes = _nbytes(dtype, shape)
        elif name.endswith(".weight") and f"{name}.absmax" in headers:
            info = _nf4(module, name, file, headers)
        elif name.endswith(".weight") and len(shape) == 2 and "embed" not in name and "norm" not in name:
            info = ModuleInfo(module, "dense", dtype, shape, bytes=_nbytes(dtype, shape))
            if sparsity:
                _dense_stats(file, name, info, recorded if LAYER.match(module) else None)
        if info is not None:
            modules.append(info)
            parameters += info.shape[0] * info.shape[1]
        else:
            count = 1
            for dim in shape:
                count *= dim
            parameters += count
    _apply_config_schemes(modules, qconfig)
    for module in modules:
        aux = [n for n in headers if n.startswith(module.name + ".") and (n.endswith(AUX_SUFFIXES) or BNB_AUX.search(n))]
        module.bytes += sum(_nbytes(headers[n][0], headers[n][1]) for n in aux)
    in_memory = sum(_nbytes(dtype, shape) for dtype, shape, _ in headers.values())
    return ModelInfo(
        path=str(path),
        architecture=(config.get("architectures") or ["?"])[0],
        model_type=config.get("model_type", "?"),
        parameters=parameters,
        layers=config.get("num_hidden_layers", 0),
        hidden_size=config.get("hidden_size", 0),
        heads=config.get("num_attention_heads", 0),
        kv_heads=config.get("num_key_value_heads", config.get("num_attention_heads", 0)),
        vocab_size=config.get("vocab_size", 0),
        quantization=qconfig.get("quant_method"),
        bytes_on_disk=sum(f.stat().st_size for f in path.iterdir() if f.is_file()),
        bytes_in_memory=in_memory,
        modules=modules,
        pruning=pruning,
        runs_with=consumers(config),
        online_transforms=_online_transforms(qconfig, [m.name for m in modules]),
    )


def _online_transforms(qconfig: dict, modules: list[str]) -> list[dict] | str | None:
    """Each online input transform of ``qconfig`` with how many of ``modules`` it applies to."""
    from llmopt.formats.hadamard import online_inputs

    try:
        found = online_inputs(qconfig)
    except ValueError as exc:
        return f"not run by llmopt: {exc}"
    return [{"transform": "hadamard", "block": t.block, "linears": sum(map(t.applies_to, modules))} for t in found] or None


def _quantized(module: str, fmt: str, dtype: str, shape: list[int], headers: dict, activations: str | None) -> ModuleInfo:
    scale_shape = headers[f"{module}.weight_scale"][1]
    groups = scale_shape[1] if len(scale_shape) > 1 else 1
    group_size = None if groups <= 1 else shape[1] // groups
    symmetric = None if fmt in ("fp8", "fp4") else f"{module}.weight_zero_point" not in headers
    return ModuleInfo(module, fmt, dtype, shape, group_size, symmetric, activations)


def _apply_config_schemes(modules: list[ModuleInfo], qconfig: dict) -> None:
    """Take group size and symmetry from a compressed-tensors config (one group spanning a whole
    row looks per-channel from the tensor shapes alone)."""
    quantized = [m for m in modules if m.format in ("int4", "int8", "fp8", "fp4")]
    if qconfig.get("quant_method") != "compressed-tensors" or not quantized:
        return
    from llmopt.formats.compressed import module_schemes

    try:
        schemes = module_schemes(qconfig, [m.name for m in quantized])
    except ValueError:
        return  # a config we cannot map: keep what the tensor shapes say
    for module in quantized:
        scheme, group_size = schemes[module.name]
        module.format = (scheme.name[:5].lower() if scheme.is_fp4 else "fp8" if scheme.is_float
                         else f"int{scheme.num_bits}")  # packed int8 exists too; FP4: nvfp4 / mxfp4
        module.group_size = group_size
        module.symmetric = None if scheme.is_float else scheme.symmetric


def _nf4(module: str, name: str, file: Path, headers: dict) -> ModuleInfo:
    state_name = next(n for n in headers if n.startswith(f"{name}.quant_state."))
    state = json.loads(bytes(_read_tensor(file, state_name).tolist()).decode())
    shape = [int(x) for x in state.get("shape", [0, 0])]
    info = ModuleInfo(module, "nf4", headers[name][0], shape, group_size=int(state.get("blocksize", 64)))
    info.bytes = _nbytes(*headers[name][:2])
    return info


def grouped_rows(modules: list[ModuleInfo]) -> list[tuple[str, str, str, str]]:
    """Collapse consecutive layers with the same format: ``layers.0-29.mlp.down_proj``."""
    rows: OrderedDict[tuple[str, str], list[tuple[int, ModuleInfo]]] = OrderedDict()
    for module in modules:
        match = LAYER.match(module.name)
        prefix, index, suffix = (match.group(1), int(match.group(2)), match.group(3)) if match else ("", -1, module.name)
        sparsity = "" if module.sparsity is None or module.sparsity < 0.001 else f"{100 * module.sparsity:.1f}%"
        pattern = f" ({module.pattern})" if module.pattern else ""
        if module.pattern_valid is False:
            pattern += " (recorded N:M pattern VIOLATED)"
        key = (f"{prefix}|{suffix}|{'x'.join(map(str, module.shape))}", module.label() + "|" + sparsity + pattern)
        rows.setdefault(key, []).append((index, module))
    out = []
    for (where, label), members in rows.items():
        prefix, suffix, shape = where.split("|")
        indices = [i for i, _ in members]
        name = suffix if indices[0] < 0 else f"{prefix.split('.')[-1]}.{_ranges(indices)}.{suffix}"
        fmt, sparse = label.split("|")
        out.append((name, shape, fmt, sparse))
    return out


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _ranges(indices: list[int]) -> str:
    parts, start = [], indices[0]
    for a, b in zip(indices, indices[1:] + [None]):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(parts)
