"""README.md stays short and every command in it works.

Every ``llmopt …`` line of the README's fenced shell blocks runs, in the README's order (later
examples read earlier outputs), through click's CliRunner in a temporary working folder, on a
tiny random Llama in place of ``demo``. Work is scaled down, never changed in kind: calibrated
commands get ``--calib-samples 2 --calib-seq-len 16`` where the command has those options,
evaluations a few short windows, ``--steps`` becomes 2, recipes get the same through ``--set``.
Each command must exit 0 and leave its output. ``llmopt serve`` starts the real command, and the
README's OpenAI client snippet is run against it before it stops. The README's Python API block
runs the same way. The set-up commands (``bash scripts/install.sh …``) are only checked for their
exact text (bench/fresh_clone.py times them on a fresh clone).
"""

from __future__ import annotations

import ast
import dataclasses
import re
import shlex
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from conftest import byte_tokenizer, save_model, tiny_llama

from llmopt.cli.main import main

pytestmark = pytest.mark.usefixtures("one_thread")

README = Path(__file__).resolve().parents[1] / "README.md"
MAX_LINES = 250
SETUP_COMMANDS = (
    "bash scripts/install.sh && .venv/bin/llmopt demo",
    "bash scripts/install.sh && .venv/bin/python -m pytest -q",
)
SHELL = {"bash", "sh", "shell", "console", ""}
CALIBRATION = {"calib_samples": 2, "calib_seq_len": 16}
EVALUATION = {"max_windows": 2, "seq_len": 128}
SCALED = {  # command -> options added when the command has them and the README line does not set them
    "eval": {"--max-windows": "2", "--seq-len": "128"},
    "compare": {"--max-windows": "2", "--seq-len": "128", "--rounds": "1", "--repetitions": "1", "--serving-requests": "2"},
    "distill": {"--seq-len": "32", "--batch-size": "2", "--val-samples": "2"},
}
AUTO_SCALED = {"--sensitivity-samples": "2"}  # quantize --scheme AUTO
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def readme_text() -> str:
    return README.read_text(encoding="utf-8")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced code block."""
    return [(m.group(1).strip().lower(), m.group(2)) for m in re.finditer(r"^```([^\n]*)\n(.*?)^```", text, re.M | re.S)]


def readme_commands(text: str) -> list[list[str]]:
    """Every ``llmopt …`` command line of the shell blocks, split as a shell would (comments dropped)."""
    commands = []
    for language, body in fenced_blocks(text):
        if language not in SHELL:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0] == "llmopt":
                commands.append(words[1:])
    return commands


def python_block(text: str, marker: str) -> str:
    blocks = [body for language, body in fenced_blocks(text) if language == "python" and marker in body]
    assert len(blocks) == 1, f"README.md should have one python block with {marker!r}, found {len(blocks)}"
    return blocks[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def needs_calibration(kind: str, values: dict) -> bool:
    """What the stage itself says about these options (``QuantizeConfig.needs_calibration`` …)."""
    from llmopt.pipeline.registry import stage
    from llmopt.pipeline.stages.base import build_config

    config = stage(kind).config
    names = {f.name for f in dataclasses.fields(config)}
    return bool(build_config(config, {k: v for k, v in values.items() if v is not None and k in names}).needs_calibration)


def option_names(command) -> set[str]:
    return {opt for param in command.params for opt in param.opts}


def given(args: list[str], option: str) -> bool:
    return any(a == option or a.startswith(option + "=") for a in args)


def scaled(args: list[str], model: Path) -> list[str]:
    """The README command with ``demo`` replaced by the tiny model and its work scaled down."""
    name, rest = args[0], [str(model) if a == "demo" else a for a in args[1:]]
    command = main.get_command(None, name)
    if command is None or not hasattr(command, "params"):
        return [name, *rest]
    options = option_names(command)
    extra: list[str] = []
    if "--steps" in rest:
        rest[rest.index("--steps") + 1] = "2"
    if "--calib-samples" in options:
        params = command.make_context(name, list(rest), resilient_parsing=True).params
        if needs_calibration(name, params):
            extra += [f"--{k.replace('_', '-')}={v}" for k, v in CALIBRATION.items() if not given(rest, f"--{k.replace('_', '-')}")]
    auto = name == "quantize" and "--scheme" in rest and rest[rest.index("--scheme") + 1].upper() == "AUTO"
    for option, value in {**SCALED.get(name, {}), **(AUTO_SCALED if auto else {})}.items():
        if option in options and not given(rest, option):
            extra += [option, value]
    if name == "run":
        extra += recipe_overrides(rest, model)
    return [name, *rest, *extra]


def recipe_overrides(rest: list[str], model: Path) -> list[str]:
    """``llmopt run``: the tiny model, and the recipe's calibration and evaluation scaled down."""
    from llmopt.pipeline.recipe import load_recipe

    recipe = load_recipe(rest[0], [])
    extra = [] if given(rest, "--model") else ["--model", str(model)]
    extra += [f"--set=calibration.{k}={v}" for k, v in (("samples", 2), ("seq_len", 16))]
    if recipe.evaluate is not None:
        extra += [f"--set=evaluate.{k}={v}" for k, v in EVALUATION.items()]
    return extra


