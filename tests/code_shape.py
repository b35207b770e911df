"""Static checks of the quantize core's shape, as a module for the tests and as a command:

    python tests/code_shape.py      # string tests of method names and file writes, per file

A *string test of a method name* is a comparison (``==``, ``!=``, ``in``, ``not in``) against a
string literal that names a quantization method or a composition of them (``"gptq"``,
``"awq+gptq"``), or a ``startswith`` / ``endswith`` with one. A *file write* is a call that
creates or changes a file (``open`` for writing, ``write_text``, ``save_file`` …).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

METHOD_WORDS = {"rtn", "gptq", "awq", "smoothquant", "hqq"}
FILE_WRITES = {"write_text", "write_bytes", "save_file", "save_pretrained", "atomic_dir", "atomic_file",
               "copy", "copy2", "copyfile", "copytree", "move", "rename", "mkdir", "unlink", "rmtree", "dump"}


def _names_method(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        parts = node.value.lower().split("+")
        return all(p in METHOD_WORDS for p in parts)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_method(e) for e in node.elts)
    return False


def method_name_tests(source: str) -> list[int]:
    """Line numbers of string tests of method names in ``source``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(_names_method(x) for x in [node.left, *node.comparators]):
            lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith") and any(_names_method(a) for a in node.args)):
            lines.append(node.lineno)
    return sorted(lines)


def file_writes(source: str) -> list[int]:
    """Line numbers of calls in ``source`` that write files (``open`` in a writing mode included)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if name in FILE_WRITES and not (name == "dump" and len(node.args) < 2):
            lines.append(node.lineno)
        elif name == "open":
            mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
            if isinstance(mode, ast.Constant) and isinstance(mode.value, str) and set(mode.value) & set("wax+"):
                lines.append(node.lineno)
    return sorted(lines)


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    total_tests = total_writes = 0
    for folder in ("quant", "compress/pipeline/stages"):
        for file in sorted((root / folder).glob("*.py")):
            rel = file.relative_to(root)
            tests = [] if rel == Path("quant/registry.py") else method_name_tests(file.read_text())
            writes = file_writes(file.read_text()) if folder == "quant" else []
            total_tests += len(tests)
            total_writes += len(writes)
            if tests or writes:
                print(f"{rel}: method-name tests at {tests}, file writes at {writes}")
    print(f"string tests of method names (quant/, pipeline/stages/; the parser quant/registry.py aside): {total_tests}")
    print(f"file writes under quant/: {total_writes}")
    return 0 if total_tests == total_writes == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
