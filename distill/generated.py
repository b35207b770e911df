"""Teacher-written training text, ``--data generated:CORPUS[:N]``: the teacher's own greedy
answers to N chat requests built from passages of CORPUS, kept as whole chat transcripts.

A speculative-decoding draft is only as good as how often it picks the teacher's next token
while the teacher writes. Distilling on text the teacher wrote itself (sequence-level knowledge
distillation, as in DistillSpec) trains the student exactly there, and in the chat format the
model serves. The transcripts are written once by llmopt's runtime (batched, greedy) and cached
per teacher checkpoint, corpus and N; they are a folder of ``.txt`` files the packer reads like
any other corpus.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from llmopt.checkpoints.provenance import model_fingerprint
from llmopt.core.atomic import atomic_dir
from llmopt.core.data import load_text, tokenize_documents
from llmopt.core.errors import LlmoptError
from llmopt.core.paths import cache_dir

PREFIX = "generated:"
DEFAULT_REQUESTS = 256
PASSAGE_TOKENS = 160
ANSWER_TOKENS = 256
VERSION = 1
REQUESTS = (
    "Summarize this passage in a few sentences:\n\n{}",
    "What happens in the following text? Explain it simply.\n\n{}",
    "Rewrite this passage in modern, plain English:\n\n{}",
    "List the main ideas of this passage:\n\n{}",
    "Who are the people in this passage, and what do they want?\n\n{}",
    "Continue this story for a paragraph:\n\n{}",
    "Write three questions a reader might ask about this passage, and answer them:\n\n{}",
    "Describe the mood of this passage and why the writer creates it:\n\n{}",
)


def is_generated(spec: str) -> bool:
    return spec.startswith(PREFIX)


def parse(spec: str) -> tuple[str, int]:
    """``generated:CORPUS[:N]`` → (CORPUS, N)."""
    rest = spec[len(PREFIX):]
    corpus, sep, count = rest.rpartition(":")
    if not sep or not count.isdigit():
        corpus, count = rest, ""
    corpus = corpus or "austen"
    requests = int(count) if count else DEFAULT_REQUESTS
    if requests < 1:
        raise LlmoptError(f"{spec}: the number of requests must be positive", "e.g. generated:austen:256")
    return corpus, requests


def _prompts(tokenizer, corpus: str, count: int, seed: int) -> list[list[int]]:
    """``count`` chat requests, each an instruction around a passage drawn from ``corpus``."""
    ids = [int(t) for doc in tokenize_documents(tokenizer, load_text(corpus)) for t in doc.tolist()]
    if len(ids) < PASSAGE_TOKENS:
        raise LlmoptError(f"corpus {corpus} holds fewer than {PASSAGE_TOKENS} tokens", "give a longer corpus")
    rng = random.Random(seed)
    chat = getattr(tokenizer, "chat_template", None) is not None
    prompts = []
    for i in range(count):
        start = rng.randrange(0, len(ids) - PASSAGE_TOKENS + 1)
        passage = tokenizer.decode(ids[start:start + PASSAGE_TOKENS]).strip()
        message = REQUESTS[i % len(REQUESTS)].format(passage)
        if chat:
            out = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True)
            prompts.append(list(out["input_ids"] if hasattr(out, "keys") else out))
        else:
            prompts.append(tokenizer(message + "\n\n", add_special_tokens=True).input_ids)
    return prompts


def generated_corpus(spec: str, teacher: Path, tokenizer, seed: int = 0, show_progress: bool = True) -> str:
    """The folder of teacher-written transcripts for ``spec`` (written on first use)."""
    corpus, count = parse(spec)
    source = load_text(corpus)
    key = hashlib.sha256(f"v{VERSION}|{model_fingerprint(teacher)}|{source.sha256}|{count}|{seed}|"
                         f"{PASSAGE_TOKENS}|{ANSWER_TOKENS}".encode()).hexdigest()[:20]
    folder = cache_dir("distill-generated") / key
    if folder.is_dir():
        return str(folder)
    from llmopt.runtime import LLM, SamplingParams

    prompts = _prompts(tokenizer, corpus, count, seed)
    llm = LLM(teacher, max_num_seqs=32)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS), progress=show_progress)
    if len(outputs) != len(prompts):
        raise LlmoptError(f"the teacher answered {len(outputs)} of {len(prompts)} requests", "run again")
    with atomic_dir(folder) as tmp:
        for i, (prompt, out) in enumerate(zip(prompts, outputs)):
            text = tokenizer.decode(prompt + list(out.token_ids), skip_special_tokens=False)
            (tmp / f"{i:05d}.txt").write_text(text)
    return str(folder)
