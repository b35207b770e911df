"""Compile every Triton kernel variant the wrappers can launch for a CUDA target, without a GPU.

Triton's front end, LLVM and the ptxas bundled with its wheel run on any x86-64 machine, so
compile-mode errors (which the CPU interpreter of the tests cannot see) and shared-memory
overruns show up here before a GPU is at hand. Prints each variant's shared memory and whether
its PTX uses mma / wgmma; exits 1 if any variant fails to compile.

    python bench/kernels_compile_check.py [--arch 90] [--quick] [--only SUBSTRING]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # compile for real: kernels must be JIT functions

SHARED_LIMIT = 227 * 1024  # usable shared memory per block on Hopper


def linear_variants(tlin, quick: bool):
    kernel = tlin._dequant_matmul_kernel
    configs = [(16, 64, 128, 4, 4), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3)]  # choose_config's tiles
    kinds = [(0, "u8"), (1, "i8"), (2, "u8")]
    dtypes = ["fp16"] if quick else ["fp16", "bf16", "fp32"]
    modes = [(False, 1, False), (True, 1, True), (True, 0, False), (False, 2, True)]  # (zero, group mode, split)
    for (bm, bn, bk, warps, stages), (kind, wdt), xdt, (zero, mode, split) in itertools.product(configs, kinds, dtypes, modes):
        if xdt != "fp16" and (zero, mode) != (True, 1):
            continue
        sig = {"x_ptr": f"*{xdt}", "w_ptr": f"*{wdt}", "scale_ptr": "*fp32", "zero_ptr": "*fp32", "bias_ptr": f"*{xdt}",
               "out_ptr": f"*{xdt}", "part_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "group_size": "i32",
               "tiles_per_split": "i32", "stride_xm": "i32", "stride_xk": "i32", "stride_wk": "i32", "stride_om": "i32",
               "stride_on": "i32"}
        consts = {"KIND": kind, "HAS_ZERO": zero, "HAS_BIAS": not split, "GROUP_MODE": mode, "SPLIT": split,
                  "DOT_F32": xdt == "fp32", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
        yield f"linear kind={kind} {xdt} zero={int(zero)} mode={mode} split={int(split)} {bm}x{bn}x{bk}", kernel, sig, consts, warps, stages
    for xdt in ["fp16", "bf16"]:
        sig = {"part_ptr": "*fp32", "bias_ptr": f"*{xdt}", "out_ptr": f"*{xdt}", "M": "i32", "N": "i32", "SPLITS": "i32",
               "stride_om": "i32", "stride_on": "i32"}
        yield f"split sum {xdt}", tlin._split_sum_kernel, sig, {"HAS_BIAS": True, "BLOCK": 1024}, 4, 3


def attention_variants(tatt, quick: bool):
    dtypes = ["fp16"] if quick else ["fp16", "bf16", "fp32"]
    heads = [(4, 128), (3, 64)] if quick else [(4, 128), (3, 64), (1, 80), (8, 128)]  # (query heads per KV head, head dim)
    kv_kinds = [(0, None), (1, "i8"), (2, "u8"), (3, "u8")]  # float cache, int8 codes, float8 codes as bytes, int4 pairs
    for dt, (group, dim), split, (kv_kind, kv_dt) in itertools.product(dtypes, heads, [False, True], kv_kinds):
        if kv_kind and (dt == "fp32" or split):
            continue
        cache = f"*{kv_dt or dt}"
        scale_dt = {0: cache, 3: "*fp16"}.get(kv_kind, "*fp32")
        sig = {"q_ptr": f"*{dt}", "k_ptr": cache, "v_ptr": cache, "k_scale_ptr": scale_dt, "v_scale_ptr": scale_dt,
               "tables_ptr": "*i32", "lens_ptr": "*i32", "out_ptr": f"*{dt}",
               "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_o_ptr": "*fp32", "sink_k_ptr": "*fp32", "sink_v_ptr": "*fp32",
               "sink_index_ptr": "*i64", "sink_entries": "i32", "offsets_ptr": "*fp16", "offset_rows": "i32",
               "qk_scale": "fp32", "tokens_per_part": "i32",
               "block_size": "i32", "num_parts": "i32", "stride_qb": "i32", "stride_qh": "i32", "stride_kh": "i32",
               "stride_kt": "i32", "stride_vh": "i32", "stride_vt": "i32", "stride_sh": "i32", "stride_tb": "i32",
               "stride_ob": "i32"}
        consts = {"GROUP": group, "HEAD_DIM": dim, "KV_KIND": kv_kind, "SPLIT": split, "DOT_F32": dt == "fp32", "BLOCK_G": 16,
                  "BLOCK_D": max(16, 1 << (dim - 1).bit_length()), "BLOCK_T": tatt.BLOCK_T, "INT4_GROUP": 32,
                  "SINK_TOKENS": 1 if kv_kind == 3 else 0, "HAS_OFFSETS": kv_kind == 3}  # an int4 cache: sinks, key offsets
        name = f"attention {dt} group={group} dim={dim} split={int(split)} kv={'int4' if kv_kind == 3 else kv_dt or dt}"
        yield name, tatt._paged_decode_kernel, sig, consts, 4, 2
    for dt in ["fp16", "bf16"]:
        sig = {"part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_o_ptr": "*fp32", "out_ptr": f"*{dt}", "num_parts": "i32",
               "stride_ob": "i32"}
        yield f"combine parts {dt}", tatt._combine_parts_kernel, sig, {"HEAD_DIM": 128, "BLOCK_P": 8, "BLOCK_D": 128}, 4, 3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for H100/H200")
    parser.add_argument("--quick", action="store_true", help="float16 variants only")
    parser.add_argument("--only", default="", help="compile only variants whose name contains this")
    args = parser.parse_args()
    import triton
    from llmopt.runtime.kernels import triton_attention, triton_linear
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", args.arch, 32)
    failures = 0
    variants = itertools.chain(linear_variants(triton_linear, args.quick), attention_variants(triton_attention, args.quick))
    for name, kernel, sig, consts, warps, stages in variants:
        if args.only not in name:
            continue
        start = time.time()
        try:
            signature = {**sig, **{k: "constexpr" for k in consts}}
            compiled = triton.compile(ASTSource(kernel, signature, consts), target=target,
                                      options={"num_warps": warps, "num_stages": stages})
            shared = compiled.metadata.shared
            ptx = compiled.asm["ptx"]
            mma = "wgmma" if "wgmma" in ptx else "mma" if "mma.sync" in ptx else "-"
            over = shared > SHARED_LIMIT
            failures += over
            print(f"{'FAIL' if over else 'ok  '} {name:58s} {time.time() - start:5.1f} s  shared {shared:>6}  {mma}", flush=True)
        except Exception as e:  # noqa: BLE001 - report every variant
            failures += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:1500]}", flush=True)
    print(f"triton {triton.__version__}, sm_{args.arch}: {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
