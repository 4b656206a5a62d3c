"""No function in ppokit is over 80 lines (docstring and decorators included): a longer one
mixes steps that read better as helpers named for what they do."""

from __future__ import annotations

import ast
from pathlib import Path

import ppokit

PACKAGE = Path(ppokit.__file__).resolve().parent
MAX_LINES = 80


def long_functions(root: Path, limit: int) -> list[str]:
    """``path:line name (N lines)`` of each function or method in ``root`` over ``limit`` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = node.end_lineno - first + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_over_80_lines():
    assert long_functions(PACKAGE, MAX_LINES) == []


def test_the_check_finds_a_long_function(tmp_path):
    (tmp_path / "pkg").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    (tmp_path / "pkg" / "m.py").write_text(f"@staticmethod\ndef short():\n    pass\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path / "pkg", MAX_LINES) == ["pkg/m.py:6 long (81 lines)"]
