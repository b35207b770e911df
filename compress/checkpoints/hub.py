"""Hugging Face Hub ids: ``org/name[@revision]`` told apart from mistyped local paths, downloaded
with huggingface_hub's own progress bars (on stderr), its failures said in one line, and the
repository and commit a downloaded snapshot came from (for ``llmopt.json``)."""

from __future__ import annotations

import difflib
import os
import re
import sys
import threading
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from llmopt.core.errors import LlmoptError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py"]
SPEC_KINDS = "pass an existing folder, a .gguf file, 'demo' or a Hub id (org/name[@revision])"
LOGIN = "set HF_TOKEN or run 'hf auth login' (huggingface-cli login)"


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    revision: str | None = None  # None: the repository's default branch

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def split_revision(spec: str) -> tuple[str, str | None]:
    """``"org/name@rev"`` → ``("org/name", "rev")``; no ``@`` → ``(spec, None)``."""
    name, at, revision = spec.partition("@")
    if at and not revision:
        raise LlmoptError(f"'{spec}' ends with '@' and names no revision", "write org/name@REVISION (a branch, tag or commit)")
    return name, revision or None


def with_revision(spec: str, revision: str | None) -> str:
    """``spec`` with ``--revision`` folded in (``org/name@revision``); a second, different
    revision or a revision for a model on disk is refused."""
    if revision is None:
        return spec
    if spec == "demo" or Path(spec).expanduser().exists():
        raise LlmoptError(f"--revision applies to a Hub id, not to {spec}", "drop --revision")
    name, given = split_revision(spec)
    if given is not None and given != revision:
        raise LlmoptError(f"{spec} names revision '{given}' but --revision says '{revision}'", "give the revision once")
    return f"{name}@{revision}"


def hub_ref(spec: str) -> HubRef | None:
    """The Hub repository ``spec`` names, or None when it is no Hub id. A spec that looks like a
    local path (see :func:`looks_local`) is never sent to the Hub: "no such folder", with the
    closest existing name when there is one."""
    name, revision = split_revision(spec)
    if looks_local(spec, name):
        raise missing_path(spec)
    return HubRef(name, revision) if HUB_ID.match(name) else None


def looks_local(spec: str, name: str) -> bool:
    """A path, not ``org/name``: it starts with ./ ../ / or ~, holds a backslash, ends with a
    separator, has more than one /, or its first part is an existing folder here or a close typo
    of one that holds something like its second part (``ot/w4a16`` when ``out/w4a16`` exists)."""
    if spec.startswith(("./", "../", "/", "~")) or "\\" in spec or spec.endswith(("/", os.sep)) or name.count("/") > 1:
        return True
    if "/" not in name:
        return False
    first, rest = name.split("/", 1)
    if Path(first).is_dir():
        return True
    folders = [p.name for p in _entries(Path(".")) if p.is_dir()]
    return any(_close(rest, [e.name for e in _entries(Path(f))]) for f in difflib.get_close_matches(first, folders, 3, 0.66))


def missing_path(spec: str) -> LlmoptError:
    """"no such folder" (or file, for a .gguf) for ``spec``, naming the closest existing path."""
    kind = "file" if spec.lower().endswith(".gguf") else "folder"
    guess = suggest_path(spec)
    return LlmoptError(f"no such {kind}: {spec}", f"did you mean {guess}?" if guess else SPEC_KINDS)


def suggest_path(spec: str) -> str | None:
    """The existing path closest to ``spec``: its deepest existing folder, then the entry there
    closest to the first missing part (a name it starts, or a difflib match), then the rest."""
    path = Path(spec).expanduser()
    parts = path.parts
    base, i = (Path(parts[0]), 1) if path.is_absolute() else (Path("."), 0)
    while i < len(parts) and (base / parts[i]).exists():
        base, i = base / parts[i], i + 1
    if i >= len(parts):
        return None
    match = _close(parts[i], [e.name for e in _entries(base)])
    return str(Path(base, match, *parts[i + 1:])) if match else None


def _close(name: str, names: list[str]) -> str | None:
    starts = sorted(n for n in names if n.startswith(name) and not n.startswith("."))
    if starts:
        return starts[0]
    found = difflib.get_close_matches(name, [n for n in names if not n.startswith(".")], 1, 0.75)
    return found[0] if found else None


