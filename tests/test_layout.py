"""Imports go one way: adapters -> monitor, dashboards -> monitor; the core imports no adapter,
dashboard or framework, except the dispatcher that picks an adapter from the model's type
(``monitor/session/trainer.py``) and the trainer callbacks of ``monitor/integrations`` (each written for
its framework); the two adapters never import each other, and the dashboards no framework. Read
from the sources with ``ast``, so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = (
    "torch",
    "mindspore",
    "transformers",
    "accelerate",
    "lightning",
    "pytorch_lightning",
    "deepspeed",
    "megatron",
)
#: source folder -> module prefixes it must never import, and the files allowed to anyway.
RULES = {
    "monitor": (
        ("adapters", "dashboards", *FRAMEWORKS),
        ("monitor/session/trainer.py", "monitor/integrations/"),
    ),
    "adapters/torch": (("dashboards", "adapters.mindspore", "mindspore"), ()),
    "adapters/mindspore": (("dashboards", "adapters.torch", "torch"), ()),
    "dashboards": (("adapters", *FRAMEWORKS), ()),
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            if node.module == "monitor":  # ``from monitor import stats`` imports monitor.stats
                found |= {f"monitor.{a.name}" for a in node.names if not a.name.startswith("__")}
    return found


def breaks(module: str, forbidden: tuple[str, ...]) -> bool:
    return any(module == prefix or module.startswith(f"{prefix}.") for prefix in forbidden)


@pytest.mark.parametrize("folder", sorted(RULES))
def test_imports_go_one_way(folder):
    forbidden, allowed = RULES[folder]
    wrong = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith(allowed):
            continue
        names = sorted(m for m in imported_modules(path) if breaks(m, forbidden))
        if names:
            wrong[relative] = names
    assert wrong == {}


def test_the_rules_see_a_wrong_import(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("def f():\n    from adapters.torch import session\n    import torch.nn\n")
    assert [m for m in sorted(imported_modules(source)) if breaks(m, RULES["monitor"][0])] == [
        "adapters.torch",
        "torch.nn",
    ]


#: inside monitor: package -> the packages of monitor it may import besides itself and the shared
#: modules at the top (naming, record, files, errors, logs, structure, memory_limit, run_info); what
#: each package's docstring promises
LAYERS = {
    "stats": (),
    "config": ("alerts.config", "anomaly.rule_args"),
    "datatypes": ("config",),
    "collectives": ("config",),
    "writers": ("datatypes",),
    "query": ("writers.eventfile", "writers.parquet_files"),
    "anomaly": ("config", "datatypes", "query", "writers.eventfile", "writers.parquet_files"),
    "alerts": ("config.values", "anomaly.ordering"),
    "session": ("config", "stats", "datatypes", "collectives", "writers", "anomaly", "alerts"),
    "integrations": ("config", "session"),
}
SHARED = ("naming", "record", "files", "errors", "logs", "structure", "memory_limit", "run_info")


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_monitor_packages_import_only_what_their_layer_allows(package):
    allowed = tuple(f"monitor.{name}" for name in (package, *LAYERS[package], *SHARED))
    wrong = {}
    for path in sorted((ROOT / "monitor" / package).rglob("*.py")):
        names = sorted(
            m for m in imported_modules(path) if m.startswith("monitor.") and not breaks(m, allowed)
        )
        if names:
            wrong[path.relative_to(ROOT).as_posix()] = names
    assert wrong == {}


def test_every_monitor_package_says_what_lives_there():
    for init in sorted((ROOT / "monitor").glob("*/__init__.py")):
        assert ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))), init


def test_the_installed_packages_are_the_products_and_nothing_the_demo_writes(tmp_path):
    """The package list setuptools builds from pyproject.toml: every product package, and not
    the demo's ``monitor_output`` folder beside them (a ``monitor*`` pattern took it in)."""
    from setuptools import find_namespace_packages
    from setuptools.config.pyprojecttoml import read_configuration  # tomllib is 3.11's

    root = Path(__file__).resolve().parents[1]
    setup = read_configuration(str(root / "pyproject.toml"), expand=False)["tool"]["setuptools"]
    include = setup["packages"]["find"]
    (tmp_path / "monitor_output" / "Dec01_00-00-00-rank0-x").mkdir(parents=True)
    for package in ("monitor/session", "adapters/torch", "dashboards/plugin", "config_templates"):
        (tmp_path / package).mkdir(parents=True)
    found = set(find_namespace_packages(where=str(tmp_path), include=include["include"]))
    assert found == {
        "monitor",
        "monitor.session",
        "adapters",
        "adapters.torch",
        "dashboards",
        "dashboards.plugin",
        "config_templates",
    }


#: "modules under about 400 lines": a module past this wants splitting by what its parts do
MAX_MODULE_LINES = 420


def test_no_module_of_the_product_outgrows_one_concept():
    long = {
        path.relative_to(ROOT).as_posix(): lines
        for folder in ("monitor", "adapters", "dashboards")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}
