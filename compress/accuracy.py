"""Accuracy against text and against an original model: perplexity, KL divergence, top-1 agreement.

Conventions (as llama.cpp's perplexity tool): the text is tokenized once, cut into
non-overlapping windows of ``seq_len`` tokens, and every token after the first of each window
is predicted, so a window contributes ``seq_len - 1`` scored tokens. KL divergence is
``KL(P_baseline || P_model)`` per scored token; its mean, median and 99th percentile are
reported, and top-1 agreement is the share of tokens where both models' argmax agree.

The baseline's next-token distributions are computed once and cached on disk as the top-k
log-probabilities per token (k = 1024 by default); the probability mass outside the top k is
kept as one "rest" bucket, so the KL divergence computed from the cache is exact for the top
k tokens and merges the remainder (exact when k is the vocabulary size).
"""

from __future__ import annotations


import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from llmopt.core.data import DEFAULT_EVAL, load_text
from llmopt.core.errors import LlmoptError
from llmopt.core.paths import cache_dir

DEFAULT_SEQ_LEN = 2048
DEFAULT_MAX_WINDOWS = 16
DEFAULT_TOP_K = 1024


@dataclass
class EvalData:
    """Token windows to score, and where they came from."""

    windows: torch.Tensor  # [n_windows, seq_len] int64
    dataset: str
    sha256: str

    @property
    def seq_len(self) -> int:
        return self.windows.shape[1]

    def key(self) -> str:
        return f"{self.sha256[:16]}-{self.seq_len}"


@dataclass
class EvalResult:
    perplexity: float
    tokens: int
    windows: int
    seq_len: int
    dataset: str
    kld_mean: float | None = None
    kld_median: float | None = None
    kld_p99: float | None = None
    top1_agreement: float | None = None
    baseline_perplexity: float | None = None
    kld_top_k: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def eval_data(
    tokenizer,
    dataset: str = DEFAULT_EVAL,
    seq_len: int = DEFAULT_SEQ_LEN,
    max_windows: int | None = DEFAULT_MAX_WINDOWS,
) -> EvalData:
    """Tokenize ``dataset`` and cut it into the first ``max_windows`` windows of ``seq_len``."""
    if seq_len < 2:
        raise LlmoptError(f"--seq-len {seq_len} is too short", "use at least 2 tokens (2048 is the convention)")
    source = load_text(dataset)
    ids = _leading_ids(tokenizer, source.documents, max_windows * seq_len if max_windows else None)
    n = ids.numel() // seq_len
    if n == 0:
        raise LlmoptError(
            f"dataset '{dataset}' has {ids.numel()} tokens, fewer than one window of {seq_len}",
            "use a longer text or a smaller --seq-len",
        )
    if max_windows:
        n = min(n, max_windows)
    windows = ids[: n * seq_len].reshape(n, seq_len)
    digest = hashlib.sha256(windows.numpy().tobytes()).hexdigest()
    return EvalData(windows, source.name, digest)


BOUNDARY_TOKENS = 64  # tokens near a cut in the text may differ from the whole text's: never kept


def _leading_ids(tokenizer, documents: list[str], needed: int | None) -> torch.Tensor:
    """The first ``needed`` token ids of the documents, one after another (all of them when None),
    equal to tokenizing every document whole: a document is tokenized in growing prefixes and
    only tokens well before a prefix's cut are kept."""
    parts: list[torch.Tensor] = []
    have = 0
    for doc in documents:
        if needed is not None and have >= needed:
            break
        chars = len(doc) if needed is None else min(len(doc), 8 * (needed - have) + 4096)
        while True:
            ids = tokenizer(doc[:chars], add_special_tokens=False, return_attention_mask=False)["input_ids"]
            if chars >= len(doc):
                break
            if len(ids) - BOUNDARY_TOKENS >= needed - have:
                ids = ids[: len(ids) - BOUNDARY_TOKENS]
                break
            chars = min(len(doc), 2 * chars)
        parts.append(torch.tensor(ids, dtype=torch.long))
        have += len(ids)
    ids = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    return ids if needed is None else ids[:needed]


