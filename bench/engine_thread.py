"""Engine-thread work per generated token outside the model's forward, at short and long outputs,
in one run: what the server's engine thread spends per token on scheduling, sampling, decoding
the text incrementally, stop-string matching and building each stream's chunk.

One streamed request at a time goes through :class:`llmopt.serve.engine_loop.EngineLoop` (the
server's engine thread, without HTTP), greedy, EOS ignored, with a stop string that never matches
(so every token goes through the stop-string path) and ``stream_text``. Timers wrap the engine's
step, the model's forward and the loop's per-step publishing; a token's engine-thread time outside
the forward is ``(step - forward + publish) / tokens``. Each output length is measured in
``--rounds`` alternating rounds; medians are reported, and the long output's figure is also given
as a ratio to the short one's (1.0: independent of output length).

    .venv/bin/python bench/engine_thread.py --model demo --lengths 64 2048
Results: ``bench/results/engine_thread.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from common import cpu_name, log

RESULTS = Path(__file__).resolve().parent / "results"


def timed(clock: dict, name: str, fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock[name] += time.perf_counter() - started

    return wrapper


async def one_request(loop, tokens: int, prompt: list[int]) -> int:
    from llmopt.runtime import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, stop=["\x00never matches"], stream_text=True)
    queue: asyncio.Queue = asyncio.Queue()
    await loop.submit_many(lambda engine: engine.add_request(prompt, params, request_id="r"), ["r"], queue, [params])
    received = 0
    while True:
        _, chunk = await queue.get()
        received += len(chunk.new_token_ids)
        if chunk.finished:
            return received


def measure(model: str, lengths: list[int], rounds: int, threads: int) -> dict:
    from llmopt.runtime import LLMEngine
    from llmopt.runtime.threads import call_in_passing_thread
    from llmopt.serve.engine_loop import EngineLoop

    # built as `llmopt serve` builds it: off the main thread, so the engine thread's OpenMP pool is the only one
    engine = call_in_passing_thread(lambda: LLMEngine(model, max_num_seqs=1, max_model_len=max(lengths) + 64, threads=threads))
    clock: dict[str, float] = defaultdict(float)
    engine.step = timed(clock, "step", engine.step)
    engine.runner.model.forward = timed(clock, "forward", engine.runner.model.forward)
    loop = EngineLoop(engine)
    loop._publish = timed(clock, "publish", loop._publish)
    loop.start()
    prompt = engine.tokenizer("The history of the city begins", add_special_tokens=False).input_ids
    runs: dict[int, list[dict]] = {n: [] for n in lengths}
    try:
        asyncio.run(one_request(loop, 8, prompt))  # warm-up
        for r in range(rounds):
            for n in lengths:
                clock.clear()
                started = time.perf_counter()
                got = asyncio.run(one_request(loop, n, prompt))
                wall = time.perf_counter() - started
                outside = clock["step"] - clock["forward"] + clock["publish"]
                runs[n].append({"tokens": got, "wall_s": wall, "forward_s": clock["forward"], "step_s": clock["step"],
                                "publish_s": clock["publish"], "outside_us_per_token": 1e6 * outside / got,
                                "forward_ms_per_token": 1e3 * clock["forward"] / got})
                log(f"round {r + 1}: {n} tokens: {runs[n][-1]['outside_us_per_token']:.0f} µs/token outside the forward, "
                    f"{runs[n][-1]['forward_ms_per_token']:.2f} ms/token forward")
    finally:
        loop.stop()
    rows = []
    for n in lengths:
        rows.append({"output_tokens": n, "rounds": rounds,
                     "outside_us_per_token": statistics.median(x["outside_us_per_token"] for x in runs[n]),
                     "forward_ms_per_token": statistics.median(x["forward_ms_per_token"] for x in runs[n]),
                     "publish_us_per_token": statistics.median(1e6 * x["publish_s"] / x["tokens"] for x in runs[n]),
                     "runs": runs[n]})
    base = rows[0]["outside_us_per_token"]
    for row in rows:
        row["outside_ratio_to_shortest"] = row["outside_us_per_token"] / base
    return {"model": model, "threads": threads, "cpu": cpu_name(), "python": platform.python_version(), "rows": rows}


def markdown(result: dict) -> str:
    lines = [
        "# Engine-thread work per token, outside the forward",
        "",
        f"Model `{result['model']}`, {result['threads']} threads, {result['cpu']}. One streamed greedy request at a time "
        "through the server's engine loop (no HTTP), a stop string that never matches, medians of "
        f"{result['rows'][0]['rounds']} alternating rounds. Written by `bench/engine_thread.py`.",
        "",
        "| output tokens | engine thread outside the forward (µs/token) | ratio to the shortest | of which publishing (µs/token) | forward (ms/token) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(f"| {row['output_tokens']} | {row['outside_us_per_token']:.0f} | {row['outside_ratio_to_shortest']:.2f} | "
                     f"{row['publish_us_per_token']:.0f} | {row['forward_ms_per_token']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 2048])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    result = measure(args.model, sorted(args.lengths), args.rounds, args.threads)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "engine_thread.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "engine_thread.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
