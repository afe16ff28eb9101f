"""A rank directory's TensorBoard event files as long rows, for ``trainmon compact``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from dashboards.plugin.cache import ByteLRU
from dashboards.plugin.eventsource import EventSource

#: bytes of decoded events a compaction keeps in memory per rank directory
EVENT_CACHE_BYTES = 64 * 2**20


class EventDirs:
    """The rank directories' TensorBoard event files, each directory indexed once per compaction."""

    def __init__(self) -> None:
        self._sources: dict[str, EventSource] = {}

    def source(self, directory: str) -> EventSource:
        found = self._sources.get(directory)
        if found is None:
            found = self._sources[directory] = EventSource(
                directory, ByteLRU(EVENT_CACHE_BYTES, lambda block: block.values.nbytes)
            )
            found.refresh(force=True)
        return found

    def prefixes(self, paths: Sequence[str]) -> list[str]:
        """The data types in the directories of these event files."""
        found: dict[str, None] = {}
        for directory in dict.fromkeys(os.path.dirname(path) for path in paths):
            found.update(dict.fromkeys(self.source(directory).prefixes()))
        return list(found)

    def frame(self, prefix: str, paths: Sequence[str]) -> Any:
        """One data type's values in these event files as a long table (pandas), ``_file``
        ordering the rank's directories and events so that a step written twice keeps the later
        value."""
        import pandas as pd

        columns: dict[str, list[np.ndarray]] = {
            name: [] for name in ("step", "micro_step", "vpp_stage", "name", "op", "value", "_file")
        }
        order = 0
        for directory in dict.fromkeys(os.path.dirname(path) for path in paths):
            source = self.source(directory)
            blocks = [source.load(prefix, chunk) for chunk in source.chunks(prefix)]
            keys = source.table(prefix).keys  # complete once every block is loaded
            vpp = np.array([key.vpp_stage for key in keys], dtype=np.int64)
            names = np.array([key.name for key in keys], dtype=object)
            micro = np.array([key.micro_step for key in keys], dtype=np.float64)
            for block in blocks:
                for column, op in enumerate(block.ops):
                    keep = slice(None) if block.present is None else block.present[:, column]
                    rows = block.rows[keep]
                    columns["step"].append(block.steps[keep])
                    columns["micro_step"].append(micro[rows])
                    columns["vpp_stage"].append(vpp[rows])
                    columns["name"].append(names[rows])
                    columns["op"].append(np.full(len(rows), op, dtype=object))
                    columns["value"].append(block.values[keep, column])
                    columns["_file"].append(np.full(len(rows), order, dtype=np.int64))
                order += 1
        frame = pd.DataFrame(
            {name: np.concatenate(parts) if parts else np.empty(0) for name, parts in columns.items()}
        )
        frame["micro_step"] = frame["micro_step"].where(frame["micro_step"] >= 0).astype("Int64")
        return frame
