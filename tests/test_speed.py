"""Speed in interleaved rounds (compare / demo): order, medians, spread, load, warnings, failures."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from conftest import CORPORA, save_model, tiny_llama
from llmopt.evaluation import speed
from llmopt.evaluation.speed import SpeedPlan, measure, summarize, warnings_for


def test_rounds_interleave_every_model(monkeypatch):
    calls = []
    figures = iter(range(100))

    def fake_round(path, plan):
        calls.append(path)
        n = next(figures)
        return {"pp512_tok_s": 100.0 + n, "tg128_tok_s": 10.0 + n, "serving_requests": 2, "serving_output_tok_s": 5.0}

    monkeypatch.setattr(speed, "one_round", fake_round)
    monkeypatch.setattr(speed, "load_average", lambda: [0.1, 0.1, 0.1])
    steps = []
    rows, record = measure(["a", "b", "c"], ["A", "B", "C"], SpeedPlan(rounds=3), steps.append)
    assert calls == ["a", "b", "c"] * 3  # round by round, never one model's rounds back to back
    assert len(rows) == 3 and [len(r["speed_rounds"]) for r in rows] == [3, 3, 3]
    assert sum(steps) == pytest.approx(3)  # one progress step per model
    # model b got figures 1, 4, 7: median 4, spread (7 - 1) / median
    assert rows[1]["tg128_tok_s"] == 14.0 and rows[1]["tg128_tok_s_spread"] == pytest.approx(6 / 14)
    assert rows[1]["pp512_tok_s"] == 104.0 and rows[1]["serving_requests"] == 2
    assert record["rounds"] == 3 and record["load_average_before"] == [0.1, 0.1, 0.1]
    assert any("B: tg128_tok_s varied by 43%" in w for w in record["warnings"])  # 6/14 > 15%


def test_summary_is_the_median_over_rounds():
    rounds = [{"tg128_tok_s": 10.0}, {"tg128_tok_s": 30.0}, {"tg128_tok_s": 11.0}]
    row = summarize(rounds)
    assert row["tg128_tok_s"] == 11.0 and row["tg128_tok_s_spread"] == pytest.approx(20 / 11)


def test_warnings_for_load_and_spread():
    quiet = [{"tg128_tok_s": 10.0, "tg128_tok_s_spread": 0.05, "speed_rounds": [{}, {}, {}]}]
    assert warnings_for(["x"], quiet, [2.0, 2, 2], [2.1, 2, 2], threads=2, cores=2) == []
    busy = warnings_for(["x"], quiet, [3.5, 2, 2], [4.0, 2, 2], threads=2, cores=2)
    assert len(busy) == 1 and "busy" in busy[0] and "3.5 before, 4.0 after" in busy[0]
    uneven = [{"tg128_tok_s": 10.0, "tg128_tok_s_spread": 0.4, "speed_rounds": [{}, {}]}]
    assert len(warnings_for(["x"], uneven, None, None, threads=2, cores=2)) == 1
    single = [{"tg128_tok_s": 10.0, "tg128_tok_s_spread": 0.0, "speed_rounds": [{}]}]
    assert "one round only" in warnings_for(["x"], single, None, None, threads=2, cores=2)[0]


def _settings_args(wiki: str) -> list[str]:
    return ["--dataset", wiki, "--seq-len", "64", "--max-windows", "2", "--repetitions", "1", "--serving-requests", "2"]


def test_compare_reports_rounds_spread_load_and_warnings(tmp_path, monkeypatch):
    from llmopt.cli.main import main

    base = save_model(tiny_llama(seed=0, max_position_embeddings=1024), tmp_path / "base")
    other = save_model(tiny_llama(seed=1, max_position_embeddings=1024), tmp_path / "other")
    monkeypatch.setattr(speed, "MAX_SPREAD", -1.0)  # every spread counts as too large: the warning must show
    out = tmp_path / "report"
    result = CliRunner().invoke(main, ["compare", str(base), str(other), *_settings_args(str(CORPORA / "wikitext-2-raw" / "wiki.test.raw")),
                                       "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    import json

    report = json.loads((out / "report.json").read_text())
    measured = report["speed_measurement"]
    assert measured["rounds"] == 3 and len(measured["load_average_before"]) == 3 and len(measured["load_average_after"]) == 3
    for row in report["rows"]:
        assert len(row["speed_rounds"]) == 3 and row["tg128_tok_s_spread"] >= 0
        tg = sorted(r["tg128_tok_s"] for r in row["speed_rounds"])
        assert row["tg128_tok_s"] == tg[1]
    assert len(measured["warnings"]) >= 2  # one per model at least (spread threshold forced below zero)
    md = (out / "report.md").read_text()
    assert "3 interleaved rounds" in md and "Load average" in md and md.count("**Warning:**") == len(measured["warnings"])


def test_compare_fails_when_a_request_errors(tmp_path, monkeypatch):
    from llmopt.cli.main import main
    from llmopt.runtime.model_runner import ModelRunner

    base = save_model(tiny_llama(seed=0, max_position_embeddings=1024), tmp_path / "base")

    def broken(self, items, *rest):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(ModelRunner, "run", broken)
    out = tmp_path / "report"
    result = CliRunner().invoke(main, ["compare", str(base), str(base), *_settings_args(str(CORPORA / "wikitext-2-raw" / "wiki.test.raw")),
                                       "-o", str(out)])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip() and "comparing" not in line]
    assert any("kernel exploded" in line for line in lines) and "Traceback" not in result.output
    assert not (out / "report.json").exists()
