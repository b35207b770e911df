"""Decode speed of every runtime architecture, native and through the generic path, in one run.

Tiny random models built from real transformers configs (4 layers, hidden 256, 8 heads / 4 KV
heads, vocabulary 259): the native architectures (Llama, Qwen3, Gemma 2, Gemma 3, Phi-3,
Mixtral, Qwen2-MoE, Qwen3-MoE) and generic-path ones (GPT-NeoX, OPT, Starcoder2), each as float32
and W4A16 (RTN, group 32). Every native architecture is also forced through the generic path
(``model_impl="transformers"``) where transformers' code can load the same checkpoint, so native
and generic compare on identical weights. Decode = ``runtime.bench.single_stream``'s tg (a
one-token prompt, then greedy tokens, one request), 2 threads, in-process.

The demo model's float32 decode is measured in the same run exactly as bench/e2e_speed.py does
(``llmopt bench demo --threads 2 -n 0 -r 5`` in a child process: tg128) and set beside the
figure recorded in bench/results/e2e_speed.json (the Llama path must not regress).

The machine has 2 cores shared with other work: variants are measured in ``--rounds``
interleaved rounds (median over rounds reported) and the 1-minute load average is recorded
each round. Results: bench/results/runtime_architectures.{json,md}.

    python bench/runtime_architectures.py [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from common import llmopt, log

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
VOCAB = 259
NATIVE = ["llama", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe"]
GENERIC_ONLY = ["gpt_neox", "opt", "starcoder2"]
PP, TG = 16, 32


def byte_tokenizer():
    """256 byte tokens plus three special tokens (the tests' tokenizer): the vocabulary of 259."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def config(kind: str):
    import transformers as tf

    c = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             tie_word_embeddings=False)
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=128)
    window = dict(sliding_window=32)
    layer4 = ["sliding_attention", "full_attention"] * 2
    return {
        "llama": lambda: tf.LlamaConfig(**c),
        "qwen3": lambda: tf.Qwen3Config(**c, head_dim=32),
        "gemma2": lambda: tf.Gemma2Config(**c, head_dim=32, query_pre_attn_scalar=32, **window),
        "gemma3": lambda: tf.Gemma3TextConfig(**c, head_dim=32, query_pre_attn_scalar=32, **window, layer_types=layer4),
        "phi3": lambda: tf.Phi3Config(**c),
        "mixtral": lambda: tf.MixtralConfig(**c, num_local_experts=8),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(**c, **moe, num_experts=8, shared_expert_intermediate_size=256),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**c, **moe, num_experts=8, head_dim=32),
        "gpt_neox": lambda: tf.GPTNeoXConfig(**c, rotary_pct=0.25),
        "opt": lambda: tf.OPTConfig(**{k: v for k, v in c.items() if k not in ("intermediate_size", "num_key_value_heads")},
                                    ffn_dim=512, word_embed_proj_dim=256),
        "starcoder2": lambda: tf.Starcoder2Config(**c, **window),
    }[kind]()


def build(kind: str, root: Path) -> dict[str, Path]:
    """Float32 and W4A16 (RTN g32) checkpoints of a tiny random ``kind``."""
    from transformers import AutoModelForCausalLM

    out = {"float32": root / kind / "float32", "W4A16": root / kind / "w4a16"}
    if (out["W4A16"] / "config.json").exists():
        return out
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(kind), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05)
    model.save_pretrained(out["float32"])
    byte_tokenizer().save_pretrained(out["float32"])
    if hasattr(getattr(model, "model", None), "layers"):  # llmopt's quantizer walks model.model.layers
        from llmopt.pipeline.stages.quantize import quantize_checkpoint
        from llmopt.quant.request import make_request

        quantize_checkpoint(out["float32"], out["W4A16"], make_request("W4A16", "rtn", group_size=32),
                            tokenizer=byte_tokenizer(), progress=False)
    else:  # round-to-nearest of every Linear but the head, written as compressed-tensors
        from llmopt.formats.compressed import save_compressed
        from llmopt.formats.schemes import QuantizedWeight, compute_qparams, get_scheme

        scheme, weights = get_scheme("W4A16", 32), {}
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                scale, zp = compute_qparams(module.weight.data, scheme, 32)
                weights[name] = QuantizedWeight.from_weight(module.weight.data, scheme, 32, scale, zp)
        save_compressed(model, byte_tokenizer(), out["W4A16"], weights, ["lm_head"])
    return out


