"""Attribute docstrings sit under the name they document.

A string literal standing alone right after another string literal is a docstring that
lost its attribute (the assignment between them was moved or deleted), and a reader
attaches it to the wrong name. An AST walk over every module of ``kvguard/`` and
``tests/`` (about a second).
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _is_string(stmt: ast.stmt) -> bool:
    return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
            and isinstance(stmt.value.value, str))


def stray_docstrings(source: str, name: str) -> list[str]:
    """``file:line`` of each string statement that directly follows another one."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if not isinstance(stmts, list):
                continue
            for prev, stmt in itertools.pairwise(stmts):
                if isinstance(stmt, ast.stmt) and _is_string(prev) and _is_string(stmt):
                    found.append(f"{name}:{stmt.lineno}")
    return found


def test_the_check_finds_a_docstring_that_lost_its_attribute() -> None:
    lost = 'class C:\n    a: int = 1\n    """About a."""\n    """About b, whose line is gone."""\n'
    assert stray_docstrings(lost, "c.py") == ["c.py:4"]
    kept = 'class C:\n    a: int = 1\n    """About a."""\n    b: int = 2\n    """About b."""\n'
    assert stray_docstrings(kept, "c.py") == []


def test_no_string_literal_follows_another_as_a_statement() -> None:
    found = []
    for top in ("kvguard", "tests"):
        for path in sorted((ROOT / top).rglob("*.py")):
            found += stray_docstrings(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "a docstring without its attribute (put it back under its name): " \
        + ", ".join(found)
