"""llm-compressor's rotations + GPTQ on given windows: run by ``bench/rotations.py --llmcompressor-python``
under the python of a venv holding ``llmcompressor`` (its own venv: it pins its own transformers and
compressed-tensors), never under llmopt's.

Reads a ``torch.save`` file of ``{"model": float checkpoint dir, "calibration": [n, len] ids,
"eval": {text: [windows, len] ids}, "variants": [names], "output": json path}``; for each variant
runs ``oneshot`` with that recipe (W4A16 as llmopt's rows: int4 symmetric groups of 128, of 64
where 128 does not divide the inputs, the head left float) and scores the quantized model as llm-compressor leaves it in memory — transforms
fused into the weights, online ones as hooks — against the float model on the same windows with
``bench/rotations.py``'s ``scores`` (mean and p99 KLD, top-1). Writes the scores as JSON.

    /path/to/llmcompressor-venv/bin/python bench/llmcompressor_rotations.py INPUTS.pt
"""

from __future__ import annotations

import json
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rotations import Reference, scores  # noqa: E402  (the same formulas as llmopt's rows; rotations.py imports no llmopt at load)


def int4_groups(model) -> dict:
    """int4 symmetric weights in groups of 128 — of 64 where 128 does not divide a Linear's inputs
    (the demo's 576), as llmopt's W4A16 g128 does — for every decoder Linear of ``model``, the head left out."""
    import re

    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    def int4(group: int) -> QuantizationArgs:
        return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)

    by_group: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and re.search(r"(q|k|v|o|gate|up|down)_proj$", name):
            by_group.setdefault(128 if module.in_features % 128 == 0 else 64, []).append(f"re:^{re.escape(name)}$")
    return {f"g{group}": QuantizationScheme(targets=targets, weights=int4(group)) for group, targets in by_group.items()}


def recipe(name: str, model) -> list:
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.modifiers.transform import QuIPModifier, SpinQuantModifier

    gptq = GPTQModifier(config_groups=int4_groups(model), ignore=["lm_head"])
    rotations = {
        # QuIP's input-side rotation of every Linear (its documented recommendation), randomized Hadamards
        # (576 is not a power of two, which the plain "hadamard" type needs)
        "QuIP + GPTQ": [QuIPModifier(rotations=["v"], transform_type="random-hadamard", ignore="lm_head")],
        # SpinQuant's offline rotations: R1 on the residual stream, R2 per value head
        "SpinQuant R1 R2 + GPTQ": [SpinQuantModifier(rotations=["R1", "R2"], transform_type="random-hadamard")],
        "SpinQuant R1 R2 R4 + GPTQ": [SpinQuantModifier(rotations=["R1", "R2", "R4"], transform_type="random-hadamard")],
        "GPTQ": [],
    }
    return rotations[name] + [gptq]


def main() -> None:
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    inputs = torch.load(sys.argv[1])
    torch.set_num_threads(2)
    calib = inputs["calibration"]
    data = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": torch.ones_like(calib).tolist()})
    load = lambda: AutoModelForCausalLM.from_pretrained(inputs["model"], dtype=torch.float32).eval()  # noqa: E731
    reference = Reference(load(), inputs["eval"])  # kept in memory, or recomputed per window for a large vocabulary
    results = {"versions": {p: version(p) for p in ("llmcompressor", "compressed-tensors", "transformers", "torch")},
               "variants": {}}
    for name in inputs["variants"]:
        model = load()
        start = time.perf_counter()
        oneshot(model=model, dataset=data, recipe=recipe(name, model), max_seq_length=calib.shape[1],
                num_calibration_samples=calib.shape[0])
        seconds = time.perf_counter() - start
        with torch.inference_mode():
            measured = scores(model.eval(), inputs["eval"], reference)
        results["variants"][name] = {**measured, "quantize_seconds": round(seconds, 1)}
        print(name, json.dumps(results["variants"][name]), flush=True)
        with open(inputs["output"], "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
