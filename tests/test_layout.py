"""The size rules of the package's layout (docs/how-it-works.md#the-architecture): no module
over 500 lines, and LockClient, the facade, under 400. A module that grows past them is doing
more than one job: split it by job."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lockaspect

PACKAGE = Path(lockaspect.__file__).parent
MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("module", MODULES, ids=lambda path: str(path.relative_to(PACKAGE)))
def test_no_module_is_over_500_lines(module: Path) -> None:
    lines = len(module.read_text(encoding="utf-8").splitlines())
    assert lines <= 500, f"{module.relative_to(PACKAGE)} has {lines} lines"


def test_the_lock_client_class_is_under_400_lines() -> None:
    tree = ast.parse((PACKAGE / "client.py").read_text(encoding="utf-8"))
    [client] = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "LockClient"]
    assert client.end_lineno is not None
    assert client.end_lineno - client.lineno + 1 < 400
