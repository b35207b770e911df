"""``llmopt serve`` under bad input and faults (tiny random model, in-process server on a free
loopback port): every bad request gets a 4xx in OpenAI's error shape, never a 5xx; an injected
engine-loop error fails only the requests it touched (500), frees their KV blocks and the engine
carries on; errors that keep coming mark the engine dead (/health 503, the server stops); the
admission slot is released when the engine finishes a request, whoever reads it."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import byte_tokenizer, save_model, tiny_llama
from llmopt.runtime import LLM, SamplingParams
from llmopt.serve import ServeSettings, build, create_app
from llmopt.serve.metrics import Sample, parse, total
from llmopt.serve.server import EngineFailed
from llmopt.serve.settings import ServeLimits
from test_serve import free_port, wait_until

KEY = "sk-faults"
NAME = "tiny"
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")
# the plain-torch kernels: no C++ build to wait for (the serving layer is under test, not the kernels)
ENGINE = dict(max_num_seqs=4, max_model_len=256, block_size=8, num_kv_blocks=160, threads=1, kernels="reference")
MAX_WAITING = 4
CAPACITY = ENGINE["max_num_seqs"] + MAX_WAITING
LIMITS = ServeLimits(max_body_bytes=2 * 2**20)  # the 200,000-word prompt (400 kB) fits; 3 MB does not
AUTH = {"Authorization": f"Bearer {KEY}"}


def _get(url: str) -> httpx.Response:
    try:
        return httpx.get(url, timeout=5)
    except httpx.TransportError:
        return httpx.Response(599)


def metrics_of(served) -> list[Sample]:
    return parse(httpx.get(f"{served.base}/metrics", headers=AUTH, timeout=5).text)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    tok = byte_tokenizer()
    tok.chat_template = TEMPLATE
    return save_model(tiny_llama(seed=5), tmp_path_factory.mktemp("faults") / "tiny", tok)


class Served:
    """A server in a thread: ``base`` URL, ``state``; ``error`` is what ``run()`` raised;
    ``listener``: a listening socket to serve on (default: a free port)."""

    def __init__(self, model_dir: Path, listener: socket.socket | None = None, **settings) -> None:
        from llmopt.runtime import LLMEngine

        port = listener.getsockname()[1] if listener is not None else free_port()
        self.srv, self.state = build(lambda: LLMEngine(model_dir, **ENGINE),
                                     ServeSettings(NAME, KEY, MAX_WAITING, **settings), "127.0.0.1", port)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(listener,), daemon=True)
        self.thread.start()
        self.base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _get(f"{self.base}/health").status_code == 200, 900, "the server to be ready")

    def _run(self, listener: socket.socket | None) -> None:
        try:
            self.srv.run(sockets=[listener] if listener is not None else None)
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            self.error = exc

    def stop(self) -> None:
        self.srv.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()

    def post(self, path: str, body, timeout: float = 60, **kw) -> httpx.Response:
        kw.setdefault("headers", AUTH)
        if isinstance(body, (dict, list)):
            kw["json"] = body
        else:
            kw["content"] = body
        return httpx.post(f"{self.base}{path}", timeout=timeout, **kw)

    @property
    def loop(self):
        return self.state.loop

    def assert_no_leaks(self) -> None:
        """No admission slot held, every KV block free, nothing running, /health 200."""
        bm = self.loop.engine.block_manager
        wait_until(lambda: self.state.in_flight == 0 and bm.num_free_blocks == bm.num_blocks
                   and not self.loop.engine.has_unfinished(), what="slots and blocks to be released")
        assert _get(f"{self.base}/health").status_code == 200


@pytest.fixture(scope="module")
def server(model_dir):
    served = Served(model_dir, limits=LIMITS)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def reference(model_dir) -> LLM:
    return LLM(model_dir, **ENGINE)


def completion(**kw) -> dict:
    return {"model": NAME, "prompt": "Hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True, **kw}


def chat(content, **kw) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 4, "ignore_eos": True, **kw}


def assert_error(response: httpx.Response, status: int, param: str | None = "", code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param != "":
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


# -- bad input: a 4xx each, never a 5xx ----------------------------------------------------------

BAD = {
    "seed 2**70": ("/v1/completions", completion(seed=2**70), 400, "seed"),
    "seed -2**70": ("/v1/completions", completion(seed=-2**70), 400, "seed"),
    "n 10**6": ("/v1/completions", completion(n=10**6), 400, "n"),
    "n above capacity": ("/v1/completions", completion(n=CAPACITY + 1), 400, "n"),
    "stop of 100,000 characters": ("/v1/completions", completion(stop="x" * 100_000), 400, "stop"),
    "too many stop strings": ("/v1/completions", completion(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    "empty stop string": ("/v1/completions", completion(stop=[""]), 400, "stop"),
    "prompt of 200,000 words": ("/v1/completions", completion(prompt="a " * 200_000), 400, "prompt"),
    "prompt of 300 token ids": ("/v1/completions", completion(prompt=[5] * 300), 400, "prompt"),
    "token id outside the vocabulary": ("/v1/completions", completion(prompt=[5, 10**9]), 400, "prompt"),
    "empty prompt": ("/v1/completions", completion(prompt=""), 400, "prompt"),
    "max_tokens 10**9": ("/v1/completions", completion(max_tokens=10**9), 400, "max_tokens"),
    "chat max_tokens 10**9": ("/v1/chat/completions", chat("hi", max_tokens=10**9), 400, "max_tokens"),
    "chat max_completion_tokens 10**9": ("/v1/chat/completions", {**chat("hi"), "max_tokens": None, "max_completion_tokens": 10**9},
                                         400, "max_tokens"),
    "content part text not a string": ("/v1/chat/completions", chat([{"type": "text", "text": 5}]), 400, "messages.0.content"),
    "content part without text": ("/v1/chat/completions", chat([{"type": "text"}]), 400, "messages.0.content"),
    "image content part": ("/v1/chat/completions", chat([{"type": "image_url", "image_url": {"url": "x"}}]), 400, "messages.0.content"),
    "chat of 200,000 words": ("/v1/chat/completions", chat("a " * 200_000), 400, "messages"),
    "temperature above 2": ("/v1/completions", completion(temperature=2.5), 400, "temperature"),
    "near-miss of a known field": ("/v1/completions", completion(temprature=0), 400, "temprature"),
    "wrong model": ("/v1/completions", completion(model="other"), 404, "model"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_4xx_with_the_openai_error_shape(server, case):
    path, body, status, param = BAD[case]
    assert_error(server.post(path, body), status, param)


def test_raw_bodies_too_large_or_malformed(server):
    limit = LIMITS.max_body_bytes
    big = json.dumps(completion(prompt="b" * (limit + 1000))).encode()
    error = assert_error(server.post("/v1/completions", big, headers={**AUTH, "Content-Type": "application/json"}), 413, None,
                         "request_too_large")
    assert str(limit) in error["message"]

    def chunked():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    assert_error(server.post("/v1/completions", chunked(), headers={**AUTH, "Content-Type": "application/json"}), 413, None,
                 "request_too_large")
    small = json.dumps(completion(max_tokens=2)).encode()
    assert server.post("/v1/completions", iter([small[:10], small[10:]]), headers={**AUTH, "Content-Type": "application/json"}
                       ).status_code == 200  # a chunked body under the limit is served
    for raw in (b"{not json", b"[]", b"null", json.dumps(completion(prompt="\ud800")).encode()):
        response = server.post("/v1/completions", raw, headers={**AUTH, "Content-Type": "application/json"})
        assert 400 <= response.status_code < 500, (raw, response.text)
    deep = b"[" * 100_000 + b"]" * 100_000  # the JSON parser's recursion limit
    assert_error(server.post("/v1/completions", deep, headers={**AUTH, "Content-Type": "application/json"}), 400)
    assert_error(httpx.get(f"{server.base}/v1/nothing", headers=AUTH), 404, None, "not_found")
    assert_error(httpx.get(f"{server.base}/v1/completions", headers=AUTH), 405, None, "method_not_allowed")
    surrogate = json.dumps(completion(model="\ud800")).encode()  # a lone surrogate, quoted back in the message
    assert_error(server.post("/v1/completions", surrogate, headers={**AUTH, "Content-Type": "application/json"}), 404, "model")


def test_accepted_edge_values(server, reference):
    # a temperature below ServeLimits.greedy_below is greedy (no NaN sampling): the greedy text
    want = reference.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].text
    for temperature in (1e-30, 1e-300, 5e-324):
        out = server.post("/v1/completions", completion(max_tokens=8, temperature=temperature))
        assert out.status_code == 200 and out.json()["choices"][0]["text"] == want
    # 64-bit seeds, negative ones included (vLLM's range), each of n choices seeded in turn
    for seed in (-1, -2**63, 2**63 - 1):
        out = server.post("/v1/completions", completion(seed=seed, temperature=1.0, n=2))
        assert out.status_code == 200 and len(out.json()["choices"]) == 2, out.text
    out = server.post("/v1/completions", completion(n=CAPACITY))  # n up to the capacity is admitted
    assert out.status_code == 200 and len(out.json()["choices"]) == CAPACITY
    server.assert_no_leaks()


EXTREMES = (0, -1, 1e-30, 1e-300, 1e30, 2**70, -(2**70), 1e308, -1e308, 0.5)
FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
          "max_tokens", "n", "seed", "logprobs")


def test_extreme_numbers_never_give_a_5xx(server):
    """Every sampling field at the extremes of its type: refused or served, never a 5xx."""
    failures = []
    for name in FIELDS:
        for value in EXTREMES:
            body = {**completion(max_tokens=2, temperature=1.0, seed=1), name: value}
            response = server.post("/v1/completions", body)
            if response.status_code >= 500:
                failures.append((name, value, response.text[:200]))
    for value in EXTREMES:
        response = server.post("/v1/chat/completions", chat("x", logprobs=True, top_logprobs=value, temperature=1.0))
        if response.status_code >= 500:
            failures.append(("top_logprobs", value, response.text[:200]))
    assert not failures
    server.assert_no_leaks()


# -- faults: the requests an error touched fail, the engine carries on --------------------------

def _ask(server: Served, results: dict, key, body, path="/v1/completions") -> threading.Thread:
    def run():
        results[key] = server.post(path, body)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_failing_output_fails_that_request_alone(server, monkeypatch):
    loop = server.loop
    real = loop._chunk
    fired = []

    def chunk(stream, out):  # detokenizing one request's output breaks, once
        if stream.params.max_tokens == 7 and not fired:
            fired.append(stream.request_id)
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(stream, out)

    monkeypatch.setattr(loop, "_chunk", chunk)
    errors_before = loop.errors
    results: dict = {}
    threads = [_ask(server, results, i, completion(prompt=f"Request {i}", max_tokens=7 if i == 1 else 12)) for i in range(3)]
    stream_events = []

    def streamed():
        with httpx.stream("POST", f"{server.base}/v1/completions", json=completion(prompt="S", max_tokens=12, stream=True),
                          headers=AUTH, timeout=60) as r:
            stream_events.extend(line for line in r.iter_lines() if line.startswith("data: "))

    threads.append(threading.Thread(target=streamed))
    threads[-1].start()
    for t in threads:
        t.join(60)
    assert fired
    error = assert_error(results[1], 500, None, "engine_error")
    assert error["type"] == "internal_server_error" and "injected" in error["message"]
    for i in (0, 2):
        assert results[i].status_code == 200 and results[i].json()["choices"][0]["finish_reason"] == "length"
    assert stream_events[-1] == "data: [DONE]" and json.loads(stream_events[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert loop.errors == errors_before + 1 and loop.healthy
    server.assert_no_leaks()

    # streamed, the failure is an error event in OpenAI's shape and the stream ends
    fired.clear()
    with httpx.stream("POST", f"{server.base}/v1/completions", json=completion(max_tokens=7, stream=True), headers=AUTH,
                      timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert fired and events[-1]["error"]["code"] == "engine_error"
    server.assert_no_leaks()


def test_a_failing_step_fails_the_running_requests_and_the_engine_carries_on(server, monkeypatch):
    loop, engine = server.loop, server.loop.engine
    real = engine.step
    calls = [0]

    def step():  # the second step raises (X is running then; Y still waits for a free sequence slot)
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("injected step failure")
        return real()

    results: dict = {}
    loop.pause()
    try:
        x = _ask(server, results, "x", completion(prompt="X", n=ENGINE["max_num_seqs"], max_tokens=12))
        wait_until(lambda: server.state.in_flight == ENGINE["max_num_seqs"], what="X to be admitted")
        y = _ask(server, results, "y", completion(prompt="Y", max_tokens=12))
        wait_until(lambda: server.state.in_flight == ENGINE["max_num_seqs"] + 1, what="Y to be admitted")
        wait_until(lambda: len(engine.scheduler.waiting) == ENGINE["max_num_seqs"] + 1, what="both to be queued")
        monkeypatch.setattr(engine, "step", step)
    finally:
        loop.resume()
    x.join(60)
    y.join(60)
    error = assert_error(results["x"], 500, None, "engine_error")
    assert "injected step failure" in error["message"]
    assert results["y"].status_code == 200 and results["y"].json()["choices"][0]["finish_reason"] == "length"
    assert loop.healthy and calls[0] > 2
    server.assert_no_leaks()
    after = server.post("/v1/completions", completion(max_tokens=3))
    assert after.status_code == 200


def test_a_lost_output_fails_its_request_instead_of_hanging(server, monkeypatch):
    """Publishing a step's outputs fails outside any one request (after the engine finished some
    of them): those requests get a 500, not a hang, and their blocks are free."""
    loop = server.loop
    real = loop._publish
    fired = []

    def publish(outputs):
        if any(o.finished for o in outputs) and not fired:
            fired.append(True)
            raise RuntimeError("injected publish failure")
        return real(outputs)

    monkeypatch.setattr(loop, "_publish", publish)
    response = server.post("/v1/completions", completion(max_tokens=1), timeout=30)
    assert fired
    assert_error(response, 500, None, "engine_error")
    server.assert_no_leaks()
    assert server.post("/v1/completions", completion(max_tokens=2)).status_code == 200


def test_failing_metrics_do_not_stop_serving(server, monkeypatch):
    loop = server.loop

    def broken():
        raise ZeroDivisionError("injected metrics failure")

    monkeypatch.setattr(loop, "_snapshot", broken)
    errors_before = loop.errors
    out = server.post("/v1/completions", completion(max_tokens=5))
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 5
    assert httpx.get(f"{server.base}/metrics", headers=AUTH).status_code == 200
    assert loop.healthy and loop.errors == errors_before
    monkeypatch.undo()
    server.assert_no_leaks()


# -- admission: released by the engine, not by the reader ------------------------------------------

def test_a_stalled_reader_does_not_pin_its_slot(server):
    """The client stops reading after the first event: the engine finishes the request and the
    slot is free at once, while the response is still stuck in ``send``."""
    state = server.state
    app = create_app(state)
    body = json.dumps(completion(max_tokens=16, stream=True)).encode()

    async def main() -> None:
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 5000),
                 "headers": [(b"authorization", f"Bearer {KEY}".encode()), (b"content-type", b"application/json"),
                             (b"content-length", str(len(body)).encode())]}
        stalled, never = asyncio.Event(), asyncio.Event()
        delivered = []

        async def receive():
            if not delivered:
                delivered.append(True)
                return {"type": "http.request", "body": body, "more_body": False}
            await never.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                stalled.set()
                await never.wait()  # the client reads nothing more

        task = asyncio.create_task(app(scope, receive, send))
        await asyncio.wait_for(stalled.wait(), 30)
        deadline = time.monotonic() + 30
        while state.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert state.in_flight == 0 and not task.done()  # released while the response is still stuck
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    asyncio.run(main())
    server.assert_no_leaks()


def test_a_reader_that_stops_reading_is_aborted_after_the_send_timeout(model_dir):
    """A raw client asks for a long stream and never reads: once the socket buffers are full, an
    event that cannot be sent within ``send_timeout_s`` aborts the request (long before the engine
    would have finished it), frees its slots and KV blocks and ends the handler."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # accepted connections inherit it (no autotuning)
    listener.bind(("127.0.0.1", 0))
    served = Served(model_dir, listener, limits=ServeLimits(send_timeout_s=0.3))
    engine, n = served.loop.engine, ENGINE["max_num_seqs"]
    real = engine.step

    def slow_step():  # 200 tokens would take more than 4 s
        time.sleep(0.02)
        return real()

    engine.step = slow_step
    reader = socket.socket()
    try:
        body = json.dumps(chat("stall", max_tokens=200, n=n, stream=True, logprobs=True, top_logprobs=20, temperature=0)).encode()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.connect(listener.getsockname())
        reader.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_until(lambda: total(metrics_of(served), "vllm:request_success_total", finished_reason="abort") == n, 30,
                   "the stalled stream to be aborted")
        served.assert_no_leaks()
        samples = metrics_of(served)
        assert total(samples, "vllm:request_success_total", finished_reason="length") == 0  # aborted, not finished
        assert total(samples, "llmopt:http_requests_total", endpoint="/v1/chat/completions") == 1  # the handler returned
    finally:
        reader.close()
        del engine.step
        served.stop()


