"""Load benchmark of ``llmopt serve`` through HTTP, and of llama.cpp's own OpenAI-compatible
server (``llama-cpp-python[server]``) on the GGUF export of the same checkpoint, in one run.

An async load generator on loopback sends streaming completions (greedy, EOS ignored) in phases:
Poisson arrivals at 1 request/s with 32–64-token prompts and 128 output tokens (the latency
target), Poisson arrivals at higher rates and a burst with prompt / output lengths drawn like
``bench/runtime_vs_hf.py`` (32–512 / 32–256 tokens, bounded by ``--prompt-len`` /
``--output-len``); a seeded 10% of the streams are closed by the client half-way. Per phase:
output tokens/s, TTFT / TPOT / end-to-end p50 / p99 measured at the client, error counts by
status; per server: KV blocks in use after the run (from /metrics; must be 0) and the server's
RSS after warm-up and after the run. Each phase is bounded in requests and in seconds; requests
still open at the deadline are closed and counted as ``unfinished``.

llama.cpp's server gets the same requests, with every special token's logit biased to -100
(our server ignores EOS for the benchmark) and ``--interrupt_requests False`` (by default a new
request cuts the running one short, which ended most of its streams after a few tokens); it
serves one request at a time. It is measured only when its Python (``--llamacpp-python``, default
/opt/llamacpp/bin/python) and the GGUF file exist; otherwise the results say it was not measured.

    python bench/serve_load.py --model /tmp/w4-serve --gguf /tmp/w4.gguf
Results: ``bench/results/serve_load.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
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
    at: float  # seconds after the phase starts
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
    return reqs


async def one(client: httpx.AsyncClient, base: str, req: Req, extra: dict, start: float, rows: list) -> None:
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
        tasks = [asyncio.create_task(one(client, base, r, extra, start, rows)) for r in reqs]
        done, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start
    return summarize(rows, duration, len(reqs))


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
            if httpx.get(f"{base}/health", timeout=2).status_code == 200 or httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become ready in time")


def measure(label: str, cmd: list[str], extra: dict, phases: list[tuple[str, list[Req]]], deadline_s: float, kv_metrics: bool,
            soak_deadline_s: float = 0.0) -> dict:
    port = free_port()
    cmd = [c.replace("{port}", str(port)) for c in cmd]
    log(f"{label}: starting {' '.join(cmd)}")
    # the server's log goes to a file: an unread pipe fills up and blocks a chatty server (llama.cpp)
    log_file = tempfile.NamedTemporaryFile("w+", prefix=f"serve-{label}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    result: dict = {"command": " ".join(cmd), "phases": {}}
    try:
        wait_ready(base, proc, 600, log_file.name)
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
        log_file.close()
        os.unlink(log_file.name)
    return result


def _share(phase: dict) -> str:
    """Tokens the completed requests got over the tokens they asked for (1.00: none stopped early)."""
    asked = phase.get("requested_tokens")
    return f"{phase['completed_tokens'] / asked:.2f}" if asked else "—"


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1000:.0f} ms"


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def write_md(data: dict, path: Path) -> None:
    lines = ["# `llmopt serve` under load (HTTP, streaming, measured at the client)", "",
             f"Model: `{data['model']}` (llmopt runtime) and `{data['gguf']}` (llama.cpp server); {data['machine']}, "
             f"{data['threads']} threads each; greedy, EOS ignored, {int(data['cancel_frac'] * 100)}% of streams closed half-way. "
             f"Each phase is bounded to {data['phase_deadline_s']:.0f} s; requests still open then are `unfinished`. "
             f"Load average when the run started: {', '.join(f'{x:.1f}' for x in data.get('load_average_at_start', []))}.", "",
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
    lines += ["", "| server | RSS after warm-up | RSS after run | ratio | KV blocks in use after | exit code after SIGTERM |", "|---|---:|---:|---:|---:|---:|"]
    for label, server in data["servers"].items():
        if "not_measured" in server:
            continue
        lines.append(f"| {label} | {server['rss_after_warmup_mib']:.0f} MiB | {server['rss_after_run_mib']:.0f} MiB | {server['rss_ratio']:.3f} | "
                     f"{server.get('kv_blocks_used_after', '—')} | {server.get('exit_code')} |")
    if data.get("ratios"):
        lines += ["", "Output tokens/s, llmopt / llama.cpp, same phase: " + ", ".join(f"{k} {v:.2f}x" for k, v in data["ratios"].items())]
    lines += [""] + [f"- {line}" for line in target_lines(data)]
    path.write_text("\n".join(lines) + "\n")


def target_lines(data: dict) -> list[str]:
    """The issue's targets against this run's figures."""
    ours = data["servers"].get("llmopt", {})
    phases = ours.get("phases", {})
    lines = []
    latency = phases.get("latency")
    if latency and latency["ttft_p50_s"] is not None:
        ok = latency["ttft_p50_s"] <= 0.150 and (latency["tpot_p50_s"] or 1) <= 0.050
        lines.append(f"1 request/s (prompts 32–64, 128 output tokens): TTFT p50 {_ms(latency['ttft_p50_s'])} (target ≤ 150 ms), "
                     f"TPOT p50 {_ms(latency['tpot_p50_s'])} (target ≤ 50 ms): {'met' if ok else 'missed'}.")
    soak = phases.get("soak")
    if soak:
        ok = soak["errors_5xx"] == 0 and ours.get("kv_blocks_used_after") == 0 and ours.get("rss_ratio", 9) <= 1.1
        lines.append(f"Soak, {soak['requests']} requests at {data['soak']['rate']:g}/s with {data['cancel_frac']:.0%} cancelled: "
                     f"{soak['completed']} completed, {soak['cancelled']} cancelled, {soak['unfinished']} unfinished, "
                     f"{soak['errors_5xx']} 5xx, KV blocks in use after {ours.get('kv_blocks_used_after')}, RSS after / after warm-up "
                     f"{ours.get('rss_ratio', float('nan')):.3f} (targets 0, 0, ≤ 1.1): {'met' if ok else 'missed'}.")
    llama = data["servers"].get("llama.cpp", {}).get("phases", {})
    for name, ratio in data.get("ratios", {}).items():
        shares = f"tokens / asked of completed requests: llmopt {_share(phases[name])}, llama.cpp {_share(llama[name])}"
        lines.append(f"Output tokens/s against llama.cpp's server, phase {name}: {ratio:.2f}× (target ≥ 1.5×): "
                     f"{'met' if ratio >= 1.5 else 'missed'} ({shares}).")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint served by llmopt serve (e.g. the demo's W4A16)")
    ap.add_argument("--gguf", help="GGUF export of the same checkpoint, served by llama.cpp")
    ap.add_argument("--llamacpp-python", default="/opt/llamacpp/bin/python")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--latency-requests", type=int, default=40, help="requests of the latency phase (Poisson 1/s, prompts 32–64, 128 output tokens)")
    ap.add_argument("--rates", default="2", help="comma-separated Poisson rates (requests/s) of the load phases")
    ap.add_argument("--rate-requests", type=int, default=100)
    ap.add_argument("--burst", type=int, default=50, help="requests of the burst phase (0: none)")
    ap.add_argument("--soak-requests", type=int, default=0,
                    help="requests of a last, llmopt-only soak phase (latency-phase lengths, 0: none)")
    ap.add_argument("--soak-rate", type=float, default=1.0, help="Poisson rate of the soak phase (requests/s)")
    ap.add_argument("--soak-deadline", type=float, default=1500.0, help="seconds of the soak phase at most")
    ap.add_argument("--prompt-len", default="32:512")
    ap.add_argument("--output-len", default="32:256")
    ap.add_argument("--cancel-frac", type=float, default=0.1)
    ap.add_argument("--phase-deadline", type=float, default=300.0, help="seconds per phase at most")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--out", default=str(RESULTS / "serve_load"))
    args = ap.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompt_len, output_len = _range(args.prompt_len), _range(args.output_len)
    specs = [("latency", args.latency_requests, 1.0, (32, 64), (128, 128))]
    specs += [(f"rate-{r}/s", args.rate_requests, float(r), prompt_len, output_len) for r in args.rates.split(",") if r]
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
        "phase_specs": [{"name": n, "requests": c, "arrivals": f"Poisson {r}/s" if r else "all at once",
                         "prompt_len": f"{pl[0]}–{pl[1]}", "output_len": f"{ol[0]}–{ol[1]}"} for n, c, r, pl, ol in specs],
        "load_average_at_start": os.getloadavg(),
        "servers": {},
    }
    ours = [sys.executable, "-m", "llmopt", "serve", args.model, "--port", "{port}", "--served-model-name", NAME,
            "--threads", str(args.threads), "--max-num-seqs", str(args.max_num_seqs), "--max-waiting", "1024"]
    data["servers"]["llmopt"] = measure("llmopt", ours, {"ignore_eos": True}, phases, args.phase_deadline, kv_metrics=True,
                                        soak_deadline_s=args.soak_deadline)
    phases = [(name, reqs) for name, reqs in phases if name != "soak"]  # the soak checks our server only

    llama_py = Path(args.llamacpp_python)
    importable = llama_py.is_file() and subprocess.run([str(llama_py), "-c", "import llama_cpp.server"], capture_output=True).returncode == 0
    if not importable:
        data["servers"]["llama.cpp"] = {"not_measured": f"{llama_py} cannot import llama_cpp.server (llama-cpp-python[server] not installed)"}
    elif not args.gguf or not Path(args.gguf).is_file():
        data["servers"]["llama.cpp"] = {"not_measured": f"no GGUF file ({args.gguf})"}
    else:
        special = sorted(set(tokenizer.all_special_ids) | {tokenizer.eos_token_id})
        cmd = [str(llama_py), "-m", "llama_cpp.server", "--model", args.gguf, "--model_alias", NAME, "--host", "127.0.0.1",
               "--port", "{port}", "--n_threads", str(args.threads), "--n_ctx", "2048",
               "--interrupt_requests", "False"]  # its default cuts the running request short when another arrives
        try:
            data["servers"]["llama.cpp"] = measure("llama.cpp", cmd, {"logit_bias": {str(t): -100 for t in special}}, phases, args.phase_deadline,
                                                   kv_metrics=False)
        except RuntimeError as exc:
            data["servers"]["llama.cpp"] = {"not_measured": f"the server failed: {exc}"}
    llama = data["servers"]["llama.cpp"]
    if "phases" in llama:
        data["ratios"] = {name: data["servers"]["llmopt"]["phases"][name]["output_tok_s"] / p["output_tok_s"]
                          for name, p in llama["phases"].items() if p["output_tok_s"]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    write_md(data, out.with_suffix(".md"))
    log(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
