"""``llmopt serve`` with the official ``openai`` client against a server on a free loopback port
(tiny random model): completions, chat, streaming, stop strings, n, logprobs, errors, auth,
concurrency against ``LLM.generate``, abort freeing KV blocks, admission control, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from click.testing import CliRunner
from conftest import byte_tokenizer, save_model, tiny_llama
from llmopt.cli.main import main
from llmopt.runtime import LLM, SamplingParams
from llmopt.runtime.sampler import apply_openai_penalties
from llmopt.serve import ServeSettings, build, resolve_served_model
from llmopt.serve.metrics import Sample, parse, total

KEY = "sk-test-key"
NAME = "tiny"
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")
ENGINE = dict(max_num_seqs=8, max_model_len=256, block_size=8, num_kv_blocks=512, threads=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    tok = byte_tokenizer()
    tok.chat_template = TEMPLATE
    return save_model(tiny_llama(seed=3), tmp_path_factory.mktemp("serve") / "tiny", tok)


@pytest.fixture(scope="module")
def reference(model_dir) -> LLM:
    return LLM(model_dir, **ENGINE)


@pytest.fixture(scope="module")
def server(model_dir):
    """An in-process server (uvicorn in a thread) with an API key and a small admission limit."""
    from llmopt.runtime import LLMEngine

    port = free_port()
    srv, state = build(lambda: LLMEngine(model_dir, **ENGINE), ServeSettings(NAME, KEY, max_waiting=4), "127.0.0.1", port)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: _get(f"{base}/health").status_code == 200, 900, "the server to be ready")  # a cold kernel cache compiles first
    yield base, state
    srv.should_exit = True
    thread.join(30)
    assert not thread.is_alive()


def _get(url: str, **kw) -> httpx.Response:
    try:
        return httpx.get(url, timeout=5, **kw)
    except httpx.TransportError:
        return httpx.Response(599)


def client(base: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)


def metrics(base: str) -> list[Sample]:
    return parse(_get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


# ---------------------------------------------------------------------------------------------


def test_completions_chat_models_and_usage(server, reference):
    base, _ = server
    api = client(base)
    assert [m.id for m in api.models.list().data] == [NAME]
    prompt = "The capital of France is"
    ref = reference.generate([prompt], greedy(10, ignore_eos=True))[0]
    out = api.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert len(out.choices) == 1 and out.choices[0].finish_reason == "length"
    assert out.choices[0].text == ref.text
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (len(ref.prompt_token_ids), 10,
                                                                                             len(ref.prompt_token_ids) + 10)
    tokens = api.completions.create(model=NAME, prompt=ref.prompt_token_ids, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert tokens.choices[0].text == ref.text  # a prompt of token ids

    chat_ids = reference.engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi there"}], add_generation_prompt=True,
                                                               tokenize=True)
    chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)
    chat_ref = reference.generate([chat_ids], greedy(8, ignore_eos=True))[0]
    chat = api.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi there"}], max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == chat_ref.text
    assert chat.usage.prompt_tokens == len(chat_ids) and chat.usage.completion_tokens == 8


def test_logprobs_n_seed_and_penalties(server, reference):
    base, _ = server
    api = client(base)
    prompt = "Logprobs"
    ref = reference.generate([prompt], greedy(6, logprobs=3, ignore_eos=True))[0]
    out = api.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for got, want, token, top in zip(lp.token_logprobs, ref.logprobs, ref.token_ids, lp.top_logprobs):
        assert got == pytest.approx(want[token], abs=1e-4)
        assert len(top) <= 3 and max(top.values()) == pytest.approx(max(want.values()), abs=1e-4)
    chat = api.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)

    sampled = dict(model=NAME, prompt="Sample", max_tokens=12, temperature=1.0, n=3, seed=11, extra_body={"ignore_eos": True})
    first, again = api.completions.create(**sampled), api.completions.create(**sampled)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded: reproducible
    assert len({c.text for c in first.choices}) > 1  # each choice gets its own seed
    assert first.usage.completion_tokens == 36
    pen = api.completions.create(model=NAME, prompt="Sample", max_tokens=12, temperature=0, presence_penalty=2.0, frequency_penalty=2.0,
                                 extra_body={"ignore_eos": True})
    assert pen.choices[0].finish_reason == "length"

    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    want = logits - torch.tensor([0.0, 0.5 + 0.25 * 2, 0.0, 0.5 + 0.25])
    assert torch.allclose(apply_openai_penalties(logits, [1, 3, 1], 0.5, 0.25), want)


def test_streaming_and_stop_strings(server, reference):
    base, _ = server
    api = client(base)
    prompt = "Stream me"
    full = api.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    chunks = list(api.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices
    assert "".join(c.choices[0].text for c in chunks[:-1]) == full
    assert chunks[-2].choices[0].finish_reason == "length"

    # a stop string from the middle of the greedy text: the text ends right before it, streamed or not
    at = next(i for i in range(3, len(full) - 2) if "\ufffd" not in full[i:i + 2] and full.find(full[i:i + 2]) == i)
    stop = full[at:at + 2]
    out = api.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].text == full[:at] and out.choices[0].finish_reason == "stop"
    streamed = list(api.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, stop=stop, stream=True,
                                           extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == full[:at]
    assert streamed[-1].choices[0].finish_reason == "stop"

    chat_full = api.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "s"}], max_tokens=10, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].message.content
    events = list(api.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "s"}], max_tokens=10, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True}))
    assert events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events) == chat_full
    assert events[-1].choices[0].finish_reason == "length"


def test_errors_have_openai_shape_and_auth(server):
    base, _ = server
    api = client(base)
    with pytest.raises(openai.BadRequestError) as bad:
        api.completions.create(model=NAME, prompt="x", max_tokens=4, temperature=-1)
    error = bad.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as long_prompt:
        api.completions.create(model=NAME, prompt="y" * 300, max_tokens=4)
    assert long_prompt.value.response.json()["error"]["code"] == "context_length_exceeded"
    assert "256" in long_prompt.value.response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        api.completions.create(model=NAME, prompt="y" * 200, max_tokens=100)
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="did you mean 'temperature'"):  # a near-miss of a known field: a typo
        api.completions.create(model=NAME, prompt="x", extra_body={"temprature": 0})
    with pytest.raises(openai.AuthenticationError):
        client(base, "wrong").completions.create(model=NAME, prompt="x", max_tokens=2)
    assert httpx.get(f"{base}/metrics").status_code == 401
    assert httpx.get(f"{base}/v1/models").json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{base}/health").status_code == 200  # health needs no key
    assert total(metrics(base), "llmopt:http_requests_total", endpoint="/v1/completions", status="400") >= 3


def test_concurrent_clients_get_the_tokens_of_llm_generate(server, reference):
    base, _ = server
    prompts = [f"Client {i} says" + " hello" * (i % 4) for i in range(12)]
    refs = [o.text for o in reference.generate(prompts, greedy(12, ignore_eos=True))]
    results: dict[int, str] = {}

    def ask(i: int) -> None:
        out = client(base).completions.create(model=NAME, prompt=prompts[i], max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        results[i] = out.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == len(prompts)
    assert [results[i] for i in range(len(prompts))] == refs


def test_abort_mid_stream_frees_every_block(server):
    base, state = server
    before = metrics(base)
    aborted_before = total(before, "vllm:request_success_total", finished_reason="abort")
    stream = client(base).completions.create(model=NAME, prompt="Abort me", max_tokens=240, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += 1
        if received == 3:
            break
    assert state.loop.engine.block_manager.num_used_blocks > 0 or state.in_flight == 1
    stream.close()
    wait_until(lambda: state.in_flight == 0 and state.loop.snapshot["kv_blocks_used"] == 0 and state.loop.snapshot["running"] == 0,
               what="the aborted request's blocks to be freed")
    bm = state.loop.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    after = metrics(base)
    assert total(after, "vllm:kv_cache_usage_perc") == 0
    assert total(after, "vllm:request_success_total", finished_reason="abort") == aborted_before + 1


def test_admission_control_429_and_503(server):
    base, state = server
    api = client(base)
    capacity = ENGINE["max_num_seqs"] + 4
    state.loop.pause()  # hold the engine so admitted requests stay in flight
    done: dict = {}
    try:
        holder = threading.Thread(target=lambda: done.update(out=api.completions.create(
            model=NAME, prompt="hold", max_tokens=3, temperature=0, n=capacity, extra_body={"ignore_eos": True})))
        holder.start()
        wait_until(lambda: state.in_flight == capacity, what="the held request to be admitted")
        with pytest.raises(openai.RateLimitError) as full:
            api.completions.create(model=NAME, prompt="one more", max_tokens=2)
        assert full.value.response.json()["error"]["code"] == "queue_full"
        assert total(metrics(base), "vllm:num_requests_waiting", model_name=NAME) == capacity
        state.draining = True
        try:
            with pytest.raises(openai.APIStatusError) as draining:
                api.completions.create(model=NAME, prompt="x", max_tokens=2)
            assert draining.value.status_code == 503
            assert httpx.get(f"{base}/health").status_code == 503
        finally:
            state.draining = False
    finally:
        state.loop.resume()
    holder.join(60)
    assert len(done["out"].choices) == capacity and all(c.finish_reason == "length" for c in done["out"].choices)
    assert state.in_flight == 0


def test_saved_runtime_settings_and_cli_errors(tmp_path, model_dir):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in model_dir.iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    (ckpt / "llmopt.json").write_text(json.dumps({"runtime": {"max_num_seqs": 3, "block_size": 4}}))
    assert resolve_served_model(str(ckpt))[:2] == (str(ckpt), {"max_num_seqs": 3, "block_size": 4})
    run_dir = tmp_path / "recipe-out"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"final": str(model_dir)}))
    (run_dir / "recipe.resolved.json").write_text(json.dumps({"runtime": {"max_num_batched_tokens": 64}}))
    assert resolve_served_model(str(run_dir))[:2] == (str(model_dir), {"max_num_batched_tokens": 64})
    (ckpt / "llmopt.json").write_text(json.dumps({"runtime": {"max_num_seq": 3}}))
    runner = CliRunner()
    result = runner.invoke(main, ["serve", str(ckpt), "--port", str(free_port())])
    assert result.exit_code == 2 and "unknown runtime setting 'max_num_seq'" in result.output
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        result = runner.invoke(main, ["serve", str(model_dir), "--port", str(busy.getsockname()[1])])
    assert result.exit_code == 2 and "already in use" in result.output and "Traceback" not in result.output


def test_sigterm_finishes_in_flight_requests_and_exits_0(model_dir):
    port = free_port()
    env = {**os.environ, "LLMOPT_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "llmopt", "serve", str(model_dir), "--port", str(port), "--served-model-name", NAME,
                             "--threads", "1", "--max-model-len", "256", "--shutdown-timeout", "30"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _get(f"{base}/health").status_code == 200, 900, "the server subprocess")
        stream = client(base).completions.create(model=NAME, prompt="Shut down", max_tokens=200, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True})
        chunks = [next(iter(stream))]
        proc.send_signal(signal.SIGTERM)
        chunks += list(stream)  # the request in flight still finishes
        assert chunks[-1].choices[0].finish_reason == "length"
        assert proc.wait(60) == 0, proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with pytest.raises(httpx.TransportError):  # and nothing listens any more
        httpx.get(f"{base}/health")


def test_batched_prompts_and_echo_with_prompt_logprobs(server, reference):
    """A batch of prompts gets n choices each (index = prompt * n + choice); ``echo`` puts the
    prompt before each text and, with ``logprobs``, its tokens' log-probabilities (the first None)
    before the generated ones, as lm-evaluation-harness's ``local-completions`` reads them."""
    base, state = server
    api = client(base)
    prompts = ["Alpha beta", "The capital of France is", "x"]
    refs = reference.generate(prompts, greedy(5, ignore_eos=True, logprobs=2, prompt_logprobs=2))
    out = api.completions.create(model=NAME, prompt=prompts, max_tokens=5, temperature=0, n=2, extra_body={"ignore_eos": True})
    assert len(out.choices) == 6 and [c.index for c in out.choices] == list(range(6))
    assert [c.text for c in out.choices] == [r.text for r in refs for _ in range(2)]
    assert out.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs) and out.usage.completion_tokens == 30

    ids = [r.prompt_token_ids for r in refs]
    echoed = api.completions.create(model=NAME, prompt=ids, max_tokens=5, temperature=0, logprobs=2, echo=True,
                                    extra_body={"ignore_eos": True})
    assert len(echoed.choices) == 3
    for choice, ref in zip(echoed.choices, refs):
        lp = choice.logprobs
        n_prompt = len(ref.prompt_token_ids)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + 5
        assert choice.text == reference.engine.tokenizer.decode(ref.prompt_token_ids) + ref.text
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i in range(1, n_prompt):
            assert lp.token_logprobs[i] == pytest.approx(ref.prompt_logprobs[i][ref.prompt_token_ids[i]], abs=1e-4)
            assert max(lp.top_logprobs[i].values()) == pytest.approx(max(ref.prompt_logprobs[i].values()), abs=1e-4)
        for got, want, token in zip(lp.token_logprobs[n_prompt:], ref.logprobs, ref.token_ids):
            assert got == pytest.approx(want[token], abs=1e-4)

    text = "".join(e.choices[0].text for e in api.completions.create(
        model=NAME, prompt=prompts[1], max_tokens=5, temperature=0, echo=True, stream=True, extra_body={"ignore_eos": True}))
    assert text == prompts[1] + refs[1].text  # a text prompt is echoed as sent
    too_many = httpx.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                          json={"model": NAME, "prompt": ["a"] * 7, "n": 2, "max_tokens": 2})
    assert too_many.status_code == 400 and "prompts" in too_many.json()["error"]["message"]
    wait_until(lambda: state.in_flight == 0, 30, "every slot to be released")
