"""``llmopt serve``'s request schema and small endpoints, in-process (fastapi's TestClient, tiny
random model): hypothesis-generated bodies for /v1/completions and /v1/chat/completions never get a
5xx; auth edge cases; /tokenize and /detokenize; unknown fields (a warning) and near-misses (400);
/version; the Prometheus metrics (vLLM's names, a model_name label)."""

from __future__ import annotations

import json
import logging

import httpx
import llmopt
import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from llmopt.cli.engine_options import engine_placement
from llmopt.core.errors import LlmoptError
from llmopt.runtime import LLMEngine
from llmopt.serve import ServerState, ServeSettings, build, create_app
from llmopt.serve.metrics import ServerMetrics, parse, total
from prometheus_client.parser import text_string_to_metric_families
from test_serve import KEY, NAME, model_dir, wait_until  # noqa: F401 - model_dir is a fixture

ENGINE = dict(max_num_seqs=4, max_model_len=64, block_size=8, num_kv_blocks=64, threads=1, kernels="reference")
AUTH = {"Authorization": f"Bearer {KEY}"}
FUZZ = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def served(model_dir):
    """``(client, state)``: the app in-process, its model loaded."""
    state = ServerState(ServeSettings(NAME, KEY, max_waiting=4), lambda: LLMEngine(model_dir, **ENGINE))
    with TestClient(create_app(state)) as client:
        wait_until(lambda: state.ready or state.load_error, 300, "the model to load")
        assert state.ready, state.load_error
        yield client, state


def post(client: TestClient, path: str, body, **headers) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=content, headers={**AUTH, "Content-Type": "application/json", **headers})


def assert_error(response: httpx.Response, status: int, param: str | None = "", code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"]
    if param != "":
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_no_leaks(state: ServerState) -> None:
    bm = state.loop.engine.block_manager
    wait_until(lambda: state.in_flight == 0 and bm.num_free_blocks == bm.num_blocks, what="slots and blocks to be released")


# -- schema fuzzing: any body gets a 2xx or a 4xx in OpenAI's shape, never a 5xx -------------------

TEXT = st.text(st.characters(exclude_categories=()), max_size=12)  # lone surrogates included
LEAF = (st.none() | st.booleans() | st.integers(-2**80, 2**80) | st.floats() | TEXT
        | st.sampled_from([0, -1, 1, 2**63, -2**63 - 1, 10**30, 1e308, 0.5, "", NAME]))
JSON = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4), max_leaves=10)
DROP = object()
SHARED = ("model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "seed", "stop", "n", "stream", "stream_options", "ignore_eos", "user")
VALID = {
    "/v1/completions": ({"model": NAME, "prompt": "Hi", "max_tokens": 3, "temperature": 0},
                        SHARED + ("prompt", "logprobs", "echo", "suffix")),
    "/v1/chat/completions": ({"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
                             SHARED + ("messages", "logprobs", "top_logprobs", "max_completion_tokens")),
}


def bodies(path: str) -> st.SearchStrategy:
    """Arbitrary JSON, or a valid body with fields dropped, replaced by junk, or added."""
    base, fields = VALID[path]
    replaced = st.dictionaries(st.sampled_from(fields), st.just(DROP) | JSON, max_size=3)
    extra = st.dictionaries(TEXT, JSON, max_size=2)
    mutated = st.builds(lambda r, e: {k: v for k, v in {**base, **e, **r}.items() if v is not DROP}, replaced, extra)
    return st.one_of(JSON, mutated, mutated)


def check_fuzzed(client: TestClient, path: str, body) -> None:
    response = post(client, path, json.dumps(body).encode())  # NaN and Infinity included, as Python writes them
    assert response.status_code < 500, (body, response.text)
    event(f"HTTP {response.status_code}")
    if response.status_code >= 400:
        assert_error(response, response.status_code)
    elif "text/event-stream" not in response.headers["content-type"]:
        assert response.json()["choices"]


@FUZZ
@given(body=bodies("/v1/completions"))
def test_fuzzed_completions_never_get_a_5xx(served, body):
    check_fuzzed(served[0], "/v1/completions", body)


@FUZZ
@given(body=bodies("/v1/chat/completions"))
def test_fuzzed_chat_completions_never_get_a_5xx(served, body):
    check_fuzzed(served[0], "/v1/chat/completions", body)


def test_no_leaks_after_fuzzing(served):
    assert_no_leaks(served[1])


# -- auth ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", f"Basic {KEY}", f"Bearer {KEY}x", f"Bearer {KEY} extra",
                                    KEY, f"Token {KEY}", "Bearer \u00e9t\u00e9".encode("latin-1")])
