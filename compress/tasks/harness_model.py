"""lm-evaluation-harness model adapter: any model llmopt loads, on the harness's model API.

Log-likelihoods (multiple-choice tasks, rolling perplexity) come from the transformers model that
``llmopt.checkpoints.models.load_model`` returns (our dequantizing loader for compressed-tensors,
converted GGUF files, pruned and distilled checkpoints alike), in right-padded batches. Generation
(``generate_until``) runs in llmopt's runtime where it supports the architecture (paged KV,
continuous batching), else through transformers' ``generate`` one request at a time.

This module imports ``lm_eval``; import it only after :func:`llmopt.tasks.scores.require_lm_eval`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from llmopt.checkpoints.models import load_model, resolve_model
from llmopt.core.errors import LlmoptError

GENERATION_BACKENDS = ("auto", "runtime", "transformers")
DEFAULT_MAX_GEN_TOKS = 256


class LlmoptLM(TemplateLM):
    """``LlmoptLM("out/w4-gptq")``: the harness's ``LM`` over an llmopt model spec.

    ``batch_size`` rows per log-likelihood forward and at most that many sequences at once in
    the runtime; ``max_length`` caps the context (default: the model's position limit);
    ``generation``: ``auto`` (runtime when supported), ``runtime`` or ``transformers``.
    """

    def __init__(self, model: str | os.PathLike, batch_size: int = 8, max_length: int | None = None,
                 generation: str = "auto", dtype: str = "float32") -> None:
        super().__init__()
        if generation not in GENERATION_BACKENDS:
            raise LlmoptError(f"unknown generation backend '{generation}'", f"use one of {', '.join(GENERATION_BACKENDS)}")
        if batch_size < 1:
            raise LlmoptError(f"batch size must be at least 1, got {batch_size}", "pass --batch-size 1 or more")
        self.spec = str(model)
        self.path = resolve_model(model)
        self.model, self.tokenizer = load_model(self.path, dtype)
        self.batch_size = int(batch_size)
        limit = getattr(self.model.config, "max_position_embeddings", None) or 2048
        self._max_length = min(int(max_length), limit) if max_length else int(limit)
        self.generation = generation
        self.generation_backend: str | None = None  # decided at the first generation request
        self._llm = None

    # -- tokenization ----------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return list(self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens)))

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # -- log-likelihood --------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """Sum of the continuation's log-probabilities and whether greedy decoding yields it,
        for each ``(key, context_ids, continuation_ids)``; longest inputs first, in batches."""
        inputs = []
        for _, context, continuation in requests:
            if not continuation:
                raise LlmoptError("a task asked for the log-likelihood of an empty continuation", "check the task's doc_to_choice")
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            scored = min(len(continuation), len(whole) - 1)  # a left-truncated continuation scores its tail
            inputs.append((whole[:-1], list(continuation)[-scored:]))
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i][0]))
        results: list[tuple[float, bool] | None] = [None] * len(inputs)
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            for i, scored in zip(batch, self._score_batch([inputs[i] for i in batch])):
                results[i] = scored
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def _score_batch(self, batch: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        width = max(len(ids) for ids, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (tokens, _) in enumerate(batch):
            ids[row, :len(tokens)] = torch.tensor(tokens)
            mask[row, :len(tokens)] = 1
        logits = self.model(input_ids=ids, attention_mask=mask).logits
        out = []
        for row, (tokens, continuation) in enumerate(batch):
            end = len(tokens)
            part = torch.log_softmax(logits[row, end - len(continuation):end].float(), dim=-1)
            target = torch.tensor(continuation)
            logprob = part.gather(1, target[:, None]).sum().item()
            out.append((float(logprob), bool((part.argmax(dim=-1) == target).all())))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihood in disjoint windows of the context length."""
        totals = []
        for (text,) in (r.args for r in requests):
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            scored = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows])
            totals.append(sum(lp for lp, _ in scored))
        return totals

    # -- generation ------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Generated text per request, cut before the first stop string (greedy unless the task
        asks for sampling). Requests with the same settings run as one runtime batch."""
        eos_text = self.tokenizer.decode([self.eot_token_id]) if self.eot_token_id is not None else None
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(repr(sorted(r.args[1].items())), []).append(i)
        texts: list[str] = [""] * len(requests)
        for members in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[members[0]].args[1]), DEFAULT_MAX_GEN_TOKS)
            until = [s for s in handle_stop_sequences(kwargs.pop("until", None), eos=eos_text) if s]
            max_new = int(kwargs.pop("max_gen_toks"))
            keep = max(self.max_length - max_new, 1)
            prompts = [self.tok_encode(requests[i].args[0])[-keep:] or [self.prefix_token_id] for i in members]
            sample = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature", 0.0)) > 0
            outs = self._generate(prompts, until, max_new, float(kwargs.get("temperature", 0.0)) if sample else 0.0)
            for i, text in zip(members, outs):
                texts[i] = _cut(text, until)
        return texts

    def _generate(self, prompts: list[list[int]], until: list[str], max_new: int, temperature: float) -> list[str]:
        llm = self._runtime()
        if llm is not None:
            from llmopt.runtime import SamplingParams

            params = [SamplingParams(max_tokens=max_new, temperature=temperature, stop=until or None, seed=i)
                      for i in range(len(prompts))]
            return [o.text for o in llm.generate(prompts, params)]
        return [self._hf_generate(p, until, max_new, temperature) for p in prompts]

    def _runtime(self):
        """The runtime's ``LLM`` when it runs this model (decided once), else None."""
        if self.generation_backend is None:
            self.generation_backend = "transformers"
            if self.generation != "transformers":
                from llmopt.runtime import LLM

                try:
                    self._llm = LLM(self.path, max_num_seqs=self.batch_size, max_model_len=self.max_length)
                    self.generation_backend = "runtime"
                except LlmoptError as exc:
                    if self.generation == "runtime":
                        raise
                    from llmopt.core.console import err

                    err.print(f"[dim]generation through transformers: {exc.problem}[/dim]")
        return self._llm

    @torch.no_grad()
    def _hf_generate(self, prompt: list[int], until: list[str], max_new: int, temperature: float) -> str:
        from transformers import StoppingCriteria, StoppingCriteriaList

        start = len(prompt)
        tokenizer = self.tokenizer

        class StopStrings(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs) -> bool:
                text = tokenizer.decode(input_ids[0, start:], skip_special_tokens=True)
                return any(s in text for s in until)

        ids = torch.tensor([prompt])
        out = self.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None, top_p=None, top_k=None,
            pad_token_id=self.eot_token_id, stopping_criteria=StoppingCriteriaList([StopStrings()]) if until else None)
        return self.tok_decode(out[0, start:].tolist())

    def get_model_info(self) -> dict:
        return {"model": self.spec, "path": str(self.path), "generation": self.generation_backend or self.generation}


def _cut(text: str, until: Iterable[str]) -> str:
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text
