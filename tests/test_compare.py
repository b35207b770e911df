"""`llmopt compare`: one consistent report (JSON, markdown, Pareto PNG) for several variants."""

from __future__ import annotations

import json

from click.testing import CliRunner

from conftest import CORPORA, save_model, tiny_llama
from llmopt.cli.main import main
from llmopt.evaluation.compare import pareto_front

WIKI = CORPORA / "wikitext-2-raw" / "wiki.test.raw"


def test_pareto_front_matches_brute_force():
    import random

    rng = random.Random(random.getrandbits(64))
    points = [(rng.random(), rng.random()) for _ in range(40)]
    front = set(pareto_front(points))
    for i, (x, y) in enumerate(points):
        dominated = any(a <= x and b >= y and (a, b) != (x, y) for a, b in points)
        assert (i in front) == (not dominated)


def test_compare_tiny_variants(tmp_path):
    base = save_model(tiny_llama(max_position_embeddings=1024), tmp_path / "base")
    runner = CliRunner()
    variants = []
    for scheme, extra in (("W8A16", []), ("W4A16", ["--group-size", "32"])):
        out = tmp_path / scheme
        result = runner.invoke(main, ["quantize", str(base), "--scheme", scheme, "-o", str(out), *extra])
        assert result.exit_code == 0, result.output
        variants.append(str(out))
    report_dir = tmp_path / "report"
    result = runner.invoke(main, ["compare", str(base), *variants, "--dataset", str(WIKI), "--seq-len", "128",
                                  "--max-windows", "2", "--repetitions", "2", "--rounds", "2", "--serving-requests", "3",
                                  "-o", str(report_dir), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    rows = report["rows"]
    assert [r["label"] for r in rows] == ["base", "W8A16 rtn", "W4A16 rtn"]
    assert rows[0]["kld_mean"] == 0 and rows[0]["top1_agreement"] == 1.0
    assert 0 < rows[1]["kld_mean"] < rows[2]["kld_mean"]  # int8 is closer to the float model than int4
    assert rows[2]["weights_bytes"] < rows[1]["weights_bytes"] < rows[0]["weights_bytes"]
    for r in rows:
        assert r["tokens"] == 2 * 127 and r["tg128_tok_s"] > 0 and r["serving_requests"] == 3
    assert json.loads((report_dir / "report.json").read_text())["rows"] == rows
    assert "W4A16 rtn" in (report_dir / "report.md").read_text()
    assert (report_dir / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_builds_every_variant_and_reports(tmp_path):
    """The whole ``llmopt demo`` pipeline on a tiny model: every variant built by its recipe,
    compared in one run, the report written; a second run reuses every variant."""
    from llmopt.evaluation.compare import CompareSettings
    from llmopt.evaluation.demo import VARIANTS, run_demo

    base = save_model(tiny_llama(num_hidden_layers=8, max_position_embeddings=1024), tmp_path / "base")

    def settings() -> CompareSettings:
        return CompareSettings(dataset=str(WIKI), seq_len=128, max_windows=2, repetitions=2, rounds=2, serving_requests=2,
                               prompt_len=(8, 16), output_len=(4, 8))

    report = run_demo(tmp_path / "demo", str(base), settings())
    labels = [r["label"] for r in report["rows"]]
    assert labels == [f"float ({base})", *VARIANTS]
    rows = {r["label"]: r for r in report["rows"]}
    assert rows[f"float ({base})"]["kld_mean"] == 0
    assert all(r["kld_mean"] > 0 and r["tg128_tok_s"] > 0 for label, r in rows.items() if label in VARIANTS)
    assert rows["W4A16 g32 gptq"]["weights_bytes"] < rows["W8A16 rtn"]["weights_bytes"] < rows[f"float ({base})"]["weights_bytes"]
    assert rows["drop 6 layers + distill"]["weights_bytes"] < rows[f"float ({base})"]["weights_bytes"]
    for name in ("report.md", "report.json", "pareto.png"):
        assert (tmp_path / "demo" / name).is_file()
    again = run_demo(tmp_path / "demo", str(base), settings())
    assert all(b["reused"] for b in again["build"].values())