def _log_probs(model, window: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities ``[seq_len - 1, vocab]`` (float32) for one window."""
    with torch.inference_mode():
        logits = model(input_ids=window[None]).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


class BaselineCache:
    """Top-k next-token log-probabilities of a baseline model, one file per window."""

    def __init__(self, root: Path, top_k: int = DEFAULT_TOP_K) -> None:
        self.root = Path(root)
        self.top_k = top_k
        self.root.mkdir(parents=True, exist_ok=True)

    @classmethod
    def for_model(cls, fingerprint: str, data: EvalData, top_k: int = DEFAULT_TOP_K) -> BaselineCache:
        key = hashlib.sha256(f"{fingerprint}|{data.key()}|{top_k}".encode()).hexdigest()[:20]
        return cls(cache_dir("eval", key), top_k)

    def _file(self, index: int) -> Path:
        return self.root / f"window-{index:05d}.pt"

    def has(self, index: int) -> bool:
        return self._file(index).is_file()

    def load(self, index: int) -> dict[str, torch.Tensor]:
        return torch.load(self._file(index), weights_only=True)

    def store(self, index: int, log_probs: torch.Tensor, targets: torch.Tensor) -> None:
        k = min(self.top_k, log_probs.shape[-1])
        top_logp, top_idx = log_probs.topk(k, dim=-1)
        entry = {
            "top_logp": top_logp.contiguous(),
            "top_idx": top_idx.to(torch.int32).contiguous(),
            "nll": -log_probs.gather(-1, targets[:, None])[:, 0],
        }
        tmp = self._file(index).with_suffix(".tmp")
        torch.save(entry, tmp)
        tmp.replace(self._file(index))

    def missing(self, n_windows: int) -> list[int]:
        return [i for i in range(n_windows) if not self.has(i)]


def kl_from_top_k(base: dict[str, torch.Tensor], log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(base || model), exact on the base's top k tokens, the rest merged in one bucket."""
    idx = base["top_idx"].long()
    p_logp = base["top_logp"]
    q_logp = log_probs.gather(-1, idx)
    p = p_logp.exp()
    kl = (p * (p_logp - q_logp)).sum(-1)
    if idx.shape[-1] < log_probs.shape[-1]:
        p_rest = (1 - p.sum(-1)).clamp(min=0)
        q_rest = (1 - q_logp.exp().sum(-1)).clamp(min=1e-30)
        rest = torch.where(p_rest > 0, p_rest * (p_rest.clamp(min=1e-30).log() - q_rest.log()), torch.zeros_like(p_rest))
        kl = kl + rest
    return kl.clamp(min=0)


def fill_baseline(model, data: EvalData, cache: BaselineCache, advance: Callable[[int], None] | None = None) -> None:
    """Compute and cache the baseline's distributions for every window not cached yet."""
    for i in cache.missing(len(data.windows)):
        window = data.windows[i]
        cache.store(i, _log_probs(model, window), window[1:])
        if advance:
            advance(1)


def evaluate(
    model,
    data: EvalData,
    baseline: BaselineCache | None = None,
    advance: Callable[[int], None] | None = None,
    store_baseline: bool = False,
) -> EvalResult:
    """Score ``model`` on ``data``; with ``baseline``, also KLD and top-1 agreement against it.

    ``store_baseline`` writes this model's own distributions into ``baseline`` as it goes
    (used when the model is its own baseline, saving a second pass).
    """
    nll_parts, kld_parts, agree, base_nll_parts = [], [], 0, []
    for i, window in enumerate(data.windows):
        targets = window[1:]
        log_probs = _log_probs(model, window)
        nll_parts.append(-log_probs.gather(-1, targets[:, None])[:, 0])
        if baseline is not None:
            if store_baseline and not baseline.has(i):
                baseline.store(i, log_probs, targets)
            base = baseline.load(i)
            kld_parts.append(kl_from_top_k(base, log_probs))
            agree += int((base["top_idx"][:, 0].long() == log_probs.argmax(-1)).sum())
            base_nll_parts.append(base["nll"])
        if advance:
            advance(1)
    nll = torch.cat(nll_parts).double()
    tokens = nll.numel()
    result = EvalResult(
        perplexity=float(nll.mean().exp()),
        tokens=tokens,
        windows=len(data.windows),
        seq_len=data.seq_len,
        dataset=data.dataset,
    )
    if baseline is not None:
        kld = torch.cat(kld_parts).double()
        result.kld_mean = float(kld.mean())
        result.kld_median = float(kld.median())
        result.kld_p99 = float(torch.quantile(kld, 0.99)) if kld.numel() <= 16_000_000 else float(kld.sort().values[int(0.99 * (kld.numel() - 1))])
        result.top1_agreement = agree / tokens
        result.baseline_perplexity = float(torch.cat(base_nll_parts).double().mean().exp())
        result.kld_top_k = baseline.top_k
    return result


def check_seq_len(model, seq_len: int) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and seq_len > limit:
        raise LlmoptError(f"--seq-len {seq_len} exceeds the model's {limit} positions", f"use --seq-len {limit} or less")


def save_json(path: Path, payload: dict) -> None:
    from llmopt.core.atomic import atomic_file

    with atomic_file(Path(path)) as tmp:
        tmp.write_text(json.dumps(payload, indent=2) + "\n")


def run_eval(
    model_spec: str,
    baseline_spec: str | None = None,
    dataset: str = DEFAULT_EVAL,
    seq_len: int = DEFAULT_SEQ_LEN,
    max_windows: int | None = DEFAULT_MAX_WINDOWS,
    top_k: int = DEFAULT_TOP_K,
) -> EvalResult:
    """Evaluate a model spec, optionally against a baseline spec (whose distributions are cached)."""
    from llmopt.core.console import progress_task
    from llmopt.checkpoints.models import load_model, resolve_model
    from llmopt.checkpoints.provenance import model_fingerprint

    path = resolve_model(model_spec)
    model, tokenizer = load_model(path)
    check_seq_len(model, seq_len)
    data = eval_data(tokenizer, dataset, seq_len, max_windows)
    cache = None
    same = False
    if baseline_spec is not None:
        base_path = resolve_model(baseline_spec)
        base_fp = model_fingerprint(base_path)
        same = base_fp == model_fingerprint(path)
        cache = BaselineCache.for_model(base_fp, data, top_k)
        missing = cache.missing(len(data.windows))
        if missing and not same:
            del model
            base_model, base_tokenizer = load_model(base_path)
            if len(base_tokenizer) != len(tokenizer) or base_model.config.vocab_size != _vocab(path):
                raise LlmoptError("the baseline and the model have different vocabularies", "compare models that share a tokenizer")
            with progress_task(f"baseline {baseline_spec}", len(missing)) as advance:
                fill_baseline(base_model, data, cache, advance)
            del base_model
            model, tokenizer = load_model(path)
    if same and not cache.missing(len(data.windows)):
        return cached_self_result(data, cache)  # the baseline against itself: nothing to compute
    with progress_task(f"eval {model_spec}", len(data.windows)) as advance:
        return evaluate(model, data, cache, advance, store_baseline=same)


def cached_self_result(data: EvalData, cache: BaselineCache) -> EvalResult:
    """A baseline's own figures from its cache: its perplexity, KLD 0 and full agreement."""
    nll = torch.cat([cache.load(i)["nll"] for i in range(len(data.windows))]).double()
    ppl = float(nll.mean().exp())
    return EvalResult(perplexity=ppl, tokens=nll.numel(), windows=len(data.windows), seq_len=data.seq_len,
                      dataset=data.dataset, kld_mean=0.0, kld_median=0.0, kld_p99=0.0, top1_agreement=1.0,
                      baseline_perplexity=ppl, kld_top_k=cache.top_k)


def _vocab(path: Path) -> int:
    from llmopt.checkpoints.models import read_config

    return int(read_config(path).get("vocab_size", 0))
