"""Calibration (and training) data in whatever form a script holds it, as token windows.

:func:`calibration_windows` is the one conversion to what the quantizers and pruners take;
:func:`packed_windows` cuts the same forms into consecutive windows for training. They take:

- a string: what ``--calib`` takes (a bundled corpus name, a file, a folder, ``hf:NAME``, a mix),
  read exactly as the CLI reads it (:func:`~llmopt.core.data.calibration_ids`);
- a ``datasets.Dataset``: its ``text`` column (else its ``input_ids`` column, else its only
  string column; the record names the column used), the rows joined as ``--calib hf:NAME`` joins them;
- a list of strings: one text, the strings joined by a blank line;
- token ids: a 2-D integer tensor ``[n, seq_len]`` is used as the windows themselves; a 1-D
  tensor, a list of ids, or a list of such sequences is one stream of tokens (concatenated);
  a tokenizer's output (a mapping with ``input_ids``) is its ``input_ids``.

Text and token streams are cut into windows as the CLI cuts a corpus (seeded random offsets).
Where the caller leaves ``samples`` / ``seq_len`` unset, a named corpus gets the defaults and
data given in memory gets as much as it holds, up to them: ``min(seq_len, tokens)`` tokens per
window and up to ``samples`` windows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from llmopt.core.data import TextSource, calibration_ids, dataset_text, token_windows, tokenize_documents
from llmopt.core.errors import LlmoptError

JOIN = "\n\n"  # between the strings of a list
FORMS = ("a corpus name or file (as --calib takes), a datasets.Dataset with a text column, a list of strings, "
         "or token ids (a [n, seq_len] tensor or lists of ids)")


def calibration_windows(data: Any, tokenizer: Any = None, *, samples: int | None = None, seq_len: int | None = None,
                        seed: int = 0, defaults: tuple[int, int] = (128, 512),
                        vocab_size: int | None = None) -> tuple[Any, dict]:
    """``(ids [samples, seq_len], record)`` from calibration ``data`` in any of the module's forms;
    ``defaults``: ``(samples, seq_len)`` where they are not given; ``vocab_size``: token ids must
    lie below it. LlmoptError for anything else, saying which forms work."""
    if isinstance(data, str):
        text = _need_tokenizer(tokenizer, f"calibration text '{data}'")
        return calibration_ids(text, data, samples or defaults[0], seq_len or defaults[1], seed)
    tokens, record, given = _tokens(data, tokenizer, samples, seq_len)
    if given:
        ids = tokens
    else:
        if len(tokens) < 2:
            raise LlmoptError(f"the calibration data holds {len(tokens)} token", "pass more text")
        length = seq_len or min(defaults[1], len(tokens))
        count = samples or max(1, min(defaults[0], len(tokens) // length))
        ids = token_windows([tokens], count, length, seed, record["name"])
    _check_vocab(ids, vocab_size)
    return ids, {**record, "samples": int(ids.shape[0]), "seq_len": int(ids.shape[1]), "seed": seed}


def packed_windows(data: Any, tokenizer: Any, seq_len: int) -> tuple[Any, dict]:
    """``(ids [n, seq_len], record)``: in-memory ``data`` (not a corpus name) cut into
    consecutive windows of ``seq_len`` tokens (the tail that does not fill one is dropped); a
    2-D tensor is used as it is."""
    ids, record, given = _tokens(data, tokenizer)
    if not given:
        n = len(ids) // seq_len
        if n == 0:
            raise LlmoptError(f"the data holds {len(ids)} tokens, fewer than one window of {seq_len}",
                              "pass more text or a shorter seq_len")
        ids = ids[: n * seq_len].reshape(n, seq_len).clone()
    return ids, {**record, "seq_len": int(ids.shape[1]), "sequences": int(ids.shape[0]), "tokens": int(ids.numel())}


def _tokens(data: Any, tokenizer: Any, samples: int | None = None, seq_len: int | None = None) -> tuple[Any, dict, bool]:
    """``(ids, record, windows given)``: a 2-D tensor (or a tokenizer's output holding one) as the
    windows themselves, anything else in memory as one token stream."""
    import torch

    if isinstance(data, Mapping) and "input_ids" in data:
        data = data["input_ids"]
    if isinstance(data, torch.Tensor) and data.dim() == 2:
        return (*_windows_as_given(data, samples, seq_len), True)
    return (*token_stream(data, tokenizer), False)


def _need_tokenizer(tokenizer: Any, what: str) -> Any:
    if tokenizer is None:
        raise LlmoptError(f"{what} needs the model's tokenizer", "pass it after the model: llmopt.quantize(model, tokenizer, ...)")
    return tokenizer


def _windows_as_given(ids: Any, samples: int | None, seq_len: int | None) -> tuple[Any, dict]:
    """A 2-D tensor of token ids: the windows themselves."""
    import torch

    if samples is not None or seq_len is not None:
        raise LlmoptError("a 2-D tensor of token ids is used as the calibration windows as it is",
                          "drop calib_samples / calib_seq_len, or pass the ids as one 1-D stream")
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise LlmoptError(f"calibration token ids must be integers, got a {ids.dtype} tensor", "pass input_ids, not embeddings")
    ids = ids.detach().cpu().long()
    return ids, {"name": f"token ids {list(ids.shape)}", "sha256": _digest(ids)}


def token_stream(data: Any, tokenizer: Any) -> tuple[Any, dict]:
    """One 1-D int64 token stream from in-memory text or token data (any form but a corpus name
    and a 2-D tensor), and its record."""
    import torch

    if _is_dataset(data):
        return _dataset_stream(data, tokenizer)
    if isinstance(getattr(data, "column_names", None), dict):
        raise LlmoptError(f"the dataset holds several splits ({', '.join(data.column_names)})",
                          f"pass one of them, e.g. dataset['{next(iter(data.column_names), 'train')}']")
    if isinstance(data, torch.Tensor):
        if data.dim() != 1 or data.is_floating_point():
            raise LlmoptError(f"calibration token ids must be a 1-D or 2-D integer tensor, got {data.dim()}-D {data.dtype}",
                              "pass input_ids [n, seq_len] or one stream of ids")
        return data.detach().cpu().long(), {"name": f"token ids [{len(data)}]", "sha256": _digest(data)}
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)) and len(data) > 0:
        if all(isinstance(x, str) for x in data):
            source = TextSource(f"{len(data)} texts", [JOIN.join(data)])
            return _text_stream(source, tokenizer)
        tokens = _token_lists(data)
        if tokens is not None:
            stream = torch.cat(tokens)
            return stream, {"name": f"token ids ({len(tokens)} sequences)", "sha256": _digest(stream)}
    raise LlmoptError(f"calibration data of type {_kind(data)} is not one llmopt reads", f"pass {FORMS}")


def _text_stream(source: TextSource, tokenizer: Any) -> tuple[Any, dict]:
    tokenizer = _need_tokenizer(tokenizer, f"calibration text ({source.name})")
    (stream,) = tokenize_documents(tokenizer, source)
    return stream, source.record()


def _token_lists(data: Sequence) -> list | None:
    """Token ids as 1-D int64 tensors: ``data`` is a list of ids (one sequence) or of sequences
    of ids; None when it is neither."""
    import torch

    if all(isinstance(x, int) and not isinstance(x, bool) for x in data):
        return [torch.tensor(list(data), dtype=torch.long)]
    out = []
    for item in data:
        if isinstance(item, torch.Tensor) and item.dim() == 1 and not item.is_floating_point():
            out.append(item.detach().cpu().long())
        elif isinstance(item, Sequence) and item and all(isinstance(x, int) and not isinstance(x, bool) for x in item):
            out.append(torch.tensor(list(item), dtype=torch.long))
        else:
            return None
    return out


def _is_dataset(data: Any) -> bool:
    return hasattr(data, "column_names") and hasattr(data, "features") and not isinstance(data.column_names, dict)


def dataset_column(data: Any) -> str:
    """The column a ``datasets.Dataset`` is read from: ``text``, else ``input_ids``, else its only
    string column; LlmoptError naming the columns otherwise."""
    columns = list(data.column_names)
    for name in ("text", "input_ids"):
        if name in columns:
            return name
    strings = [c for c in columns if getattr(data.features[c], "dtype", None) in ("string", "large_string")]
    if len(strings) == 1:
        return strings[0]
    raise LlmoptError(f"the dataset has no 'text' column (columns: {', '.join(columns) or 'none'})",
                      "pick one: dataset.rename_column(NAME, 'text'), or pass a list of strings")


def _dataset_stream(data: Any, tokenizer: Any) -> tuple[Any, dict]:
    import torch

    column = dataset_column(data)
    if column == "input_ids":
        tokens = _token_lists(list(data[column]))
        if tokens is None:
            raise LlmoptError("the dataset's input_ids column does not hold lists of token ids", "pass a dataset with a text column")
        stream = torch.cat(tokens)
        return stream, {"name": "datasets.Dataset", "column": column, "rows": len(data), "sha256": _digest(stream)}
    stream, record = _text_stream(dataset_text(data, column, "datasets.Dataset"), tokenizer)
    return stream, {**record, "column": column, "rows": len(data)}


def _check_vocab(ids: Any, vocab_size: int | None) -> None:
    if vocab_size is None or ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise LlmoptError(f"calibration token id {bad} is outside the model's vocabulary (0 to {vocab_size - 1})",
                          "tokenize the text with the model's own tokenizer")


def _digest(ids: Any) -> str:
    return hashlib.sha256(ids.detach().cpu().long().numpy().tobytes()).hexdigest()[:16]


def _kind(data: Any) -> str:
    return type(data).__name__ if not isinstance(data, Sequence) or not data else f"{type(data).__name__} of {type(data[0]).__name__}"
