"""Where the int4 KV cache's error comes from, and what other layouts would leave (demo model).

Every variant runs the engine's forward on a float32 cache in the int4 cache's basis (the
Hadamard rotation, key scales and per-block key offsets the int4 engine calibrated) and rounds K
and/or V as written (quantize, then dequantize; keys less their offset, added back): the same arithmetic as storing codes, so layouts the
kernels do not have can be measured. Variants: the engine's layout with its attention sink (the
first token of each window in float32; checked against the int4 engine itself), int4_g16's with
it, then without sinks: the engine's layout (asymmetric int4 with a float16 (scale, minimum) pair
per 32 values), keys only, values only, one float32 pair per token and head (the layout before
groups), a pair per 16 values, keys per channel over blocks of 16 tokens (KIVI's layout; decode steps, which write one
token, fall back to the engine's), and int8 keys with int4 values. Then the int4 engine itself
with the key scales' power (``runtime.kv_cache.KEY_SCALE_POWER``) swept, 0 being no key scales. KL divergence to the
float cache on WikiText-2, ``--windows`` × ``--window`` tokens (chunks of 64, the last 64 as
decode steps), as in ``bench/kv_cache.py``.

Results: ``bench/results/kv_int4_error.{json,md}``.

    python bench/kv_int4_error.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))
from kv_cache import engine_for, engine_with_key_scale_power, forced_logits, log  # noqa: E402

Rounding = Callable[[torch.Tensor], torch.Tensor]
POWERS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3)


def asymmetric_int4(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` rounded to asymmetric int4 per ``group`` values of its last dimension, float32 pairs."""
    grouped = x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)
    low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    step = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    return (((grouped - low) / step).round().clamp(0, 15) * step + low).reshape(x.shape)