def expected_output(args: list[str]) -> Path | None:
    """Where the command says it writes (``-o`` / ``--output``; a recipe's default folder)."""
    for i, a in enumerate(args):
        if a in ("-o", "--output") and i + 1 < len(args):
            return Path(args[i + 1])
        if a.startswith("--output="):
            return Path(a.split("=", 1)[1])
    if args[0] == "run":
        from llmopt.pipeline.recipe import load_recipe

        return Path(load_recipe(args[1], []).output)
    return None


def tiny_model(root: Path, layers: int) -> Path:
    """A tiny random Llama with a chat template (for the README's chat client call). Wide enough
    that GGUF metadata is a small part of a file, so a GGUF-size budget such as 4.85 bits per weight
    has a plan; deep enough for the layers a README command drops."""
    path = root / f"tiny-{layers}"
    if not path.exists():
        tokenizer = byte_tokenizer()
        tokenizer.chat_template = CHAT_TEMPLATE
        model = tiny_llama(seed=0, hidden_size=128, intermediate_size=1024, num_hidden_layers=layers,
                           max_position_embeddings=2048)
        save_model(model, path, tokenizer)
    return path


def layers_dropped(args: list[str]) -> int:
    """How many decoder layers the command removes (``--drop-layers N``, ``prune --method drop-layers --num N``)."""
    if "--drop-layers" in args:
        return int(args[args.index("--drop-layers") + 1])
    if "drop-layers" in args and "--num" in args:
        return int(args[args.index("--num") + 1])
    return 0


@pytest.fixture
def tiny(tmp_path) -> Path:
    return tiny_model(tmp_path / "models", 2)


def test_readme_is_short_and_keeps_the_set_up_commands():
    text = readme_text()
    lines = text.count("\n") + (not text.endswith("\n"))
    assert lines <= MAX_LINES, f"README.md has {lines} lines; at most {MAX_LINES} (move detail to docs/)"
    shell = [line.strip() for language, body in fenced_blocks(text) if language in SHELL for line in body.splitlines()]
    for command in SETUP_COMMANDS:
        assert command in shell, f"README.md lost the set-up command {command!r}"
    for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):  # relative links point at files that exist
        assert (README.parent / link).exists(), f"README.md links to {link}, which does not exist"


def test_every_readme_command_runs(tiny, tmp_path, monkeypatch):
    text = readme_text()
    commands = readme_commands(text)
    assert len(commands) >= 10 and {c[0] for c in commands} >= {"quantize", "export", "prune", "distill", "run", "serve", "eval",
                                                                "compare"}
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    yaml_blocks = [body for language, body in fenced_blocks(text) if language in ("yaml", "yml")]
    if any(c[0] == "run" and c[1].endswith((".yaml", ".yml")) for c in commands):
        assert len(yaml_blocks) == 1, "README.md runs a recipe file: it should show it in one yaml block"
        for c in commands:
            if c[0] == "run" and c[1].endswith((".yaml", ".yml")):
                Path(c[1]).write_text(yaml_blocks[0])
    served = []
    for args in commands:
        shown = "llmopt " + " ".join(args)
        if args[0] == "serve":
            served.append(serve_and_call(args, tiny, text, monkeypatch))
            continue
        run = scaled(args, tiny_model(tmp_path / "models", 2 + layers_dropped(args)))
        result = CliRunner().invoke(main, run)
        assert result.exit_code == 0, f"README command failed: {shown}\nran: llmopt {' '.join(run)}\n{result.output}"
        out = expected_output(args)
        if out is not None:
            assert out.exists(), f"README command wrote no {out}: {shown}"
            if args[0] == "run":
                assert (out / "run.json").exists(), f"{shown}: no run record in {out}"
    assert served, "README.md should show `llmopt serve`"


