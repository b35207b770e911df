"""The import graph keeps the layer order of docs/architecture.md and has no cycle.

The layer order lives in one place: the ``layers`` block of docs/architecture.md, which is both
the document's drawing and what this test reads (:func:`read_layers`). Every import in the
package is read from the source (function-level imports too, and ``importlib.import_module`` /
``__import__`` calls whose module name is a string literal or an f-string with a literal
prefix), mapped to the module it names, and checked: a module may import modules of its own
layer or of lower layers only, and the graph of imports between modules has no cycle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
FOLDERS = {"compress": "llmopt", "quant": "llmopt.quant", "prune": "llmopt.pruning", "distill": "llmopt.distillation",
           "runtime": "llmopt.runtime", "recipes": "llmopt.recipes"}
CLI_ONLY = {"click": (), "rich.table": ("llmopt.distillation.display",)}  # external module → allowed outside the CLI


def read_layers(text: str) -> list[list[str]]:
    """The layers of the document's ``layers`` block, lowest first.

    The block is drawn highest layer first. A line that starts with at most one space and then a
    name begins a layer: its first column (up to two spaces) lists the layer's modules, relative
    to ``llmopt`` and separated by ``·`` (``llmopt`` itself is written ``llmopt``). Every other
    line (indented further: the ``│`` connectors, descriptions and folders) is commentary.
    """
    blocks = re.findall(r"^```layers\n(.*?)^```", text, flags=re.M | re.S)
    assert len(blocks) == 1, f"{DOC.name} must hold exactly one ```layers block (found {len(blocks)})"
    layers = []
    for line in blocks[0].splitlines():
        if not re.match(r" ?[A-Za-z_]", line):
            continue
        column = re.split(r"\s{2,}", line.strip())[0]
        names = [n.strip() for n in column.split("·")]
        layers.append([n if n == "llmopt" else f"llmopt.{n}" for n in names])
    return layers[::-1]


# Lowest first. A module's layer is that of the longest prefix listed.
LAYERS = read_layers(DOC.read_text())


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        base = ROOT / folder
        for file in base.rglob("*.py"):
            if folder == "compress" and file.relative_to(base).parts[0] in FOLDERS.values():
                continue
            parts = list(file.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = file
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The llmopt module ``name`` refers to (a module, or the package holding the name)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _dynamic_name(call: ast.Call, module: str, package: str) -> str | None:
    """The module an ``importlib.import_module`` / ``__import__`` call names, where the source says.

    A string literal counts whole; an f-string counts up to its first part that is not a literal,
    ``__name__`` or ``__package__`` (``f"llmopt.runtime.backends.{name}"`` imports at least the
    package ``llmopt.runtime.backends``).
    """
    func = call.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if called not in ("import_module", "__import__") or not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        name = arg.value
    elif isinstance(arg, ast.JoinedStr):
        name = ""
        for part in arg.values:
            if isinstance(part, ast.Constant):
                name += part.value
            elif isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Name) \
                    and part.value.id in ("__name__", "__package__") and part.format_spec is None:
                name += module if part.value.id == "__name__" else package
            else:
                break
        name = name.rstrip(".")
    else:
        return None
    if name.startswith("."):  # import_module(".x", package): relative to this package
        dots = len(name) - len(name.lstrip("."))
        anchor = package.split(".")[: len(package.split(".")) - dots + 1]
        name = ".".join(anchor + [name.lstrip(".")]).rstrip(".")
    return name or None


def _imports(module: str, file: Path) -> list[tuple[str, int, list[str]]]:
    """(imported module, line, names) for every import statement and literal importlib call in the file."""
    tree = ast.parse(file.read_text(), str(file))
    package = module if file.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [alias.name for alias in node.names]
            submodules = [n for n in names if f"{base}.{n}" in MODULES]
            if len(submodules) < len(names):  # names defined in ``base`` itself
                found.append((base, node.lineno, [n for n in names if n not in submodules]))
            found += [(f"{base}.{n}", node.lineno, []) for n in submodules]
        elif isinstance(node, ast.Call):
            name = _dynamic_name(node, module, package)
            if name:
                found.append((name, node.lineno, []))
    return found


def _layer(module: str) -> int:
    best, rank = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank is not None, f"{module} is in no layer: add it to the layers block of docs/architecture.md"
    return rank


def _edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, file in MODULES.items():
        for name, _, names in _imports(module, file):
            target = _resolve(name) if name.startswith("llmopt") else None
            if target and target != module and not (target == "llmopt" and set(names) <= {"__version__"}):
                graph[module].add(target)
    return graph


def test_the_document_lists_real_modules_once():
    """Every name in the layers block is a module or package of llmopt, and appears once."""
    names = [name for layer in LAYERS for name in layer]
    assert len(LAYERS) >= 5
    assert sorted(set(names)) == sorted(names), "a name appears in two layers"
    assert not [n for n in names if n not in MODULES], f"not modules of llmopt: {[n for n in names if n not in MODULES]}"


def test_every_module_has_a_layer():
    assert len(MODULES) > 100
    for module in MODULES:
        _layer(module)


def test_imports_follow_the_layer_order():
    wrong = []
    for module, targets in _edges().items():
        for target in targets:
            if _layer(target) > _layer(module):
                wrong.append(f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})")
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles():
    graph = _edges()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" → ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("external", sorted(CLI_ONLY))
def test_only_the_cli_imports_click_and_rich_tables(external):
    offenders = []
    for module, file in MODULES.items():
        if module.startswith("llmopt.cli") or module in CLI_ONLY[external]:
            continue
        for name, line, _ in _imports(module, file):
            if name == external or name.startswith(external + "."):
                offenders.append(f"{file.relative_to(ROOT)}:{line}")
    assert not offenders, f"{external} imported outside llmopt.cli: {offenders}"


def test_the_checker_sees_a_violation(tmp_path, monkeypatch):
    """The layer check itself works: a core module importing the CLI is reported."""
    fake = tmp_path / "bad.py"
    fake.write_text("from llmopt.cli.main import main\n")
    monkeypatch.setitem(MODULES, "llmopt.core.bad", fake)
    with pytest.raises(AssertionError, match="llmopt.core.bad"):
        test_imports_follow_the_layer_order()


def test_the_checker_follows_importlib_strings(tmp_path, monkeypatch):
    """A literal ``importlib.import_module`` (or an f-string with a literal prefix) is an import."""
    fake = tmp_path / "bad.py"
    fake.write_text("import importlib\n\n\ndef f(name):\n    return importlib.import_module('llmopt.api'), "
                    "importlib.import_module(f'llmopt.cli.{name}')\n")
    monkeypatch.setitem(MODULES, "llmopt.core.bad", fake)
    assert {name for name, _, _ in _imports("llmopt.core.bad", fake)} == {"importlib", "llmopt.api", "llmopt.cli"}
    with pytest.raises(AssertionError, match="llmopt.core.bad.*llmopt.api"):
        test_imports_follow_the_layer_order()


def test_read_layers():
    doc = "text\n```layers\n top · api   the top    compress/\n   │        more\n core         low\n```\n"
    assert read_layers(doc) == [["llmopt.core"], ["llmopt.top", "llmopt.api"]]