def test_wrong_or_malformed_authorization_is_a_401(served, header):
    client, _ = served
    headers = {} if header is None else {"Authorization": header}
    assert_error(client.get("/v1/models", headers=headers), 401, None, "invalid_api_key")
    assert_error(client.get("/no/such/route", headers=headers), 401, None, "invalid_api_key")  # routes are not revealed


def test_bearer_scheme_in_any_case_and_unknown_routes(served):
    client, _ = served
    for header in (f"Bearer {KEY}", f"bearer {KEY}", f"BEARER  {KEY}"):
        assert client.get("/v1/models", headers={"Authorization": header}).json()["data"][0]["id"] == NAME
    assert_error(client.get("/no/such/route", headers=AUTH), 404, None, "not_found")
    assert client.get("/health").status_code == 200  # no key needed
    for path in ("/tokenize", "/detokenize"):
        assert_error(client.post(path, json={"prompt": "x", "tokens": [1]}), 401, None, "invalid_api_key")


# -- /tokenize, /detokenize, /version -----------------------------------------------------------

def test_tokenize_detokenize_round_trip(served):
    client, state = served
    tokenizer = state.loop.engine.tokenizer
    for text in ("Hello w\u00f6rld \U0001f600", " spaces  and\nnewlines", ""):
        out = post(client, "/tokenize", {"model": NAME, "prompt": text})
        assert out.status_code == 200, out.text
        data = out.json()
        assert data["tokens"] == list(tokenizer(text).input_ids)
        assert data["count"] == len(data["tokens"]) and data["max_model_len"] == ENGINE["max_model_len"]
        back = post(client, "/detokenize", {"tokens": data["tokens"]})
        assert back.status_code == 200 and back.json() == {"prompt": tokenizer.decode(data["tokens"])}
        assert back.json()["prompt"] == text  # a byte-level tokenizer loses nothing
    messages = [{"role": "user", "content": "hi"}]
    for add in (True, False):
        out = post(client, "/tokenize", {"messages": messages, "add_generation_prompt": add}).json()
        want = tokenizer.apply_chat_template(messages, add_generation_prompt=add, tokenize=True)
        assert out["tokens"] == list(want["input_ids"] if hasattr(want, "keys") else want)
    size = len(tokenizer)
    assert_error(post(client, "/detokenize", {"tokens": [1, size]}), 400, "tokens", "invalid_request")
    assert_error(post(client, "/detokenize", {"tokens": [-1]}), 400, "tokens")
    assert_error(post(client, "/detokenize", {"tokens": ["x"]}), 400)
    assert_error(post(client, "/tokenize", {"prompt": "x", "messages": messages}), 400, "prompt")
    assert_error(post(client, "/tokenize", {}), 400, "prompt")
    assert_error(post(client, "/tokenize", {"model": "other", "prompt": "x"}), 404, "model", "model_not_found")
    assert client.get("/version", headers=AUTH).json() == {"version": llmopt.__version__}


# -- unknown fields -----------------------------------------------------------------------------

def test_unknown_fields_are_logged_and_near_misses_refused(served, caplog):
    client, _ = served
    with caplog.at_level(logging.WARNING, logger="llmopt.serve"):
        out = post(client, "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 2, "foo_bar": 1, "metadata": {"a": 1},
                                                "logit_bias": {}, "best_of": 1})
    assert out.status_code == 200, out.text
    warnings = [r.getMessage() for r in caplog.records if r.name == "llmopt.serve" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'foo_bar'" in warnings[0] and "'metadata'" in warnings[0]
    # a field that would change the answer, which this server does not implement, is refused rather than ignored
    for field, value in (("logit_bias", {"5": 100}), ("min_tokens", 3), ("best_of", 2), ("tools", [{"type": "function"}]),
                         ("response_format", {"type": "json_object"}), ("suffix", "end")):
        error = assert_error(post(client, "/v1/completions", {"model": NAME, "prompt": "x", field: value}), 400, field)
        assert error["message"] == f"'{field}' is not supported by this server: leave it out"
    error = assert_error(post(client, "/v1/completions", {"model": NAME, "prompt": "x", "max_token": 2}), 400, "max_token",
                         "invalid_request")
    assert error["message"] == "unknown field 'max_token': did you mean 'max_tokens'?"
    error = assert_error(post(client, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                                               "temprature": 0.5}), 400, "temprature")
    assert "did you mean 'temperature'?" in error["message"]
    assert_error(post(client, "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": "many"}), 400, "max_tokens")
    assert_error(post(client, "/v1/completions", {"model": NAME, "prompt": "x", "top_p": 0}), 400, "top_p")


