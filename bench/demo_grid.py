"""Why llama.cpp's importance-matrix files look so good on the demo model: its weights already
sit on a Q4_1 grid.

The demo (SmolLM2-135M-Instruct) ships only as a Q4_1 GGUF, so every float weight llmopt starts
from is a Q4_1 block dequantized: within each group of 32 inputs at most 16 distinct values
``m + q * d``. A format with a free float offset per group and at least as many steps (Q5_1,
and nearly Q5_K with its 6-bit scales and mins) can hold such a block exactly, and a search over
scale and offset (llama.cpp's ``make_qkx3_quants``, which it runs when given an importance matrix)
finds that fit, and so does llmopt's least-squares fit of float zero points (the formats its
mixtures give Q4_1 / Q5_1 / Q4_K / Q5_K tensors); min-max rounding (llama.cpp without an importance
matrix) does not, nor do integer zero points (``-z * scale``) or symmetric codes. On weights that
were never quantized no format has such an exact fit, so the numbers measured on this model say
little about models in general.

Measured here, from the files ``bench/llama_mixtures.py`` leaves in ``out/llama_mixtures``:
the share of the demo's groups of 32 with at most 16 distinct values, and per GGUF file and
tensor type the tensors whose dequantized values equal the float (F32) file's exactly and the
mean relative squared error of the weights.

    python bench/demo_grid.py [--files 'out/llama_mixtures/*Q5_K_M.gguf']

Results: ``bench/results/demo_grid.{json,md}``.
"""

from __future__ import annotations

import argparse
import glob
import json
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "out" / "llama_mixtures"


def tensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """Every 2-D tensor of a GGUF file: its type name and its values as float32 rows."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    found = {}
    for t in GGUFReader(str(path)).tensors:
        if len(t.shape) != 2:
            continue
        values = dequantize(t.data, t.tensor_type).astype(np.float32)
        found[t.name] = (t.tensor_type.name, values.reshape(-1, int(t.shape[0])))
    return found


def on_q4_1_grid(float_tensors: dict[str, tuple[str, np.ndarray]]) -> dict:
    """Per kind of matrix (the token embedding, the layers' linears): groups of 32 inputs, and
    those holding at most 16 distinct values."""
    kinds: dict[str, dict] = {}
    for name, (_, w) in float_tensors.items():
        if w.shape[1] % 32:
            continue
        g = np.sort(w.reshape(-1, 32), axis=1)
        distinct = 1 + (np.diff(g, axis=1) != 0).sum(axis=1)
        row = kinds.setdefault("token embedding" if name.startswith("token_embd") else "linear layers",
                               {"groups": 0, "at_most_16_distinct": 0})
        row["groups"] += g.shape[0]
        row["at_most_16_distinct"] += int((distinct <= 16).sum())
    return kinds


def compare(path: Path, base: dict[str, tuple[str, np.ndarray]]) -> dict:
    """Per tensor type: tensors, tensors equal to the float file's, mean relative squared error."""
    rows: dict[str, dict] = {}
    for name, (qtype, values) in tensors(path).items():
        ref = base[name][1]
        row = rows.setdefault(qtype, {"tensors": 0, "exact": 0, "rel_err": []})
        row["tensors"] += 1
        row["exact"] += int(np.array_equal(values, ref))
        row["rel_err"].append(float(((values - ref) ** 2).sum() / (ref ** 2).sum()))
    return {q: {"tensors": r["tensors"], "exact": r["exact"], "rel_err_mean": float(np.mean(r["rel_err"]))}
            for q, r in sorted(rows.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", default=str(OUT / "*Q5_K_M.gguf"), help="GGUF files to compare with the float one (glob)")
    parser.add_argument("--float", dest="float_file", default=str(OUT / "f32.gguf"))
    args = parser.parse_args()
    base = tensors(Path(args.float_file))
    result = {"date": time.strftime("%Y-%m-%d"), "float_file": args.float_file, "grid": on_q4_1_grid(base), "files": {}}
    for name in sorted(glob.glob(args.files)):
        result["files"][Path(name).name] = compare(Path(name), base)
        print(Path(name).name, result["files"][Path(name).name], flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "demo_grid.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "demo_grid.md").write_text(render(result))
    print(render(result))


def render(result: dict) -> str:
    shares = "; ".join(f"{kind}: {r['at_most_16_distinct']:,} of {r['groups']:,} ({100 * r['at_most_16_distinct'] / r['groups']:.2f}%)"
                       for kind, r in result["grid"].items())
    lines = [
        "# The demo's weights sit on a Q4_1 grid",
        "",
        f"Written by `bench/demo_grid.py` on {result['date']} from `{result['float_file']}` (the demo exported to F32) and the",
        "GGUF files below. The demo model ships only as a Q4_1 GGUF; groups of 32 weights holding at most 16 distinct values,",
        f"{shares}. A type with a free float offset per group and enough steps (Q5_1) holds such a group exactly",
        "when its scale and offset are searched, as llama.cpp does with an importance matrix and llmopt's float zero points",
        "(least-squares scale and min) always do; min-max rounding and integer zero points do not.",
        "",
        "| file | GGUF type | tensors | equal to the float weights | mean relative squared error |",
        "|---|---|---:|---:|---:|",
    ]
    for name, types in result["files"].items():
        for qtype, r in types.items():
            lines.append(f"| {name} | {qtype} | {r['tensors']} | {r['exact']} | {r['rel_err_mean']:.2e} |")
    lines += ["", "On weights that were never quantized no type has such an exact fit: the Q5_K_M numbers of "
              "`bench/results/llama_mixtures.md` owe much to this property of the demo."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