def engines(root: Path, threads: int) -> tuple[dict, dict]:
    """Every variant's engine (label -> engine), and the variants that cannot load (label -> why)."""
    from llmopt.core.errors import LlmoptError
    from llmopt.runtime import LLMEngine

    found, refused = {}, {}
    for kind in NATIVE + GENERIC_ONLY:
        paths = build(kind, root)
        impls = ["auto", "transformers"] if kind in NATIVE else ["transformers"]
        for scheme, path in paths.items():
            for impl in impls:
                label = f"{kind} | {scheme} | {'native' if impl == 'auto' else 'generic'}"
                try:
                    found[label] = LLMEngine(path, threads=threads, model_impl=impl, max_model_len=PP + TG + 8,
                                             max_num_seqs=1, kv_cache_gib=0.05)
                except (LlmoptError, RuntimeError, KeyError, ValueError) as exc:
                    refused[label] = str(exc).splitlines()[0][:200]
                    log(f"{label}: cannot run ({refused[label]})")
    return found, refused


def decode(engine, repetitions: int) -> float:
    from llmopt.runtime.bench import single_stream

    return single_stream(engine, pp=PP, tg=TG, repetitions=repetitions)[f"tg{TG}_tok_s"]


def demo_decode(threads: int) -> float:
    """The demo model's float32 tg128 exactly as bench/e2e_speed.py measures it."""
    r = llmopt("bench", "demo", "--threads", str(threads), "-n", "0", "--kernels", "auto", "-r", "5")
    return r["tg128_tok_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--workdir", default=str(ROOT / "out" / "bench-architectures"))
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument("--render", action="store_true", help="only rewrite runtime_architectures.md from its json")
    args = parser.parse_args()
    if args.render:
        (RESULTS / "runtime_architectures.md").write_text(report(json.loads((RESULTS / "runtime_architectures.json").read_text())))
        return
    torch.set_num_threads(args.threads)
    found, refused = engines(Path(args.workdir), args.threads)
    rates: dict[str, list[float]] = {label: [] for label in found}
    demo: list[float] = []
    load: list[float] = []
    for r in range(args.rounds):
        load.append(os.getloadavg()[0])
        log(f"round {r + 1}/{args.rounds}, load average {load[-1]:.2f}")
        for label, engine in found.items():
            rates[label].append(decode(engine, args.repetitions))
            log(f"  {label}: {rates[label][-1]:.1f} tok/s")
        if not args.skip_demo:
            demo.append(demo_decode(args.threads))
            log(f"  demo float32 tg128: {demo[-1]:.1f} tok/s")
        save(args, rates, refused, demo, load + [os.getloadavg()[0]], r + 1)  # every round: an interrupted run keeps its rounds
    log("wrote bench/results/runtime_architectures.{json,md}")


