"""The runtime engine's options, shared by ``generate``, ``bench`` and ``serve``."""

from __future__ import annotations

from typing import Any

import click

from llmopt.runtime.config import KERNEL_CHOICES, KV_CACHE_DTYPES, LM_HEAD_CHOICES, MATMUL_PRECISION_CHOICES, MODEL_IMPL_CHOICES

SAVED = " [default: the checkpoint's saved runtime settings (a recipe's runtime: block), else auto / cpu]"
LM_HEAD_HELP = ("Output head: as the checkpoint stores it (auto), rounded to bfloat16 (bf16, half the bytes per "
                "token) or float16 (f16: the values a GGUF export keeps) or quantized to int8 per output channel (int8, a quarter) at load; the demo model's float32 head "
                "is most of a W4A16 model's weight traffic. Accuracy cost on WikiText-2 (demo model, float32 and W4A16), "
                "against the float32 head: mean KLD 2.7e-4 (bf16) / 9.3e-4 (int8) nats, top-1 agreement 98% / 97%, "
                "perplexity unchanged (bench/results/lm_head.md).")
KERNELS_HELP = ("The kernel backend, chosen once: auto is triton on a CUDA device and on the CPU the C++ kernels "
                "when they build; cpu requires the C++ kernels, triton the Triton ones; reference forces the "
                "plain-torch path for comparison.")
MATMUL_PRECISION_HELP = ("Linear layers' arithmetic (torch's float32 matmul precision names): highest is float32 "
                         "throughout; medium lets the C++ CPU kernels multiply bfloat16-rounded weights and activations "
                         "with float32 sums when many rows run at once (prefill, decode of over 16 sequences) on CPUs "
                         "with AVX512-BF16, as W4A16 on a GPU does (speed: bench/results/serve_load.md); on the demo's "
                         "W4A16 g32 a mean KLD of 2.5e-4 nats against float32 products (bench/results/lm_head.md). "
                         "Decode of few sequences stays exact; a float output head keeps a bfloat16 copy for many rows "
                         "(its bytes again). low also rounds the activations of int4 weights (int8 "
                         "and IQ4_NL weights with AVX-512 VNNI) to int8 per block of 32 inputs, as llama.cpp's CPU "
                         "kernels do, for integer dot products at every batch size (accuracy: bench/results/lm_head.md).")
MODEL_IMPL_HELP = ("Model code: auto runs an architecture's native model when the runtime has one, else transformers' "
                   "modeling code with the runtime's paged attention and linears; native refuses the latter; "
                   "transformers forces it (vLLM's --model-impl).")
PLACED = " [default: the checkpoint's saved runtime settings, else auto]"
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
NAMES = ("threads", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_gib", "prefix_caching",
         "kv_cache_dtype", "kernels", "device", "dtype", "lm_head", "matmul_precision", "model_impl")


