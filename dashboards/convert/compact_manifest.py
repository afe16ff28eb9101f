"""``compact.json``: what each file of a compacted dataset was made from, so that a compaction
writes only what changed, resumes where a killed one stopped, and never drops values whose
source files are gone."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from dashboards.convert.compact_tables import TEMPORARY_PREFIX, read_json_object
from dashboards.convert.runs import ConvertError
from monitor.files import atomic_write_text, make_private_dir
from monitor.writers.parquet_files import DATASET_MANIFEST

logger = logging.getLogger("trainmon")

MANIFEST = DATASET_MANIFEST
#: the longest a killed compaction loses of the parts it wrote
SAVE_EVERY_S = 2.0
#: the value's SQL type where every value survives it, and where one does not
FLOAT, DOUBLE = "FLOAT", "DOUBLE"


class Manifest:
    """``compact.json``: per file of each part, its source files (path within the run, size,
    modification time) and the value type it was written in. It is saved as parts are written
    (at most every SAVE_EVERY_S seconds), so that a compaction killed halfway does not write the
    finished parts again. The dataset outlives its sources: a part whose source files are all
    gone is kept as it is, and one that lost some keeps their values (its files are read with
    the sources that remain)."""

    def __init__(self, path: str, monitor_path: str, output: str) -> None:
        self.path, self.monitor_path, self.output = path, monitor_path, output
        old = read_json_object(path)
        parts = old.get("parts") if isinstance(old.get("parts"), dict) else {}
        self._old_type = old.get("value_type") if old.get("value_type") in (FLOAT, DOUBLE) else None
        self._old = {part: units for part, units in parts.items() if isinstance(units, dict)}
        #: part -> unit -> {"sources", "files", "type"}: what the dataset holds when this run ends
        self.current: dict[str, dict[str, dict[str, Any]]] = {}
        #: (part, unit) -> the value type of its files on disk, None: to be written
        self._stored: dict[tuple[str, str], str | None] = {}
        #: (part, unit) -> its files on disk, to be read with its sources (some sources are gone)
        self._carried: dict[tuple[str, str], list[str]] = {}
        self._saved_at = time.monotonic()

    def _on_disk(self, part: str, was: Any) -> tuple[list[str], str] | None:
        """The files and value type of an earlier entry, if it is one and its files are all there."""
        if not isinstance(was, dict):
            return None
        files, kind = was.get("files"), was.get("type", self._old_type)
        if kind not in (FLOAT, DOUBLE) or not isinstance(files, list):
            return None
        if not all(isinstance(f, str) and os.path.isfile(os.path.join(self.output, part, f)) for f in files):
            return None
        return files, kind

    def expect(self, part: str, unit: str, signatures: list) -> None:
        """The unit made from these sources: kept if its files were written from them."""
        was = self._old.get(part, {}).get(unit)
        on_disk = self._on_disk(part, was)
        unchanged = on_disk is not None and was.get("sources") == signatures
        entry = {"sources": signatures, "files": [], "type": None}
        if unchanged:
            entry.update(files=on_disk[0], type=on_disk[1])
        elif on_disk is not None and any(
            not isinstance(source, list)
            or not os.path.exists(os.path.join(self.monitor_path, str(source[0])))
            for source in was.get("sources") or []
        ):
            self._carried[part, unit] = [os.path.join(self.output, part, f) for f in on_disk[0]]
        self.current.setdefault(part, {})[unit] = entry
        self._stored[part, unit] = entry["type"]

    def keep_orphans(self) -> None:
        """Keep the units of the last compaction whose sources are all gone (a rank directory
        deleted, the CSV files of early steps removed to save space)."""
        kept = 0
        for part, units in self._old.items():
            for unit, was in units.items():
                on_disk = self._on_disk(part, was)
                if on_disk is not None and unit not in self.current.get(part, {}):
                    self.current.setdefault(part, {})[unit] = {**was, "type": on_disk[1]}
                    self._stored[part, unit] = on_disk[1]
                    self._carried[part, unit] = [os.path.join(self.output, part, f) for f in on_disk[0]]
                    kept += 1
        if kept:
            logger.info(
                "trainmon compact: kept %d part file group(s) whose source files are gone; delete the "
                "dataset and compact again to hold only what the sources hold",
                kept,
            )

    def other_directories(self, rank_dirs: set[str]) -> list[str]:
        """The rank directories the dataset was made from, when none of them is among
        ``rank_dirs`` (this run's, by name): the dataset is another run's."""
        earlier = {
            str(source[0]).split("/")[0].split(os.sep)[0]
            for units in self._old.values()
            for was in units.values()
            if isinstance(was, dict)
            for source in was.get("sources") or []
            if isinstance(source, list) and source
        }
        return [] if earlier & rank_dirs else sorted(earlier)

    def carried(self, part: str, unit: str) -> list[str]:
        """The unit's files on disk, when some or all of its sources are gone: their values are kept."""
        return self._carried.get((part, unit), [])

    def dataset_type(self) -> str:
        """The value type the kept files share: DOUBLE if one of them is, else FLOAT."""
        kept = {kind for kind in self._stored.values() if kind is not None}
        return DOUBLE if DOUBLE in kept else FLOAT

    def to_write(self, value_type: str, rewrite: bool) -> list[tuple[str, str]]:
        """The units to write: those not on disk, or (``rewrite``) those in another type."""
        return [
            key
            for key, kind in self._stored.items()
            if (kind is not None and kind != value_type if rewrite else kind is None)
        ]

    def written(self, part: str, unit: str, value_type: str, files: list[str]) -> None:
        self.current[part][unit].update(files=files, type=value_type)
        self._stored[part, unit] = value_type
        self.save(value_type)

    def save(self, value_type: str, force: bool = False) -> None:
        """Write the entries of the units whose files are on disk (not those still to write)."""
        if not force and time.monotonic() - self._saved_at < SAVE_EVERY_S:
            return
        parts: dict[str, dict[str, Any]] = {}
        for (part, unit), kind in self._stored.items():
            if kind is not None:
                parts.setdefault(part, {})[unit] = self.current[part][unit]
        atomic_write_text(self.path, json.dumps({"value_type": value_type, "parts": parts}, indent=1))
        self._saved_at = time.monotonic()


#: what a dataset directory holds: anything else there is the user's, not ours to write among
DATASET_ENTRIES = frozenset({"values", MANIFEST, "runs.parquet", "anomalies.parquet", "incidents.parquet"})


def open_dataset(output: str, monitor_path: str, rank_dirs: list[str]) -> Manifest:
    """Make ``output`` ready for a compaction of the run whose rank directories are ``rank_dirs``
    and return its manifest, the temporary files a killed compaction left beside the tables
    removed.

    Raises:
        ConvertError: ``output`` is inside a rank directory (it would be read as the rank's files),
            cannot be made, holds files and no dataset, or, outside ``monitor_path``, holds the
            dataset of other rank directories (this run's parts would replace the values of the
            ranks both have).
    """
    for directory in map(os.path.abspath, rank_dirs):
        if os.path.commonpath([output, directory]) == directory:
            raise ConvertError(
                f"output: {output!r} is inside the rank directory {directory!r}: expected one outside"
            )
    try:
        make_private_dir(output)
        names = os.listdir(output)
    except OSError as exc:
        raise ConvertError(
            f"output: {output!r} cannot be made ({exc.strerror or type(exc).__name__}): expected a "
            "directory this user may write in"
        ) from None
    foreign = sorted(n for n in names if n not in DATASET_ENTRIES and not n.startswith(TEMPORARY_PREFIX))
    if foreign and MANIFEST not in names:  # a dataset's own directory may hold the user's notes too
        raise ConvertError(
            f"output: {output!r} holds files that are not a trainmon dataset's ({', '.join(foreign[:3])}"
            f"{' ...' if len(foreign) > 3 else ''}): expected a new or empty directory, or a dataset "
            "that trainmon compact wrote"
        )
    for name in names:
        if name.startswith(TEMPORARY_PREFIX) and os.path.isfile(os.path.join(output, name)):
            os.unlink(os.path.join(output, name))
    manifest = Manifest(os.path.join(output, MANIFEST), monitor_path, output)
    others = manifest.other_directories({os.path.basename(d) for d in rank_dirs})
    root = os.path.abspath(monitor_path)
    if others and os.path.commonpath([output, root]) == root:  # the root's own dataset: a resumed
        # job's earlier rank directories, deleted since, whose values stay
        logger.warning(
            "trainmon compact: %s was made from rank directories no longer under %s (%s); their values "
            "stay, and the steps this run's files hold replace theirs",
            output,
            monitor_path,
            ", ".join(others[:3]) + (" ..." if len(others) > 3 else ""),
        )
    elif others:
        raise ConvertError(
            f"output: {output!r} holds the dataset of other rank directories "
            f"({', '.join(others[:3])}{' ...' if len(others) > 3 else ''}): this run's parts would "
            "replace the values of the ranks both have; expected a new directory, or this run's dataset"
        )
    return manifest