def save(args, rates: dict, refused: dict, demo: list[float], load: list[float], rounds: int) -> None:
    recorded = json.loads((RESULTS / "e2e_speed.json").read_text())["variants"]["float32"]["kernels"]["tg128_tok_s"]
    rows = {label: {"decode_tok_s": statistics.median(v), "rounds": v} for label, v in rates.items()}
    result = {
        "machine": platform.machine(), "cpus": os.cpu_count(), "threads": args.threads, "date": time.strftime("%Y-%m-%d"),
        "rounds": rounds, "repetitions": args.repetitions, "prompt_tokens": PP, "decode_tokens": TG,
        "load_average_1min": load, "variants": rows, "cannot_run": refused,
        "demo_float32_tg128": {"this_run": statistics.median(demo) if demo else None, "rounds": demo,
                               "e2e_speed_json": recorded},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "runtime_architectures.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "runtime_architectures.md").write_text(report(result))


def report(result: dict) -> str:
    rows, load = result["variants"], result["load_average_1min"]
    lines = [
        "# Runtime architectures: decode speed, native and generic path",
        "",
        f"Tiny random models (4 layers, hidden 256, 8 heads / 4 KV heads, vocabulary {VOCAB}), float32 and W4A16 (RTN g32); "
        f"decode tok/s of {result['decode_tokens']} greedy tokens after a {result['prompt_tokens']}-token prompt, one request, "
        f"{result['threads']} threads, {result['machine']}, {result['date']}. {result['rounds']} interleaved rounds "
        f"(median of {result['repetitions']} each), median over rounds. **The machine has {result['cpus']} cores shared "
        f"with other work**: 1-minute load average during the run {min(load):.1f}–{max(load):.1f}, so absolute figures "
        "are noisy; ratios within a round are the fairer comparison. Generic = transformers' modeling code with llmopt's "
        "paged attention and linears (`model_impl=\"transformers\"`).",
        "",
        "| architecture | float32 native | float32 generic | W4A16 native | W4A16 generic | generic / native (float32) |",
        "|---|---|---|---|---|---|",
    ]
    kinds = list(dict.fromkeys(label.split(" | ")[0] for label in list(rows) + list(result["cannot_run"])))
    for kind in kinds:
        def cell(scheme: str, impl: str) -> str:
            label = f"{kind} | {scheme} | {impl}"
            if label in rows:
                return f"{rows[label]['decode_tok_s']:.1f}"
            return "cannot run¹" if label in result["cannot_run"] else "—"

        native, generic = rows.get(f"{kind} | float32 | native"), rows.get(f"{kind} | float32 | generic")
        ratio = f"{generic['decode_tok_s'] / native['decode_tok_s']:.2f}×" if native and generic else ""
        lines.append(f"| {kind} | {cell('float32', 'native')} | {cell('float32', 'generic')} | {cell('W4A16', 'native')} | "
                     f"{cell('W4A16', 'generic')} | {ratio} |")
    demo = result["demo_float32_tg128"]
    lines += [""]
    if demo["this_run"] is not None:
        lines.append(f"- Demo model float32 tg128 (`llmopt bench demo`, as bench/e2e_speed.py): **{demo['this_run']:.1f} tok/s** "
                     f"this run (rounds: {', '.join(f'{x:.1f}' for x in demo['rounds'])}) vs {demo['e2e_speed_json']:.1f} "
                     f"recorded in bench/results/e2e_speed.json ({demo['this_run'] / demo['e2e_speed_json']:.2f}×; "
                     "that figure comes from another run, so this is not a same-run ratio).")
    regression = RESULTS / "runtime_regression.json"
    if regression.is_file():  # the same-run check (bench/runtime_regression.py)
        r = json.loads(regression.read_text())
        compared = [row for row in r["rows"] if "tg_ratio" in row]
        lines.append(f"- Same-run check against commit {r['baseline']} (bench/results/runtime_regression.md, {r['rounds']} "
                     "alternating rounds): " + "; ".join(
                         f"{row['model']} tg{r['tg']} {row['current']['tg_median']:.1f} vs {row['baseline']['tg_median']:.1f} tok/s "
                         f"({row['tg_ratio']:.2f}×), pp{r['pp']} {row['pp_ratio']:.2f}×" for row in compared) + ".")
    if result["cannot_run"]:
        lines.append("- ¹ cannot run: " + "; ".join(f"{k}: {v}" for k, v in result["cannot_run"].items()))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
