"""Text for evaluation, calibration and training: named corpora, files, or ``datasets`` names.

Named corpora are bundled with llmopt (:mod:`llmopt.corpora`); a folder in ``$LLMOPT_DATA``
holding the same relative paths overrides them, file by file:

| name        | files                                   | use                              |
|-------------|-----------------------------------------|----------------------------------|
| wikitext2   | wikitext-2-raw/wiki.test.raw            | evaluation only                  |
| austen      | the six Jane Austen novels (Gutenberg)  | default calibration set          |
| gutenberg   | all novels but the held-out one         | distillation training            |
| heldout     | gutenberg/war-of-the-worlds.txt         | validation while training        |

Anything else is a text file, a folder of ``.txt`` files, or ``hf:NAME[:CONFIG[:SPLIT]]`` for
the ``datasets`` library (column ``text``). Calibration also takes ``self`` (text the model
samples itself) and mixes joined by ``+`` (``austen+self``: an equal share of windows from each, interleaved).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from llmopt.core.errors import LlmoptError
from llmopt.core.paths import data_dir

AUSTEN = ["emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice", "sensesensibility"]
HELDOUT = "war-of-the-worlds"
NAMED: dict[str, list[str]] = {
    "wikitext2": ["wikitext-2-raw/wiki.test.raw"],
    "austen": [f"gutenberg/{name}.txt" for name in AUSTEN],
    "gutenberg": [f"gutenberg/{name}.txt" for name in AUSTEN + ["great-expectations", "twenty-thousand-leagues"]],
    "heldout": [f"gutenberg/{HELDOUT}.txt"],
}
SELF = "self"  # calibration windows sampled by the model itself
CALIB_HELP = ("Calibration text: corpus name, file, folder, hf:NAME, 'self' (sampled by the model itself), "
              "or a mix with equal shares such as austen+self.")
DEFAULT_EVAL = "wikitext2"
DEFAULT_CALIB = "austen"


@dataclass
class TextSource:
    """Documents of one corpus, with a record of where they came from."""

    name: str
    documents: list[str]
    files: list[str] = field(default_factory=list)

    @property
    def sha256(self) -> str:
        digest = hashlib.sha256()
        for doc in self.documents:
            digest.update(doc.encode())
        return digest.hexdigest()

    def record(self) -> dict:
        return {"name": self.name, "files": self.files, "sha256": self.sha256[:16]}


def load_text(spec: str) -> TextSource:
    """Resolve a corpus name, a file, a folder or ``hf:`` spec into documents."""
    if spec in NAMED:
        return _load_named(spec)
    if spec.startswith("hf:"):
        return _load_hf(spec[3:])
    path = Path(spec).expanduser()
    if path.is_file():
        return TextSource(spec, [_read(path)], [str(path)])
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise LlmoptError(f"no .txt files in {path}", "pass a text file, a folder of .txt files or a corpus name")
        return TextSource(spec, [_read(f) for f in files], [str(f) for f in files])
    raise LlmoptError(
        f"dataset not found: {spec}",
        f"pass a text file, a folder, one of {', '.join(NAMED)}, or hf:NAME[:CONFIG[:SPLIT]]",
    )


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise LlmoptError(f"{path} is not UTF-8 text", "convert it to UTF-8") from exc


def _load_named(name: str) -> TextSource:
    """A named corpus: each file from ``$LLMOPT_DATA`` when it is there, else the bundled copy."""
    from llmopt import corpora

    root = data_dir()
    documents, files = [], []
    for rel in NAMED[name]:
        override = root / rel if root is not None else None
        if override is not None and override.is_file():
            documents.append(_read(override))
            files.append(str(override))
        else:
            documents.append(corpora.read(rel))
            files.append(f"llmopt.corpora:{rel}")
    return TextSource(name, documents, files)


def _load_hf(spec: str, name: str | None = None) -> TextSource:
    parts = spec.split(":")
    path, config, split = parts[0], (parts[1] if len(parts) > 1 else None), (parts[2] if len(parts) > 2 else "train")
    try:
        import datasets

        data = datasets.load_dataset(path, config, split=split)
    except Exception as exc:  # offline or unknown name: the user can only fix the spec or the network
        raise LlmoptError(f"cannot load dataset '{spec}' ({type(exc).__name__})", "check the name and your connection, or pass a local text file") from exc
    if "text" not in data.column_names:
        raise LlmoptError(f"dataset '{spec}' has no 'text' column", "pass a dataset with a text column")
    return dataset_text(data, "text", name or f"hf:{spec}")


def dataset_text(data, column: str, name: str) -> TextSource:
    """A ``datasets.Dataset``'s ``column`` as one document (the rows joined as they are)."""
    return TextSource(name, ["".join(data[column])], [name])


def tokenize_documents(tokenizer, source: TextSource) -> list:
    """Token ids of each document (no special tokens), as 1-D int64 tensors.

    Cached on disk by the tokenizer's full definition and the document's text, so the stages of
    a recipe (and later runs) tokenize a calibration corpus once."""
    import torch

    identity = _tokenizer_identity(tokenizer)
    out = []
    for doc in source.documents:
        key = None if identity is None else hashlib.sha256(f"{identity}|".encode() + doc.encode()).hexdigest()[:24]
        cached = _TOKEN_CACHE.get(key) if key else None
        if cached is None and key:
            cached = _load_tokens(key)
        if cached is None:
            ids = tokenizer(doc, add_special_tokens=False, return_attention_mask=False)["input_ids"]
            cached = torch.tensor(ids, dtype=torch.long)
            if key:
                _save_tokens(key, cached)
        if key:
            _TOKEN_CACHE[key] = cached
        out.append(cached)
    return out


