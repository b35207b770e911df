"""The runtime against transformers on the demo model (float32, CPU), in one run.

Serving workload: N requests (default 32) with seeded random prompt lengths (32–512 tokens,
random token ids) and output lengths (32–256 tokens, EOS ignored), all arriving at once, run

* through llmopt's engine (continuous batching, chunked prefill, paged KV);
* through ``transformers`` ``generate``, one request at a time;
* through ``transformers`` ``generate`` in static batches of 8 (left padding; a batch runs
  until its longest request is done, only the requested tokens count).

Latencies count from the common arrival time, so queueing is included. Single stream, like
llama-bench: prompt processing of 512 tokens and generation of 128 tokens from a one-token
prompt, median of 5, for both. Results: ``bench/results/runtime.{json,md}``.

    python bench/runtime_vs_hf.py [--threads 2] [--requests 32] [--seed 0]

(``--model``, ``--prompt-len``, ``--output-len``, ``--reps`` and ``--out`` exist for quick trials.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TARGETS = {"vs_one_at_a_time": 3.0, "vs_static_batches": 1.5, "single_stream_decode": 1.5}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class FirstTokenClock:
    """A transformers streamer noting when the first generated token(s) arrive."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # the first call carries the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def produced_tokens(output: torch.Tensor, prompt_len: int) -> int:
    """Tokens ``generate`` actually added after a ``prompt_len``-token prompt (none is an error)."""
    produced = int(output.shape[-1]) - prompt_len
    if produced < 1:
        raise RuntimeError("transformers generate produced no token")
    return produced


def summarize(name: str, per_request: list[dict], duration: float) -> dict:
    from llmopt.runtime.metrics import percentiles

    out_tokens = sum(r["output_tokens"] for r in per_request)
    result = {"name": name, "requests": len(per_request), "duration_s": duration, "output_tokens": out_tokens,
              "output_tok_s": out_tokens / duration,
              "total_tok_s": (out_tokens + sum(r["prompt_tokens"] for r in per_request)) / duration}
    for key in ("ttft", "tpot", "e2e"):
        for q, v in percentiles([r[key] for r in per_request]).items():
            result[f"{key}_{q}_s"] = v
    return result


@torch.inference_mode()
def hf_one_at_a_time(model, workload) -> dict:
    start = time.perf_counter()
    rows = []
    for i, w in enumerate(workload):
        clock = FirstTokenClock()
        out = model.generate(torch.tensor([w.prompt_token_ids]), max_new_tokens=w.max_tokens, do_sample=False,
                             pad_token_id=0, streamer=clock)
        end = time.perf_counter()
        produced = produced_tokens(out, len(w.prompt_token_ids))
        rows.append({"prompt_tokens": len(w.prompt_token_ids), "output_tokens": produced, "ttft": clock.first - start,
                     "tpot": (end - clock.first) / max(produced - 1, 1), "e2e": end - start})
        log(f"  transformers one-at-a-time {i + 1}/{len(workload)}")
    return summarize("transformers, one at a time", rows, time.perf_counter() - start)


@torch.inference_mode()
def hf_static_batches(model, workload, size: int = 8) -> dict:
    start = time.perf_counter()
    rows = []
    for b in range(0, len(workload), size):
        group = workload[b:b + size]
        width = max(len(w.prompt_token_ids) for w in group)
        ids = torch.tensor([[0] * (width - len(w.prompt_token_ids)) + w.prompt_token_ids for w in group])
        mask = torch.tensor([[0] * (width - len(w.prompt_token_ids)) + [1] * len(w.prompt_token_ids) for w in group])
        steps = max(w.max_tokens for w in group)
        clock = FirstTokenClock()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, pad_token_id=0, streamer=clock)
        end = time.perf_counter()
        steps = produced_tokens(out, width)  # every row runs this many steps (no EOS: it is switched off)
        if steps < max(w.max_tokens for w in group):
            raise RuntimeError(f"transformers generated {steps} steps, {max(w.max_tokens for w in group)} requested")
        per_step = (end - clock.first) / max(steps - 1, 1)
        for w in group:  # a request's tokens are ready after its own length, but it returns with the batch
            rows.append({"prompt_tokens": len(w.prompt_token_ids), "output_tokens": w.max_tokens,
                         "ttft": clock.first - start, "tpot": per_step, "e2e": end - start})
        log(f"  transformers static batch {b // size + 1}/{-(-len(workload) // size)} ({end - t0:.1f} s)")
    return summarize(f"transformers, static batches of {size}", rows, time.perf_counter() - start)


