"""Marks for tests that need an optional extra: they skip, naming it, where it is not installed
(the README's lighter PyTorch-only install), and run in full where it is."""

from __future__ import annotations

import importlib.util

import pytest


def _missing(package: str) -> bool:
    return importlib.util.find_spec(package) is None


NEEDS_PYARROW = pytest.mark.skipif(
    _missing("pyarrow"), reason="format parquet needs pyarrow (pip install -e '.[dataset]')"
)
NEEDS_DUCKDB = pytest.mark.skipif(
    _missing("duckdb"), reason="trainmon compact needs DuckDB (pip install -e '.[dataset]')"
)
#: the three output formats, parquet where its extra is installed
OUTPUT_FORMATS = ["csv", "tensorboard", pytest.param("parquet", marks=NEEDS_PYARROW)]
