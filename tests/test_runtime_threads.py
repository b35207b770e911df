"""Work before serving runs on a thread that ends (one OpenMP pool per process while serving):
results and errors come back to the caller, and ``llmopt serve`` builds its engine that way."""

from __future__ import annotations

import threading

import pytest
from click.testing import CliRunner

from llmopt.core.errors import LlmoptError
from llmopt.runtime.threads import call_in_passing_thread


def test_result_and_error_come_back_from_a_thread_that_ends():
    seen = []

    def work() -> int:
        seen.append(threading.current_thread())
        return 41 + 1

    assert call_in_passing_thread(work) == 42
    assert len(seen) == 1 and seen[0] is not threading.main_thread() and not seen[0].is_alive()
    with pytest.raises(LlmoptError, match="bad model"):
        call_in_passing_thread(lambda: (_ for _ in ()).throw(LlmoptError("bad model", "fix it")))
    with pytest.raises(KeyboardInterrupt):
        call_in_passing_thread(lambda: (_ for _ in ()).throw(KeyboardInterrupt()))


def test_serve_builds_its_engine_off_the_main_thread(monkeypatch, tiny_model_dir):
    import llmopt.runtime as runtime
    from llmopt.cli.main import main

    threads = []

    class Refused:
        def __init__(self, *args, **kwargs) -> None:
            threads.append(threading.current_thread())
            raise LlmoptError("engine refused for the test", "nothing to fix")

    monkeypatch.setattr(runtime, "LLMEngine", Refused)
    result = CliRunner().invoke(main, ["serve", str(tiny_model_dir), "--port", "0"])
    assert result.exit_code != 0 and "engine refused for the test" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert len(threads) == 1 and threads[0] is not threading.main_thread() and not threads[0].is_alive()
