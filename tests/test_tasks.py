"""Task accuracy through lm-evaluation-harness: the adapter's scores against a direct
transformers computation of the same items, on a float and a W4A16 checkpoint of a tiny model."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from conftest import save_model, tiny_llama
from llmopt.core.errors import LlmoptError

pytestmark = pytest.mark.usefixtures("one_thread")


def _rows(name: str, split: str = "test") -> list[dict]:
    from llmopt.tasks.scores import TASK_DATA

    rows = [json.loads(line) for line in (TASK_DATA / name).read_text().splitlines() if line.strip()]
    return [r for r in rows if r["split"] == split]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny random float model and its W4A16 (RTN, group 32) checkpoint."""
    pytest.importorskip("lm_eval")
    from click.testing import CliRunner

    from llmopt.cli.main import main

    root = tmp_path_factory.mktemp("task_models")
    base = save_model(tiny_llama(seed=3, max_position_embeddings=1024), root / "float")  # room for pp512
    out = root / "w4a16"
    result = CliRunner().invoke(main, ["quantize", str(base), "--scheme", "W4A16", "--group-size", "32", "-o", str(out)])
    assert result.exit_code == 0, result.output
    return {"float": base, "w4a16": out}


def _reference(path):
    """transformers' own loader (compressed-tensors decompression for W4A16), not ours."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


@torch.no_grad()
def _continuation_logprob(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    ctx = tokenizer.encode(context, add_special_tokens=False)
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    assert whole[:len(ctx)] == ctx
    logits = model(torch.tensor([whole])).logits[0, len(ctx) - 1:len(whole) - 1]
    logp = torch.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(whole[len(ctx):])
    return float(logp.gather(1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())


@pytest.mark.parametrize("variant", ["float", "w4a16"])
def test_multiple_choice_matches_direct_transformers(checkpoints, variant):
    from llmopt.tasks.scores import run_tasks

    result = run_tasks(checkpoints[variant], "llmopt_tiny_mc", num_fewshot=0, batch_size=5, use_cache=False)
    task = result["tasks"]["llmopt_tiny_mc"]
    docs = _rows("tiny_mc.jsonl")
    model, tokenizer = _reference(checkpoints[variant])
    acc, acc_norm = {}, {}
    for i, doc in enumerate(docs):
        lls = [_continuation_logprob(model, tokenizer, f"Question: {doc['question']}\nAnswer:", " " + c)[0] for c in doc["choices"]]
        acc[str(i)] = float(max(range(len(lls)), key=lls.__getitem__) == doc["answer"])
        normed = [ll / len(c) for ll, c in zip(lls, doc["choices"])]
        acc_norm[str(i)] = float(max(range(len(normed)), key=normed.__getitem__) == doc["answer"])
    assert task["n"] == len(docs) == 40
    assert len(task["items"]["acc"]) == len(docs)
    assert task["items"]["acc"] == acc  # the same choice on every item
    assert task["items"]["acc_norm"] == acc_norm
    assert task["metrics"]["acc"]["value"] == pytest.approx(sum(acc.values()) / len(acc), abs=1e-12)
    assert task["metrics"]["acc_norm"]["value"] == pytest.approx(sum(acc_norm.values()) / len(acc_norm), abs=1e-12)
    p = task["metrics"]["acc"]["value"]
    assert task["metrics"]["acc"]["stderr"] == pytest.approx((p * (1 - p) / (len(docs) - 1)) ** 0.5, rel=1e-9)


def test_loglikelihood_values_and_rolling(checkpoints):
    """The adapter's raw log-likelihoods (batched, right-padded) against one-at-a-time forwards."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from llmopt.tasks.harness_model import LlmoptLM

    lm = LlmoptLM(checkpoints["float"], batch_size=3)
    model, tokenizer = _reference(checkpoints["float"])
    pairs = [("Question: What is two plus two?\nAnswer:", " four"), ("The cat", " sat on the mat"), ("A", "b"),
             ("Hello world ", "again"), ("x" * 40, " y")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    got = lm.loglikelihood(requests, disable_tqdm=True)
    assert len(got) == len(pairs)
    for (context, continuation), (logprob, greedy) in zip(pairs, got):
        if context.endswith(" "):  # the harness moves the context's trailing space to the continuation
            context, continuation = context.rstrip(), " " + continuation
        ref, ref_greedy = _continuation_logprob(model, tokenizer, context, continuation)
        assert logprob == pytest.approx(ref, abs=1e-4) and greedy == ref_greedy
    text = "The quick brown fox jumps over the lazy dog. " * 3
    ids = tokenizer.encode(text, add_special_tokens=False)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([[tokenizer.bos_token_id, *ids]])).logits[0, :-1], -1)
    ref = float(logp.gather(1, torch.tensor(ids)[:, None]).sum())
    (rolled,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert rolled == pytest.approx(ref, abs=1e-3)


@torch.no_grad()
def _greedy(model, tokenizer, prompt: str, max_new: int) -> str:
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                         pad_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split("\n")[0].split(tokenizer.eos_token)[0]


GEN_YAML = """task: {name}
custom_dataset: !function data.load
output_type: generate_until
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  do_sample: false
  max_gen_toks: 8
filter_list:
  - name: strip
    filter:
      - function: remove_whitespace
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

GEN_LOADER = """import json, pathlib
import datasets

def load(**_):
    rows = [json.loads(l) for l in (pathlib.Path(__file__).parent / "items.jsonl").read_text().splitlines()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
"""


@pytest.mark.parametrize("variant", ["float", "w4a16"])
def test_generation_exact_match_equals_direct_greedy(checkpoints, variant, tmp_path):
    """A generation task whose targets are, for every other item, the model's own greedy answer
    from transformers' ``generate`` (the rest a string it never writes): the adapter (through
    llmopt's runtime) must score exactly those items as matches."""
    from llmopt.tasks.scores import run_tasks

    model, tokenizer = _reference(checkpoints[variant])
    docs = _rows("tiny_gen.jsonl")[:24]
    items, expected = [], {}
    for i, doc in enumerate(docs):
        answer = _greedy(model, tokenizer, f"Question: {doc['question']}\nAnswer:", 8).strip()  # the filter strips
        match = i % 2 == 0
        items.append({"question": doc["question"], "answer": answer if match else "never-generated"})
        expected[str(i)] = float(match)
    name = f"gen_check_{variant}"
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / f"{name}.yaml").write_text(GEN_YAML.format(name=name))
    (folder / "data.py").write_text(GEN_LOADER)
    (folder / "items.jsonl").write_text("\n".join(json.dumps(r) for r in items))
    result = run_tasks(checkpoints[variant], [name], include_path=[str(folder)], batch_size=4, use_cache=False)
    assert result["generation"] == "runtime"
    task = result["tasks"][name]
    assert task["n"] == len(docs)
    assert task["items"]["exact_match,strip"] == expected
    assert task["metrics"]["exact_match,strip"]["value"] == pytest.approx(0.5)


def test_baseline_differences_are_paired(checkpoints):
    from llmopt.tasks.scores import run_tasks, task_rows, tasks_markdown

    result = run_tasks(checkpoints["w4a16"], ["llmopt_tiny_mc"], num_fewshot=0, limit=20, baseline=checkpoints["float"])
    mine = result["tasks"]["llmopt_tiny_mc"]["items"]["acc"]
    base = result["baseline"]["tasks"]["llmopt_tiny_mc"]["items"]["acc"]
    assert len(mine) == len(base) == 20
    d = torch.tensor([mine[k] - base[k] for k in mine], dtype=torch.float64)
    diff = result["differences"]["llmopt_tiny_mc"]["acc"]
    assert diff["paired"] and diff["difference"] == pytest.approx(float(d.mean()), abs=1e-12)
    assert diff["stderr"] == pytest.approx(float(d.std() / len(d) ** 0.5), rel=1e-9)
    rows = task_rows(result)
    assert [r["metric"] for r in rows] == ["acc", "acc_norm"] and rows[0]["n"] == 20
    assert "| llmopt_tiny_mc | acc | 20 | 0 |" in tasks_markdown(result)


def test_bad_task_requests_are_one_line_errors(tiny_model_dir, tmp_path):
    pytest.importorskip("lm_eval")
    from llmopt.tasks.scores import run_tasks

    with pytest.raises(LlmoptError, match="unknown task: no_such_task") as info:
        run_tasks(tiny_model_dir, "llmopt_tiny_mc,no_such_task", include_path=[])
    assert "--include-path" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(LlmoptError, match="task folder not found"):
        run_tasks(tiny_model_dir, "llmopt_tiny_mc", include_path=[str(tmp_path / "missing")])
    with pytest.raises(LlmoptError, match="no task names"):
        run_tasks(tiny_model_dir, " , ")


def test_missing_extra_names_the_install_command(tiny_model_dir, monkeypatch):
    from llmopt.tasks.scores import run_tasks

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if lm-eval were not installed
    with pytest.raises(LlmoptError) as info:
        run_tasks(tiny_model_dir, "llmopt_tiny_mc")
    message = str(info.value)
    assert "\n" not in message and "pip install 'llmopt[tasks]'" in message


def test_compare_puts_task_scores_beside_kld_and_speed(checkpoints, tmp_path):
    from conftest import CORPORA
    from llmopt.evaluation.compare import CompareSettings, compare, write_report
    from llmopt.tasks.scores import run_tasks

    settings = CompareSettings(dataset=str(CORPORA / "wikitext-2-raw" / "wiki.test.raw"), seq_len=128, max_windows=2,
                               repetitions=1, serving_requests=2, prompt_len=(8, 16), output_len=(4, 8),
                               tasks=["llmopt_tiny_mc", "llmopt_tiny_gen"], task_num_fewshot=0, task_limit=10)
    report = compare(str(checkpoints["float"]), [str(checkpoints["w4a16"])], settings)
    base, variant = report["rows"]
    for row in (base, variant):
        assert list(row["tasks"]) == ["llmopt_tiny_mc", "llmopt_tiny_gen"]
        assert row["tasks"]["llmopt_tiny_mc"]["n"] == 10 and row["tasks"]["llmopt_tiny_mc"]["metric"] == "acc"
        assert row["kld_mean"] >= 0 and row["tg128_tok_s"] > 0
    assert "difference" not in base["tasks"]["llmopt_tiny_mc"]
    direct = run_tasks(checkpoints["w4a16"], "llmopt_tiny_mc", num_fewshot=0, limit=10, baseline=checkpoints["float"], use_cache=False)
    mc = variant["tasks"]["llmopt_tiny_mc"]
    assert mc["value"] == direct["tasks"]["llmopt_tiny_mc"]["metrics"]["acc"]["value"]
    assert mc["difference"] == pytest.approx(direct["differences"]["llmopt_tiny_mc"]["acc"]["difference"], abs=1e-12)
    files = write_report(report, tmp_path / "report")
    text = files["md"].read_text()
    assert "llmopt_tiny_mc (acc)" in text and "llmopt_tiny_gen (exact_match,strip)" in text
    assert json.loads(files["json"].read_text())["rows"][1]["tasks"] == variant["tasks"]
    assert files["tasks_plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(LlmoptError, match="unknown task"):
        compare(str(checkpoints["float"]), [], CompareSettings(tasks=["nope"]))


def test_cli_eval_tasks_equals_run_tasks(checkpoints):
    """`llmopt eval MODEL --tasks … --baseline …` prints the scores run_tasks computes; perplexity
    options are refused beside --tasks, and task options without it."""
    from click.testing import CliRunner

    from llmopt.cli.main import main
    from llmopt.tasks.scores import run_tasks

    args = ["eval", str(checkpoints["w4a16"]), "--tasks", "llmopt_tiny_mc", "--num-fewshot", "0", "--limit", "12",
            "--baseline", str(checkpoints["float"])]
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    direct = run_tasks(checkpoints["w4a16"], "llmopt_tiny_mc", num_fewshot=0, limit=12, baseline=checkpoints["float"])
    assert len(printed["tasks"]["llmopt_tiny_mc"]["items"]["acc"]) == 12
    assert printed["tasks"] == json.loads(json.dumps(direct["tasks"]))
    assert printed["differences"] == json.loads(json.dumps(direct["differences"]))
    table = CliRunner().invoke(main, args)
    assert table.exit_code == 0 and "llmopt_" in table.stdout and "task accuracy" in table.stdout  # (a narrow terminal wraps cells)
    for extra, message in ((["--seq-len", "64"], "apply to perplexity"), ([], "apply to --tasks only")):
        argv = [*args[:2], *extra, *(["--tasks", "llmopt_tiny_mc"] if extra else ["--limit", "3"])]
        bad = CliRunner().invoke(main, argv)
        assert bad.exit_code == 2 and message in bad.stderr, bad.output


def test_lm_eval_local_completions_scores_the_served_model_as_eval_does(checkpoints):
    """lm-evaluation-harness's own ``local-completions`` client (batched token prompts, echo with
    prompt log-probabilities) against ``llmopt serve`` gives the scores ``llmopt eval --tasks`` gives."""
    import threading

    import lm_eval
    from llmopt.runtime import LLMEngine
    from llmopt.serve import ServeSettings, build
    from llmopt.tasks.scores import run_tasks, task_manager

    from test_serve import free_port, wait_until

    path = checkpoints["w4a16"]
    port = free_port()
    server, state = build(lambda: LLMEngine(path, max_num_seqs=8, max_model_len=512, threads=1),
                          ServeSettings("tiny"), "127.0.0.1", port)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: state.ready, 600, "the server to be ready")
        seeds = dict(random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
        model_args = (f"base_url=http://127.0.0.1:{port}/v1/completions,model=tiny,tokenizer={path},"
                      "tokenizer_backend=huggingface,tokenized_requests=True,batch_size=4,max_retries=1")
        served = lm_eval.simple_evaluate(model="local-completions", tasks=["llmopt_tiny_mc"], num_fewshot=0,
                                         task_manager=task_manager(), model_args=model_args, log_samples=True, **seeds)
        generated = lm_eval.simple_evaluate(model="local-completions", tasks=["llmopt_tiny_gen"], limit=8,
                                            task_manager=task_manager(), model_args=model_args, log_samples=True, **seeds)
        assert state.in_flight == 0
    finally:
        server.should_exit = True
        thread.join(30)
    direct = run_tasks(path, "llmopt_tiny_mc", num_fewshot=0, batch_size=5, use_cache=False)["tasks"]["llmopt_tiny_mc"]
    samples = sorted(served["samples"]["llmopt_tiny_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == direct["n"] == 40
    for metric in ("acc", "acc_norm"):
        assert {str(s["doc_id"]): float(s[metric]) for s in samples} == direct["items"][metric]
        assert served["results"]["llmopt_tiny_mc"][f"{metric},none"] == pytest.approx(direct["metrics"][metric]["value"], abs=1e-12)
    # generation (stop strings, batched token prompts): the texts llmopt's own harness model generates
    from llmopt.tasks.harness_model import LlmoptLM

    direct_gen = lm_eval.simple_evaluate(model=LlmoptLM(path, batch_size=4), tasks=["llmopt_tiny_gen"], limit=8,
                                         task_manager=task_manager(), log_samples=True, **seeds)
    got = sorted(generated["samples"]["llmopt_tiny_gen"], key=lambda s: s["doc_id"])
    want = sorted(direct_gen["samples"]["llmopt_tiny_gen"], key=lambda s: s["doc_id"])
    assert len(got) == len(want) == 8
    assert [s["resps"] for s in got] == [s["resps"] for s in want]
    assert any(s["resps"][0][0].strip() for s in got)  # something was generated
