"""Parameters shared by the tests of several packages."""

from __future__ import annotations

#: the three output formats
OUTPUT_FORMATS = ["csv", "tensorboard", "parquet"]
