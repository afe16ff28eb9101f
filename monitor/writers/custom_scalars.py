"""A Custom Scalars layout in each run directory: per data type and op, one chart per layer group.

TensorBoard's Custom Scalars tab reads a ``layout_pb2.Layout`` from the tag
``custom_scalars__config__`` (a string tensor with the ``custom_scalars`` plugin metadata) and
draws, per chart, every scalar tag that matches the chart's regular expression. It colours the
lines of a chart by run (each rank directory is one), never by tag, so a chart of every layer is
one tangle of lines of one colour. The layout therefore has one category per data type and op
(``grad_reduced norm``), only the first open, and in it one chart per layer group: the module path
up to its first numeric index (``layers.3``), else its first component (``embedding``), and the
root module's own rows; hovering a line names its tag.

The layout lives in its own event file in the run directory,
``events.out.tfevents.{time}.{host}.trainmon-layout``. Each call that adds charts appends one
Event with the union of the charts so far, at the next step, so the newest layout is the one shown;
a call that adds nothing writes nothing.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
from tensorboard.compat.proto.types_pb2 import DT_STRING
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import metadata as cs_metadata

from monitor.datatypes.tasks import PREFIX_ORDER, order_key, tasks_of_prefix
from monitor.files import FILE_MODE, create_exclusive
from monitor.record import StepRecord
from monitor.writers.eventfile import frame_record, iter_records

LAYOUT_SUFFIX = ".trainmon-layout"
_EVENT_PREFIX = "events.out.tfevents."

#: category title -> charts as (title, tag regex), in display order.
Categories = dict[str, list[tuple[str, str]]]


_BLOCK = re.compile(r"^(.*?\.\d+)(?=[.\[:]|$)")
_FIRST_PART = re.compile(r"[.\[:]")


def layer_group(name: str) -> str:
    """The layer group of a row name: the module path up to its first numeric index (``layers.3``
    of ``layers.3.mlp.fc1.weight``), else its first component; ``""`` for the root module's rows."""
    if name.startswith((".", "[")):
        return ""
    block = _BLOCK.match(name)
    return block.group(1) if block else _FIRST_PART.split(name, 1)[0]


def layer_groups(rows: Iterable[tuple[int, str]]) -> list[tuple[int, str]]:
    """The distinct (chunk, layer group) of ``(chunk, name)`` rows, in first-seen order."""
    return list(dict.fromkeys((vpp, layer_group(name)) for vpp, name in rows))


def group_charts(
    groups: Sequence[tuple[int, str]],
    chunk_head: Callable[[int], str],
    tail: str,
    roots: Mapping[int, str] | None = None,
) -> list[tuple[str, str]]:
    """One (title, tag regex) chart per layer group.

    A tag is ``{chunk_head(chunk)}{name}...{tail}`` (``tail`` a regex of its end); ``roots`` names
    each chunk's root module class for the root group's title.
    """
    roots = roots or {}
    show_vpp = any(vpp for vpp, _ in groups)
    charts = []
    for vpp, group in groups:
        title = group or f"{roots.get(vpp, 'model')} (root)"
        body = re.escape(group) + r"[.\[:/]" if group else r"[.\[]"
        regex = f"^{re.escape(chunk_head(vpp))}{body}.*{tail}$"
        charts.append((f"{vpp}:{title}" if show_vpp else title, regex))
    return charts


def live_categories(
    prefix: str, ops: Sequence[str], groups: Sequence[tuple[int, str]], roots: Mapping[int, str] | None = None
) -> Categories:
    """The categories of one data type's live tags ``N:name[:m]/rankR/{task}_{op}``: one per op."""
    tasks = "|".join(re.escape(task) for task in tasks_of_prefix(prefix))
    return {
        f"{prefix} {op}": group_charts(groups, lambda vpp: f"{vpp}:", rf"/(?:{tasks})_{re.escape(op)}", roots)
        for op in ops
    }


def build_layout(categories: Mapping[str, Sequence[tuple[str, str]]]) -> layout_pb2.Layout:
    """The Layout proto of ``categories``, in the given order; only the first category is open."""
    layout = layout_pb2.Layout()
    for index, (title, charts) in enumerate(categories.items()):
        category = layout.category.add(title=title, closed=index > 0)
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
    # by data type; the ops of one data type keep the order they came in (the sort is stable)
    order = sorted(merged, key=lambda title: order_key(title.rsplit(" ", 1)[0], PREFIX_ORDER))
    return {title: merged[title] for title in order}


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


class CustomScalarsSink:
    """A writer for the monitor's writer thread: adds the charts of new data types and layer groups.

    ``write(record)`` costs an identity check when the record's rows are those seen last for its
    data type (row tables are built once), else a pass over the row names; only new charts append
    one layout Event.
    """

    def __init__(self, log_dir: str | os.PathLike, roots: Mapping[int, str] | None = None) -> None:
        self.log_dir = os.fspath(log_dir)
        self.roots = dict(roots or {})
        self._last_rows: dict[str, object] = {}
        self._seen: set[tuple] = set()

    def write(self, record: StepRecord) -> None:
        rows = record.rows
        if self._last_rows.get(record.prefix) is rows:
            return
        groups = layer_groups(zip(rows.vpp_stages, rows.names))
        key = (record.prefix, tuple(record.ops), tuple(groups))
        if key not in self._seen:
            write_layout(self.log_dir, live_categories(record.prefix, record.ops, groups, self.roots))
            self._seen.add(key)
        self._last_rows[record.prefix] = rows

    def close(self) -> None:
        """Nothing to release."""
