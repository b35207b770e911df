"""Hub ids against a local mirror of the Hub's HTTP API (no network): ``org/name@revision`` and
``--revision`` download that revision (and llmopt.json records it), huggingface_hub's progress
bars go to stderr, gated / missing / unreachable repositories are one line each, a mistyped
local path never reaches the Hub, and remote code is opt-in."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import torch
from click.testing import CliRunner

from conftest import save_model, tiny_llama
from llmopt.cli.main import main

C1, C2 = "1" * 40, "2" * 40  # the commits of revisions main and rev2


class Handler(BaseHTTPRequestHandler):
    """What ``snapshot_download`` asks (huggingface_hub 2.x): the model info of a revision, the
    tree of a commit, then HEAD and GET of ``/{repo}/resolve/{commit}/{file}``."""

    def do_GET(self):
        self.answer(body=True)

    def do_HEAD(self):
        self.answer(body=False)

    def log_message(self, *args):
        pass

    def answer(self, body: bool):
        mirror: Mirror = self.server.mirror
        mirror.requests.append(f"{self.command} {self.path}")
        parts = [unquote(p) for p in urlsplit(self.path).path.strip("/").split("/")]
        api = parts[:2] == ["api", "models"]
        if api:
            parts = parts[2:]
        repo_id, rest = "/".join(parts[:2]), parts[2:]
        repo = mirror.repos.get(repo_id)
        if repo is None:
            return self.send(401, error="RepoNotFound")  # as the Hub answers for a repository it does not show
        if repo == "gated":
            return self.send(403, error="GatedRepo")
        revision = rest[1] if len(rest) > 1 else "main"
        commit = repo["refs"].get(revision, revision if revision in repo["files"] else None)
        if commit is None:
            return self.send(404, error="RevisionNotFound")
        files = repo["files"][commit]
        if api and rest[:1] == ["tree"]:
            return self.send(200, json.dumps([{"type": "file", "path": name, "size": len(data),
                                               "oid": hashlib.sha1(data).hexdigest()} for name, data in files.items()]))
        if api:
            return self.send(200, json.dumps({"id": repo_id, "sha": commit, "siblings": [{"rfilename": n} for n in files]}))
        name = "/".join(rest[2:])
        if rest[:1] != ["resolve"] or name not in files:
            return self.send(404, error="EntryNotFound", commit=commit)
        data = files[name]
        self.send(200, data, commit=commit, etag=hashlib.sha256(data).hexdigest(), body=body)

    def send(self, status, payload: str | bytes = b"", *, error=None, commit=None, etag=None, body=True):
        data = payload.encode() if isinstance(payload, str) else payload
        self.send_response(status)
        if error:
            self.send_header("X-Error-Code", error)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        if etag:
            self.send_header("ETag", f'"{etag}"')
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)


class Mirror:
    def __init__(self, repos: dict):
        self.repos, self.requests = repos, []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.mirror = self
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def files_of(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file()}


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-repos")
    revisions = {C1: files_of(save_model(tiny_llama(seed=1), root / "r1")),
                 C2: files_of(save_model(tiny_llama(seed=2), root / "r2"))}
    mirror = Mirror({"org/tiny": {"refs": {"main": C1, "rev2": C2}, "files": revisions}, "org/gated": "gated"})
    yield mirror
    mirror.server.shutdown()


@pytest.fixture
def hub(mirror, tmp_path, monkeypatch):
    """huggingface_hub pointed at the mirror, online, with its cache in tmp_path and no token."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", mirror.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", mirror.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.chdir(tmp_path)
    return mirror


