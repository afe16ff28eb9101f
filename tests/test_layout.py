"""Imports go one way: adapters -> monitor, dashboards -> monitor; the core imports neither,
except the dispatcher that picks an adapter from the model's type (``monitor/trainer.py``).
Read from the sources with ``ast``, so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: package -> packages it must never import, and the files allowed to anyway.
RULES = {
    "monitor": (("adapters", "dashboards"), {"monitor/trainer.py"}),
    "adapters": (("dashboards",), set()),
    "dashboards": (("adapters",), set()),
}


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package", sorted(RULES))
def test_imports_go_one_way(package):
    forbidden, allowed = RULES[package]
    wrong = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) & set(forbidden))
        for path in sorted((ROOT / package).rglob("*.py"))
        if str(path.relative_to(ROOT)) not in allowed
    }
    assert {file: names for file, names in wrong.items() if names} == {}