def _entries(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []


_downloaded: dict[tuple, Path] = {}  # one look-up per process and revision: a command resolves its model more than once
_requested: dict[str, str] = {}  # snapshot folder → the revision it was asked for (a branch, tag or commit)


def download(ref: HubRef) -> Path:
    """The local snapshot folder of ``ref`` (downloaded, or found in huggingface_hub's cache)."""
    from huggingface_hub import constants, snapshot_download

    key = (constants.ENDPOINT, constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE, ref)
    if key in _downloaded:
        return _downloaded[key]
    try:
        local = snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=ALLOW_PATTERNS,
                                  tqdm_class=progress_bar())
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line; unknown ones keep their type
        raise hub_error(ref, exc) from exc
    path = Path(local)
    _downloaded[key] = path
    _requested[str(path)] = ref.revision or constants.DEFAULT_REVISION
    return path


@cache
def progress_bar() -> type:
    """huggingface_hub's download bars, shown on stderr even where the CLI silenced the libraries'
    tqdm bars (TQDM_DISABLE, transformers' disable_progress_bar); HF_HUB_DISABLE_PROGRESS_BARS=1
    still hides them."""
    from tqdm.auto import tqdm

    class HubBar(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            kwargs["disable"] = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").upper() in {"1", "ON", "YES", "TRUE"}
            kwargs["file"] = kwargs.get("file") or sys.stderr
            super().__init__(*args, **kwargs)

    HubBar.set_lock(threading.RLock())  # no multiprocessing lock (a resource-tracker process) for a thread pool
    return HubBar


def hub_error(ref: HubRef, exc: BaseException) -> LlmoptError:
    """One line for a failed download: gated, missing repository or revision, offline, unreachable."""
    import httpx2
    from huggingface_hub import constants, errors

    chain = _chain(exc)

    def find(kind):
        return next((e for e in chain if isinstance(e, kind)), None)

    what = f"cannot download '{ref}' from the Hugging Face Hub"
    http = find(errors.HfHubHTTPError)
    status = getattr(getattr(http, "response", None), "status_code", None)
    if find(errors.GatedRepoError):
        return LlmoptError(f"{what}: '{ref.repo_id}' is a gated repository",
                           f"accept its terms at {constants.ENDPOINT}/{ref.repo_id}, then {LOGIN}")
    if status in (401, 403) and not find(errors.RepositoryNotFoundError):
        return LlmoptError(f"{what}: the Hub refused access (HTTP {status})", f"{LOGIN} with a token that can read it")
    if find(errors.RevisionNotFoundError):
        return LlmoptError(f"{what}: '{ref.repo_id}' has no revision '{ref.revision}'",
                           "pass an existing branch, tag or commit (org/name@REVISION or --revision)")
    if find(errors.RepositoryNotFoundError) or status == 404:
        return LlmoptError(f"{what}: no model '{ref.repo_id}' on the Hub (a private one needs a token)",
                           f"check the id; for a private model {LOGIN}")
    if find(errors.HFValidationError):
        return LlmoptError(f"'{ref.repo_id}' is not a valid Hub id", SPEC_KINDS)
    if find(errors.OfflineModeIsEnabled) or (constants.HF_HUB_OFFLINE and find(errors.LocalEntryNotFoundError)):
        return LlmoptError(f"{what}: HF_HUB_OFFLINE=1 is set and no copy of it is cached",
                           "unset HF_HUB_OFFLINE to download it, or pass a local folder")
    network = find(httpx2.TransportError) or find(ConnectionError)
    if network or find(errors.LocalEntryNotFoundError) or (status or 0) >= 500:
        reason = type(network or exc).__name__ if status is None else f"HTTP {status}"
        return LlmoptError(f"{what}: the Hub is unreachable ({reason}) and no copy of it is cached",
                           "check your connection, pass a local folder, or set HF_HUB_OFFLINE=1 to use a cached copy")
    return LlmoptError(f"{what} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
                       "check the id and your connection, or pass a local folder")


def _chain(exc: BaseException | None) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def hub_origin(path: str | os.PathLike | None) -> dict | None:
    """``{"repo_id", "revision", "commit"}`` for a folder of huggingface_hub's cache
    (``…/models--org--name/snapshots/<commit>``), None for any other path."""
    if not path:
        return None
    folder = Path(path)
    repo = folder.parent.parent.name
    if folder.parent.name != "snapshots" or not repo.startswith("models--") or not re.fullmatch(r"[0-9a-f]{40}", folder.name):
        return None
    record = {"repo_id": repo[len("models--"):].replace("--", "/"), "commit": folder.name}
    if str(folder) in _requested:
        record["revision"] = _requested[str(folder)]
    return record