def llmopt(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def refused(result, *words):
    """Exit 2, one line on stderr holding every word, no traceback."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_a_revision_downloads_its_own_weights(hub, tmp_path):
    from llmopt import load_model

    result = llmopt("quantize", "org/tiny@rev2", "--scheme", "W8A16", "-o", tmp_path / "w8", "--json")
    assert result.exit_code == 0, result.output
    json.loads(result.stdout)  # --json: the record alone on stdout
    assert "Fetching" in result.stderr and "%|" in result.stderr  # huggingface_hub's own bars, on stderr
    snapshots = tmp_path / "hub" / "models--org--tiny" / "snapshots"
    assert [p.name for p in snapshots.iterdir()] == [C2]
    record = json.loads((tmp_path / "w8" / "llmopt.json").read_text())
    assert record["hub"] == {"repo_id": "org/tiny", "commit": C2, "revision": "rev2"}
    assert record["source_spec"] == "org/tiny@rev2"
    name = "model.layers.0.self_attn.q_proj.weight"
    written = load_model(tmp_path / "w8")[0].state_dict()[name]
    weights = {seed: tiny_llama(seed=seed).state_dict()[name] for seed in (1, 2)}
    assert torch.allclose(written, weights[2], atol=0.01) and not torch.allclose(written, weights[1], atol=0.1)

    # --revision is the same; a second revision that disagrees is refused before any request
    before = len(hub.requests)
    refused(llmopt("inspect", "org/tiny@rev2", "--revision", "main"), "'rev2'", "--revision", "'main'")
    assert len(hub.requests) == before
    assert llmopt("inspect", "org/tiny", "--revision", "rev2", "--json").exit_code == 0

    # offline, the cached revision still resolves, with no request
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True  # restored by the hub fixture's monkeypatch
    before = len(hub.requests)
    assert llmopt("inspect", "org/tiny@rev2", "--json").exit_code == 0
    assert len(hub.requests) == before
    refused(llmopt("inspect", "org/tiny"), "HF_HUB_OFFLINE", "local folder")


def test_gated_missing_and_unreachable_are_one_line(hub, monkeypatch):
    refused(llmopt("inspect", "org/gated"), "'org/gated'", "HF_TOKEN", "hf auth login", "huggingface-cli login")
    refused(llmopt("inspect", "org/nope"), "no model 'org/nope'")
    refused(llmopt("generate", "org/tiny@v9", "hi", "--max-tokens", "1"), "'org/tiny'", "no revision 'v9'")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    refused(llmopt("eval", "org/tiny"), "unreachable", "local folder", "HF_HUB_OFFLINE=1")


def test_a_path_that_looks_local_never_reaches_the_hub(hub, tmp_path):
    (tmp_path / "out" / "w4a16").mkdir(parents=True)
    before = len(hub.requests)
    assert refused(llmopt("inspect", "out/w4")) == "error: no such folder: out/w4; did you mean out/w4a16?"
    refused(llmopt("quantize", "ot/w4a16", "--scheme", "W8A16", "-o", "x"), "no such folder: ot/w4a16", "did you mean out/w4a16?")
    for spec in ("./org/tiny", "org/tiny/", "org/tiny/extra", "~/org/tiny", "org\\tiny"):
        refused(llmopt("inspect", spec), f"no such folder: {spec}")
    refused(llmopt("inspect", tmp_path / "out", "--revision", "rev2"), "--revision applies to a Hub id")
    assert len(hub.requests) == before


def test_remote_code_is_opt_in(tmp_path):
    """A checkpoint whose config names its own classes (auto_map) loads only when trusted."""
    from llmopt import load_model

    folder = save_model(tiny_llama(seed=3), tmp_path / "custom")
    (folder / "configuration_tiny.py").write_text(
        "from transformers import LlamaConfig\n\nclass TinyConfig(LlamaConfig):\n    model_type = 'tiny_custom'\n")
    (folder / "modeling_tiny.py").write_text(
        "from transformers import LlamaForCausalLM\nfrom .configuration_tiny import TinyConfig\n\n"
        "class TinyForCausalLM(LlamaForCausalLM):\n    config_class = TinyConfig\n")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="tiny_custom", auto_map={"AutoConfig": "configuration_tiny.TinyConfig",
                                                      "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    refused(llmopt("inspect", folder), "needs its own Python code", "--trust-remote-code")
    result = llmopt("quantize", folder, "--scheme", "W8A16", "-o", tmp_path / "w8", "--trust-remote-code")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "w8" / "modeling_tiny.py").is_file()  # the code goes with the quantized checkpoint
    model, _ = load_model(tmp_path / "w8", trust_remote_code=True)
    assert type(model).__name__ == "TinyForCausalLM"