def test_disconnects_release_slots_and_blocks(server):
    loop = server.loop
    # mid-stream
    with httpx.stream("POST", f"{server.base}/v1/completions", json=completion(max_tokens=200, stream=True), headers=AUTH,
                      timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert any(line.startswith("data: {") for line in got)
    server.assert_no_leaks()
    # while queued, streaming and not
    loop.pause()
    try:
        with httpx.stream("POST", f"{server.base}/v1/chat/completions", json=chat("q", max_tokens=200, stream=True), headers=AUTH,
                          timeout=60) as r:
            assert r.status_code == 200
            assert next(r.iter_lines()).startswith("data: {")  # the role event, before any token
        wait_until(lambda: server.state.in_flight == 0, what="the queued stream's slot")
        with pytest.raises(httpx.ReadTimeout):
            server.post("/v1/completions", completion(max_tokens=200), timeout=0.5)
        wait_until(lambda: server.state.in_flight == 0, what="the queued request's slot")  # noticed within a second
    finally:
        loop.resume()
    server.assert_no_leaks()
    # in decode, not streaming (steps slowed down so the client leaves mid-way)
    engine = loop.engine
    real = engine.step

    def slow_step():
        time.sleep(0.02)
        return real()

    engine.step = slow_step
    try:
        with pytest.raises(httpx.ReadTimeout):
            server.post("/v1/completions", completion(max_tokens=240, prompt="decode"), timeout=0.5)
        assert engine.has_unfinished()
        server.assert_no_leaks()
    finally:
        del engine.step
    gone = dict(endpoint="/v1/completions", status="499")  # counted, not logged as a server error
    wait_until(lambda: total(metrics_of(server), "llmopt:http_requests_total", **gone) >= 2, 10,
               "both non-streaming disconnects to be counted as 499")


def test_disconnects_in_prefill_release_slots_and_blocks(server):
    """The client leaves while its prompt's forward pass runs (blocks allocated, no token yet),
    streaming and not: its slot and blocks come back once the pass ends."""
    runner = server.loop.engine.runner
    real = runner.run
    in_prefill: list[bool] = []

    def slow_run(items, prompt_rows=None):
        in_prefill.append(any(seq.num_computed < seq.num_prompt_tokens for seq, _ in items))
        time.sleep(1.0)
        return real(items, prompt_rows)

    runner.run = slow_run
    try:
        with pytest.raises(httpx.ReadTimeout):
            server.post("/v1/completions", completion(max_tokens=8, prompt="p" * 150), timeout=0.4)
        assert in_prefill == [True] and server.loop.engine.has_unfinished()
        server.assert_no_leaks()  # (a decode step may run before the disconnect is noticed)
        passes_before_stream = len(in_prefill)
        with httpx.stream("POST", f"{server.base}/v1/chat/completions", json=chat("q" * 150, max_tokens=8, stream=True),
                          headers=AUTH, timeout=httpx.Timeout(60, read=0.4)) as r:
            lines = r.iter_lines()
            assert r.status_code == 200 and next(lines).startswith("data: {")  # the role event, before any token
            with pytest.raises(httpx.ReadTimeout):
                next(line for line in lines if line)  # (events are separated by empty lines)
            blocks = server.loop.engine.block_manager
            assert in_prefill[passes_before_stream:] == [True] and blocks.num_free_blocks < blocks.num_blocks
    finally:
        del runner.run
    server.assert_no_leaks()


# -- an engine that keeps failing is dead: /health 503, the server stops ------------------------------

def _always_failing(served: Served, monkeypatch) -> None:
    def step():
        raise RuntimeError("injected sticky failure")

    monkeypatch.setattr(served.loop.engine, "step", step)


def test_repeated_errors_mark_the_engine_dead(model_dir, monkeypatch):
    served = Served(model_dir, limits=ServeLimits(engine_error_limit=3), exit_on_engine_death=False)
    try:
        _always_failing(served, monkeypatch)
        statuses = []
        for _ in range(4):
            response = served.post("/v1/completions", completion())
            statuses.append(response.status_code)
            assert response.status_code in (500, 503) and set(response.json()["error"]) == {"message", "type", "param", "code"}
            if response.status_code == 503:
                break
        assert statuses[0] == 500 and statuses[-1] == 503, statuses
        assert served.loop.dead and "injected sticky failure" in served.loop.dead
        health = _get(f"{served.base}/health")
        assert health.status_code == 503 and "engine failed" in health.json()["status"]
        assert_error(served.post("/v1/chat/completions", chat("x")), 503, None, "engine_dead")
        assert served.state.in_flight == 0 and served.thread.is_alive()  # still answering, truthfully
    finally:
        served.stop()


def test_a_dead_engine_stops_the_server_with_an_error(model_dir, monkeypatch):
    served = Served(model_dir, limits=ServeLimits(engine_error_limit=1))
    _always_failing(served, monkeypatch)
    response = served.post("/v1/completions", completion())
    assert_error(response, 500, None, "engine_error")
    served.thread.join(30)
    assert not served.thread.is_alive()
    assert isinstance(served.error, EngineFailed) and served.error.exit_code == 1
    assert "injected sticky failure" in str(served.error)


def test_a_burst_of_ten_times_capacity_gets_only_200s_and_429s(server):
    """10 × capacity concurrent requests, streaming and not: every answer is a 200 with its
    tokens or a 429 in OpenAI's shape; afterwards nothing is held."""
    count = 10 * CAPACITY

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, int]:
        body = completion(max_tokens=8, prompt=f"burst {i}", stream=bool(i % 2))
        if body["stream"]:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                text = "".join([line async for line in r.aiter_lines()])
                return r.status_code, text.count('"text"') if r.status_code == 200 else 0
        r = await client.post("/v1/completions", json=body)
        return r.status_code, r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0

    async def burst():
        limits = httpx.Limits(max_connections=count)
        async with httpx.AsyncClient(base_url=server.base, headers=AUTH, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(count)))

    results = asyncio.run(burst())
    assert len(results) == count
    statuses = [s for s, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= CAPACITY  # at least the first capacity's worth got in
    assert all(tokens > 0 for s, tokens in results if s == 200)
    server.assert_no_leaks()
