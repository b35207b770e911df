"""The import graph keeps the layer order of docs/architecture.md and has no cycle.

Every ``import`` in the package is read from the source (function-level imports too), mapped to
the module it names, and checked: a module may import modules of its own layer or of lower
layers only, and the graph of imports between modules has no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"compress": "llmopt", "quant": "llmopt.quant", "prune": "llmopt.prune", "distill": "llmopt.distill",
           "runtime": "llmopt.runtime", "recipes": "llmopt.recipes"}
# Lowest first. A module's layer is that of the longest prefix listed.
LAYERS = [
    ["llmopt.core", "llmopt.corpora"],
    ["llmopt.formats", "llmopt.checkpoints", "llmopt.calibration", "llmopt.linear_stats", "llmopt.float_reference", "llmopt.accuracy"],
    ["llmopt.runtime"],
    ["llmopt.quant", "llmopt.prune", "llmopt.distill", "llmopt.tasks", "llmopt.self_calibration"],
    ["llmopt.pipeline"],
    ["llmopt.evaluation"],
    ["llmopt.serve"],
    ["llmopt.cli", "llmopt.__main__"],
    ["llmopt.api", "llmopt", "llmopt.recipes"],
]
CLI_ONLY = {"click": (), "rich.table": ("llmopt.distill.display",)}  # external module → allowed outside the CLI


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


def _imports(module: str, file: Path) -> list[tuple[str, int, list[str]]]:
    """(imported module, line, names) for every import statement in the file."""
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
    return found


def _layer(module: str) -> int:
    best, rank = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank is not None, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
    return rank


def _edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, file in MODULES.items():
        for name, _, names in _imports(module, file):
            target = _resolve(name) if name.startswith("llmopt") else None
            if target and target != module and not (target == "llmopt" and set(names) <= {"__version__"}):
                graph[module].add(target)
    return graph


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
