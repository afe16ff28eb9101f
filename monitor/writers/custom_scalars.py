"""A Custom Scalars layout in each run directory: one chart per data type and op, all layers overlaid.

TensorBoard's Custom Scalars tab reads a ``layout_pb2.Layout`` from the tag
``custom_scalars__config__`` (a string tensor with the ``custom_scalars`` plugin metadata) and
draws, per chart, every scalar tag that matches the chart's regular expression; each rank
directory is a run, so a chart overlays all layers of all ranks.

The layout lives in its own event file in the run directory,
``events.out.tfevents.{time}.{host}.trainmon-layout``. Each call that adds charts appends one
Event with the union of the charts so far, at the next step, so the newest layout is the one shown;
a call that adds nothing writes nothing. Calling it once per new data type is therefore cheap.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Iterable, Mapping, Sequence

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
from tensorboard.compat.proto.types_pb2 import DT_STRING
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import metadata as cs_metadata

from monitor.datatypes import PREFIX_ORDER, order_key, tasks_of_prefix
from monitor.files import FILE_MODE, create_exclusive
from monitor.record import StepRecord
from monitor.writers.eventfile import iter_records
from monitor.writers.tensorboard import frame_record

LAYOUT_SUFFIX = ".trainmon-layout"
_EVENT_PREFIX = "events.out.tfevents."

#: category title -> charts as (title, tag regex), in display order.
Categories = dict[str, list[tuple[str, str]]]


def live_tag_regex(prefix: str, op: str) -> str:
    """Regex of the live scalar tags ``N:name[:m]/rankR/{task}_{op}`` of one data type and op."""
    tasks = "|".join(re.escape(task) for task in tasks_of_prefix(prefix))
    return rf"^.*/(?:{tasks})_{re.escape(op)}$"


def live_categories(prefixes: Iterable[str], ops: Sequence[str]) -> Categories:
    """One category per data type, one chart per op (title ``"{prefix} {op}"``)."""
    return {prefix: [(f"{prefix} {op}", live_tag_regex(prefix, op)) for op in ops] for prefix in prefixes}


def build_layout(categories: Mapping[str, Sequence[tuple[str, str]]]) -> layout_pb2.Layout:
    """The Layout proto of ``categories``, in the given order."""
    layout = layout_pb2.Layout()
    for title, charts in categories.items():
        category = layout.category.add(title=title)
        for chart_title, regex in charts:
            category.chart.add(title=chart_title).multiline.tag.append(regex)
    return layout


def layout_summary(layout: layout_pb2.Layout) -> Summary:
    """The Summary that carries ``layout`` (what the custom_scalars plugin reads)."""
    tensor = TensorProto(
        dtype=DT_STRING, tensor_shape=TensorShapeProto(), string_val=[layout.SerializeToString()]
    )
    summary = Summary()
    summary.value.add(
        tag=cs_metadata.CONFIG_SUMMARY_TAG, metadata=cs_metadata.create_summary_metadata(), tensor=tensor
    )
    return summary


def find_layout_file(log_dir: str | os.PathLike) -> str | None:
    """The layout event file of ``log_dir`` (a regular file, not a symlink), or None."""
    found = [
        entry.path
        for entry in os.scandir(log_dir)
        if entry.name.startswith(_EVENT_PREFIX)
        and entry.name.endswith(LAYOUT_SUFFIX)
        and entry.is_file(follow_symlinks=False)
    ]
    return max(found) if found else None


def read_layout(path: str | os.PathLike) -> tuple[Categories, int]:
    """The newest layout in a layout file as categories, and the number of layouts in it."""
    categories: Categories = {}
    count = 0
    for data in iter_records(path):
        for value in Event.FromString(data).summary.value:
            if value.tag != cs_metadata.CONFIG_SUMMARY_TAG or not value.tensor.string_val:
                continue
            layout = layout_pb2.Layout.FromString(value.tensor.string_val[0])
            categories = {
                category.title: [(chart.title, chart.multiline.tag[0]) for chart in category.chart]
                for category in layout.category
            }
            count += 1
    return categories, count


def _merge(old: Categories, new: Mapping[str, Sequence[tuple[str, str]]]) -> Categories:
    merged = {title: list(charts) for title, charts in old.items()}
    for title, charts in new.items():
        have = merged.setdefault(title, [])
        titles = {chart_title for chart_title, _ in have}
        have.extend(chart for chart in charts if chart[0] not in titles)
    return {title: merged[title] for title in sorted(merged, key=lambda t: order_key(t, PREFIX_ORDER))}


def write_layout(log_dir: str | os.PathLike, categories: Mapping[str, Sequence[tuple[str, str]]]) -> str:
    """Add ``categories`` to the layout of ``log_dir`` (an existing directory); returns the file path.

    Charts already in the layout (same category and chart title) are kept as they are.
    """
    log_dir = os.fspath(log_dir)
    path = find_layout_file(log_dir)
    old, count = read_layout(path) if path else ({}, 0)
    merged = _merge(old, categories)
    if path is not None and merged == old:
        return path
    event = Event(wall_time=time.time(), step=count, summary=layout_summary(build_layout(merged)))
    record = frame_record(event.SerializeToString())
    if path is None:
        name = f"{_EVENT_PREFIX}{int(time.time())}.{socket.gethostname()}.{os.getpid()}{LAYOUT_SUFFIX}"
        path = os.path.join(log_dir, name)
        fd = create_exclusive(path, FILE_MODE)
        first = Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString()
        record = frame_record(first) + record
    else:
        fd = os.open(
            path, os.O_WRONLY | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        )
    try:
        view = memoryview(record)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    return path


def write_custom_scalars_layout(
    log_dir: str | os.PathLike, prefixes: Iterable[str], ops: Sequence[str]
) -> str:
    """Make TensorBoard's Custom Scalars tab show one chart per data type and op for ``log_dir``.

    Args:
        log_dir: the rank directory (it must exist).
        prefixes: data types (CSV prefixes such as ``grad_reduced``) to add charts for.
        ops: the statistics written for them (``norm``, ``max``, ...).

    Returns:
        The path of the layout event file. Repeated calls add only what is new.
    """
    return write_layout(log_dir, live_categories(prefixes, ops))


class CustomScalarsSink:
    """A writer for the monitor's writer thread: adds each new data type's charts to ``log_dir``.

    ``write(record)`` costs a set lookup, except for the first record of a data type (or of new
    ops), which appends one layout Event (write_custom_scalars_layout).
    """

    def __init__(self, log_dir: str | os.PathLike) -> None:
        self.log_dir = os.fspath(log_dir)
        self._seen: set[tuple[str, tuple[str, ...]]] = set()

    def write(self, record: StepRecord) -> None:
        key = (record.prefix, tuple(record.ops))
        if key not in self._seen:
            write_custom_scalars_layout(self.log_dir, [record.prefix], record.ops)
            self._seen.add(key)

    def close(self) -> None:
        """Nothing to release."""
