"""Model loading, evaluation (perplexity, KLD, top-1), inspect and the CLI's error paths."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from conftest import CORPORA, byte_tokenizer, save_model, tiny_llama
from llmopt.cli.main import main
from llmopt.core.errors import LlmoptError
from llmopt.accuracy import BaselineCache, eval_data, evaluate, kl_from_top_k
from llmopt.checkpoints.models import load_model, resolve_model

WIKI = CORPORA / "wikitext-2-raw" / "wiki.test.raw"


def run_cli(*args: str):
    return CliRunner().invoke(main, list(args))


def reference_perplexity(model, windows: torch.Tensor) -> float:
    """Straightforward per-window cross-entropy, averaged over all scored tokens."""
    total, count = 0.0, 0
    for window in windows:
        with torch.no_grad():
            logits = model(window[None]).logits[0]
        loss = torch.nn.functional.cross_entropy(logits[:-1].double(), window[1:], reduction="sum")
        total += float(loss)
        count += window.numel() - 1
    return math.exp(total / count)


def reference_kld(base, model, windows: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Exact per-token KL(base || model) over the whole vocabulary and the top-1 agreement, on the
    positions perplexity scores (each window's last ``seq_len - 1`` tokens)."""
    klds, agree = [], 0
    for window in windows:
        with torch.no_grad():
            p = torch.log_softmax(base(window[None]).logits[0, :-1].double(), -1)
            q = torch.log_softmax(model(window[None]).logits[0, :-1].double(), -1)
        klds.append((p.exp() * (p - q)).sum(-1))
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
    kld = torch.cat(klds)
    return kld, agree / kld.numel()


# ---------------------------------------------------------------------------------------------
# loading


def test_load_round_trip_gives_same_logits(tmp_path):
    model = tiny_llama()
    path = save_model(model, tmp_path / "m")
    assert resolve_model(str(path)) == path.resolve()
    loaded, tokenizer = load_model(str(path))
    ids = torch.randint(0, 259, (2, 33))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert tokenizer("abc", add_special_tokens=False)["input_ids"] == byte_tokenizer()("abc", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda p: p / "missing", "no such folder"),
        (lambda p: (p / "empty").mkdir() or p / "empty", "no config.json"),
        (lambda p: _write(p / "notes.txt", "hello"), "is a file, not a model"),
        (lambda p: _write(p / "x.gguf", "nope"), "not a GGUF file"),
    ],
)
def test_bad_model_paths(tmp_path, make, expected):
    path = make(tmp_path)
    with pytest.raises(LlmoptError, match=expected):
        resolve_model(str(path))


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_truncated_and_corrupt_safetensors(tiny_model_dir):
    weights = tiny_model_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(LlmoptError, match="truncated"):
        resolve_model(str(tiny_model_dir))
    weights.write_bytes(b"\xff" * 64)
    with pytest.raises(LlmoptError, match="corrupt header"):
        resolve_model(str(tiny_model_dir))


def test_missing_weights_and_bad_config(tiny_model_dir):
    (tiny_model_dir / "model.safetensors").unlink()
    with pytest.raises(LlmoptError, match="no weights"):
        resolve_model(str(tiny_model_dir))
    (tiny_model_dir / "config.json").write_text("{not json")
    with pytest.raises(LlmoptError, match="not valid JSON"):
        resolve_model(str(tiny_model_dir))