def serve_and_call(args: list[str], model: Path, text: str, monkeypatch) -> str:
    """Run the README's ``llmopt serve`` line for real (on a free port); while it serves, run the
    README's client snippet against it, then stop the server the way SIGTERM would."""
    import llmopt.serve as serve_module

    port = free_port()
    run = scaled(args, model)
    if "--port" in run:
        run[run.index("--port") + 1] = str(port)
    else:
        run += ["--port", str(port)]
    snippet = python_block(text, "OpenAI(")
    shown_port = re.search(r"127\.0\.0\.1:(\d+)|localhost:(\d+)", snippet)
    assert shown_port, "the client snippet should name the server's address"
    snippet = snippet.replace(shown_port.group(0), f"127.0.0.1:{port}")
    snippet = snippet.replace('"demo"', repr(str(model)))
    outcome: dict = {}
    real_build = serve_module.build

    def build(*a, **kw):
        server, state = real_build(*a, **kw)
        real_run = server.run

        def run_and_call():
            thread = threading.Thread(target=real_run, daemon=True)
            thread.start()
            try:
                deadline = time.monotonic() + 600  # a cold kernel cache compiles first
                while time.monotonic() < deadline:
                    try:
                        if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    time.sleep(0.05)
                printed: list = []
                namespace = {"print": lambda *p, **_: printed.append(p)}
                try:
                    exec(compile(snippet, "README.md (client snippet)", "exec"), namespace)
                except Exception as exc:  # reported by the test, not swallowed by the CLI
                    outcome["error"] = exc
                outcome["printed"], outcome["namespace"] = printed, namespace
            finally:
                server.should_exit = True
                thread.join(60)

        server.run = run_and_call
        return server, state

    monkeypatch.setattr(serve_module, "build", build)
    result = CliRunner().invoke(main, run)
    shown = "llmopt " + " ".join(args)
    assert result.exit_code == 0, f"README command failed: {shown}\n{result.output}"
    assert "error" not in outcome, f"the README's client call failed against `{shown}`: {outcome.get('error')!r}"
    assert outcome["printed"], "the client snippet should print the reply"
    replies = [v for v in outcome["namespace"].values() if hasattr(v, "choices")]
    assert replies and all(r.choices and r.usage.completion_tokens >= 1 for r in replies)
    return shown


def test_readme_python_api_runs(tiny, tmp_path, monkeypatch):
    import llmopt

    code = python_block(readme_text(), 'llmopt.quantize("demo"')
    monkeypatch.chdir(tmp_path)

    def small(kind: str, function):
        def call(*args, **kwargs):
            if kind == "evaluate":
                kwargs = {**EVALUATION, **kwargs}
            elif needs_calibration(kind, {**kwargs, "model": args[0] if args else None}):
                kwargs = {**CALIBRATION, **kwargs}
            return function(*args, **kwargs)

        return call

    for kind in ("quantize", "prune", "evaluate"):
        monkeypatch.setattr(llmopt, kind, small(kind, getattr(llmopt, kind)))
    code = code.replace('"demo"', repr(str(tiny)))
    printed: list = []
    exec(compile(code, "README.md (Python API block)", "exec"), {"print": lambda *p, **_: printed.append(p)})
    assert printed, "the Python block should print its results"
    outputs = [n.value for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Constant) and isinstance(n.value, str)
               and n.value.startswith("out/")]
    assert outputs, "the Python block should write under out/"
    for out in outputs:
        assert (tmp_path / out).exists(), f"the README's Python block wrote no {out}"