def engine_options(batching: bool = True):
    """Decorator adding the engine options (``batching``: also the batch and KV-budget ones)."""
    options = [
        click.option("--threads", type=click.IntRange(1), help="CPU threads (default: torch's)."),
        click.option("--max-model-len", type=click.IntRange(2), help="Longest prompt + output (default: the model's)."),
    ]
    if batching:
        options += [
            click.option("--max-num-seqs", type=click.IntRange(1), help="Sequences decoded together at most." + SAVED),
            click.option("--max-num-batched-tokens", type=click.IntRange(1), help="Tokens per step at most (prefill chunk budget)." + SAVED),
            click.option("--kv-cache-gib", type=click.FloatRange(0, min_open=True), help="KV cache budget in GiB."),
            click.option("--prefix-caching/--no-prefix-caching", default=None, help="Reuse the KV of shared prompt prefixes." + SAVED),
        ]
    options += [
        click.option("--kv-cache-dtype", type=click.Choice(list(KV_CACHE_DTYPES)),
                     help="KV cache storage: the model's dtype (auto), a 16-bit float (float16, llama.cpp's default, "
                          "or bfloat16: half a float32 model's cache), fp8 e4m3 / int8 with per-token scales "
                          "(about half / a quarter of bf16 / fp32 memory), or int4 (Hadamard-rotated, calibrated "
                          "key scales and offsets, each sequence's first token kept in float32; five bits a value, "
                          "under a third of bf16's memory; int4_g16: a scale pair per 16 values, six bits, closer "
                          "to float)." + SAVED),
        click.option("--kernels", type=click.Choice(list(KERNEL_CHOICES)), help=KERNELS_HELP + SAVED),
        click.option("--device", help="Where weights and KV cache live: auto (the GPU when torch sees one, else the CPU), "
                                      "cpu, cuda or cuda:N." + PLACED),
        click.option("--dtype", type=click.Choice(DTYPE_CHOICES),
                     help="Activation and unquantized-weight dtype: auto is bfloat16 on a GPU, float32 on the CPU." + PLACED),
        click.option("--lm-head", type=click.Choice(list(LM_HEAD_CHOICES)), help=LM_HEAD_HELP + SAVED),
        click.option("--matmul-precision", type=click.Choice(list(MATMUL_PRECISION_CHOICES)), help=MATMUL_PRECISION_HELP + SAVED),
        click.option("--model-impl", type=click.Choice(list(MODEL_IMPL_CHOICES)), help=MODEL_IMPL_HELP + SAVED),
        click.option("--speculative-method", type=click.Choice(["ngram", "draft"]),
                     help="Speculative decoding: ngram (prompt lookup in the prompt and the text so far; pays off on "
                          "summaries, rewrites, code edits) or draft (a small model, --draft, proposes). Greedy output "
                          "is unchanged, sampling keeps the model's distribution; k adapts per sequence." + SAVED),
        click.option("--draft", "draft_model", help="Draft model for --speculative-method draft (any model spec sharing the "
                                                    "tokenizer, e.g. a `llmopt distill` or `prune drop-layers` student)."),
        click.option("--spec-tokens", type=click.IntRange(1, 16), help="Most tokens proposed per step and sequence [default: 4]."),
    ]

    def decorate(func):
        for option in reversed(options):
            func = option(func)
        return func

    return decorate


def engine_placement(device: str | None, dtype: str | None) -> dict[str, str]:
    """``{"device", "dtype"}`` for an engine: device ``auto`` (or None) is the GPU when torch sees
    one, else the CPU; dtype ``auto`` (or None) is bfloat16 on a GPU, float32 on the CPU."""
    from llmopt.calibration import resolve_device

    where = resolve_device(device or "auto")  # a bad name, or cuda without a GPU: one LlmoptError line
    if dtype in (None, "auto"):
        dtype = "bfloat16" if where.type == "cuda" else "float32"
    return {"device": str(where), "dtype": dtype}


def saved_with(model: str) -> dict[str, Any]:
    """The engine settings saved with ``model`` (its ``llmopt.json`` ``runtime`` block)."""
    from llmopt.checkpoints.models import resolve_model
    from llmopt.runtime.config import saved_settings

    return saved_settings(resolve_model(model))


def engine_settings(params: dict[str, Any], saved: dict[str, Any] | None = None) -> dict[str, Any]:
    """Remove the engine options from a command's parameters; the ones given, as EngineConfig
    fields, with device and dtype always set (given, else ``saved`` with the model, else auto)."""
    settings = {}
    for name in NAMES:
        value = params.pop(name, None)
        if value is not None:
            settings["enable_prefix_caching" if name == "prefix_caching" else name] = value
    saved = saved or {}
    device, dtype = (settings.get(name) or saved.get(name) for name in ("device", "dtype"))
    settings.update(engine_placement(device, dtype))
    spec = {key: value for key, value in (("method", params.pop("speculative_method", None)),
                                          ("model", params.pop("draft_model", None)),
                                          ("num_speculative_tokens", params.pop("spec_tokens", None))) if value is not None}
    if spec:  # checked by the engine (SpeculativeConfig): one clear line for a bad combination
        settings["speculative_config"] = spec
    return settings