def engine_int4(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the int4 cache stores it (``kv_quant``: float16 pairs per group of 32)."""
    from llmopt.runtime.kernels import kv_quant

    return kv_quant.dequantize(*kv_quant.quantize(x, "int4"), torch.float32)


def int8_tokens(x: torch.Tensor) -> torch.Tensor:
    from llmopt.runtime.kernels import kv_quant

    return kv_quant.dequantize(*kv_quant.quantize(x, "int8"), torch.float32)


def int4_channels(x: torch.Tensor, tokens: int, fallback: Rounding) -> torch.Tensor:
    """``x`` ``[T, kv_heads, head_dim]`` rounded per channel over runs of ``tokens`` tokens
    (``fallback`` when ``T`` is not a multiple of it: a decode step's single token)."""
    count = x.shape[0]
    if count % tokens:
        return fallback(x)
    runs = x.float().reshape(count // tokens, tokens, *x.shape[1:]).movedim(1, -1)  # [runs, heads, dim, tokens]
    return asymmetric_int4(runs, tokens).movedim(-1, 1).reshape(x.shape)


def engine_int4_g16(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the ``int4_g16`` cache stores it (float16 pairs per group of 16)."""
    from llmopt.runtime.kernels import kv_quant

    return kv_quant.dequantize(*kv_quant.quantize(x, "int4_g16"), torch.float32)


SINK_ROWS = {  # variants whose first token stays float32, as the engine's attention sinks
    "keys and values, the engine's layout, the first token in float32 (the engine's sinks)",
    "keys and values, a pair per 16 values (int4_g16), the first token in float32",
}


def variants(head_dim: int) -> dict[str, tuple[Rounding | None, Rounding | None]]:
    """Name → (keys' rounding, values' rounding); None keeps float."""
    return {
        "keys and values, the engine's layout, the first token in float32 (the engine's sinks)": (engine_int4, engine_int4),
        "keys and values, a pair per 16 values (int4_g16), the first token in float32": (engine_int4_g16, engine_int4_g16),
        "keys and values, the engine's layout (a float16 pair per 32 values)": (engine_int4, engine_int4),
        "keys only, the engine's layout": (engine_int4, None),
        "values only, the engine's layout": (None, engine_int4),
        "keys and values, one float32 pair per token and head": (partial(asymmetric_int4, group=head_dim),) * 2,
        "keys and values, a pair per 16 values": (partial(asymmetric_int4, group=16),) * 2,
        "keys per channel over 16 tokens, values in the engine's layout": (
            partial(int4_channels, tokens=16, fallback=engine_int4), engine_int4),
        "keys int8, values in the engine's layout": (int8_tokens, engine_int4),
    }


def simulating_engine(int4_engine):
    """A float32-cache engine in ``int4_engine``'s basis, K/V written through the reference step;
    the int4 cache's key offsets kept aside (``engine.int4_offsets``) for :func:`round_on_store`."""
    from llmopt.runtime.backends import Backend

    engine = engine_for("auto", True, max_num_seqs=1, max_model_len=int4_engine.max_model_len)
    engine.backend.rope_and_store = partial(Backend.rope_and_store, engine.backend)  # no fused float32 write
    source = int4_engine.cache
    engine.cache.rotation, engine.cache.key_scale = source.rotation, source.key_scale
    engine.int4_offsets = source.k_offsets
    return engine


def round_on_store(engine, keys: Rounding | None, values: Rounding | None, sink: bool = False) -> dict:
    """Make ``engine``'s cache write K / V rounded by ``keys`` / ``values`` (keys less their block's
    offset, added back after rounding, as the int4 kernels read them), the first token of each
    window unrounded when ``sink``. Returns the per-layer count of tokens written, which the
    caller clears at the start of each window."""
    from llmopt.runtime.kernels.reference import write_kv

    cache = engine.cache
    written: dict[int, int] = {}

    def store(index, k, v, slots, sink_writes=None, key_blocks=None):
        offsets = engine.int4_offsets[index]
        offset = 0 if offsets is None else offsets.index_select(1, key_blocks).transpose(0, 1).to(k.dtype)
        rounded_k = keys(k - offset).to(k.dtype) + offset if keys else k
        rounded_v = values(v).to(v.dtype) if values else v
        if sink and written.get(index, 0) == 0:
            rounded_k, rounded_v = torch.cat([k[:1], rounded_k[1:]]), torch.cat([v[:1], rounded_v[1:]])
        written[index] = written.get(index, 0) + k.shape[0]
        write_kv(cache.k[index], cache.v[index], rounded_k, rounded_v, slots)

    cache.store = store
    return written


def kld(base: list[torch.Tensor], other: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([(b.exp() * (b - o)).sum(-1) for b, o in zip(base, other)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from llmopt.core.data import load_text, tokenize_documents

    start = time.perf_counter()
    chunk, decode = 64, 64
    float_engine = engine_for("auto", True, max_num_seqs=1)
    ids = torch.cat(tokenize_documents(float_engine.tokenizer, load_text("wikitext2"))).tolist()
    windows = [ids[i * args.window:(i + 1) * args.window] for i in range(args.windows)]
    base = [forced_logits(float_engine, w, chunk, decode).log_softmax(-1) for w in windows]
    int4_engine = engine_for("int4", True, max_num_seqs=1)
    engine_kld = kld(base, [forced_logits(int4_engine, w, chunk, decode).log_softmax(-1) for w in windows])
    log(f"the int4 engine: mean KLD {float(engine_kld.mean()):.5f}")
    simulated = simulating_engine(int4_engine)
    rows = {}
    for name, (keys, values) in variants(simulated.cache.head_dim).items():
        written = round_on_store(simulated, keys, values, sink=name in SINK_ROWS)
        logits = []
        for w in windows:
            written.clear()
            logits.append(forced_logits(simulated, w, chunk, decode).log_softmax(-1))
        value = kld(base, logits)
        rows[name] = {"kld_mean": float(value.mean()), "kld_p99": float(value.quantile(0.99))}
        log(f"{name}: mean KLD {rows[name]['kld_mean']:.5f}")
    sweep = {}
    for power in POWERS:
        engine = engine_with_key_scale_power("int4", power)
        value = kld(base, [forced_logits(engine, w, chunk, decode).log_softmax(-1) for w in windows])
        sweep[str(power)] = {"kld_mean": float(value.mean()), "kld_p99": float(value.quantile(0.99))}
        log(f"key-scale power {power}: mean KLD {sweep[str(power)]['kld_mean']:.5f}")
    report = {"model": "demo", "text": "wikitext2", "windows": args.windows, "window": args.window, "chunk": chunk,
              "decode": decode, "threads": args.threads, "int4_engine_kld_mean": float(engine_kld.mean()),
              "variants": rows, "key_scale_power": sweep, "default_power": default_power(), "seconds": time.perf_counter() - start}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "kv_int4_error.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "kv_int4_error.md").write_text(markdown(report))
    print(markdown(report))


def markdown(report: dict) -> str:
    lines = [
        "# Where the int4 KV cache's error comes from (demo model)",
        "",
        (f"Written by bench/kv_int4_error.py: WikiText-2, {report['windows']} windows × {report['window']} tokens "
         f"(chunks of {report['chunk']}, the last {report['decode']} as decode steps), mean KLD to the float cache. "
         "Each row rounds K and/or V as written to a float32 cache in the int4 cache's basis (rotation, key scales, "
         "key offsets as the int4 engine calibrated them; pairs chosen among trimmed ranges as the cache does); the "
         "first row is the engine's own layout with its attention sink (each window's first token kept in float32), "
         f"and the int4 engine itself measured {report['int4_engine_kld_mean']:.5f} on the same windows."),
        "",
        "| rounding | mean KLD | KLD p99 |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {row['kld_mean']:.5f} | {row['kld_p99']:.4f} |" for name, row in report["variants"].items()]
    lines += ["", (f"The int4 engine with the key scales' power swept (the engine's default: {report['default_power']}; "
                   "0: no key scales), same windows:"), "", "| power | mean KLD | KLD p99 |", "|---:|---:|---:|"]
    lines += [f"| {power} | {row['kld_mean']:.5f} | {row['kld_p99']:.4f} |" for power, row in report["key_scale_power"].items()]
    return "\n".join(lines + [""])


def default_power() -> float:
    from llmopt.runtime import kv_cache

    return kv_cache.KEY_SCALE_POWER



if __name__ == "__main__":
    main()
