"""Triton kernels on a CUDA GPU (sized for one H200 run of at most ~5 minutes).

1. Correctness: every quantized-linear format and the paged decode attention against the
   plain-torch reference on the GPU (float32 reference on the same inputs; NaN-poisoned outputs).
2. A device-to-device copy, the bandwidth ceiling (bytes read + written per second).
3. Linear timings for the decoder shapes below at M in {1, 4, 16, 128}: int4 g128, int8 and
   fp8 kernels against torch float16 ``F.linear``; achieved GB/s (weight + input + output
   bytes) as a share of the copy bandwidth. Each timing replays a CUDA graph of calls that
   cycle through enough weight copies to exceed the L2, and takes the median replay.
4. Paged decode attention timings against the reference (gather + SDPA).
5. The whole engine on the GPU (``device="cuda"``, float16): random-weight Llama-shaped
   checkpoints (float16 and W4A16 compressed-tensors) on the Triton backend against the
   plain-torch reference backend on the same GPU: single stream (pp512 / tg128 tok/s) and a
   serving workload (output tok/s, TTFT / TPOT p50), plus greedy-token agreement of the two.

Results go to ``$OUT/kernels_gpu.{json,md}`` when ``$OUT`` is set (the device machine), else
``bench/results/``. Without CUDA it says so and exits 0; a failed correctness check exits 1.
Sections past the time budget are skipped and say so. ``llmopt`` need not be installed: the
source folders are mapped to its package names.

    python bench/kernels_gpu.py [--budget 270]
    python bench/kernels_gpu.py --cpu-dry-run   # tiny shapes under the Triton interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
import types
from dataclasses import replace
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(576, 576), (576, 1536), (1536, 576), (576, 49152), (4096, 4096), (4096, 14336), (14336, 4096)]  # (in, out)
ROWS = [1, 4, 16, 128]
ROTATE_BYTES = 256 << 20  # weights / KV cycled per timing: several times the H200's 60 MB L2
MIN_CALLS = 32  # calls per timed graph
REPEATS = 7  # timed graph replays; the median is reported
# (batch, context, heads, kv heads, head dim, KV cache kind: auto = float16, int8 / fp8 = quantized)
ATTENTION_SHAPES = [(1, 4096, 32, 8, 128, "auto"), (8, 4096, 32, 8, 128, "auto"), (32, 2048, 32, 8, 128, "auto"),
                    (64, 1024, 32, 8, 128, "auto"), (16, 1024, 9, 3, 64, "auto"), (8, 4096, 32, 8, 128, "int8"),
                    (8, 4096, 32, 8, 128, "fp8")]
TIMED_FORMATS = {"int4 g128": ("int4", 128, False), "int8": ("int8", None, False), "fp8": ("fp8", None, False)}
# name: (kind, group, asymmetric, activations) for the correctness sweep
CHECK_FORMATS = {
    "int4 g32": ("int4", 32, False, None),
    "int4 g64": ("int4", 64, False, None),
    "int4 g128": ("int4", 128, False, None),
    "int4 channel": ("int4", None, False, None),
    "int4 asym g32": ("int4", 32, True, None),
    "int4 asym g64": ("int4", 64, True, None),
    "int4 asym g128": ("int4", 128, True, None),
    "int4 asym channel": ("int4", None, True, None),
    "int4 g48": ("int4", 48, False, None),
    "int8": ("int8", None, False, None),
    "int8 asym g64": ("int8", 64, True, None),
    "fp8": ("fp8", None, False, None),
    "w8a8": ("int8", None, False, "int8"),
    "fp8 dynamic": ("fp8", None, False, "fp8"),
}
TOLERANCE = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 2e-5}  # max error / max |ref|
# engine benchmark models, random weights: name: (hidden, intermediate, layers, heads, kv heads, vocab)
ENGINE_MODELS = {"SmolLM2-135M shape": (576, 1536, 30, 9, 3, 49152), "Llama-3.2-1B shape": (2048, 8192, 16, 32, 8, 128256)}
ENGINE_SMALL = {"tiny": (64, 192, 2, 4, 2, 259)}


def import_llmopt() -> None:
    """Make ``llmopt`` importable from this checkout when it is not installed, mapping the
    package folders as pyproject does, without running the package ``__init__`` files (which
    pull in transformers)."""
    try:
        import llmopt.runtime.kernels  # noqa: F401
        return
    except ImportError:
        pass
    for name, folder in (("llmopt", "compress"), ("llmopt.quant", "quant"), ("llmopt.runtime", "runtime")):
        module = types.ModuleType(name)
        module.__path__ = [str(ROOT / folder)]
        sys.modules[name] = module


class Clock:
    """Deadline bookkeeping: sections past the budget are skipped."""

    def __init__(self, budget_s: float) -> None:
        self.start = time.time()
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.time() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------
# Timing.


def time_calls(torch, calls: list, device) -> tuple[float, str]:
    """Median microseconds per call of ``calls`` (each a no-argument function), cycled to
    ``MIN_CALLS``: a CUDA graph's replays when it can be captured, else an eager loop between
    events. Returns (microseconds, method)."""
    seq = [calls[i % len(calls)] for i in range(max(MIN_CALLS, len(calls)))]
    if device.type != "cuda":  # dry run: host clock
        for c in calls:
            c()
        t = time.perf_counter()
        for c in seq:
            c()
        return (time.perf_counter() - t) * 1e6 / len(seq), "host"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (and compilation) off the capture
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    run, method = None, "graph"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in seq:
                c()
        run = graph.replay
    except Exception as e:  # noqa: BLE001 - fall back to launching eagerly
        torch.cuda.synchronize()
        method = f"eager ({type(e).__name__})"

        def run() -> None:
            for c in seq:
                c()
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(seq))
    return statistics.median(times), method


def copy_bandwidth(torch, device) -> float:
    """GB/s of a large device-to-device copy, counting bytes read plus bytes written."""
    n = (1 << 30) if device.type == "cuda" else (1 << 20)
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    us, _ = time_calls(torch, [lambda: dst.copy_(src)], device)
    return 2 * n / (us * 1e-6) / 1e9


# ---------------------------------------------------------------------------------------------
# Correctness.


def random_weight(torch, kind: str, group: int | None, asym: bool, n: int, k: int, device):
    """Fresh random codes over the whole range (fp8: every finite code), scales, zero points."""
    n_groups = 1 if group is None else k // group
    if kind == "fp8":
        bits = torch.randint(0, 256, (n, k), dtype=torch.uint8, device=device)
        bits[(bits & 0x7F) == 0x7F] = 0x3C
        codes = bits.view(torch.float8_e4m3fn)
    else:
        lo, hi = (-8, 8) if kind == "int4" else (-128, 128)
        codes = torch.randint(lo, hi, (n, k), dtype=torch.int8, device=device)
    scale = torch.rand(n, n_groups, device=device) * 0.02 + 0.002
    zero = torch.randint(-8, 8, (n, n_groups), dtype=torch.int32, device=device) if asym else None
    return codes, scale, zero


def errors(torch, out, ref) -> dict:
    bad = int(torch.isnan(out).sum())
    diff = (out.double() - ref.double())
    return {
        "unwritten_or_nan": bad,
        "max_err_over_max_ref": float(diff.abs().max() / ref.abs().max().clamp(min=1e-30)),
        "rel_l2": float(diff.norm() / ref.double().norm().clamp(min=1e-30)),
    }


def check_in_features(group: int | None, small: bool) -> int:
    """In features for the sweep: odd per-channel, else whole groups (48: no tile divides it, so
    the kernel gathers scales per element; 1536 is not a multiple of 128 * 48)."""
    if group is None:
        return 333 if small else 999
    if group == 48:
        return 48 * (5 if small else 32)
    return group * 3 if small else 1536


def check_linears(torch, kernels, device, dtypes, clock: Clock, small: bool) -> list[dict]:
    reference, tlin = kernels.reference, kernels.triton_linear
    n = 203 if small else 1000  # not a multiple of any BLOCK_N
    plan = [(name, m, torch.float16, None) for name in CHECK_FORMATS for m in (1, 33)]
    plan += [(name, m, torch.float16, None) for name in ("int4 asym g128", "int8", "fp8") for m in (5, 16, 200)]
    plan += [(name, m, torch.float16, 3) for name in ("int4 g64", "fp8 dynamic") for m in (1, 17)]
    plan += [(name, m, dt, None) for dt in dtypes if dt != torch.float16 for name in ("int4 asym g128", "int4 g48", "fp8") for m in (1, 70)]
    results = []
    for name, m, dtype, split_k in plan:
        if clock.left() < 0:
            results.append({"kernel": "linear", "case": name, "skipped": "time budget"})
            continue
        kind, group, asym, act = CHECK_FORMATS[name]
        k = check_in_features(group, small)
        row = {"kernel": "linear", "case": name, "m": m, "n": n, "k": k, "dtype": str(dtype).split(".")[-1], "split_k": split_k}
        try:
            codes, scale, zero = random_weight(torch, kind, group, asym, n, k, device)
            packed = tlin.pack_weight(codes, scale, zero, group, 4 if kind == "int4" else 8)
            x = torch.randn(m, k, device=device).to(dtype)
            bias = torch.randn(n, device=device).to(dtype)
            out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
            tlin.triton_quant_linear(x, packed, act, bias, out=out, split_k=split_k)
            ref = reference.quant_linear(x.float(), codes, scale, zero, group, act, bias.float())
            row.update(errors(torch, out.float(), ref))
            row["ok"] = row["unwritten_or_nan"] == 0 and row["max_err_over_max_ref"] <= TOLERANCE[row["dtype"]]
        except Exception:  # noqa: BLE001 - record and go on
            row.update(ok=False, error=traceback.format_exc(limit=4))
        results.append(row)
        if not row["ok"]:
            log(f"  FAIL linear {row}")
    return results


def paged_inputs(torch, kernels, lens, heads, kv_heads, dim, block_size, dtype, device, kv: str = "auto", copies: int = 1):
    """A poisoned cache (NaN floats, or random codes with NaN scales) with each sequence's K/V
    in shuffled blocks, once per copy. Returns ``q, (k_cache, v_cache, k_scale, v_scale),
    width, sets``, a set being the reference's and the kernel's inputs for one copy."""
    reference, kv_quant = kernels.reference, kernels.kv_quant
    per_copy = sum(-(-n // block_size) for n in lens)
    num_blocks = per_copy * copies + 1
    shape = (kv_heads, num_blocks * block_size, dim)
    k_scale = v_scale = None
    if kv_quant.is_quantized(kv):
        storage = kv_quant.storage_dtype(kv, dtype)
        k_cache = torch.randint(-128 if storage == torch.int8 else 0, 128, shape, device=device).to(storage)
        v_cache = torch.randint(-128 if storage == torch.int8 else 0, 128, shape, device=device).to(storage)
        k_scale = torch.full(shape[:2], float("nan"), device=device)
        v_scale = torch.full(shape[:2], float("nan"), device=device)
    else:
        k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
        v_cache = torch.full_like(k_cache, float("nan"))
    width = max(lens)
    n_table = -(-width // block_size)
    order = torch.randperm(num_blocks - 1) + 1
    sets = []
    for c in range(copies):
        free = order[c * per_copy:(c + 1) * per_copy].tolist()
        tables = torch.zeros(len(lens), n_table, dtype=torch.long)
        slots = []
        for i, n in enumerate(lens):
            used = -(-n // block_size)
            tables[i, :used] = torch.tensor([free.pop() for _ in range(used)])
            slots.append((tables[i, :used, None] * block_size + torch.arange(block_size)).flatten()[:n])
        slots = torch.cat(slots).to(device)
        total = slots.numel()
        reference.write_kv(k_cache, v_cache, torch.randn(total, kv_heads, dim, device=device).to(dtype),
                           torch.randn(total, kv_heads, dim, device=device).to(dtype), slots, k_scale, v_scale)
        rows = reference.block_rows(tables, kv_heads, num_blocks).to(device)
        mask = None
        if min(lens) != width:
            visible = torch.arange(n_table * block_size)[None, :] < torch.tensor(lens)[:, None]
            mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))[:, None, None, :].to(device)
        sets.append((rows, mask, tables.to(device=device, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32, device=device)))
    q = torch.randn(len(lens), heads, dim, device=device).to(dtype)
    return q, (k_cache, v_cache, k_scale, v_scale), width, sets


def workspace(torch, reference, n: int, dtype, device):
    """A reference workspace already holding ``n`` elements on ``device`` (it grows on the CPU)."""
    ws = reference.Workspace(dtype)
    ws.buffer = torch.empty(n, dtype=dtype, device=device)
    return ws


def check_attention(torch, kernels, device, dtypes, clock: Clock, small: bool) -> list[dict]:
    reference, tatt = kernels.reference, kernels.triton_attention
    cases = [  # (lengths, heads, kv heads, head dim, block size, partitions, KV cache kind)
        ([1, 37, 150], 6, 2, 48, 16, None, "auto"),
        ([70, 37, 150], 6, 2, 48, 8, 3, "auto"),
        ([100, 100], 4, 4, 64, 16, None, "auto"),
        ([129, 5], 8, 2, 64, 32, 4, "auto"),
        ([200], 9, 3, 64, 16, 2, "auto"),
        ([70, 37, 150], 6, 2, 48, 8, 3, "int8"),
        ([129, 5], 8, 2, 64, 32, 4, "fp8"),
    ]
    if not small:
        cases += [
            ([3000, 17, 1024, 2500], 32, 8, 128, 16, None, "auto"),  # long contexts: automatic split
            ([777] * 3, 28, 4, 128, 16, 1, "auto"),  # GQA 7, unsplit
            ([4096], 64, 8, 128, 16, None, "auto"),  # one long sequence, GQA 8
            ([513, 2049], 40, 40, 80, 16, None, "auto"),  # MHA, head dim 80
            ([3000, 17, 1024, 2500], 32, 8, 128, 16, None, "int8"),
            ([3000, 17, 1024, 2500], 32, 8, 128, 16, None, "fp8"),
        ]
    results = []
    for dtype in dtypes:
        for lens, heads, kv_heads, dim, block_size, parts, kv in cases:
            if clock.left() < 0:
                results.append({"kernel": "attention", "case": str(lens), "skipped": "time budget"})
                continue
            row = {"kernel": "attention", "dtype": str(dtype).split(".")[-1],
                   "case": f"lens={lens} heads={heads}/{kv_heads} dim={dim} block={block_size} parts={parts} kv={kv}"}
            try:
                q, (k_cache, v_cache, k_scale, v_scale), width, sets = paged_inputs(
                    torch, kernels, lens, heads, kv_heads, dim, block_size, dtype, device, kv)
                rows, mask, tables, context_lens = sets[0]
                out = torch.full((len(lens), heads * dim), float("nan"), dtype=dtype, device=device)
                tatt.triton_paged_decode_attention(q, k_cache, v_cache, tables, context_lens, block_size, dim ** -0.5,
                                                   k_scale, v_scale, out=out, num_parts=parts)
                n_ws = rows.numel() * block_size * dim
                if k_scale is None:  # the reference in float32: a float cache upcast, a quantized one dequantized to float32
                    k_cache, v_cache = k_cache.float(), v_cache.float()
                ref = reference.paged_decode_attention(
                    q.float(), k_cache, v_cache, rows, width, None if mask is None else mask.float(),
                    block_size, dim ** -0.5, workspace(torch, reference, n_ws, k_cache.dtype, device),
                    workspace(torch, reference, n_ws, k_cache.dtype, device), k_scale, v_scale)
                row.update(errors(torch, out.float(), ref))
                row["ok"] = row["unwritten_or_nan"] == 0 and row["max_err_over_max_ref"] <= TOLERANCE[row["dtype"]]
            except Exception:  # noqa: BLE001
                row.update(ok=False, error=traceback.format_exc(limit=4))
            results.append(row)
            if not row["ok"]:
                log(f"  FAIL attention {row}")
    return results


# ---------------------------------------------------------------------------------------------
# Timings.


def time_linears(torch, kernels, device, shapes, rows, clock: Clock, copy_gbps: float, rotate: int) -> list[dict]:
    import torch.nn.functional as F

    tlin = kernels.triton_linear
    from llmopt.formats.schemes import effective_group_size

    dtype = torch.float16
    results = []
    for k, n in shapes:
        if clock.left() < 0:
            results.append({"shape": f"{k}->{n}", "skipped": "time budget"})
            continue
        weights: dict[str, list] = {}
        base = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        weights["fp16"] = [base] + [base.clone() for _ in range(copies_for(n * k * 2, rotate) - 1)]
        groups = {}
        for name, (kind, group, asym) in TIMED_FORMATS.items():
            group = groups[name] = effective_group_size(k, group)  # 576 inputs: g64, as the quantizer picks
            codes, scale, zero = random_weight(torch, kind, group, asym, n, k, device)
            packed = tlin.pack_weight(codes, scale, zero, group, 4 if kind == "int4" else 8)
            del codes
            weights[name] = [packed] + [clone_packed(torch, packed) for _ in range(copies_for(packed.nbytes(), rotate) - 1)]
        for m in rows:
            if clock.left() < 0:
                results.append({"shape": f"{k}->{n}", "m": m, "skipped": "time budget"})
                continue
            x = torch.randn(m, k, device=device, dtype=dtype)
            out = torch.empty(m, n, device=device, dtype=dtype)
            row = {"shape": f"{k}->{n}", "in": k, "out": n, "m": m, "int4 group": groups["int4 g128"]}
            io_bytes = (m * k + m * n) * 2
            for name, ws in weights.items():
                try:
                    if name == "fp16":
                        calls = [partial(F.linear, x, w) for w in ws]
                        wbytes = n * k * 2
                    else:
                        calls = [partial(tlin.triton_quant_linear, x, w, None, None, out=out) for w in ws]
                        wbytes = ws[0].nbytes()
                        cfg = tlin.choose_config(m, ws[0], device)
                        row[f"{name} config"] = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} split{cfg.split_k}"
                    us, method = time_calls(torch, calls, device)
                    gbps = (wbytes + io_bytes) / (us * 1e-6) / 1e9
                    row[name] = {"us": round(us, 2), "GB/s": round(gbps, 1), "of_copy": round(gbps / copy_gbps, 3),
                                 "TFLOP/s": round(2 * m * n * k / (us * 1e-6) / 1e12, 2), "timing": method, "copies": len(ws)}
                except Exception:  # noqa: BLE001
                    row[name] = {"error": traceback.format_exc(limit=4)}
            results.append(row)
            log("  " + linear_line(row))
        del weights, base
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def copies_for(nbytes: int, rotate: int) -> int:
    """Copies of ``nbytes`` that together hold ``rotate`` bytes (at most 1024)."""
    return max(1, min(1024, -(-rotate // max(1, nbytes))))


def clone_packed(torch, w):
    return replace(w, data=w.data.clone(), scale=w.scale.clone(), zero=None if w.zero is None else w.zero.clone())


def time_attention(torch, kernels, device, shapes, clock: Clock, copy_gbps: float, rotate: int) -> list[dict]:
    reference, tatt = kernels.reference, kernels.triton_attention
    dtype, block_size = torch.float16, 16
    results = []
    for batch, ctx, heads, kv_heads, dim, kv in shapes:
        if clock.left() < 0:
            results.append({"shape": f"B={batch} ctx={ctx} kv={kv}", "skipped": "time budget"})
            continue
        row = {"batch": batch, "context": ctx, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "block_size": block_size, "kv": kv}
        element = 2 if kv == "auto" else 1
        kv_bytes = batch * ctx * kv_heads * (dim * element + (0 if kv == "auto" else 4)) * 2  # K and V (codes and scales)
        try:
            copies = min(32, copies_for(kv_bytes, rotate))
            q, (k_cache, v_cache, k_scale, v_scale), width, sets = paged_inputs(
                torch, kernels, [ctx] * batch, heads, kv_heads, dim, block_size, dtype, device, kv, copies)
            scale = dim ** -0.5
            out = torch.empty(batch, heads * dim, dtype=dtype, device=device)
            parts = tatt.choose_parts(batch, kv_heads, ctx, device)
            row["parts"] = parts
            calls = [partial(tatt.triton_paged_decode_attention, q, k_cache, v_cache, t, c, block_size, scale, k_scale, v_scale,
                             out=out, max_context=width)
                     for _, _, t, c in sets]
            n_ws = sets[0][0].numel() * block_size * dim
            k_ws, v_ws = (workspace(torch, reference, n_ws, k_cache.dtype, device) for _ in range(2))
            ref_calls = [partial(reference.paged_decode_attention, q, k_cache, v_cache, r, width, mk, block_size, scale, k_ws, v_ws,
                                 k_scale, v_scale)
                         for r, mk, _, _ in sets]
            for name, fns in (("triton", calls), ("reference", ref_calls)):
                us, method = time_calls(torch, fns, device)
                gbps = kv_bytes / (us * 1e-6) / 1e9
                row[name] = {"us": round(us, 2), "GB/s": round(gbps, 1), "of_copy": round(gbps / copy_gbps, 3), "timing": method,
                             "copies": len(fns)}
            del calls, ref_calls, k_cache, v_cache, k_scale, v_scale, sets
        except Exception:  # noqa: BLE001
            row["error"] = traceback.format_exc(limit=4)
        results.append(row)
        log("  " + attention_line(row))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


# ---------------------------------------------------------------------------------------------
# The whole engine.


def engine_checkpoints(torch, folder: Path, shape: tuple, small: bool) -> dict[str, Path]:
    """A random Llama of ``shape`` saved dense and as W4A16 (g128; g32 when small) compressed-tensors."""
    from llmopt.formats.compressed import save_compressed
    from llmopt.formats.schemes import QuantizedWeight, compute_qparams, effective_group_size, get_scheme
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, kv_heads, vocab = shape
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder / "float")
    scheme = get_scheme("W4A16", 32 if small else 128)
    weights = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            group = effective_group_size(module.in_features, scheme.group_size)
            scale, zero = compute_qparams(module.weight.data, scheme, group)
            weights[name] = QuantizedWeight.from_weight(module.weight.data, scheme, group, scale, zero)
    save_compressed(model, None, folder / "w4a16", weights, ["lm_head"])
    return {"float": folder / "float", "W4A16": folder / "w4a16"}


def greedy_tokens(engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    from llmopt.runtime.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[i] for i in ids]


def time_engine(torch, device, clock: Clock, small: bool) -> list[dict]:
    """Section 5: per model and format, the Triton backend and the reference backend on ``device``."""
    import random
    import tempfile

    from llmopt.runtime.bench import make_workload, serving, single_stream
    from llmopt.runtime.engine import LLMEngine

    models = ENGINE_SMALL if small else ENGINE_MODELS
    pp, tg, reps, requests, n_check = (16, 8, 1, 4, 6) if small else (512, 128, 5, 64, 32)
    settings = {"device": str(device), "dtype": "float32" if small else "float16", "max_model_len": 1024,
                "max_num_seqs": 64, "max_num_batched_tokens": 512 if small else 2048, "kv_cache_gib": 0.05 if small else 16.0}
    no_tokenizer = types.SimpleNamespace(eos_token_id=None)  # token-id prompts only
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in models.items():
            if clock.left() < (20 if small else 150):
                results.append({"model": name, "skipped": "time budget"})
                continue
            try:
                paths = engine_checkpoints(torch, Path(tmp) / name.replace(" ", "_"), shape, small)
            except Exception:  # noqa: BLE001 - e.g. transformers missing on the machine
                results.append({"model": name, "error": traceback.format_exc()[-600:]})
                continue
            rng = random.Random(0)
            prompts = [[rng.randrange(3, shape[5]) for _ in range(rng.randint(8, 64))] for _ in range(n_check)]
            for fmt, path in paths.items():
                row, tokens = {"model": name, "format": fmt}, {}
                for kernels in ("triton", "reference"):
                    engine = None
                    try:
                        engine = LLMEngine(path, tokenizer=no_tokenizer, kernels=kernels, **settings)
                        tokens[kernels] = greedy_tokens(engine, prompts, 16)
                        figures = single_stream(engine, pp, tg, reps)
                        workload = make_workload(requests, (32, 512) if not small else (4, 16), (32, 256) if not small else (2, 8),
                                                 shape[5], seed=0)
                        figures["serving"] = serving(engine, workload)
                        row[kernels] = figures
                    except Exception:  # noqa: BLE001 - reported in the row, the other runs go on
                        row[kernels] = {"error": traceback.format_exc()[-600:]}
                    del engine
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                if len(tokens) == 2:
                    pairs = [(a, b) for x, y in zip(tokens["triton"], tokens["reference"]) for a, b in zip(x, y)]
                    row["greedy_agreement"] = sum(a == b for a, b in pairs) / len(pairs)
                    row["greedy_sequences_equal"] = sum(x == y for x, y in zip(tokens["triton"], tokens["reference"]))
                    row["greedy_sequences"] = len(prompts)
                results.append(row)
                log(engine_line(row, pp, tg))
    return results


# ---------------------------------------------------------------------------------------------
# Report.


def cell(entry) -> str:
    if not isinstance(entry, dict):
        return "-"
    if "error" in entry:
        return "error"
    return f"{entry['us']:.1f} µs, {entry['GB/s']:.0f} GB/s ({100 * entry['of_copy']:.0f}%)"


def linear_line(row: dict) -> str:
    if "skipped" in row:
        return f"{row['shape']} m={row.get('m', '*')}: skipped ({row['skipped']})"
    names = ["fp16", *TIMED_FORMATS]
    return f"{row['shape']:>12} m={row['m']:<4}" + " | ".join(f"{nm}: {cell(row.get(nm))}" for nm in names)


def attention_line(row: dict) -> str:
    if "skipped" in row:
        return f"{row['shape']}: skipped ({row['skipped']})"
    head = f"B={row['batch']} ctx={row['context']} heads={row['heads']}/{row['kv_heads']} dim={row['head_dim']} kv={row['kv']}"
    if "error" in row:
        return f"{head}: error"
    return f"{head} parts={row['parts']}: triton {cell(row['triton'])} | reference {cell(row['reference'])}"


def speedup(row: dict, name: str) -> str:
    a, b = row.get("fp16"), row.get(name)
    if not (isinstance(a, dict) and isinstance(b, dict) and "us" in a and "us" in b):
        return "-"
    return f"{a['us'] / b['us']:.2f}x"


def engine_figure(row: dict, kernels: str, key: str) -> str:
    entry = row.get(kernels)
    if not isinstance(entry, dict):
        return "-"
    if "error" in entry:
        return "error"
    value = entry["serving"].get(key) if key.startswith(("output", "ttft", "tpot")) else entry.get(key)
    if value is None:
        return "-"
    return f"{value * 1000:.1f} ms" if key.endswith("_s") and not key.endswith("tok_s") else f"{value:.1f}"


def engine_line(row: dict, pp: int, tg: int) -> str:
    if "skipped" in row or "error" in row:
        return f"engine {row['model']}: {row.get('skipped') or 'error ' + row['error'][-200:]}"
    figures = " | ".join(f"{k}: pp {engine_figure(row, k, f'pp{pp}_tok_s')} tg {engine_figure(row, k, f'tg{tg}_tok_s')} "
                         f"serving {engine_figure(row, k, 'output_tok_s')} tok/s" for k in ("triton", "reference"))
    return f"engine {row['model']} {row['format']}: {figures}; greedy agreement {row.get('greedy_agreement', '-')}"


def markdown(result: dict) -> str:
    lines = [
        "# Triton kernels on the GPU",
        "",
        (f"{result['device']} · torch {result['torch']} · triton {result['triton']} · {result['wall_s']:.0f} s. "
         f"Copy bandwidth {result['copy_GBps']:.0f} GB/s (read + written); percentages below are of it. "
         "Times are medians of CUDA-graph replays over weights (KV) cycled past the L2."),
        "",
    ]
    checks = result["correctness"]
    failed = [c for c in checks if c.get("ok") is False]
    skipped = [c for c in checks if "skipped" in c]
    lines += [f"## Correctness: {len(checks) - len(failed) - len(skipped)} passed, {len(failed)} failed, {len(skipped)} skipped", ""]
    if checks:
        worst = max((c for c in checks if "max_err_over_max_ref" in c), key=lambda c: c["max_err_over_max_ref"], default=None)
        if worst is not None:
            lines.append(f"Largest error (max |out - ref| / max |ref|): {worst['max_err_over_max_ref']:.2e} "
                         f"({worst['kernel']} {worst['case']} {worst['dtype']}).")
        for c in failed:
            lines.append(f"- FAILED {c['kernel']} {c['case']} {c.get('dtype', '')} m={c.get('m', '')}: "
                         f"{c.get('max_err_over_max_ref', c.get('error', '')[-300:])}")
        lines.append("")
    lines += ["## Quantized linear (float16 activations)", "",
              ("int4 is g128 where 128 divides the input features, else the largest power of two that does "
               "(g64 for 576), as the quantizer picks."), "",
              "| in → out | M | fp16 F.linear | int4 g128 | int8 | fp8 | int4 / int8 / fp8 speedup vs fp16 |",
              "| --- | ---: | --- | --- | --- | --- | --- |"]
    for row in result["linear"]:
        if "skipped" in row:
            lines.append(f"| {row['shape']} | {row.get('m', '*')} | skipped ({row['skipped']}) | | | | |")
            continue
        speeds = " / ".join(speedup(row, nm) for nm in TIMED_FORMATS)
        lines.append(f"| {row['shape']} | {row['m']} | {cell(row.get('fp16'))} | {cell(row.get('int4 g128'))} | "
                     f"{cell(row.get('int8'))} | {cell(row.get('fp8'))} | {speeds} |")
    lines += ["", "## Paged decode attention (float16 queries, block size 16, every sequence at the full context)", "",
              "| batch | context | heads / kv | head dim | KV cache | parts | triton | reference (gather + SDPA) | speedup |",
              "| ---: | ---: | --- | ---: | --- | ---: | --- | --- | --- |"]
    for row in result["attention"]:
        if "skipped" in row or "error" in row:
            lines.append(f"| {row.get('batch', '')} | {row.get('context', '')} | {row.get('skipped', 'error')} | | | | | | |")
            continue
        sp = row["reference"]["us"] / row["triton"]["us"]
        kv = "float16" if row["kv"] == "auto" else row["kv"]
        lines.append(f"| {row['batch']} | {row['context']} | {row['heads']} / {row['kv_heads']} | {row['head_dim']} | {kv} | {row['parts']} | "
                     f"{cell(row['triton'])} | {cell(row['reference'])} | {sp:.2f}x |")
    lines += ["", ("GB/s counts the bytes a kernel must move: packed weights with scales (zero points), input and output "
                   "for linears; the K and V read (codes and scales) for attention."), ""]
    pp, tg = result.get("engine_pp", 512), result.get("engine_tg", 128)
    lines += ["## The engine on the GPU (random weights, float16 activations)", "",
              (f"Single stream pp{pp} / tg{tg} (median tok/s), serving {result.get('engine_requests', '')} requests "
               "(output tok/s, TTFT / TPOT p50); triton: the Triton backend, reference: plain torch on the same GPU. "
               "Greedy agreement: share of equal tokens of the two backends on the same prompts."), "",
              "| model | weights | backend | pp tok/s | tg tok/s | serving tok/s | TTFT p50 | TPOT p50 | greedy agreement |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in result.get("engine", []):
        if "skipped" in row or "error" in row:
            lines.append(f"| {row['model']} | | {row.get('skipped', 'error')} | | | | | | |")
            continue
        for k in ("triton", "reference"):
            lines.append(f"| {row['model']} | {row['format']} | {k} | {engine_figure(row, k, f'pp{pp}_tok_s')} | "
                         f"{engine_figure(row, k, f'tg{tg}_tok_s')} | {engine_figure(row, k, 'output_tok_s')} | "
                         f"{engine_figure(row, k, 'ttft_p50_s')} | {engine_figure(row, k, 'tpot_p50_s')} | "
                         f"{row.get('greedy_agreement', '-') if k == 'triton' else ''} |")
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=270.0, help="seconds after which remaining sections are skipped")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    args = parser.parse_args()
    if args.cpu_dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if not args.cpu_dry_run and not torch.cuda.is_available():
        log("kernels_gpu: no CUDA device on this machine; nothing to measure (run it on a GPU machine).")
        return 0
    try:
        import triton
    except ImportError:
        log("kernels_gpu: triton is not installed; the Triton kernels cannot run (pip install triton).")
        return 1
    import_llmopt()
    from llmopt.runtime.kernels import (
        kv_quant,
        reference,
        triton_attention,
        triton_linear,
    )

    kernels = types.SimpleNamespace(reference=reference, kv_quant=kv_quant, triton_linear=triton_linear, triton_attention=triton_attention)
    clock = Clock(args.budget)
    torch.manual_seed(0)
    small = args.cpu_dry_run
    device = torch.device("cpu" if small else "cuda")
    name = "CPU (Triton interpreter dry run)" if small else torch.cuda.get_device_name(device)
    dtypes = [torch.float16, torch.bfloat16]
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"device": name, "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
              "multiprocessors": None if small else torch.cuda.get_device_properties(device).multi_processor_count,
              "correctness": [], "linear": [], "attention": [], "engine": [], "copy_GBps": 0.0, "wall_s": 0.0}

    def save() -> None:
        result["wall_s"] = clock.elapsed()
        (out_dir / "kernels_gpu.json").write_text(json.dumps(result, indent=1) + "\n")
        (out_dir / "kernels_gpu.md").write_text(markdown(result))

    log(f"kernels_gpu on {name}: torch {torch.__version__}, triton {triton.__version__}")
    log("correctness: linear ...")
    result["correctness"] += check_linears(torch, kernels, device, dtypes, clock, small)
    log(f"correctness: attention ... ({clock.elapsed():.0f} s)")
    result["correctness"] += check_attention(torch, kernels, device, dtypes, clock, small)
    failed = [c for c in result["correctness"] if c.get("ok") is False]
    log(f"correctness: {len(result['correctness']) - len(failed)} of {len(result['correctness'])} ok ({clock.elapsed():.0f} s)")
    save()
    result["copy_GBps"] = copy_bandwidth(torch, device)
    log(f"copy bandwidth: {result['copy_GBps']:.0f} GB/s")
    shapes = [(96, 203), (256, 64)] if small else SHAPES
    rows = [1, 17] if small else ROWS
    log("linear timings (median µs per call, GB/s, share of copy bandwidth):")
    rotate = (1 << 16) if small else ROTATE_BYTES
    result["linear"] = time_linears(torch, kernels, device, shapes, rows, clock, result["copy_GBps"], rotate)
    save()
    log("attention timings:")
    att_shapes = [(2, 100, 8, 2, 64, "auto"), (2, 100, 8, 2, 64, "int8")] if small else ATTENTION_SHAPES
    result["attention"] = time_attention(torch, kernels, device, att_shapes, clock, result["copy_GBps"], rotate)
    save()
    log("engine (Triton backend against the reference backend):")
    result.update(engine_pp=16 if small else 512, engine_tg=8 if small else 128, engine_requests=4 if small else 64)
    result["engine"] = time_engine(torch, device, clock, small)
    save()
    log(f"wrote {out_dir / 'kernels_gpu.json'} and .md in {clock.elapsed():.0f} s")
    if failed:
        log(f"{len(failed)} correctness checks FAILED")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