def test_unsupported_architecture(tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["model_type"] = "vit"
    (tiny_model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(LlmoptError, match="unsupported architecture 'vit'"):
        load_model(str(tiny_model_dir))


def test_hub_id_offline_is_a_clear_error():
    with pytest.raises(LlmoptError, match="cannot download 'someone/no-such-model'"):
        resolve_model("someone/no-such-model")


# ---------------------------------------------------------------------------------------------
# evaluation


@pytest.fixture
def wiki_data():
    return eval_data(byte_tokenizer(), str(WIKI), seq_len=96, max_windows=4)


def test_perplexity_matches_reference(wiki_data):
    model = tiny_llama()
    result = evaluate(model, wiki_data)
    assert result.tokens == 4 * 95 and result.windows == 4 and result.seq_len == 96
    assert result.perplexity == pytest.approx(reference_perplexity(model, wiki_data.windows), rel=1e-5)


def test_windows_are_consecutive_non_overlapping(wiki_data):
    tokenizer = byte_tokenizer()
    ids = tokenizer(WIKI.read_text(), add_special_tokens=False)["input_ids"]
    assert wiki_data.windows.flatten().tolist() == ids[: 4 * 96]


def test_kld_self_is_zero_and_perturbed_is_positive(tmp_path, wiki_data):
    model = tiny_llama()
    cache = BaselineCache(tmp_path / "base", top_k=32)
    same = evaluate(model, wiki_data, cache, store_baseline=True)
    assert same.kld_mean == 0 and same.kld_p99 == 0 and same.top1_agreement == 1.0
    assert same.baseline_perplexity == pytest.approx(same.perplexity)

    perturbed = tiny_llama()
    perturbed.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    other = evaluate(perturbed, wiki_data, cache)
    assert other.kld_mean > 0 and other.kld_p99 >= other.kld_median > 0
    assert other.top1_agreement < 1.0
    assert other.baseline_perplexity == pytest.approx(same.perplexity)
    # the figures themselves: exact at the full vocabulary, a lower bound with the top 32
    want, agreement = reference_kld(model, perturbed, wiki_data.windows)
    assert want.numel() == other.tokens == 4 * 95
    assert other.top1_agreement == pytest.approx(agreement)
    assert 0 < other.kld_mean <= float(want.mean()) * (1 + 1e-6)
    full = BaselineCache(tmp_path / "full", top_k=259)
    evaluate(model, wiki_data, full, store_baseline=True)
    exact = evaluate(perturbed, wiki_data, full)
    assert exact.kld_mean == pytest.approx(float(want.mean()), rel=1e-4)
    assert exact.kld_median == pytest.approx(float(want.median()), rel=1e-3)
    assert exact.kld_p99 == pytest.approx(float(torch.quantile(want, 0.99)), rel=1e-3)


def test_top_k_kld_exact_at_full_vocab_and_lower_bound_below():
    vocab = 50
    base = torch.log_softmax(torch.randn(20, vocab) * 2, -1)
    model = torch.log_softmax(base + torch.randn(20, vocab), -1)
    exact = (base.exp() * (base - model)).sum(-1)

    def cached(k):
        top, idx = base.topk(k, -1)
        return {"top_logp": top, "top_idx": idx.int()}

    torch.testing.assert_close(kl_from_top_k(cached(vocab), model), exact, rtol=1e-5, atol=1e-6)
    partial = kl_from_top_k(cached(10), model)
    assert (partial <= exact + 1e-6).all()  # merging outcomes never increases KL (data processing)
    assert (partial > 0).all()


def test_baseline_is_computed_once_and_reused(tmp_path, wiki_data):
    model = tiny_llama()
    cache = BaselineCache(tmp_path / "base", top_k=16)
    from llmopt.accuracy import fill_baseline

    fill_baseline(model, wiki_data, cache)
    assert cache.missing(4) == []

    class Exploding(torch.nn.Module):
        def forward(self, *args, **kwargs):
            raise AssertionError("baseline recomputed")

    fill_baseline(Exploding(), wiki_data, cache)  # nothing missing: the model is never called
    again = evaluate(model, wiki_data, cache)
    assert again.kld_mean == 0


def test_dataset_errors(tmp_path):
    tokenizer = byte_tokenizer()
    empty = _write(tmp_path / "empty.txt", "")
    with pytest.raises(LlmoptError, match="fewer than one window"):
        eval_data(tokenizer, str(empty), seq_len=64)
    short = _write(tmp_path / "short.txt", "only a few words")
    with pytest.raises(LlmoptError, match="fewer than one window"):
        eval_data(tokenizer, str(short), seq_len=64)
    with pytest.raises(LlmoptError, match="dataset not found"):
        eval_data(tokenizer, str(tmp_path / "nope.txt"))


# ---------------------------------------------------------------------------------------------
# CLI


def test_cli_eval_json_and_baseline(tiny_model_dir, tmp_path):
    result = run_cli("eval", str(tiny_model_dir), "--baseline", str(tiny_model_dir), "--dataset", str(WIKI),
                     "--seq-len", "64", "--max-windows", "3", "--json", "-o", str(tmp_path / "r.json"))
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    for key in ("perplexity", "kld_mean", "kld_median", "kld_p99", "top1_agreement", "tokens", "windows", "seq_len"):
        assert key in payload
    assert payload["kld_mean"] == 0 and payload["top1_agreement"] == 1.0 and payload["tokens"] == 3 * 63
    assert json.loads((tmp_path / "r.json").read_text()) == payload


def test_cli_eval_against_other_model(tmp_path):
    a = save_model(tiny_llama(seed=1), tmp_path / "a")
    b = save_model(tiny_llama(seed=2), tmp_path / "b")
    result = run_cli("eval", str(b), "--baseline", str(a), "--dataset", str(WIKI), "--seq-len", "64", "--max-windows", "2",
                     "--top-k", "259", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    windows = eval_data(byte_tokenizer(), str(WIKI), seq_len=64, max_windows=2).windows
    model_a, model_b = load_model(str(a))[0], load_model(str(b))[0]
    want, agreement = reference_kld(model_a, model_b, windows)
    assert payload["tokens"] == want.numel() == 2 * 63
    assert payload["kld_mean"] == pytest.approx(float(want.mean()), rel=1e-4)  # top-k = vocabulary: exact
    assert payload["top1_agreement"] == pytest.approx(agreement)
    assert payload["perplexity"] == pytest.approx(reference_perplexity(model_b, windows), rel=1e-5)
    assert payload["baseline_perplexity"] == pytest.approx(reference_perplexity(model_a, windows), rel=1e-5)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["eval", "/no/such/model"], "no such folder"),
        (["inspect", "/no/such/model"], "no such folder"),
        (["eval", "{model}", "--dataset", "/no/such.txt", "--seq-len", "64"], "dataset not found"),
        (["eval", "{model}", "--dataset", "{short}", "--seq-len", "64"], "fewer than one window"),
        (["eval", "{model}", "--seq-len", "4096"], "exceeds the model's 512 positions"),
        (["eval", "{model}", "--baseline", "{other}", "--dataset", "{wiki}", "--seq-len", "32", "--max-windows", "1"], "different vocabularies"),
    ],
)
def test_cli_errors_are_one_line_exit_2(tmp_path, tiny_model_dir, args, expected):
    short = _write(tmp_path / "short.txt", "tiny")
    other = save_model(tiny_llama(vocab_size=300), tmp_path / "other")
    values = {"model": str(tiny_model_dir), "short": str(short), "other": str(other), "wiki": str(WIKI)}
    result = run_cli(*[a.format(**values) for a in args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0]
    assert "Traceback" not in result.output


def test_inspect_counts_parameters_and_sparsity(tmp_path):
    model = tiny_llama()
    with torch.no_grad():
        w = model.model.layers[0].mlp.up_proj.weight
        mask = torch.zeros_like(w, dtype=torch.bool).reshape(-1, 4)
        mask[:, :2] = True  # exactly 2:4
        w.mul_(mask.reshape(w.shape))
    path = save_model(model, tmp_path / "m")
    result = run_cli("inspect", str(path), "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["parameters"] == model.num_parameters()
    assert info["layers"] == 2 and info["kv_heads"] == 2
    up = next(m for m in info["modules"] if m["name"] == "model.layers.0.mlp.up_proj")
    assert up["sparsity"] == pytest.approx(0.5) and up["pattern_2_4"] is True
    down = next(m for m in info["modules"] if m["name"] == "model.layers.0.mlp.down_proj")
    assert down["sparsity"] < 0.01 and down["pattern_2_4"] is None
    table = run_cli("inspect", str(path))
    assert table.exit_code == 0 and "layers.0-1.self_attn.q_proj" in table.stdout


# ---------------------------------------------------------------------------------------------
# the demo model (integration)


@pytest.mark.demo
def test_demo_self_baseline_and_inspect(demo_cache):
    path = resolve_model("demo")
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
    result = run_cli("eval", "demo", "--baseline", "demo", "--seq-len", "256", "--max-windows", "2", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["kld_mean"] == 0 and payload["top1_agreement"] == 1.0
    assert 5 < payload["perplexity"] < 100  # a trained model, not a random one (random ≈ vocab size)
    info = json.loads(run_cli("inspect", "demo", "--json", "--no-sparsity").stdout)
    assert info["parameters"] == 134_515_008 and info["layers"] == 30


def test_self_baseline_from_cache_matches_computed(tiny_model_dir):
    from llmopt.accuracy import run_eval

    first = run_eval(str(tiny_model_dir), str(tiny_model_dir), str(WIKI), seq_len=64, max_windows=3, top_k=8)
    again = run_eval(str(tiny_model_dir), str(tiny_model_dir), str(WIKI), seq_len=64, max_windows=3, top_k=8)
    assert again.perplexity == pytest.approx(first.perplexity, rel=1e-9)
    assert (again.kld_mean, again.top1_agreement, again.tokens) == (0.0, 1.0, first.tokens)
    reference = reference_perplexity(load_model(str(tiny_model_dir))[0], eval_data(byte_tokenizer(), str(WIKI), 64, 3).windows)
    assert again.perplexity == pytest.approx(reference, rel=1e-5)


def test_tokenized_documents_are_cached_by_tokenizer_and_text(monkeypatch):
    """A corpus is tokenized once per tokenizer definition: the second call reads the cache
    (the same ids), and a tokenizer that differs gets its own entry."""
    from conftest import byte_tokenizer
    from llmopt.core import data

    source = data.TextSource("t", ["hello world, " * 50, "another document"], ["a", "b"])
    tok = byte_tokenizer()
    first = data.tokenize_documents(tok, source)
    assert [len(t) for t in first] == [len(tok(d, add_special_tokens=False)["input_ids"]) for d in source.documents]
    data._TOKEN_CACHE.clear()  # force the disk cache
    calls = []
    monkeypatch.setattr(type(tok), "__call__", lambda self, *a, **k: calls.append(a) or {"input_ids": []})
    again = data.tokenize_documents(tok, source)
    assert not calls and len(again) == 2 and all(torch.equal(a, b) for a, b in zip(first, again))
    other = byte_tokenizer()
    other.backend_tokenizer.add_tokens(["hello"])
    data.tokenize_documents(other, source)
    assert len(calls) == 2  # a different tokenizer is not served from the first one's cache
