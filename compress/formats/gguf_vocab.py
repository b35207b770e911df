"""A Hugging Face tokenizer as GGUF ``tokenizer.*`` metadata, the way llama.cpp reads it.

Two tokenizer families are written:

* byte-level BPE (GPT-2 style: Llama 3, SmolLM, Qwen …) → ``tokenizer.ggml.model = "gpt2"`` with
  the tokens, their types and the merges;
* SentencePiece-style BPE with byte fallback (Llama 2, Mistral …) → ``"llama"`` with tokens,
  scores (merge priority: earlier tokens score higher) and types (``<0xNN>`` tokens are BYTE).

``tokenizer.ggml.pre`` names llama.cpp's pre-tokenizer (the regex that splits text before BPE);
it is recognized from the tokenizer's own pre-tokenizer, or copied from the GGUF file the
checkpoint was converted from. Special token ids, whether BOS/EOS are added, and the chat
template are carried over. The vocabulary is padded with ``[PAD<i>]`` (type UNUSED) up to the
embedding's row count, as llama.cpp's converter does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import TokenType

from llmopt.core.errors import LlmoptError
from llmopt.checkpoints.provenance import read_provenance

PROBE_TEXT = "Hello world"


@dataclass
class Vocab:
    """Everything the GGUF tokenizer keys hold."""

    model: str  # "gpt2" or "llama"
    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    scores: list[float] | None
    special_ids: dict[str, int]  # bos / eos / unk / pad
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool | None
    chat_template: str | None
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "model": self.model, "pre": self.pre, "tokens": len(self.tokens), "merges": len(self.merges),
            "special_ids": self.special_ids, "add_bos": self.add_bos, "add_eos": self.add_eos,
            "chat_template": self.chat_template is not None,
        }


def _merge_text(merge: Any) -> str:
    return merge if isinstance(merge, str) else " ".join(merge)


def _is_byte_level(spec: dict) -> bool:
    """Whether the tokenizer.json spec is byte-level (ByteLevel pre-tokenizer or decoder)."""
    def has(node: Any) -> bool:
        if isinstance(node, dict):
            return node.get("type") == "ByteLevel" or any(has(v) for v in node.values())
        if isinstance(node, list):
            return any(has(v) for v in node)
        return False

    return has(spec.get("pre_tokenizer")) or has(spec.get("decoder"))


def detect_pre(pre_tokenizer: dict | None) -> str | None:
    """llama.cpp's name for a byte-level pre-tokenizer, or None when it is not recognized."""
    if not pre_tokenizer:
        return None
    kind = pre_tokenizer.get("type")
    if kind == "ByteLevel":
        return "gpt-2" if pre_tokenizer.get("use_regex", True) else None
    if kind != "Sequence":
        return None
    items = pre_tokenizer.get("pretokenizers") or []
    kinds = [item.get("type") for item in items]
    if kinds == ["Digits", "ByteLevel"] and items[0].get("individual_digits") and items[1].get("use_regex", True):
        return "smollm"
    for item in items:
        if item.get("type") == "Split":
            pattern = (item.get("pattern") or {}).get("Regex")
            name = _known_splits().get(pattern)
            if name:
                return name
    return None


