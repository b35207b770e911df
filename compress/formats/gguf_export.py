"""Export a checkpoint to one GGUF file for llama.cpp, exact where our formats allow.

What each tensor becomes:

* 1-D tensors (norms, biases): F32, as llama.cpp keeps them.
* Linears quantized by us (compressed-tensors): their integer codes are carried over unchanged
  when a GGUF block type holds them — int4 symmetric → Q4_0, int4 asymmetric → Q4_1, int5
  symmetric → Q5_0, int5 asymmetric → Q5_1, int8 codes all on the IQ4_NL grid (``nl4``) →
  IQ4_NL, or IQ4_XS when their scales are also quantized per 256 features (``nl4x``), int6
  symmetric in groups of 16 whose scales are 8-bit multiples of one float16 per 256 features
  (``int6x``) → Q6_K, int3 symmetric in groups of 16 with 6-bit multiples (``int3x``) → Q3_K,
  int8 symmetric and int6 / int7 → Q8_0 (any group size that is a multiple of 32, per-channel
  included: a group spans whole blocks that share its scale). Only the scales are rounded, to
  float16 (IQ4_XS, Q3_K and Q6_K scales are already exact).
  ``--type auto`` takes the first exact mapping, or F16 (near-lossless) when there is none
  (FP8, int8 asymmetric, groups not a multiple of 32). An explicit integer type that would need
  the weights rounded again is refused unless ``requantize`` is set.
* Float matrices: quantized to the requested type. For a dense checkpoint ``auto`` is the
  lossless float type (BF16 / F16 when every value fits, else F32); with an explicit 4-bit type
  the output matrix (``lm_head``, or the tied embedding) gets Q6_K as llama.cpp's quantizer
  does. The float matrices of a quantized checkpoint (embeddings, ``lm_head``, layers left in
  float) stay F16 unless ``dense_type`` says otherwise. A row length the block type does not
  divide falls back as llama.cpp does (Q4_K → Q5_0, Q6_K → Q8_0, then F16).

Llama-family naming (``blk.N.attn_q.weight`` …) and the q/k row permutation llama.cpp's rotary
embedding expects are applied; layer counts and widths come from the tensors themselves, so
pruned models (fewer or narrower layers) are described as they are.

After writing (to a temporary file), the file is read back with ``gguf.GGUFReader``; every
tensor is dequantized and compared with its source, and carried codes are checked bit for bit,
before the file is renamed into place. ``llmopt.formats.gguf_verify`` additionally loads it
through transformers' GGUF loader and compares logits with the source model.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType

from llmopt.formats import gguf_blocks as blocks
from llmopt.formats.registry import format_of
from llmopt.core.atomic import atomic_file, check_output
from llmopt.core.errors import LlmoptError
from llmopt.formats.gguf_vocab import Vocab, build_vocab, write_vocab
from llmopt.checkpoints.models import resolve_model
from llmopt.formats.gguf_arch import TensorNames, write_metadata
from llmopt.formats.gguf_source import (
    Arch,
    Layout,
    Source,
    UnmappableTypeError,
    UnsupportedArchitectureError,
    check_architecture,
    read_layout,
    read_source,
    rope_parameters,
)
from llmopt.formats.gguf_verify import verify_with_transformers

FLOAT_TYPES = {T.F32, T.F16, T.BF16}
CARRY_TYPES = {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL, T.IQ4_XS, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4}
FOUR_BIT = {T.Q4_0, T.Q4_1, T.Q4_K, T.IQ4_NL, T.IQ4_XS}
FALLBACK = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0, T.Q4_0: T.F16, T.Q4_1: T.F16, T.Q5_0: T.F16, T.Q5_1: T.F16, T.Q8_0: T.F16,
            T.IQ4_NL: T.F16, T.IQ4_XS: T.IQ4_NL, T.MXFP4: T.F16}
FILE_TYPES = {
    T.F32: LlamaFileType.ALL_F32, T.F16: LlamaFileType.MOSTLY_F16, T.BF16: LlamaFileType.MOSTLY_BF16,
    T.Q8_0: LlamaFileType.MOSTLY_Q8_0, T.Q4_0: LlamaFileType.MOSTLY_Q4_0, T.Q4_1: LlamaFileType.MOSTLY_Q4_1,
    T.Q5_0: LlamaFileType.MOSTLY_Q5_0, T.Q5_1: LlamaFileType.MOSTLY_Q5_1, T.Q4_K: LlamaFileType.MOSTLY_Q4_K_S, T.Q5_K: LlamaFileType.MOSTLY_Q5_K_S, T.Q2_K: LlamaFileType.MOSTLY_Q2_K,
    T.Q6_K: LlamaFileType.MOSTLY_Q6_K,
    T.Q3_K: LlamaFileType.MOSTLY_Q3_K_S, T.IQ4_NL: LlamaFileType.MOSTLY_IQ4_NL, T.IQ4_XS: LlamaFileType.MOSTLY_IQ4_XS,
    T.MXFP4: LlamaFileType.MOSTLY_MXFP4_MOE,  # llama.cpp's one MXFP4 file type (named for gpt-oss's experts)
}
F16_MAX = 65504.0
# carried types whose scales are integer multiples of a float16 d per super-block
SUPERBLOCK_ENCODERS = {T.IQ4_XS: blocks.encode_iq4_xs, T.Q2_K: blocks.encode_q2_k, T.Q3_K: blocks.encode_q3_k,
                       T.Q4_K: blocks.encode_q4_k, T.Q5_K: blocks.encode_q5_k, T.Q6_K: blocks.encode_q6_k}

def parse_type(name: str) -> T | None:
    """The GGML type for a user-facing name (``auto`` → None)."""
    if name.lower() == "auto":
        return None
    try:
        return T[name.upper()]
    except KeyError:
        raise LlmoptError(f"unknown GGUF type '{name}'", f"use one of {', '.join(blocks.USER_TYPES)}") from None


# ---------------------------------------------------------------------------------------------
# Planning: GGUF name, type and how each tensor gets there


@dataclass
class Planned:
    """One output tensor: its source, the GGUF type chosen and how it is produced."""

    name: str
    source: str
    value: Any  # float tensor [rows, cols] / [n], or QuantizedWeight (rows already permuted)
    qtype: T
    how: str  # "carried codes", "quantized", "cast", "requantized", "stored"
    source_format: str
    note: str = ""
    expected_codes: np.ndarray | None = None  # carried codes as stored (for the read-back check)
    expected_d: np.ndarray | None = None  # their fp16 block scales, as float32
    expected_min: np.ndarray | None = None  # Q4_K / Q5_K with float zero points: their sub-block mins dmin · m
    # super-block types: (d, k) of the scales and (dmin, m) of the mins or None, found once when planned
    superblock: tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray] | None] | None = None
    parts: list[Planned] | None = None  # experts stacked into this one 3-D tensor, in order

    def reference(self) -> torch.Tensor:
        """The source values this tensor should reproduce, in float32."""
        if self.parts:
            return torch.stack([p.reference() for p in self.parts])
        if isinstance(self.value, torch.Tensor):
            return self.value.float()
        return self.value.dequantize(torch.float32)

    @property
    def weights(self) -> int:
        """How many values the tensor holds."""
        if self.parts:
            return sum(p.weights for p in self.parts)
        return int(np.prod(self.value.shape if isinstance(self.value, torch.Tensor) else self.value.codes.shape))

    def stored_codes(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The carried codes and block scales the file must hold (experts one after another)."""
        parts = self.parts or [self]
        if any(p.expected_codes is None for p in parts):
            return None
        return np.concatenate([p.expected_codes for p in parts]), np.concatenate([p.expected_d for p in parts])

    def stored_mins(self) -> np.ndarray | None:
        """The carried sub-block mins the file must hold (K-quants with float zero points), else None."""
        parts = self.parts or [self]
        if any(p.expected_min is None for p in parts):
            return None
        return np.concatenate([p.expected_min for p in parts])