# -- metrics ------------------------------------------------------------------------------------

VLLM_NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
              "vllm:generation_tokens_total", "vllm:request_success_total", "vllm:num_preemptions_total",
              "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
              "vllm:request_time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
              "vllm:request_queue_time_seconds_count", "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count")


def test_metrics_have_vllm_names_and_the_model_name(served):
    client, _ = served
    out = post(client, "/v1/completions", {"model": NAME, "prompt": "count me", "max_tokens": 5, "temperature": 0,
                                           "ignore_eos": True})
    assert out.status_code == 200
    response = client.get("/metrics", headers=AUTH)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    families = list(text_string_to_metric_families(response.text))
    samples = parse(response.text)
    for name in VLLM_NAMES:
        found = [labels for n, labels, _ in samples if n == name]
        assert found and all(labels.get("model_name") == NAME for labels in found), name
    assert total(samples, "vllm:request_success_total", finished_reason="length") >= 1
    assert total(samples, "vllm:generation_tokens_total") >= 5 and total(samples, "vllm:prefix_cache_queries_total") > 0
    assert total(samples, "vllm:inter_token_latency_seconds_count") >= 4  # one per gap between output tokens
    assert total(samples, "llmopt:http_requests_total", endpoint="/v1/completions", status="200") >= 1
    assert not [f.name for f in families if f.name.endswith("_created")]
    assert "vllm:spec_decode_num_drafts" not in {f.name for f in families}  # no speculative decoding here


def test_speculative_decoding_counters_come_from_the_engine_snapshot():
    snapshot = {"spec_num_drafts": 7, "spec_proposed_tokens": 20, "spec_accepted_tokens": 12, "running": 2, "kv_usage": 0.25}
    samples = parse(ServerMetrics("m", lambda: snapshot).render().decode())
    assert total(samples, "vllm:spec_decode_num_drafts_total", model_name="m") == 7
    assert total(samples, "vllm:spec_decode_num_draft_tokens_total") == 20
    assert total(samples, "vllm:spec_decode_num_accepted_tokens_total") == 12
    assert total(samples, "vllm:num_requests_running") == 2 and total(samples, "vllm:kv_cache_usage_perc") == 0.25


def test_max_connections_is_uvicorns_concurrency_limit():
    server, state = build(lambda: None, ServeSettings(NAME), "127.0.0.1", 0, max_connections=7)
    assert server.config.limit_concurrency == 7 and state.loop is None  # nothing loaded before it runs


# -- device and dtype choice --------------------------------------------------------------------

def test_device_auto_picks_the_gpu_when_there_is_one(monkeypatch):
    assert engine_placement(None, None) == engine_placement("auto", "auto")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert engine_placement("auto", "auto") == {"device": "cuda", "dtype": "bfloat16"}
    assert engine_placement("auto", "float16") == {"device": "cuda", "dtype": "float16"}
    assert engine_placement("cpu", None) == {"device": "cpu", "dtype": "float32"}  # today's CPU default
    with pytest.raises(LlmoptError, match="sees 1 CUDA GPU"):
        engine_placement("cuda:3", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engine_placement("auto", None) == {"device": "cpu", "dtype": "float32"}
    with pytest.raises(LlmoptError, match="no CUDA GPU"):
        engine_placement("cuda", "auto")
    with pytest.raises(LlmoptError, match="unknown --device"):
        engine_placement("tpu:0", None)


def test_stop_token_ids_include_stop_str_and_special_tokens(served, model_dir):
    """vLLM's extra sampling fields llmopt implements reach the engine."""
    from llmopt.runtime import LLM, SamplingParams

    client, _ = served
    base = {"model": NAME, "prompt": "stop here", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    free = post(client, "/v1/completions", base).json()["choices"][0]["text"]
    ref = LLM(model_dir, **ENGINE).generate(["stop here"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert len(ref.token_ids) == 8 and ref.text == free
    first = ref.token_ids.index(ref.token_ids[2])  # where that id first comes
    stopped = post(client, "/v1/completions", {**base, "stop_token_ids": [ref.token_ids[2]]}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] == first + 1
    stop = free[2:4]
    cut = post(client, "/v1/completions", {**base, "stop": [stop]}).json()["choices"][0]["text"]
    kept = post(client, "/v1/completions", {**base, "stop": [stop], "include_stop_str_in_output": True}).json()["choices"][0]["text"]
    assert kept == cut + stop and free.startswith(kept)
