"""Compare quantized checkpoints made before and after a change to the quantize core, tensor by tensor.

For each named pair of checkpoint folders (``--pair NAME BEFORE AFTER``) every tensor of every
shard is compared: the key sets must be equal; tensors of the same dtype must be equal bit for bit;
tensors whose dtype changed (scales written in 16 bits instead of the source's float32) are
compared as values, and the dequantized weights of both checkpoints (llmopt's loader) are compared
Linear by Linear (maximum difference relative to the weight's largest magnitude). Writes
``bench/results/<out>.json`` and ``.md``.

The checkpoints are made by ``llmopt quantize`` at the two commits, e.g. on the demo model::

    llmopt quantize demo --scheme W4A16 --group-size 32 --method gptq --calib-samples 16 --device cpu -o w4a16_gptq_g32
    llmopt quantize demo --scheme W8A16 --method rtn --device cpu -o w8a16_rtn
    llmopt quantize demo --scheme W4A16_ASYM --method awq --calib-samples 16 --device cpu -o w4a16asym_awq
    llmopt quantize demo --scheme AUTO --plan PLAN.json --method gptq --calib-samples 16 --device cpu -o auto_replay

    python bench/quant_core_identity.py --pair w4a16_gptq_g32 before/w4a16_gptq_g32 after/w4a16_gptq_g32 … --out quant_core_identity
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

RESULTS = Path(__file__).resolve().parent / "results"


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def compare(before: Path, after: Path) -> dict:
    """The comparison record of one pair of checkpoints."""
    from llmopt.formats.compressed import load_dequantized

    a, b = tensors(before), tensors(after)
    record: dict = {"before": str(before), "after": str(after), "tensors_before": len(a), "tensors_after": len(b),
                    "only_before": sorted(set(a) - set(b)), "only_after": sorted(set(b) - set(a))}
    identical, differ, dtype_changed = [], [], []
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        if x.dtype != y.dtype:
            rel = float((x.double() - y.double()).abs().max() / x.double().abs().max().clamp(min=1e-30))
            dtype_changed.append({"tensor": key, "before": str(x.dtype), "after": str(y.dtype), "max_rel_diff": rel})
        elif x.shape == y.shape and torch.equal(x, y):
            identical.append(key)
        else:
            changed = float((x != y).float().mean()) if x.shape == y.shape else 1.0
            differ.append({"tensor": key, "fraction_changed": changed})
    record.update({"identical": len(identical), "differ": differ, "dtype_changed": dtype_changed})
    wa, wb = load_dequantized(before, torch.float32).state_dict(), load_dequantized(after, torch.float32).state_dict()
    worst, worst_name, worst_fro = 0.0, None, 0.0
    for key in sorted(set(wa) & set(wb)):
        if wa[key].is_floating_point() and wa[key].shape == wb[key].shape and wa[key].numel():
            diff = (wa[key].double() - wb[key].double())
            rel = float(diff.abs().max() / wa[key].double().abs().max().clamp(min=1e-30))
            worst_fro = max(worst_fro, float(diff.norm() / wa[key].double().norm().clamp(min=1e-30)))
            if rel > worst:
                worst, worst_name = rel, key
    codes_changed = [d["fraction_changed"] for d in differ]
    record.update({"dequantized_max_rel_diff": worst, "dequantized_worst": worst_name,
                   "dequantized_max_rel_frobenius": worst_fro,
                   "mean_fraction_changed_of_differing": sum(codes_changed) / len(codes_changed) if codes_changed else 0.0,
                   "byte_identical": not differ and not dtype_changed and not record["only_before"] and not record["only_after"]})
    return record


def markdown(rows: dict[str, dict], title: str) -> str:
    lines = [f"# {title}", "", "Written by bench/quant_core_identity.py from the checkpoints it compared.", "",
             "| checkpoint | tensors | bit-identical | differing (mean share of elements) | dtype changed | "
             "dequantized: max rel. element diff | dequantized: worst rel. Frobenius diff |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['tensors_before']} / {r['tensors_after']} | {r['identical']} | "
                     f"{len(r['differ'])} ({r['mean_fraction_changed_of_differing']:.2%}) | {len(r['dtype_changed'])} | "
                     f"{r['dequantized_max_rel_diff']:.3g} | {r['dequantized_max_rel_frobenius']:.3g} |")
    lines.append("")
    for name, r in rows.items():
        for d in r["differ"][:5]:
            lines.append(f"- {name}: `{d['tensor']}` differs in {d['fraction_changed']:.2%} of its elements")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", nargs=3, action="append", metavar=("NAME", "BEFORE", "AFTER"), required=True)
    parser.add_argument("--out", default="quant_core_identity", help="results file stem under bench/results/")
    parser.add_argument("--title", default="Quantize core: checkpoints before and after, tensor by tensor")
    args = parser.parse_args()
    rows = {name: compare(Path(before), Path(after)) for name, before, after in args.pair}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(rows, indent=2) + "\n")
    (RESULTS / f"{args.out}.md").write_text(markdown(rows, args.title))
    print(markdown(rows, args.title))


if __name__ == "__main__":
    main()