@torch.inference_mode()
def single_streams(engine, model, vocab: int, pp: int = 512, tg: int = 128, reps: int = 5, seed: int = 0) -> dict:
    """pp / tg tokens/s of the engine and of transformers ``generate``, median of ``reps``.

    The two alternate within each repetition, so a shared machine's changing load falls on both."""
    import random

    from llmopt.runtime.bench import time_generation, time_prompt

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)

    def hf(ids: torch.Tensor, new: int) -> tuple[float, int]:
        """Seconds, and the tokens processed (prompt, for new == 1) or generated."""
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)
        seconds = time.perf_counter() - t
        return seconds, (ids.shape[1] if new == 1 else produced_tokens(out, ids.shape[1]))

    time_generation(engine, 4, rng)  # warm-up
    hf(torch.randint(100, vocab, (1, 16), generator=gen), 4)
    # (seconds, tokens actually processed / produced) per repetition
    times: dict[str, list[tuple[float, int]]] = {"engine_pp": [], "hf_pp": [], "engine_tg": [], "hf_tg": []}
    for i in range(reps):
        times["engine_pp"].append(time_prompt(engine, pp, rng))
        times["hf_pp"].append(hf(torch.randint(100, vocab, (1, pp), generator=gen), 1))
        times["engine_tg"].append(time_generation(engine, tg, rng))
        times["hf_tg"].append(hf(torch.randint(100, vocab, (1, 1), generator=gen), tg))
        log(f"  single stream repetition {i + 1}/{reps}")

    def rate(key: str) -> float:
        return statistics.median(n / t for t, n in times[key])

    return {
        who: {f"pp{pp}_tok_s": rate(f"{who}_pp"), f"tg{tg}_tok_s": rate(f"{who}_tg"),
              "pp_seconds": [t for t, _ in times[f"{who}_pp"]], "tg_seconds": [t for t, _ in times[f"{who}_tg"]],
              "pp_tokens": [n for _, n in times[f"{who}_pp"]], "tg_tokens": [n for _, n in times[f"{who}_tg"]],
              "repetitions": reps}
        for who in ("engine", "hf")
    }


def engine_serving(engine, workload) -> dict:
    from llmopt.runtime.bench import serving

    done = [0]

    def advance(n: int) -> None:
        done[0] += n
        if done[0] % 8 == 0:
            log(f"  engine {done[0]}/{len(workload)} requests done")

    result = serving(engine, workload, advance)
    result["name"] = "llmopt engine"
    return result


