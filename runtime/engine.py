"""LLMEngine: requests in, one scheduled forward per ``step``, outputs out."""

from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import torch
from llmopt.core.errors import LlmoptError

from .backends import choose_backend
from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer, held_back
from .config import GIB, EngineConfig, saved_settings, read_arch, resolve_max_model_len
from .metrics import RunStats, request_metrics
from .kv_cache import KVCache
from .kv_calibration import calibrate_cache_basis
from .models import load_model
from .model_runner import ModelRunner
from .outputs import RequestOutput
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence, Status
from .speculative import SpeculativeConfig, Speculator


class LLMEngine:
    """The serving loop: ``add_request``, then ``step`` until ``has_unfinished`` is False.

    ``model`` is anything ``llmopt.checkpoints.models.resolve_model`` accepts (``demo``, a directory, a
    ``.gguf`` file, a Hub id). Settings come from ``config`` and/or keyword overrides of
    :class:`EngineConfig` fields.
    """

    def __init__(self, model: str | os.PathLike, config: EngineConfig | None = None, *, tokenizer=None, **overrides) -> None:
        from llmopt.checkpoints.models import resolve_model

        try:  # the settings given are checked before the model is even looked for
            replace(config or EngineConfig(), **overrides).validate()
        except TypeError as exc:
            raise LlmoptError(f"unknown engine setting: {exc}", f"settings: {', '.join(EngineConfig.__dataclass_fields__)}") from exc
        self.path = resolve_model(model)
        # precedence: keyword overrides, then an explicit config, then the checkpoint's saved settings
        self.saved_settings = saved_settings(self.path) if config is None else {}
        config = replace(config or EngineConfig(**self.saved_settings), **overrides)
        config.validate()
        if config.speculative_config:  # a bad setting fails before any weight is loaded
            SpeculativeConfig.parse(config.speculative_config)
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        self.arch = read_arch(self.path, config.model_impl)
        dtype = getattr(torch, config.dtype)
        self.max_model_len = resolve_max_model_len(self.arch, config.max_model_len)
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise LlmoptError(f"device {config.device!r} was asked for but torch sees no CUDA device here",
                              "use device='cpu', or a CUDA build of torch on a machine with a GPU")
        self.backend = choose_backend(config.kernels, device, dtype)
        self.backend.set_matmul_precision(config.matmul_precision)
        self.model, self.weights = load_model(self.path, self.arch, dtype, self.backend, config.lm_head, self.max_model_len)
        bs = config.block_size
        self.bytes_per_block = KVCache.bytes_per_block(self.arch, bs, dtype, config.kv_cache_dtype)
        num_blocks = config.num_kv_blocks
        if num_blocks is None:
            num_blocks = min(int(config.kv_cache_gib * GIB) // self.bytes_per_block, config.max_num_seqs * -(-self.max_model_len // bs))
            if num_blocks < 1:
                raise LlmoptError(
                    f"a KV cache budget of {config.kv_cache_gib} GiB holds no block ({self.bytes_per_block} bytes each)",
                    "raise kv_cache_gib or lower block_size",
                )
        self.cache = KVCache(self.arch, num_blocks, bs, dtype, config.kv_cache_dtype, device, config.max_num_seqs)
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.runner = ModelRunner(self.arch, self.model, self.cache, self.max_model_len, dtype)
        self.sampler = Sampler(config.seed, self.backend.argmax)
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(self.path)
        self.eos_token_ids = _eos_ids(self.path, self.tokenizer)
        if self.cache.rotation is not None:
            calibrate_cache_basis(self.runner, self.tokenizer, num_blocks, bs, config.max_num_batched_tokens, self.max_model_len)
        self.stats = RunStats()
        self._requests: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()
        self.spec = self._speculator(config.speculative_config)

    def _speculator(self, setting) -> Speculator | None:
        """Speculative decoding as ``speculative_config`` asks (None: off); a draft model gets its
        own engine (its KV cache as many blocks as the target's) and must share the tokenizer."""
        if not setting:
            return None
        spec = SpeculativeConfig.parse(setting)
        draft = None
        if spec.method == "draft":
            c = self.config
            draft_config = EngineConfig(max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
                                        block_size=c.block_size, num_kv_blocks=self.block_manager.num_blocks,
                                        max_model_len=self.max_model_len, enable_prefix_caching=True, dtype=c.dtype,
                                        seed=c.seed, kernels=c.kernels, lm_head=c.lm_head, device=c.device,
                                        matmul_precision=c.matmul_precision)
            try:
                draft = LLMEngine(spec.model, draft_config)
            except LlmoptError as exc:
                raise LlmoptError(f"draft model {spec.model}: {exc.problem}", exc.fix) from exc
            _check_same_vocabulary(self, draft, spec.model)
        return Speculator(spec, self, draft)
    # -- requests ------------------------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a request (text or token ids); returns its id. Invalid requests raise
        ``LlmoptError`` and leave the engine as it was."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise LlmoptError(f"sampling parameters must be SamplingParams, not {type(params).__name__}", "pass SamplingParams(...)")
        text, ids = self._tokens(prompt)
        self._check_request(ids, params)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise LlmoptError(f"request id '{request_id}' is already in use", "pass a unique request_id")
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        seq = Sequence(request_id, ids, params, text, arrival_time, generator)
        if params.stop or params.stream_text:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def _tokens(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        if isinstance(prompt, torch.Tensor) and prompt.dim() == 1 and not prompt.is_floating_point():
            return None, prompt.tolist()
        raise LlmoptError(f"a prompt must be a string or a list of token ids, not {type(prompt).__name__}", "pass text or token ids")

    def _check_request(self, ids: list[int], params: SamplingParams) -> None:
        n = len(ids)
        if n == 0:
            raise LlmoptError("the prompt is empty (no tokens)", "pass a prompt of at least one token")
        vocab = self.arch.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise LlmoptError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "pass ids from this model's tokenizer")
        if n >= self.max_model_len:
            raise LlmoptError(
                f"the prompt has {n} tokens but the model length is {self.max_model_len} (prompt plus at least one generated token)",
                "shorten the prompt or raise max_model_len",
            )
        wanted = min(n + (params.max_tokens or self.max_model_len), self.max_model_len)
        if wanted > self.kv_capacity_tokens:
            raise LlmoptError(
                f"the KV cache holds {self.kv_capacity_tokens} tokens ({self.block_manager.num_blocks} blocks of "
                f"{self.block_manager.block_size}) but this request may need {wanted} (prompt {n} + max_tokens)",
                "raise kv_cache_gib / num_kv_blocks, or lower max_tokens",
            )

    def abort(self, request_id: str, report: bool = True) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already finished.
        With ``report`` the next ``step`` returns its final output (finish_reason "abort")."""
        seq = self._requests.get(str(request_id))
        if seq is None or seq.is_finished:
            return False
        self._finish(seq, "abort")
        output = self._output(seq, [])
        if report:
            self._pending.append(output)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_metrics(self) -> None:
        """Start a new measurement window for :meth:`metrics` (counters, peaks, clock)."""
        self.stats.reset()
        self.scheduler.num_preemptions = self.scheduler.prefix_queried_tokens = self.scheduler.prefix_hit_tokens = 0
        self.block_manager.peak_used = self.block_manager.num_used_blocks
        if self.spec is not None:
            self.spec.reset()

    def metrics(self) -> dict:
        """Run figures so far: throughput, KV usage, prefix-cache hit rate, preemptions …"""
        figures = self.stats.snapshot(self.scheduler, self.block_manager, self.bytes_per_block)
        if self.spec is not None:
            figures.update(self.spec.metrics())
        return figures

    # -- the loop --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and compute one step; returns an output per request that got a token or ended."""
        outputs, self._pending = self._pending, []
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if self.spec is not None:
            for seq in batch.preempted:
                self.spec.release(seq)
        if not batch:
            return outputs
        started = time.perf_counter()
        prompt_rows: list = []
        try:
            logits, sampled = self.runner.run(batch.items, prompt_rows)
            self._record_prompt_logprobs(prompt_rows)
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving
            for seq, _ in batch.items:
                seq.error = f"forward failed: {type(exc).__name__}: {exc}"
                self._finish(seq, "error")
                outputs.append(self._output(seq, []))
            return outputs
        now = time.perf_counter()
        verifying = any(seq.spec_tokens for seq, _ in batch.items)
        if self.spec is not None:
            self.spec.observe_step(batch.items, now - started, verifying)
        for seq, n in batch.items:
            seq.num_computed += 1 if seq.spec_tokens else n  # verified proposals are counted once accepted
            if seq.times.first_scheduled is None:
                seq.times.first_scheduled = started
            self.block_manager.register_full_blocks(seq)
        self.stats.steps += 1
        self.stats.computed_tokens += batch.num_tokens
        self.stats.busy_seconds += now - started
        if verifying:
            results = self.spec.verify(logits, sampled, self.sampler)
        else:
            results = [(seq, None, result) for seq, result in zip(sampled, self.sampler(logits, sampled))]
        for seq, verdict, result in results:
            if verdict is None and result.error is not None:
                seq.error = result.error
                self._finish(seq, "error")
                outputs.append(self._output(seq, []))
                continue
            if verdict is None:
                tokens, logprobs = [result.token_id], None if result.logprobs is None else [result.logprobs]
            else:
                tokens, logprobs = verdict.tokens, verdict.logprobs
            new = self._append(seq, tokens, logprobs, now)
            outputs.append(self._output(seq, new))
        return outputs

    def _record_prompt_logprobs(self, rows: list) -> None:
        """Store, for each ``(seq, positions, logits)`` the runner computed, the log-probability of
        the prompt token after each position and the top ``prompt_logprobs`` tokens there."""
        for seq, positions, logits in rows:
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            targets = torch.tensor([seq.token_ids[q + 1] for q in positions], dtype=torch.long, device=logprobs.device)
            chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
            k = seq.params.prompt_logprobs
            top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
            top_lp = top_lp.tolist() if k else None
            top_ids = top_ids.tolist() if k else None
            for j, q in enumerate(positions):
                entry = dict(zip(top_ids[j], top_lp[j])) if k else {}
                entry[int(targets[j])] = chosen[j]
                seq.prompt_logprobs[q + 1] = entry

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[dict] | None, now: float) -> list[int]:
        """Append the step's tokens to ``seq`` until one stops it; each token after the first
        is an accepted proposal whose KV the step computed. Returns the tokens appended."""
        new = []
        for j, token in enumerate(tokens):
            if j:
                seq.num_computed += 1
            seq.append_token(token)
            new.append(token)
            self.stats.generated_tokens += 1
            if seq.times.first_token is None:
                seq.times.first_token = now
            if logprobs is not None:
                seq.logprobs.append(logprobs[j])
                seq.cumulative_logprob += logprobs[j][token]
            self._check_stop(seq, token)
            if seq.is_finished:
                return new
        if len(tokens) > 1:
            self.block_manager.register_full_blocks(seq)
        return new

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        reason = None
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            reason, seq.stop_reason = "stop", token
        elif params.stop:
            shown = len(seq.detokenizer.text)
            text = seq.detokenizer.text + seq.detokenizer.push(seq.output_token_ids)
            start = max(0, shown - max(len(s) for s in params.stop) + 1)  # a match must end in the new text
            hits = [(at, s) for s in params.stop if (at := text.find(s, start)) >= 0]
            if hits:
                at, stop = min(hits)
                seq.text_end = at + len(stop) if params.include_stop_str_in_output else at
                reason, seq.stop_reason = "stop", stop
        if reason is None and (
            (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens)
            or seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        if self.spec is not None:
            self.spec.release(seq)
        seq.times.finished = time.perf_counter()
        self.stats.finished_requests += 1

    def _decode_ids(self, ids: list[int], params: SamplingParams, end: int | None) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        return text if end is None else text[:end]

    def _output(self, seq: Sequence, new: list[int]) -> RequestOutput:
        finished = seq.status is Status.FINISHED
        if finished:
            self._requests.pop(seq.request_id, None)
        ids, end = seq.output_token_ids, seq.text_end
        text, delta = self._grown_text(seq, ids, finished) if seq.detokenizer is not None else (None, "")
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
            token_ids=ids,
            new_token_ids=new,
            finished=finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=None if seq.logprobs is None else list(seq.logprobs),
            cumulative_logprob=None if seq.logprobs is None else seq.cumulative_logprob,
            num_cached_tokens=seq.num_cached_tokens,
            metrics=request_metrics(seq),
            error=seq.error,
            prompt_logprobs=None if seq.prompt_logprobs is None else list(seq.prompt_logprobs),
            delta_text=delta,
            _decode=lambda: self._decode_ids(ids, seq.params, end),
            _text=text,
        )

    def _grown_text(self, seq: Sequence, ids: list[int], finished: bool) -> tuple[str, str]:
        """``(text so far, new text to hand out)`` of a sequence decoded as it grows: a few
        tokens' work per step. Text that could still become a stop string is held back."""
        detok = seq.detokenizer
        if finished:
            detok.flush(ids)
        elif not seq.params.stop:  # with stop strings every token was decoded when it was checked
            detok.push(ids)
        text = detok.text if seq.text_end is None else detok.text[:seq.text_end]
        ready = len(text) if finished else len(text) - held_back(text, seq.params.stop)
        delta = text[seq.num_text_sent:ready] if ready > seq.num_text_sent else ""
        seq.num_text_sent = max(seq.num_text_sent, ready)
        return text, delta


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    from llmopt.checkpoints.remote_code import remote_code_kwargs

    try:
        return AutoTokenizer.from_pretrained(path, **remote_code_kwargs())  # a trusted checkpoint's own tokenizer code
    except (OSError, ValueError) as exc:
        raise LlmoptError(f"cannot load the tokenizer of {path}: {str(exc).splitlines()[0]}", "copy the tokenizer files into the checkpoint") from exc


def _eos_ids(path: Path, tokenizer) -> set[int]:
    """End-of-sequence ids: generation_config.json's, else config.json's, else the tokenizer's."""
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if file.is_file():
            value = json.loads(file.read_text()).get("eos_token_id")
            if value is not None:
                return set(value) if isinstance(value, list) else {int(value)}
    eos = getattr(tokenizer, "eos_token_id", None)
    return set() if eos is None else {int(eos)}


def _check_same_vocabulary(target: LLMEngine, draft: LLMEngine, name: str) -> None:
    """A draft must tokenize like the target: same vocabulary size and the same token table."""
    if target.arch.vocab_size != draft.arch.vocab_size or target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise LlmoptError(
            f"draft model {name} does not share the target's tokenizer (vocabulary {draft.arch.vocab_size} "
            f"vs {target.arch.vocab_size} entries, or different tokens)",
            "use a draft made from the target (llmopt distill / prune drop-layers) or one of the same model family",
        )