_TOKEN_CACHE: dict = {}  # this process's tokenized documents, by key


def _tokenizer_identity(tokenizer) -> str | None:
    """A digest of everything that decides a fast tokenizer's output (None: not cacheable)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    return hashlib.sha256(backend.to_str().encode()).hexdigest()


def _load_tokens(key: str):
    import torch

    from llmopt.core.paths import cache_dir

    path = cache_dir("tokens") / f"{key}.pt"
    try:
        return torch.load(path, weights_only=True) if path.is_file() else None
    except (OSError, RuntimeError, EOFError):  # a damaged cache entry is recomputed
        return None


def _save_tokens(key: str, ids) -> None:
    import torch

    from llmopt.core.atomic import atomic_file
    from llmopt.core.paths import cache_dir

    try:
        with atomic_file(cache_dir("tokens") / f"{key}.pt") as tmp:
            torch.save(ids, tmp)
    except OSError:  # a read-only cache only costs the time to tokenize again
        pass


def calibration_ids(tokenizer, spec: str = DEFAULT_CALIB, samples: int = 128, seq_len: int = 512, seed: int = 0,
                    sample_self: Callable | None = None):
    """``samples`` windows of ``seq_len`` tokens at seeded random offsets across the documents.

    ``spec`` names one text, ``self`` (windows the model being compressed samples itself, from
    ``sample_self(tokenizer, samples, seq_len, seed)``: :mod:`llmopt.self_calibration`), or a mix joined by ``+`` (``austen+self``) that takes an equal
    share of the windows from each part, interleaved. Returns ``(ids [samples, seq_len], record)``;
    the record says what was used.
    """
    import torch

    parts = calibration_parts(spec)
    shares = [samples // len(parts) + (i < samples % len(parts)) for i in range(len(parts))]
    chunks, records = [], []
    for part, share in zip(parts, shares):
        if share:
            ids, record = _part_windows(tokenizer, part, share, seq_len, seed, sample_self)
            chunks.append(ids)
            records.append({**record, "samples": share})
    if len(parts) == 1:
        record = {k: v for k, v in records[0].items() if k != "samples"}
    else:
        record = {"name": spec, "parts": records}
    return _interleave(chunks), {**record, "samples": samples, "seq_len": seq_len, "seed": seed}


def _interleave(chunks: list):
    """The rows of each part in turn (a0 b0 a1 b1 …), so that any prefix of a mix (the sensitivity
    pass takes the first few windows) holds every part."""
    import torch

    order = sorted(((row, part) for part, chunk in enumerate(chunks) for row in range(len(chunk))))
    return torch.stack([chunks[part][row] for row, part in order])


def calibration_parts(spec: str) -> list[str]:
    """The texts of a calibration spec: ``a+b`` is a mix unless a file or folder has that name."""
    if "+" not in spec or Path(spec).expanduser().exists():
        return [spec]
    parts = spec.split("+")
    if any(not part.strip() for part in parts):
        raise LlmoptError(f"calibration mix '{spec}' has an empty part", "join texts with single +, e.g. austen+self")
    return [part.strip() for part in parts]


def _part_windows(tokenizer, spec: str, samples: int, seq_len: int, seed: int, sample_self: Callable | None):
    if spec == SELF:
        if sample_self is None:
            raise LlmoptError("calibration text 'self' is sampled from the model being compressed, and this step has none",
                              "calibrate this step on a corpus (e.g. austen)")
        return sample_self(tokenizer, samples, seq_len, seed)
    return _corpus_windows(tokenizer, spec, samples, seq_len, seed)


def _corpus_windows(tokenizer, spec: str, samples: int, seq_len: int, seed: int):
    source = load_text(spec)
    return token_windows(tokenize_documents(tokenizer, source), samples, seq_len, seed, spec), source.record()


def token_windows(documents: list, samples: int, seq_len: int, seed: int, name: str):
    """``samples`` windows ``[samples, seq_len]`` of the token ``documents`` (1-D int64 tensors)
    at seeded random offsets, each document weighted by the windows it holds; ``name``: the
    text, for the error when too few windows fit."""
    import torch

    docs = [d for d in documents if len(d) >= seq_len]
    available = sum(len(d) // seq_len for d in docs)
    if available < samples:
        raise LlmoptError(
            f"calibration text '{name}' holds {available} windows of {seq_len} tokens, {samples} requested",
            "use fewer samples, shorter sequences or a longer text",
        )
    generator = torch.Generator().manual_seed(seed)
    weights = torch.tensor([float(len(d) - seq_len + 1) for d in docs])
    rows = []
    for _ in range(samples):
        doc = docs[int(torch.multinomial(weights, 1, generator=generator))]
        start = int(torch.randint(0, len(doc) - seq_len + 1, (1,), generator=generator))
        rows.append(doc[start : start + seq_len])
    return torch.stack(rows)