def _known_splits() -> dict[str, str]:
    """Split regex → llama.cpp pre-tokenizer name (first name listed for each regex)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_PRE_TOKENIZER_SPLITS,
        )
    except ImportError:  # older transformers: recognize nothing by regex
        return {}
    names: dict[str, str] = {}
    for name, regex in GGUF_PRE_TOKENIZER_SPLITS.items():
        names.setdefault(regex, "llama-bpe" if name == "llama3" else name)
    return names


def source_gguf_pre(checkpoint: Path, depth: int = 4) -> str | None:
    """``tokenizer.ggml.pre`` of the GGUF file a checkpoint was converted from (following
    ``llmopt.json`` sources through derived checkpoints), or None."""
    path = Path(checkpoint)
    for _ in range(depth):
        source = read_provenance(path).get("source")
        if not source:
            return None
        source_path = Path(source)
        if source_path.suffix.lower() == ".gguf" and source_path.is_file():
            from gguf import GGUFReader

            field_ = GGUFReader(source_path).fields.get("tokenizer.ggml.pre")
            return field_.contents() if field_ is not None else None
        if not source_path.is_dir() or source_path.resolve() == path.resolve():
            return None
        path = source_path
    return None


def build_vocab(tokenizer: Any, n_vocab: int, checkpoint: Path | None = None) -> Vocab:
    """The GGUF vocabulary of a fast (``tokenizers``-backed) tokenizer, padded to ``n_vocab``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise LlmoptError("the tokenizer has no tokenizer.json (slow tokenizer)", "save it with a fast tokenizer first")
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise LlmoptError(
            f"a {model.get('type')} tokenizer cannot be written to GGUF",
            "GGUF export supports byte-level BPE and SentencePiece-style BPE tokenizers",
        )
    byte_level = _is_byte_level(spec)
    if not byte_level and not model.get("byte_fallback"):
        raise LlmoptError("the BPE tokenizer is neither byte-level nor byte-fallback", "GGUF cannot describe it")
    notes: list[str] = []
    by_id: dict[int, str] = {i: t for t, i in model.get("vocab", {}).items()}
    added = {a["id"]: a for a in spec.get("added_tokens") or []}
    for i, a in added.items():
        by_id[i] = a["content"]
    if by_id and max(by_id) >= n_vocab:
        raise LlmoptError(
            f"the tokenizer has ids up to {max(by_id)} but the embedding has {n_vocab} rows",
            "export a checkpoint whose tokenizer fits its embedding",
        )
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
            continue
        tok = by_id[i]
        tokens.append(tok)
        if i in added:
            types.append(TokenType.CONTROL if added[i].get("special") else TokenType.USER_DEFINED)
        elif not byte_level and len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            types.append(TokenType.BYTE)
        else:
            types.append(TokenType.NORMAL)
    padded = n_vocab - len(by_id)
    if padded:
        notes.append(f"vocabulary padded with {padded} [PAD] tokens to the embedding's {n_vocab} rows")
    merges = [_merge_text(m) for m in model.get("merges") or []]
    special_ids = {
        name: int(getattr(tokenizer, f"{name}_token_id"))
        for name in ("bos", "eos", "unk", "pad")
        if getattr(tokenizer, f"{name}_token_id", None) is not None
    }
    if not byte_level and "unk" in special_ids:
        types[special_ids["unk"]] = TokenType.UNKNOWN
    probe = tokenizer(PROBE_TEXT)["input_ids"]
    plain = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    add_bos = "bos" in special_ids and len(probe) > len(plain) and probe[0] == special_ids["bos"]
    add_eos = "eos" in special_ids and len(probe) > len(plain) and probe[-1] == special_ids["eos"]
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        template = None
    if byte_level:
        pre = source_gguf_pre(checkpoint) if checkpoint is not None else None
        pre = pre or detect_pre(spec.get("pre_tokenizer"))
        if pre is None:
            pre = "default"
            notes.append("pre-tokenizer not recognized: llama.cpp will split text with its default regex")
        scores = None
        if not merges:
            # GGUF cannot store an empty array; with scores readers rebuild the (empty) merges.
            scores = [0.0] * n_vocab
            notes.append("the tokenizer has no merges; wrote scores instead (llama.cpp needs merges)")
        return Vocab("gpt2", pre, tokens, [int(t) for t in types], merges, scores, special_ids,
                     add_bos, add_eos, None, template, notes)
    scores = [0.0 if t != TokenType.NORMAL else -float(i) for i, t in enumerate(types)]
    add_space_prefix = "Metaspace" in json.dumps(spec.get("pre_tokenizer")) or "Prepend" in json.dumps(spec.get("normalizer"))
    return Vocab("llama", "default", tokens, [int(t) for t in types], merges, scores, special_ids,
                 add_bos, add_eos, add_space_prefix, template, notes)


def write_vocab(writer: Any, vocab: Vocab) -> None:
    """Add the vocabulary's keys to a ``gguf.GGUFWriter``."""
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    adders = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id,
              "unk": writer.add_unk_token_id, "pad": writer.add_pad_token_id}
    for name, token_id in vocab.special_ids.items():
        adders[name](token_id)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)