@dataclass
class TensorReport:
    name: str
    source: str
    shape: list[int]
    source_format: str
    type: str
    how: str
    note: str
    max_abs_err: float
    rel_err: float  # max_abs_err / max |source|
    codes_identical: bool | None


@dataclass
class GGUFExportReport:
    """What was written and how faithfully."""

    output: str
    source: str
    source_kind: str
    architecture: str
    requested_type: str
    file_type: str
    bytes: int
    seconds: float
    layers: int
    tensors: list[TensorReport]
    by_type: dict[str, dict]
    decisions: list[str]
    notes: list[str]
    tokenizer: dict
    verify: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _permute_rows(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """Reorder each head's rows from halves (HF rotate-half) to interleaved pairs (llama.cpp)."""
    rows = x.shape[0]
    half = rows // n_head // 2
    return x.reshape(n_head, 2, half, *x.shape[1:]).transpose(1, 2).reshape(x.shape)


def _permute(value: Any, n_head: int) -> Any:
    if isinstance(value, torch.Tensor):
        return _permute_rows(value, n_head)
    from dataclasses import replace

    zp = None if value.zero_point is None else _permute_rows(value.zero_point, n_head)
    return replace(value, codes=_permute_rows(value.codes, n_head), scale=_permute_rows(value.scale, n_head), zero_point=zp)


def describe_quantized(qw: Any) -> str:
    """``int4 sym g32``, ``int8 sym per-channel``, ``nl4 (IQ4_NL grid) g32``, ``fp8_e4m3 per-channel`` …"""
    fmt = format_of(qw)
    group = f"g{qw.group_size}" if qw.group_size else "per-channel"
    if fmt.float_codes:
        return f"{fmt.name} {group}" if fmt.fp4 else f"fp8_e4m3 {group}"
    if fmt.grid is not None:
        return f"nl4 (IQ4_NL grid) {group}"
    return f"int{fmt.bits} {'sym' if fmt.symmetric else 'float mins' if fmt.float_zero else 'asym'} {group}"


def carry_types(qw: Any) -> list[T]:
    """GGUF block types that hold ``qw``'s integer codes exactly (best first): its weight format's
    (:mod:`llmopt.formats.registry`)."""
    return format_of(qw).gguf_types(qw)


def _fits(qtype: T, cols: int) -> bool:
    return cols % blocks.block_size(qtype) == 0


def _with_fallback(qtype: T, cols: int) -> tuple[T, str]:
    """``qtype`` or llama.cpp's fallback when the row length is not a multiple of its block."""
    chosen = qtype
    while not _fits(chosen, cols):
        chosen = FALLBACK[chosen]
    if chosen == qtype:
        return qtype, ""
    return chosen, f"{qtype.name} → {chosen.name}: row length {cols} is not a multiple of {blocks.block_size(qtype)}"


def _lossless_float(t: torch.Tensor) -> T:
    """The smallest float type holding every value of ``t`` exactly."""
    if t.dtype == torch.bfloat16:
        return T.BF16
    if t.dtype == torch.float16:
        return T.F16
    f = t.float()
    if torch.equal(f.to(torch.float16).float(), f):
        return T.F16
    if torch.equal(f.to(torch.bfloat16).float(), f):
        return T.BF16
    return T.F32


def _float_format(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


@dataclass
class Options:
    """How to choose types: the requested one (None: auto), the one for float matrices, and
    whether codes may be rounded again."""

    qtype: T | None = None
    dense_type: T | None = None
    requantize: bool = False


def _plan_quantized(name: str, source: str, qw: Any, opts: Options) -> Planned:
    fmt = describe_quantized(qw)
    exact = carry_types(qw)
    cols = qw.codes.shape[1]
    if opts.qtype is None:
        if exact:
            return _carry(name, source, qw, exact[0], fmt, f"auto: {fmt} → {exact[0].name} (codes carried, scales to fp16)")
        return Planned(name, source, qw, T.F16, "cast", fmt, f"auto: no GGUF block type holds {fmt} codes; F16 (near-lossless)")
    if opts.qtype in exact:
        return _carry(name, source, qw, opts.qtype, fmt, "")
    if opts.qtype in FLOAT_TYPES:
        return Planned(name, source, qw, opts.qtype, "cast", fmt)
    if not opts.requantize:
        hint = f"use --type auto ({exact[0].name} here)" if exact else "use --type auto (F16 here)"
        raise UnmappableTypeError(
            f"{source} ({fmt}) cannot be written as {opts.qtype.name} without rounding its weights again",
            f"{hint}, or pass --requantize",
        )
    qtype, note = _with_fallback(opts.qtype, cols)
    return Planned(name, source, qw, qtype, "requantized", fmt, note or f"{fmt} dequantized and quantized again")


def _carry(name: str, source: str, qw: Any, qtype: T, fmt: str, note: str) -> Planned:
    """Plan a tensor whose codes go into ``qtype`` blocks unchanged."""
    cols = qw.codes.shape[1]
    group = qw.group_size or cols
    carrier = format_of(qw).gguf_carrier_of(qtype)
    scale = qw.scale.float().repeat_interleave(group // carrier.sub_block, dim=1)  # [rows, cols/32] (Q3_K / Q6_K: cols/16)
    if carrier.steps is not None or qtype == T.MXFP4:  # carried exactly: k · d per super-block, or powers of two
        d16 = scale
    else:
        d16 = scale.to(torch.float16)
        if not torch.isfinite(d16).all():
            raise UnmappableTypeError(f"{source}: a scale exceeds float16's range", "export with --type F32")
    # MXFP4's codes are compared as the doubled E2M1 values its blocks index
    codes = (qw.codes.float() * 2).to(torch.int16) if qtype == T.MXFP4 else qw.codes.to(torch.int16)
    if qtype == T.Q8_0 and qw.zero_point is not None:
        codes = codes - qw.zero_point.to(torch.int16).repeat_interleave(group, dim=1)
    mins = min_factors = superblock = None
    if carrier.min_steps is not None:  # the mins are carried exactly too: dmin per super-block times an integer
        dmin, m = carrier.min_factors(qw)
        mins = (m * dmin.repeat_interleave(m.shape[1] // dmin.shape[1], dim=1)).numpy()
        min_factors = (dmin.numpy(), m.numpy())
    if qtype in SUPERBLOCK_ENCODERS:
        d, k = carrier.factors(qw)
        superblock = ((d.numpy(), k.numpy()), min_factors)
    return Planned(name, source, qw, qtype, "carried codes", fmt, note, expected_codes=codes.numpy().astype(np.int8),
                   expected_d=d16.float().numpy(), expected_min=mins, superblock=superblock)


def _plan_float(name: str, source: str, t: torch.Tensor, opts: Options, is_output: bool, quantized_source: bool,
                router: bool = False) -> Planned:
    fmt = _float_format(t)
    if t.dim() == 1:
        return Planned(name, source, t, T.F32, "stored", fmt)
    if router:  # llama.cpp keeps expert routers in float32 whatever the file's type
        return Planned(name, source, t, T.F32, "stored" if t.dtype == torch.float32 else "cast", fmt, "expert router kept in F32")
    cols = t.shape[1]
    note = ""
    if opts.dense_type is not None:
        want = opts.dense_type
    elif quantized_source:
        want = opts.qtype if opts.qtype in FLOAT_TYPES else T.F16
        if opts.qtype is None:
            note = "auto: float matrix of a quantized checkpoint kept in F16"
    elif opts.qtype is None:
        want = _lossless_float(t)
        note = f"auto: {fmt} → {want.name} (lossless)"
    else:
        want = opts.qtype
        if is_output and want in FOUR_BIT:
            want = T.Q6_K
            note = f"output matrix at Q6_K (llama.cpp's choice for {opts.qtype.name})"
    qtype, fallback = _with_fallback(want, cols)
    if qtype == T.F16 and t.abs().max() > F16_MAX:
        qtype, fallback = T.F32, f"values exceed F16's range; F32 instead of {want.name}"
    same = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}.get(qtype) == t.dtype
    how = "stored" if same else "cast" if qtype in FLOAT_TYPES else "quantized"
    return Planned(name, source, t, qtype, how, fmt, "; ".join(n for n in (note, fallback) if n))



def plan_tensors(source: Source, arch: Arch, layout: Layout, opts: Options) -> tuple[list[Planned], list[str]]:
    """Every output tensor with its GGUF name, type and value (q/k rows permuted, Gemma norms
    shifted, experts stacked into one tensor per projection)."""
    tied = bool(source.config.get("tie_word_embeddings", False))
    names = TensorNames(arch, layout, tied)
    entries: list[tuple[str, str, Any]] = []  # (gguf name, source key, value)
    notes: list[str] = []
    for key, t in source.floats.items():
        if arch.norm_shift and key.endswith("norm.weight"):
            t = t.float() + arch.norm_shift
        entries.append((names(key), key, t))
    for module, qw in source.quantized.items():
        entries.append((names(f"{module}.weight"), f"{module}.weight", qw))
    entries = [e for e in entries if e[0]]
    has_output = any(name == "output.weight" for name, _, _ in entries)
    if tied and arch.output_required and not has_output:
        embed = next(e for e in entries if e[0] == "token_embd.weight")
        entries.append(("output.weight", embed[1], embed[2]))
        has_output = True
        notes.append(f"the tied embedding is written twice, as token_embd and output (llama.cpp's {arch.gguf} needs both)")
    elif tied and "lm_head.weight" in source.floats:
        notes.append("lm_head is tied to the embedding: written once, as token_embd")
    if arch.norm_shift:
        notes.append("Gemma norms stored as 1 + weight (llama.cpp scales by the stored weight)")
    plans: list[Planned] = []
    stacks: dict[str, list[tuple[int, Planned]]] = {}
    for name, key, value in sorted(entries, key=lambda e: _order(e[0])):
        block = re.match(r"blk\.(\d+)\.(attn_q|attn_k)\.", name)
        if arch.permute_qk and block:
            i = int(block.group(1))
            value = _permute(value, layout.n_head[i] if block.group(2) == "attn_q" else layout.n_kv[i])
        is_output = name == "output.weight" or (name == "token_embd.weight" and not has_output)
        router = "ffn_gate_inp" in name
        if router and isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[0] == 1:
            value = value[0]  # a one-row gate (Qwen2-MoE's shared-expert gate) is a vector in llama.cpp
        if isinstance(value, torch.Tensor):
            planned = _plan_float(name, key, value, opts, is_output, source.is_quantized, router)
        else:
            planned = _plan_quantized(name, key, value, opts)
        expert = names.expert(key)
        if expert is None:
            plans.append(planned)
            continue
        if name not in stacks:
            plans.append(planned)  # holds the stack's place; replaced below
        stacks.setdefault(name, []).append((expert, planned))
    for name, parts in stacks.items():
        at = next(j for j, p in enumerate(plans) if p.name == name)
        plans[at] = _stack(name, [p for _, p in sorted(parts, key=lambda e: e[0])], opts)
    return plans, notes


def _stack(name: str, parts: list[Planned], opts: Options) -> Planned:
    """The experts of one projection as one 3-D tensor; all share one GGUF type (with ``auto``,
    F16 when their carried types differ)."""
    if len({(p.qtype, p.how) for p in parts}) > 1:
        if opts.qtype is not None:
            raise UnmappableTypeError(f"{name}: the experts' weights need different GGUF types "
                                      f"({', '.join(sorted({p.qtype.name for p in parts}))})", "export with --type auto")
        parts = [replace(p, qtype=T.F16, how="cast", note="experts of different formats: F16 (near-lossless)",
                         expected_codes=None, expected_d=None) for p in parts]
    first = parts[0]
    return replace(first, source=re.sub(r"\.experts\.\d+\.", ".experts.*.", first.source), parts=parts)


def _order(name: str) -> tuple:
    m = re.match(r"blk\.(\d+)\.(.*)", name)
    if m:
        return (1, int(m.group(1)), m.group(2))
    return (0 if name.startswith("token_embd") else 2, 0, name)


# ---------------------------------------------------------------------------------------------
# Encoding and writing


def encode(p: Planned) -> tuple[np.ndarray, T | None]:
    """The array handed to ``GGUFWriter.add_tensor`` and its raw type (None: from the dtype)."""
    from gguf import quants

    if p.parts:
        arrays = [encode(part) for part in p.parts]
        return np.stack([a for a, _ in arrays]), arrays[0][1]
    if p.how == "carried codes":
        qw = p.value
        codes = p.expected_codes
        if p.qtype == T.Q4_0:
            return blocks.encode_q4_0(codes, p.expected_d), T.Q4_0
        if p.qtype == T.Q5_0:
            return blocks.encode_q5_0(codes, p.expected_d), T.Q5_0
        if p.qtype == T.Q8_0:
            return blocks.encode_q8_0(codes, p.expected_d), T.Q8_0
        if p.qtype == T.IQ4_NL:
            return blocks.encode_iq4_nl(codes, p.expected_d), T.IQ4_NL
        if p.qtype == T.MXFP4:
            return blocks.encode_mxfp4(codes, p.expected_d), T.MXFP4
        if p.superblock is not None:
            (d, k), min_factors = p.superblock
            return SUPERBLOCK_ENCODERS[p.qtype](codes, d, k, *([min_factors] if min_factors is not None else [])), p.qtype
        cols = codes.shape[1]
        group = qw.group_size or cols
        scale = qw.scale.float().repeat_interleave(group // blocks.QK, dim=1)
        zp = torch.zeros_like(scale) if qw.zero_point is None else qw.zero_point.float().repeat_interleave(group // blocks.QK, dim=1)
        half = 2 ** (qw.scheme.num_bits - 1)  # u = q + half
        m = (-(zp + half) * scale).numpy()
        if p.qtype == T.Q5_1:
            return blocks.encode_q5_1(codes, p.expected_d, m), T.Q5_1
        return blocks.encode_q4_1(codes, p.expected_d, m), T.Q4_1
    x = p.reference().numpy()
    if p.qtype == T.F32:
        return np.ascontiguousarray(x, dtype=np.float32), None
    if p.qtype == T.F16:
        return x.astype(np.float16), None
    if p.qtype == T.Q4_K:
        return blocks.quantize_q4_k(x), T.Q4_K
    if p.qtype == T.Q6_K:
        return blocks.quantize_q6_k(x), T.Q6_K
    if p.qtype == T.IQ4_NL:
        return blocks.quantize_iq4_nl(x), T.IQ4_NL
    if p.qtype == T.IQ4_XS:
        return blocks.quantize_iq4_xs(x), T.IQ4_XS
    return quants.quantize(x, p.qtype), p.qtype


def _file_type(plans: list[Planned], opts: Options) -> T:
    """The type most of the matrices' weights have (what ``general.file_type`` states)."""
    if opts.qtype is not None:
        return opts.qtype
    weights: Counter = Counter()
    for p in plans:
        if isinstance(p.value, torch.Tensor) and p.value.dim() == 1:
            continue
        weights[p.qtype] += p.weights
    return weights.most_common(1)[0][0] if weights else T.F32


def _write(path: Path, arch: Arch, source: Source, layout: Layout, vocab: Vocab,
           plans: list[Planned], file_type: LlamaFileType) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch.gguf)
    write_metadata(writer, source, layout, file_type, arch)
    write_vocab(writer, vocab)
    for p in plans:
        array, raw = encode(p)
        writer.add_tensor(p.name, array, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---------------------------------------------------------------------------------------------
# Read-back verification


class VerificationError(LlmoptError):
    """The written file does not hold what was planned (a bug, never a user error)."""

    exit_code = 1


def read_back(path: Path, plans: list[Planned], layout: Layout, vocab: Vocab) -> list[TensorReport]:
    """Read ``path`` with ``gguf.GGUFReader``; dequantize and compare every tensor with its source.

    Raises VerificationError when a tensor is missing, has another type or shape, holds
    non-finite values, or (carried codes) differs from the source codes or fp16 scales.
    """
    from gguf import GGUFReader, quants

    reader = GGUFReader(str(path))
    stored = {t.name: t for t in reader.tensors}
    if set(stored) != {p.name for p in plans}:
        raise VerificationError(f"tensor names differ after writing: {sorted(set(stored) ^ {p.name for p in plans})}")
    fields = reader.fields
    arch = fields["general.architecture"].contents()
    if fields[f"{arch}.block_count"].contents() != layout.layers or len(fields["tokenizer.ggml.tokens"].data) != len(vocab.tokens):
        raise VerificationError("metadata read back differs from what was written")
    reports = []
    for p in plans:
        t = stored[p.name]
        ref = p.reference()
        shape = list(ref.shape)
        if t.tensor_type != p.qtype or [int(n) for n in reversed(t.shape)] != shape:
            raise VerificationError(f"{p.name}: read back as {t.tensor_type.name} {list(t.shape)}, planned {p.qtype.name} {shape}")
        values = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if not np.isfinite(values).all():
            raise VerificationError(f"{p.name}: non-finite values after writing")
        ref_np = ref.numpy()
        err = float(np.abs(values - ref_np).max()) if values.size else 0.0
        scale = float(np.abs(ref_np).max()) if ref_np.size else 0.0
        identical = None
        expected = p.stored_codes() if p.how == "carried codes" else None
        if expected is not None:
            rows = int(np.prod(shape[:-1]))
            data = np.asarray(t.data).reshape(rows, -1)
            mins = p.stored_mins()
            if mins is not None:
                codes, d, stored_mins = blocks.stored_k_mins(data, t.tensor_type, rows)
                identical = bool(np.array_equal(codes, expected[0]) and np.array_equal(d, expected[1])
                                 and np.array_equal(stored_mins, mins))
            else:
                codes, d = blocks.stored_codes(data, t.tensor_type, rows)
                identical = bool(np.array_equal(codes, expected[0]) and np.array_equal(d, expected[1]))
            if not identical:
                raise VerificationError(f"{p.name}: carried codes or scales differ after writing")
        reports.append(TensorReport(p.name, p.source, shape, p.source_format, p.qtype.name, p.how, p.note,
                                    err, err / scale if scale else 0.0, identical))
    return reports


def summarize(reports: list[TensorReport]) -> dict[str, dict]:
    """Per GGUF type: tensors, weights, and the largest absolute / relative error against the source."""
    out: dict[str, dict] = {}
    for r in reports:
        s = out.setdefault(r.type, {"tensors": 0, "weights": 0, "max_abs_err": 0.0, "max_rel_err": 0.0, "codes_identical": None})
        s["tensors"] += 1
        s["weights"] += int(np.prod(r.shape))
        s["max_abs_err"] = max(s["max_abs_err"], r.max_abs_err)
        s["max_rel_err"] = max(s["max_rel_err"], r.rel_err)
        if r.codes_identical is not None:
            s["codes_identical"] = r.codes_identical if s["codes_identical"] is None else s["codes_identical"] and r.codes_identical
    return out


def _decisions(plans: list[Planned]) -> list[str]:
    """One line per distinct (source format, type, how, note), with how many tensors it covers."""
    counts: Counter = Counter()
    for p in plans:
        if isinstance(p.value, torch.Tensor) and p.value.dim() == 1:
            continue
        counts[(p.source_format, p.qtype.name, p.how, p.note)] += 1
    lines = []
    for (fmt, qtype, how, note), n in counts.items():
        lines.append(f"{n} × {fmt} → {qtype} ({how})" + (f" — {note}" if note else ""))
    return lines


# ---------------------------------------------------------------------------------------------
# Entry points


def _refuse_online_transforms(source: Any, model: Any) -> None:
    """GGUF has no online transforms: a checkpoint whose Linears read transformed inputs is refused."""
    from llmopt.formats.hadamard import online_inputs

    try:
        online = online_inputs(source.config.get("quantization_config"))
    except ValueError as exc:
        raise LlmoptError(f"{model}: {exc}") from exc
    if online:
        raise LlmoptError(f"{model} applies an online Hadamard to the inputs of Linears matching "
                          f"{', '.join(t for o in online for t in o.targets)} (transform_config), which GGUF cannot carry",
                          "export the float model, or quantize for GGUF without --rotate or with a weight-only scheme")


def export_gguf(
    model: str | Path,
    output: str | Path,
    gguf_type: str = "auto",
    dense_type: str | None = None,
    requantize: bool = False,
    overwrite: bool = False,
    verify: bool = False,
    verify_text: str | None = None,
    mixture: str | None = None,
) -> GGUFExportReport:
    """Export MODEL (any spec ``resolve_model`` takes) to the GGUF file ``output``.

    ``mixture``: the llama.cpp mixture (Q4_K_M …) MODEL was quantized as, which the file states as
    its type (its tensors are carried as ``auto`` carries them).

    Writes to a temporary file beside ``output``, reads it back and checks every tensor, then
    renames it into place; nothing is left behind on error. ``verify`` also loads the file
    through transformers' GGUF loader and compares logits with the source model.
    """
    from transformers import AutoTokenizer

    start = time.perf_counter()
    output = Path(output)
    if output.is_dir():
        raise LlmoptError(f"output {output} is a directory", "give a file name such as model.gguf")
    check_output(output, overwrite)
    opts = Options(parse_type(gguf_type), parse_type(dense_type) if dense_type else None, requantize)
    path = resolve_model(model)
    source = read_source(path)
    _refuse_online_transforms(source, model)
    arch = check_architecture(source.config)
    layout = read_layout(source)
    plans, notes = plan_tensors(source, arch, layout, opts)
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab = build_vocab(tokenizer, layout.vocab, path)
    notes += vocab.notes
    if layout.layers != source.config.get("num_hidden_layers"):
        notes.append(f"{layout.layers} layers in the tensors, {source.config.get('num_hidden_layers')} in the config: wrote {layout.layers}")
    if sorted(layout.layer_map) != list(range(layout.layers)):
        notes.append(f"layers renumbered {sorted(layout.layer_map)} → 0..{layout.layers - 1}")
    if any(q.scheme.activations for q in source.quantized.values()):
        notes.append("the checkpoint's dynamic activation quantization is not stored in GGUF (llama.cpp quantizes "
                     "activations to 8-bit blocks itself for Q4_0/Q4_1/Q8_0 dot products)")
    if len(set(layout.ffn)) > 1 or len(set(layout.n_head)) > 1 or len(set(layout.n_kv)) > 1:
        notes.append("layer widths differ: feed_forward_length / head counts written per layer (llama.cpp reads arrays; transformers' GGUF loader does not)")
    file_type = FILE_TYPES[_file_type(plans, opts)] if mixture is None else LlamaFileType[f"MOSTLY_{mixture}"]
    with atomic_file(output, overwrite) as tmp:
        _write(tmp, arch, source, layout, vocab, plans, file_type)
        reports = read_back(tmp, plans, layout, vocab)
    report = GGUFExportReport(
        output=str(output), source=str(path), source_kind=_source_kind(source), architecture=arch.gguf,
        requested_type=mixture or (gguf_type.upper() if gguf_type.lower() != "auto" else "auto"),
        file_type=file_type.name, bytes=output.stat().st_size,
        seconds=0.0, layers=layout.layers, tensors=reports, by_type=summarize(reports),
        decisions=_decisions(plans), notes=notes, tokenizer=vocab.summary(),
    )
    if verify:
        report.verify = verify_with_transformers(output, source, verify_text)
    report.seconds = round(time.perf_counter() - start, 2)
    return report


def _source_kind(source: Source) -> str:
    if source.kind == "dense":
        dtypes = Counter(str(t.dtype).replace("torch.", "") for t in source.floats.values() if t.dim() == 2)
        return f"dense {dtypes.most_common(1)[0][0]}" if dtypes else "dense"
    if source.kind == "bitsandbytes":
        return "bitsandbytes NF4 (dequantized; no GGUF type holds NF4 exactly)"
    formats = Counter(describe_quantized(q) for q in source.quantized.values())
    return "compressed-tensors " + ", ".join(f"{fmt} ({n})" for fmt, n in formats.most_common())