def markdown(report: dict) -> str:
    s = report["serving"]
    lines = [
        f"# Runtime vs transformers ({report['model']})",
        "",
        f"Machine: {report['machine']}, {report['threads']} threads (1-minute load average {report['load_average_before_after'][0]:.1f} "
        f"before, {report['load_average_before_after'][1]:.1f} after; OMP_WAIT_POLICY={report['omp_wait_policy'] or 'unset'}); torch {report['torch']}, transformers "
        f"{report['transformers']}; {report['workload']['requests']} requests, prompt {report['workload']['prompt_len']} "
        f"and output {report['workload']['output_len']} tokens (uniform, seed {report['workload']['seed']}), all arriving at once.",
        "",
        "## Serving workload",
        "",
        "| system | duration s | output tok/s | total tok/s | TTFT p50 / p99 s | TPOT p50 / p99 ms | e2e p50 / p99 s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key in ("engine", "hf_static", "hf_one"):
        r = s[key]
        lines.append(
            f"| {r['name']} | {r['duration_s']:.1f} | {r['output_tok_s']:.1f} | {r['total_tok_s']:.1f} | "
            f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | {1000 * r['tpot_p50_s']:.0f} / {1000 * r['tpot_p99_s']:.0f} | "
            f"{r['e2e_p50_s']:.1f} / {r['e2e_p99_s']:.1f} |")
    e = s["engine"]
    lines += [
        "",
        f"Engine: {e['steps']} steps, {e['preemptions']} preemptions, KV peak {e['kv_bytes_peak_in_use'] / 2**20:.0f} MiB in use "
        f"({100 * e['kv_peak_usage']:.1f}% of the {e['kv_bytes_allocated'] / 2**20:.0f} MiB cache; KV memory is exactly "
        f"blocks × {report['kv_bytes_per_block']} bytes).",
        "",
        f"## Single stream (median of {report['single']['engine']['repetitions']}, engine and transformers alternating)",
        "",
        *([f"Re-measured on their own at {report['single_measured']['when']} (load average "
           f"{report['single_measured']['load_average']:.1f}); earlier figures are kept in runtime.json.", ""]
          if report.get("single_measured") else []),
        "| system | pp512 tok/s | tg128 tok/s |",
        "|---|---:|---:|",
        f"| llmopt engine | {report['single']['engine']['pp512_tok_s']:.1f} | {report['single']['engine']['tg128_tok_s']:.1f} |",
        f"| transformers generate | {report['single']['hf']['pp512_tok_s']:.1f} | {report['single']['hf']['tg128_tok_s']:.1f} |",
        "",
        "## Against the targets",
        "",
        "| ratio | measured | target | met |",
        "|---|---:|---:|:---:|",
    ]
    for key, target in TARGETS.items():
        value = report["ratios"][key]
        lines.append(f"| {key.replace('_', ' ')} | {value:.2f}× | ≥ {target}× | {'yes' if value >= target else 'no'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[32, 512])
    parser.add_argument("--output-len", type=int, nargs=2, default=[32, 256])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--single-only", action="store_true", help="re-measure only the single-stream figures of an earlier run")
    args = parser.parse_args()
    load_before = os.getloadavg()

    torch.set_num_threads(args.threads)
    import transformers
    from llmopt.checkpoints.models import load_model
    from llmopt.runtime import LLMEngine
    from llmopt.runtime.bench import make_workload

    transformers.utils.logging.set_verbosity_error()
    log("loading the engine and the transformers model")
    engine = LLMEngine(args.model, threads=args.threads)
    model, _ = load_model(args.model)
    model.generation_config.eos_token_id = None  # outputs run to their requested lengths
    vocab = engine.arch.vocab_size
    workload = make_workload(args.requests, tuple(args.prompt_len), tuple(args.output_len), vocab, args.seed)

    log("single stream, engine and transformers alternating")
    single = single_streams(engine, model, vocab, reps=args.reps, seed=args.seed)
    if args.single_only:
        update_single(args.out, single)
        return
    log("engine: serving workload")
    engine_result = engine_serving(engine, workload)
    log(f"  {engine_result['output_tok_s']:.1f} output tok/s")
    log("transformers: static batches of 8")
    static = hf_static_batches(model, workload)
    log("transformers: one request at a time")
    one = hf_one_at_a_time(model, workload)

    report = {
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "model": "demo (SmolLM2-135M-Instruct, float32)" if args.model == "demo" else args.model,
        "load_average_before_after": [load_before[0], os.getloadavg()[0]],
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "workload": {"requests": args.requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
                     "seed": args.seed, "arrival": "all at once"},
        "engine_config": {k: getattr(engine.config, k) for k in engine.config.__dataclass_fields__},
        "kv_bytes_per_block": engine.bytes_per_block,
        "serving": {"engine": engine_result, "hf_static": static, "hf_one": one},
        "single": single,
    }
    report["ratios"] = {
        "vs_one_at_a_time": engine_result["output_tok_s"] / one["output_tok_s"],
        "vs_static_batches": engine_result["output_tok_s"] / static["output_tok_s"],
    }
    write(args.out, report)


def single_ratios(report: dict) -> None:
    single = report["single"]
    report["ratios"]["single_stream_decode"] = single["engine"]["tg128_tok_s"] / single["hf"]["tg128_tok_s"]
    report["ratios"]["single_stream_prompt"] = single["engine"]["pp512_tok_s"] / single["hf"]["pp512_tok_s"]


def write(out: Path, report: dict) -> None:
    single_ratios(report)
    out.mkdir(parents=True, exist_ok=True)
    (out / "runtime.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "runtime.md").write_text(markdown(report))
    print(markdown(report))


def update_single(out: Path, single: dict) -> None:
    """Replace the single-stream figures of an earlier full run (``--single-only``)."""
    report = json.loads((out / "runtime.json").read_text())
    report.setdefault("single_earlier", []).append({"single": report["single"], "load_average": report.get("load_average_before_after")})
    report["single"] = single
    report["single_measured"] = {"when": time.strftime("%Y-%m-%d %H:%M"), "load_average": os.getloadavg()[0]}
    write(out, report)


if __name__ == "__main__":
    main()
