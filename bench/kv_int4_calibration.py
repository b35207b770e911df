"""How the int4 KV cache's calibration length meets the context length it serves (demo model).

The int4 cache's key offsets come from a calibration text the engine runs at start-up
(``runtime.kv_calibration.CALIBRATION_TOKENS``, 512 tokens). RoPE turns each key's slow pairs
through an angle that grows with its position, so a fixed mean key after RoPE depends on the
positions the calibration covers: centred on positions 0 .. 511, it is off-centre at position
2000. The engine therefore fits a mean key before RoPE and turns it by each block's average
RoPE rotation (one offset per 16 positions, ``runtime.kv_cache``). This measures the int4
engine calibrated on ``--calibrations`` token counts against windows of ``--lengths`` tokens
(WikiText-2 and the held-out Gutenberg novel, mean KLD to the float cache, prompt chunks then
the last 64 tokens as decode steps, as ``bench/kv_cache.py``).

A last row simulates the finest version, which the kernels do not run: the mean key before RoPE
rotated to each key's own position (not its block's average), each key rounded less it and the
offset added back as read (a float32 cache written through the reference, as
``bench/kv_int4_error.py`` does; first token in float32 as the engine's sinks).

Results: ``bench/results/kv_int4_calibration.{json,md}``.

    python bench/kv_int4_calibration.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))
from kv_cache import TEXT_START, TEXTS, engine_for, forced_logits, log  # noqa: E402
from kv_int4_error import kld, simulating_engine  # noqa: E402

DECODE = 64


def windows_of(ids: list[int], start: int, length: int, tokens: int) -> list[list[int]]:
    """Consecutive windows of ``length`` tokens from ``start``, ``tokens`` in all."""
    return [ids[start + i * length:start + (i + 1) * length] for i in range(tokens // length)]


def position_offsets(int4_engine, tokenizer):
    """``forced(ids, chunk)``: log-probabilities of a float32-cache engine in ``int4_engine``'s basis
    whose keys are rounded less position-aware offsets and the offsets added back (see the module
    doc), values as the cache rounds them, each window's first token unrounded."""
    from llmopt.runtime.kernels import kv_quant
    from llmopt.runtime.kernels.reference import write_kv
    from llmopt.runtime.kv_calibration import basis_calibration_ids
    from llmopt.runtime.rope import apply_rotary

    engine = simulating_engine(int4_engine)
    cache, rope = engine.cache, engine.runner.rope
    rotation = cache.rotation.float()
    written: dict[int, int] = {}

    def turn(x: torch.Tensor, positions: torch.Tensor, sign: float) -> torch.Tensor:
        cos, sin = rope.for_positions(positions)
        return apply_rotary(x, cos.unsqueeze(1).float(), sign * sin.unsqueeze(1).float())

    def positions_of(index: int, count: int) -> torch.Tensor:
        first = written.get(index, 0)
        written[index] = first + count
        return torch.arange(first, first + count)

    def int4(x: torch.Tensor) -> torch.Tensor:
        return kv_quant.dequantize(*kv_quant.quantize(x, "int4"), torch.float32)

    sums: dict[int, torch.Tensor] = {}

    def calibrate(index, k, v, slots, sink_writes=None, key_blocks=None):
        before_rope = turn((k.float() @ rotation) / cache.key_scale[index], positions_of(index, k.shape[0]), -1.0)
        sums[index] = sums.get(index, 0) + before_rope.double().sum(0)
        write_kv(cache.k[index], cache.v[index], k, v, slots)

    ids = basis_calibration_ids(tokenizer, 512)
    cache.store = calibrate
    forced_logits(engine, ids, 64, 1)
    mean_key = {index: (total / len(ids)).float() for index, total in sums.items()}

    def store(index, k, v, slots, sink_writes=None, key_blocks=None):
        positions = positions_of(index, k.shape[0])
        offsets = (turn(mean_key[index].expand(len(positions), *mean_key[index].shape), positions, 1.0)
                   * cache.key_scale[index]) @ rotation
        rounded_k, rounded_v = int4(k - offsets) + offsets, int4(v)
        if positions[0] == 0:
            rounded_k[0], rounded_v[0] = k[0], v[0]
        write_kv(cache.k[index], cache.v[index], rounded_k.to(k.dtype), rounded_v.to(v.dtype), slots)

    cache.store = store

    def forced(window: list[int], chunk: int) -> torch.Tensor:
        written.clear()
        return forced_logits(engine, window, chunk, DECODE).log_softmax(-1)

    return forced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibrations", type=int, nargs="+", default=[256, 512, 2048])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per text and window length")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from llmopt.core.data import load_text, tokenize_documents
    from llmopt.runtime import kv_calibration

    start = time.perf_counter()
    longest = max(args.lengths + args.calibrations)
    float_engine = engine_for("auto", True, max_num_seqs=1, max_model_len=longest + 1)
    texts = {name: torch.cat(tokenize_documents(float_engine.tokenizer, load_text(name))).tolist() for name in TEXTS}
    chunk = {length: max(64, length // 8) for length in args.lengths}
    windows = {(name, length): windows_of(texts[name], TEXT_START[name], length, args.tokens)
               for name in TEXTS for length in args.lengths}
    base = {key: [forced_logits(float_engine, w, chunk[key[1]], DECODE).log_softmax(-1) for w in ws] for key, ws in windows.items()}
    rows = {}
    default = kv_calibration.CALIBRATION_TOKENS
    try:
        for calibration in args.calibrations:
            kv_calibration.CALIBRATION_TOKENS = calibration
            engine = engine_for("int4", True, max_num_seqs=1, max_model_len=longest + 1)
            for (name, length), ws in windows.items():
                value = kld(base[name, length], [forced_logits(engine, w, chunk[length], DECODE).log_softmax(-1) for w in ws])
                rows[f"{calibration}/{name}/{length}"] = {"calibration": calibration, "text": name, "length": length,
                                                          "windows": len(ws), "kld_mean": float(value.mean())}
                log(f"calibration {calibration}, {name}, windows of {length}: mean KLD {float(value.mean()):.5f}")
    finally:
        kv_calibration.CALIBRATION_TOKENS = default
    simulated = position_offsets(engine_for("int4", True, max_num_seqs=1, max_model_len=longest + 1), float_engine.tokenizer)
    for (name, length), ws in windows.items():
        value = kld(base[name, length], [simulated(w, chunk[length]) for w in ws])
        rows[f"position/{name}/{length}"] = {"calibration": "position", "text": name, "length": length, "windows": len(ws),
                                              "kld_mean": float(value.mean())}
        log(f"position offsets (simulated), {name}, windows of {length}: mean KLD {float(value.mean()):.5f}")
    report = {"model": "demo", "default_calibration": default, "tokens": args.tokens, "decode": DECODE, "chunks": chunk,
              "threads": args.threads, "rows": rows, "seconds": time.perf_counter() - start}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "kv_int4_calibration.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "kv_int4_calibration.md").write_text(markdown(report, args))
    print(markdown(report, args))


def markdown(report: dict, args) -> str:
    lines = [
        "# The int4 KV cache's calibration length against the context length (demo model)",
        "",
        (f"Written by bench/kv_int4_calibration.py: mean KLD of the int4 engine (rotated, key scales and per-block "
         f"position-aware key offsets, float32 "
         f"sinks) to the float cache, {report['tokens']} tokens of each text cut into windows of each length (prompt chunks "
         f"of length / 8, at least 64, then the last {report['decode']} tokens as decode steps). Rows: the calibration "
         f"text's length (the engine's default: {report['default_calibration']} tokens)."),
        "",
        "| calibration tokens | " + " | ".join(f"{TEXTS[t]}, windows of {n}" for t in TEXTS for n in args.lengths) + " |",
        "|---:|" + "---:|" * (len(TEXTS) * len(args.lengths)),
    ]
    for calibration in [*args.calibrations, "position"]:
        cells = [f"{report['rows'][f'{calibration}/{t}/{n}']['kld_mean']:.5f}" for t in TEXTS for n in args.lengths]
        label = "512, offsets per position (simulated)" if calibration == "position" else calibration
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines + [""])


if __name__ == "__main__":
    main()
