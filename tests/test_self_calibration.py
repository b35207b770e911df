"""Calibration windows sampled by the model itself (``--calib self``) and mixes (``a+b``)."""

from __future__ import annotations

import pytest
import torch
from conftest import CORPORA, byte_tokenizer, save_model, tiny_llama
from llmopt.core.data import calibration_ids, calibration_parts
from llmopt.core.errors import LlmoptError
from llmopt.self_calibration import sampler

CORPUS = str(CORPORA / "gutenberg" / "persuasion.txt")


@pytest.fixture(scope="module")
def peaked_model(tmp_path_factory):
    """A tiny model whose next-token distributions are far from uniform (sharpened tied embeddings)."""
    model = tiny_llama(seed=3)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(4.0)
    return model, save_model(model, tmp_path_factory.mktemp("peaked") / "m")


def _self(path, samples=8, seq_len=24, seed=0):
    return calibration_ids(byte_tokenizer(), "self", samples, seq_len, seed, sample_self=sampler(path, show_progress=False))


def test_self_windows_shape_record_and_seed(peaked_model, tmp_path, monkeypatch):
    _, path = peaked_model
    ids, record = _self(path)
    assert ids.shape == (8, 24) and ids.dtype == torch.long
    assert int(ids.min()) >= 0 and int(ids.max()) < 259
    assert record["name"] == "self" and record["samples"] == 8 and record["seq_len"] == 24 and record["seed"] == 0
    assert len({tuple(row.tolist()) for row in ids}) == 8  # each window its own sample
    again, _ = _self(path)  # from the cache
    assert torch.equal(again, ids)
    monkeypatch.setenv("LLMOPT_CACHE", str(tmp_path / "fresh"))
    resampled, _ = _self(path)  # sampled again, with the same seeds
    assert torch.equal(resampled, ids)
    other, _ = _self(path, seed=1)
    assert other.shape == ids.shape and not torch.equal(other, ids)


def test_self_windows_follow_the_models_distribution(peaked_model):
    """Tokens sampled from p have mean -log p equal to p's mean entropy (up to sampling noise);
    tokens drawn uniformly do not."""
    model, path = peaked_model
    ids, _ = _self(path, samples=16, seq_len=24)
    bos = torch.full((ids.shape[0], 1), byte_tokenizer().bos_token_id)

    def nll_and_entropy(windows):
        with torch.no_grad():
            logits = model(torch.cat([bos, windows[:, :-1]], dim=1)).logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        nll = -logp.gather(-1, windows.unsqueeze(-1)).squeeze(-1)
        return float(nll.mean()), float(-(logp.exp() * logp).sum(-1).mean())

    nll, entropy = nll_and_entropy(ids)
    assert entropy < 0.8 * torch.log(torch.tensor(259.0))  # the distributions are peaked
    assert abs(nll - entropy) < 0.3
    uniform_nll, uniform_entropy = nll_and_entropy(torch.randint(3, 259, ids.shape))
    assert uniform_nll > uniform_entropy + 1.0


def test_mix_interleaves_equal_shares(peaked_model):
    _, path = peaked_model
    tok = byte_tokenizer()
    ids, record = calibration_ids(tok, f"{CORPUS}+self", 5, 24, 0, sample_self=sampler(path, show_progress=False))
    corpus_ids, corpus_record = calibration_ids(tok, CORPUS, 3, 24, 0)
    self_ids, _ = _self(path, samples=2)
    assert ids.shape == (5, 24)
    assert torch.equal(ids[0::2], corpus_ids) and torch.equal(ids[1::2], self_ids)  # c0 s0 c1 s1 c2
    assert record["name"] == f"{CORPUS}+self" and record["samples"] == 5
    assert [p["name"] for p in record["parts"]] == [CORPUS, "self"] and [p["samples"] for p in record["parts"]] == [3, 2]
    assert record["parts"][0]["sha256"] == corpus_record["sha256"]


def test_bad_calibration_specs_are_refused(tmp_path):
    tok = byte_tokenizer()
    with pytest.raises(LlmoptError, match="'self' is sampled from the model"):
        calibration_ids(tok, "self", 2, 16, 0)
    with pytest.raises(LlmoptError, match="empty part"):
        calibration_ids(tok, "austen+", 2, 16, 0)
    plus = tmp_path / "a+b.txt"  # a file whose name holds + is a file, not a mix
    plus.write_text(open(CORPUS, encoding="utf-8").read()[:20000], encoding="utf-8")
    assert calibration_parts(str(plus)) == [str(plus)]
    ids, record = calibration_ids(tok, str(plus), 2, 16, 0)
    assert ids.shape == (2, 16) and record["name"] == str(plus)


def test_quantize_calibrates_on_self_samples(tmp_path):
    from llmopt.pipeline.stages.quantize import QuantizeConfig, run_quantize

    src = save_model(tiny_llama(seed=8), tmp_path / "src")
    record = run_quantize(QuantizeConfig(model=str(src), output=str(tmp_path / "q"), scheme="W4A16", method="gptq",
                                         calib=f"{CORPUS}+self", calib_samples=4, calib_seq_len=32))
    calibration = record["calibration"]
    assert calibration["name"] == f"{CORPUS}+self" and calibration["samples"] == 4
    assert [p["samples"] for p in calibration["parts"]] == [2, 2] and calibration["parts"][1]["name"] == "self"
    assert (tmp_path / "q" / "config.json").is_file()
