"""``LLM``: the offline API — generate for a list of prompts, or stream one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from collections.abc import Sequence as Seq

from llmopt.core.errors import LlmoptError

from .engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """``LLM("demo").generate(["Hello"], SamplingParams(max_tokens=32))``.

    Keyword arguments are :class:`~llmopt.runtime.config.EngineConfig` settings
    (``max_num_seqs``, ``max_num_batched_tokens``, ``kv_cache_gib``, ``num_kv_blocks``,
    ``block_size``, ``threads``, ``max_model_len``, ``enable_prefix_caching``, ``dtype``, ``seed``,
    ``device``, ``kernels`` …).
    """

    def __init__(self, model: str | os.PathLike, **settings) -> None:
        self.engine = LLMEngine(model, **settings)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, progress: bool = False) -> list[RequestOutput]:
        """One finished output per prompt, in order. A text, a list of token ids, or a list of either."""
        batch = _as_list(prompts)
        params = _params_for(batch, sampling_params)
        ids = self._add_all(batch, params)
        done: dict[str, RequestOutput] = {}
        try:
            if progress:
                from llmopt.core.console import progress_task

                with progress_task("generating", total=len(ids)) as advance:
                    self._run(done, advance)
            else:
                self._run(done, None)
        except BaseException:  # an error (or Ctrl-C) mid-run: the requests and their KV blocks go
            for rid in ids:
                self.engine.abort(rid, report=False)
            raise
        return [done[i] for i in ids]

    def _add_all(self, batch: list[Prompt], params: list[SamplingParams]) -> list[str]:
        """Queue every prompt, or none: a bad one is reported by its index and nothing runs."""
        added: list[str] = []
        for i, (prompt, p) in enumerate(zip(batch, params)):
            try:
                added.append(self.engine.add_request(prompt, p))
            except LlmoptError as exc:
                for rid in added:
                    self.engine.abort(rid, report=False)
                problem = f"prompt {i}: {exc.problem}" if len(batch) > 1 else exc.problem
                raise LlmoptError(problem, exc.fix) from exc
        return added

    def _run(self, done: dict[str, RequestOutput], advance) -> None:
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    if advance:
                        advance()

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that adds to it; ``delta_text`` is the new text."""
        params = replace(sampling_params or SamplingParams(), stream_text=True)
        rid = self.engine.add_request(prompt, params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id != rid:
                        continue
                    yield out
                    if out.finished:
                        return
        finally:
            self.engine.abort(rid, report=False)  # the consumer stopped early: free its blocks

    def chat_prompt(self, message: str) -> list[int]:
        """Token ids of a one-message chat through the tokenizer's chat template (with the
        generation prompt); a clear error when the model has no template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise LlmoptError("this model has no chat template", "drop --chat and pass the prompt as plain text")
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def metrics(self) -> dict:
        return self.engine.metrics()


def _as_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    return list(prompts)


def _params_for(batch: list[Prompt], params) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * len(batch)
    params = list(params)
    if len(params) != len(batch):
        raise LlmoptError(f"{len(params)} SamplingParams for {len(batch)} prompts", "pass one per prompt, or a single one for all")
    return params
