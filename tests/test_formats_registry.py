"""The weight-format registry: every registered format packs and unpacks exactly, declares the
bytes it writes, is recognized again from a checkpoint read back, and names the GGUF block type
and runtime kernel the exporter and the kernels use."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.quantization import QuantizationScheme

from llmopt.formats import compressed, fp4
from llmopt.formats.registry import FORMATS, LINEAR_CANDIDATES, OUTER_CANDIDATES, format_for, format_of, kernel_for_codes
from llmopt.formats.schemes import QuantizedWeight, compute_qparams, search_qparams

ROWS, COLS = 40, 256  # 256 columns: the super-block formats' scales factor; 40 rows: zero points pack a partial word


def _group(fmt) -> int | None:
    return None if fmt.name in ("int8", "fp8") else 16 if fmt.name in ("int6x", "int3x", "nvfp4") else 32


def _quantized(fmt, scale_dtype: str = "bfloat16", activations: str | None = None) -> QuantizedWeight:
    scheme = replace(fmt.scheme(_group(fmt), scale_dtype), activations=activations)
    w = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(len(fmt.name))) * 0.05
    if scheme.needs_global_scale:  # NVFP4: scales relative to the tensor's global scale
        scheme = scheme.with_global_scale(fp4.global_scale(w))
    scale, zp = (search_qparams if fmt.grid is not None else compute_qparams)(w, scheme, scheme.group_size)
    return QuantizedWeight.from_weight(w, scheme, scheme.group_size, scale, zp)


def _read_back_scheme(qw: QuantizedWeight):
    """The scheme a compressed-tensors config gives back: no grid, no super-block steps."""
    ct = compressed._ct_scheme(qw.scheme, qw.group_size, ["Linear"])
    scheme, _ = compressed._scheme_from_ct(ct)
    return scheme


@pytest.mark.parametrize("name", list(FORMATS))
def test_every_format_round_trips_and_declares_its_bytes(name):
    fmt = FORMATS[name]
    qw = _quantized(fmt)
    assert format_of(qw) is fmt and format_for(qw.scheme) is fmt
    tensors = fmt.pack(qw)
    assert set(tensors) == set(fmt.checkpoint_tensors())
    written = sum(t.numel() * t.element_size() for t in tensors.values())
    assert fmt.checkpoint_bytes(ROWS, COLS, qw.group_size) == written
    # scales in 16 bits, except super-block (k·d) scales: float32, exactly as the quantizer chose them;
    # FP4: FP8 times the global scale (NVFP4), E8M0 exponents (MXFP4); float zero points with free
    # scales: float16, as Q4_1 / Q5_1 hold d
    want = (torch.float32 if fmt.scale_steps else qw.scheme.stored_scale_dtype if fmt.fp4
            else torch.float16 if fmt.float_zero else torch.bfloat16)
    assert tensors["weight_scale"].dtype == want
    if not fmt.fp4:
        assert torch.equal(tensors["weight_scale"].float(), qw.scale)
    # read back as a checkpoint is: the scheme from the config, the format recognized from the values
    scheme = _read_back_scheme(qw)
    back = format_for(scheme).unpack(tensors, scheme, qw.group_size)
    assert format_of(back) is fmt
    assert torch.equal(back.codes.view(torch.int8), qw.codes.view(torch.int8)) and torch.equal(back.scale, qw.scale)
    assert torch.equal(fmt.dequantize(back), qw.dequantize())
    # compressed-tensors' own choice of layout is the format's
    ct = QuantizationScheme(targets=["Linear"], weights=compressed._weight_args(qw.scheme, qw.group_size))
    want_format = {"e4m3": "nvfp4-pack-quantized", "e8m0": "mxfp4-pack-quantized"}.get(fmt.fp4, "pack-quantized")
    assert (infer_module_format(torch.nn.Linear, ct).value == want_format) == (fmt.packs() or fmt.fp4 is not None or fmt.float_zero)
    # float zero points: naive-quantized (one int8 a code), since pack-quantized packs integer zero points only
    if fmt.float_zero:
        assert compressed._ct_scheme(qw.scheme, qw.group_size, ["Linear"]).format == "naive-quantized"
    assert fmt.kernel == kernel_for_codes(qw.codes, qw.zero_point)  # the narrowest kernel holding its codes


@pytest.mark.parametrize("activations,name", [("int8", "int8"), ("fp8", "fp8")])
def test_activation_schemes_store_codes_unpacked(activations, name):
    """W8A8 / FP8_DYNAMIC: one byte a code (int-quantized / float-quantized), bytes as declared."""
    fmt = FORMATS[name]
    qw = _quantized(fmt, activations=activations)
    tensors = compressed.compress_weight(qw)
    assert "weight" in tensors and "weight_packed" not in tensors
    assert fmt.checkpoint_bytes(ROWS, COLS, qw.group_size, activations=activations) == \
        sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_scales_are_written_in_the_dtype_asked(dtype):
    fmt = FORMATS["int4"]
    qw = _quantized(fmt, scale_dtype=dtype)
    assert torch.equal(qw.scale.to(getattr(torch, dtype)).float(), qw.scale)  # rounded where they were chosen
    tensors = compressed.quantized_tensors({"x": qw})
    assert tensors["x.weight_scale"].dtype == getattr(torch, dtype)
    assert fmt.checkpoint_bytes(ROWS, COLS, 32, dtype) == sum(t.numel() * t.element_size() for t in tensors.values())
    assert compressed.quantized_tensors({"x": qw}, torch.float32)["x.weight_scale"].dtype == torch.float32


@pytest.mark.parametrize("name", [n for n, f in FORMATS.items() if f.gguf])
def test_the_planners_gguf_block_is_the_exporters(name):
    """The block type the planner counts for a shape (``gguf_carrier``) is the one the exporter
    carries the codes in (``gguf_types``, which also checks the scales)."""
    from llmopt.formats.gguf_export import carry_types

    fmt = FORMATS[name]
    qw = _quantized(fmt)
    assert carry_types(qw)[0] == fmt.gguf_carrier(COLS, qw.group_size).qtype


def test_candidates_name_registered_formats():
    assert set(LINEAR_CANDIDATES) >= {"int4_g32", "nl4x_g32", "int6x_g16", "int3x_g16", "int8"}
    assert set(OUTER_CANDIDATES) == {"int4", "int4a", "int5", "int5a", "int6", "nl4", "int8"}
    for cand in (*LINEAR_CANDIDATES.values(), *OUTER_CANDIDATES.values()):
        scheme = cand.scheme(COLS)
        assert format_for(scheme) is cand.format and scheme.group_size == cand.group_size
        assert cand.checkpoint_bytes((ROWS, COLS)) == cand.format.checkpoint_bytes(ROWS, COLS, cand.group_size)
