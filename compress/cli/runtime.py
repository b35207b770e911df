"""``llmopt generate`` and ``llmopt bench``: run a model in the runtime and measure its speed."""

from __future__ import annotations

import dataclasses
import platform
import sys

import click

from llmopt.cli.common import MODEL_HELP, emit_json, hub_options, user_errors
from llmopt.core.errors import LlmoptError
from llmopt.cli.engine_options import engine_options, engine_settings, saved_with


def _range(text: str, what: str) -> tuple[int, int]:
    """``"32:512"`` (or ``"64"``) → ``(32, 512)``."""
    try:
        low, _, high = text.partition(":")
        pair = (int(low), int(high or low))
    except ValueError:
        raise LlmoptError(f"--{what} must be N or MIN:MAX, got {text!r}", f"e.g. --{what} 32:512") from None
    if pair[0] < 1 or pair[1] < pair[0]:
        raise LlmoptError(f"--{what} {text!r} is not a valid range", "use 1 <= MIN <= MAX")
    return pair


@click.command("generate", epilog=MODEL_HELP)
@click.argument("model")
@click.argument("prompt")
@click.option("--max-tokens", default=128, show_default=True, type=click.IntRange(1), help="Tokens to generate at most.")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0), help="0: greedy.")
@click.option("--top-k", default=0, show_default=True, type=int, help="Sample from the K most likely tokens (0: off).")
@click.option("--top-p", default=1.0, show_default=True, type=float, help="Nucleus sampling mass (1: off).")
@click.option("--min-p", default=0.0, show_default=True, type=float, help="Drop tokens below MIN_P × the top probability.")
@click.option("--repetition-penalty", default=1.0, show_default=True, type=float, help="> 1 discourages repeating tokens.")
@click.option("--seed", type=int, help="Seed for sampling (reproducible output).")
@click.option("--stop", multiple=True, metavar="TEXT", help="Stop before this text (repeatable).")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past the end-of-sequence token.")
@click.option("--chat", is_flag=True, help="Wrap PROMPT in the model's chat template as a user message.")
@click.option("--stream", is_flag=True, help="Print tokens as they are generated.")
@engine_options(batching=False)
@click.option("--json", "as_json", is_flag=True, help="Print the output, token ids and timings as JSON.")
@user_errors
@hub_options()
def generate_command(model, prompt, max_tokens, temperature, top_k, top_p, min_p, repetition_penalty, seed, stop,
                     ignore_eos, chat, stream, as_json, **engine):
    """Generate text for PROMPT with MODEL in llmopt's runtime.

    \b
    Examples:
      llmopt generate demo "The capital of France is" --max-tokens 16
      llmopt generate demo "Write a haiku about the sea" --chat --stream --temperature 0.7
    """
    from llmopt.runtime import LLM, SamplingParams

    from llmopt.core.console import err, out

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            repetition_penalty=repetition_penalty, seed=seed, stop=list(stop), ignore_eos=ignore_eos)
    llm = LLM(model, **engine_settings(engine, saved_with(model)), max_num_seqs=1)
    request = llm.chat_prompt(prompt) if chat else prompt
    if stream and not as_json:
        final = None
        for final in llm.stream(request, params):
            sys.stdout.write(final.delta_text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    else:
        final = llm.generate(request, params)[0]
        if not as_json and final.finish_reason != "error":
            out.print(final.text, highlight=False, markup=False)
    from llmopt.runtime.outputs import raise_if_failed

    raise_if_failed(final, "generation")
    m = final.metrics
    if as_json:
        emit_json({
            "model": model, "prompt": prompt, "text": final.text, "token_ids": final.token_ids,
            "prompt_tokens": len(final.prompt_token_ids), "finish_reason": final.finish_reason,
            "ttft_s": m.ttft, "tpot_s": m.tpot, "e2e_s": m.e2e,
        })
    else:
        speed = f", {1 / m.tpot:.1f} tok/s" if m.tpot else ""
        ttft = "" if m.ttft is None else f"; TTFT {m.ttft * 1000:.0f} ms"
        err.print(f"[dim]{len(final.prompt_token_ids)} prompt + {len(final.token_ids)} generated tokens "
                  f"({final.finish_reason}){ttft}{speed}[/dim]", highlight=False)


@click.command("bench", epilog=MODEL_HELP)
@click.argument("model")
@click.option("--pp", default=512, show_default=True, type=click.IntRange(1), help="Prompt tokens for the prompt-processing figure.")
@click.option("--tg", default=128, show_default=True, type=click.IntRange(1), help="Generated tokens for the generation figure.")
@click.option("--repetitions", "-r", default=5, show_default=True, type=click.IntRange(1), help="Single-stream repetitions (median).")
@click.option("--num-requests", "-n", default=32, show_default=True, type=click.IntRange(0), help="Requests in the serving workload (0: skip it).")
@click.option("--prompt-len", default="32:512", show_default=True, help="Serving prompt lengths, MIN:MAX tokens (uniform).")
@click.option("--output-len", default="32:256", show_default=True, help="Serving output lengths, MIN:MAX tokens (uniform).")
@click.option("--rate", type=click.FloatRange(0, min_open=True), help="Poisson arrival rate, requests/s (default: all at once).")
@click.option("--seed", default=0, show_default=True, help="Seed of the workload's lengths and tokens.")
@click.option("--no-single", is_flag=True, help="Skip the single-stream figures.")
@engine_options()
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@user_errors
@hub_options()
def bench_command(model, pp, tg, repetitions, num_requests, prompt_len, output_len, rate, seed, no_single, as_json, **engine):
    """Speed of MODEL in the runtime: single stream (pp/tg tokens/s, median of repetitions, like
    llama-bench) and a serving workload (throughput, TTFT / TPOT p50 and p99).

    \b
    Examples:
      llmopt bench demo --threads 2
      llmopt bench demo -n 64 --rate 2 --output-len 64:128 --json
    """
    import torch
    from llmopt.runtime import LLMEngine
    from llmopt.runtime.bench import make_workload, serving, single_stream

    from llmopt.core.console import make_progress, out

    prompt_range, output_range = _range(prompt_len, "prompt-len"), _range(output_len, "output-len")
    settings = engine_settings(engine, saved_with(model))
    engine = LLMEngine(model, **settings)
    config = engine.config
    result = {"model": model, "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
              "torch": torch.__version__, "seed": seed, "kv_cache_dtype": config.kv_cache_dtype,
              "kernels": config.kernels, "backend": engine.backend.name, "device": config.device, "lm_head": config.lm_head,
              "lm_head_runs_as": engine.weights.head_kind, "matmul_precision": config.matmul_precision,
              "engine": dataclasses.asdict(config),
              "saved_runtime_settings": engine.saved_settings}
    with make_progress() as progress:
        if not no_single:
            task = progress.add_task(f"single stream pp{pp}/tg{tg}", total=repetitions)
            result.update(single_stream(engine, pp, tg, repetitions, seed, lambda n: progress.advance(task, n)))
        if num_requests:
            workload = make_workload(num_requests, prompt_range, output_range, engine.arch.vocab_size, seed, rate)
            task = progress.add_task(f"serving {num_requests} requests", total=num_requests)
            result["serving"] = serving(engine, workload, lambda n: progress.advance(task, n))
            result["serving"].update({"prompt_len": list(prompt_range), "output_len": list(output_range),
                                      "rate": rate})
    if as_json:
        emit_json(result)
    else:
        from rich.table import Table

        from llmopt.cli.tables import _fmt

        table = Table(title=f"llmopt bench {model} ({result['threads']} threads)", title_justify="left")
        table.add_column("figure")
        table.add_column("value", justify="right")
        table.add_row("output head", result["lm_head_runs_as"])
        table.add_row("matmul precision", result["matmul_precision"])
        if not no_single:
            table.add_row(f"pp{pp} (prompt tok/s)", f"{result[f'pp{pp}_tok_s']:.1f}")
            table.add_row(f"tg{tg} (generation tok/s)", f"{result[f'tg{tg}_tok_s']:.1f}")
        s = result.get("serving")
        if s:
            table.add_row("serving requests", f"{s['requests']} ({'all at once' if rate is None else f'{rate}/s Poisson'})")
            table.add_row("output tok/s", f"{s['output_tok_s']:.1f}")
            table.add_row("total tok/s", f"{s['total_tok_s']:.1f}")
            for key in ("ttft", "tpot", "e2e"):
                for q in ("p50", "p99"):
                    value = s[f"{key}_{q}_s"]
                    table.add_row(f"{key.upper()} {q}", "—" if value is None else f"{value * 1000:,.0f} ms")
            table.add_row("preemptions", _fmt(s["preemptions"]))
            table.add_row("KV peak usage", f"{100 * s['kv_peak_usage']:.1f}% of {s['kv_bytes_allocated'] / 2**20:,.0f} MiB")
        out.print(table)
