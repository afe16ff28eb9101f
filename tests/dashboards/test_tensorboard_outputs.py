"""TensorBoard histograms (TensorBoardWriter.write_histogram) and the Custom Scalars layout, read back
with TensorBoard's own readers."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from tensorboard import data_compat
from tensorboard.backend.event_processing.event_accumulator import (
    HISTOGRAMS,
    SCALARS,
    TENSORS,
    EventAccumulator,
)
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.util import tensor_util

from monitor.record import RowSet, StepRecord
from monitor.writers.base import WriterThread
from monitor.writers.custom_scalars import (
    LAYOUT_SUFFIX,
    CustomScalarsSink,
    live_categories,
    write_layout,
)
from monitor.writers.tensorboard import TensorBoardWriter


def _accumulator(path) -> EventAccumulator:
    accumulator = EventAccumulator(str(path), size_guidance={SCALARS: 0, HISTOGRAMS: 0, TENSORS: 0})
    accumulator.Reload()
    return accumulator


def test_histograms_read_back_with_nan_and_inf_counted_apart(tmp_path):
    rng = np.random.default_rng(3)
    data = np.concatenate([rng.uniform(-1, 1, 1000), [np.nan] * 3, [np.inf, -np.inf]])
    finite = data[np.isfinite(data)]
    counts, edges = np.histogram(finite, bins=30, range=(-1, 1))
    writer = TensorBoardWriter(tmp_path)
    tag = "0:layers.0.fc1.weight/rank0/adam_update"
    for step in (1, 2):
        writer.write_histogram(
            step,
            tag,
            edges,
            counts * step,
            value_sum=float(finite.sum()),
            value_sum_squares=float((finite**2).sum()),
            nan_count=int(np.isnan(data).sum()),
            inf_count=int(np.isinf(data).sum()),
        )
    writer.write_histogram(3, "no_counts_of_nonfinite", [0.0, 0.5, 1.0], [2, 0])
    writer.close()

    accumulator = _accumulator(tmp_path)
    events = accumulator.Histograms(tag)
    assert [e.step for e in events] == [1, 2]
    for event in events:
        h = event.histogram_value
        assert list(h.bucket) == (counts * event.step).tolist()
        assert list(h.bucket_limit) == edges[1:].tolist()
        assert (h.min, h.max, h.num) == (-1.0, 1.0, float(counts.sum() * event.step))
        assert h.sum == pytest.approx(finite.sum()) and h.sum_squares == pytest.approx((finite**2).sum())
    assert [(e.step, e.value) for e in accumulator.Scalars(f"{tag}_nans")] == [(1, 3.0), (2, 3.0)]
    assert [(e.step, e.value) for e in accumulator.Scalars(f"{tag}_infs")] == [(1, 2.0), (2, 2.0)]
    assert "no_counts_of_nonfinite_nans" not in accumulator.Tags()["scalars"]

    # what the Histograms tab draws: buckets [left, right, count] after TensorBoard's migration (float32)
    raw = next(v for e in _events(tmp_path) for v in e.summary.value if v.tag == tag)
    buckets = tensor_util.make_ndarray(data_compat.migrate_value(raw).tensor)
    assert np.array_equal(buckets, np.stack([edges[:-1], edges[1:], counts], axis=1).astype(np.float32))


def _events(path):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    for name in os.listdir(path):
        yield from EventFileLoader(os.path.join(path, name)).Load()


@pytest.mark.parametrize(
    ("edges", "counts", "words"),
    [
        ([0.0, 1.0], [1, 2], "k + 1 bucket edges"),
        ([0.0, np.nan, 1.0], [1, 2], "finite and increasing"),
        ([0.0, 1.0, 1.0], [1, 2], "finite and increasing"),
        ([0.0, 1.0, 2.0], [1, -2], "counts must be finite and >= 0"),
        ([0.0, 1.0, 2.0], [1, np.inf], "counts must be finite and >= 0"),
        ([], [], "k >= 1 counts"),
    ],
)
def test_bad_histograms_are_refused_with_the_tag(tmp_path, edges, counts, words):
    writer = TensorBoardWriter(tmp_path)
    with pytest.raises(ValueError, match=re.escape(words)) as info:
        writer.write_histogram(0, "w/rank0/adam_ratio", edges, counts)
    assert "w/rank0/adam_ratio" in str(info.value)
    writer.close()


def _layouts(path) -> list[layout_pb2.Layout]:
    accumulator = _accumulator(path)
    return [
        layout_pb2.Layout.FromString(tensor_util.make_ndarray(e.tensor_proto).item())
        for e in accumulator.Tensors("custom_scalars__config__")
    ]


def _charts(layout: layout_pb2.Layout) -> dict[str, list[tuple[str, str]]]:
    return {c.title: [(ch.title, ch.multiline.tag[0]) for ch in c.chart] for c in layout.category}


def _closed(layout: layout_pb2.Layout) -> list[bool]:
    return [c.closed for c in layout.category]


def test_custom_scalars_layout_grows_by_data_type_and_is_read_by_tensorboard(tmp_path):
    groups = [(0, "embedding"), (0, "layers.0")]
    path = write_layout(tmp_path, live_categories("grad_reduced", ["norm", "max"], groups))
    assert path.endswith(LAYOUT_SUFFIX) and os.path.dirname(path) == str(tmp_path)
    assert write_layout(tmp_path, live_categories("exp_avg_sq", ["norm"], groups)) == path
    assert write_layout(tmp_path, live_categories("exp_avg", ["norm"], groups)) == path
    size = os.path.getsize(path)
    assert write_layout(tmp_path, live_categories("grad_reduced", ["norm"], groups)) == path  # nothing new
    assert os.path.getsize(path) == size and len(os.listdir(tmp_path)) == 1
    write_layout(tmp_path, live_categories("grad_reduced", ["norm"], [(0, "layers.1")]))  # a new group
    layouts = _layouts(tmp_path)
    assert len(layouts) == 4
    charts = _charts(layouts[-1])
    assert list(charts) == ["grad_reduced norm", "grad_reduced max", "exp_avg norm", "exp_avg_sq norm"]
    assert [title for title, _ in charts["grad_reduced norm"]] == ["embedding", "layers.0", "layers.1"]
    assert [title for title, _ in charts["grad_reduced max"]] == ["embedding", "layers.0"]
    assert _closed(layouts[-1]) == [False, True, True, True]  # only the first category opens


#: (chunk, row name) -> the chart (layer group) that must show it.
_ROWS = {
    (0, "embedding.weight"): "embedding",
    (0, "layers.0.fc1.weight"): "layers.0",
    (0, "layers.0.fc1.bias"): "layers.0",
    (0, "layers.1.fc1.weight"): "layers.1",
    (0, "layers.10.fc1.weight"): "layers.10",
    (0, "head"): "head",
    (0, ".input"): "Net (root)",
    (0, "[1].output_grad"): "Net (root)",
    (1, "layers.0.fc1.weight"): "layers.0",
}


def test_each_row_is_drawn_in_the_chart_of_its_layer_group_only(tmp_path):
    keys = list(_ROWS)
    writer = TensorBoardWriter(tmp_path)
    rows = RowSet.build([v for v, _ in keys], [n for _, n in keys], 3, "acc_grad", [0] * len(keys))
    writer.write(StepRecord("grad_unreduced", 0, ("norm", "max"), rows, np.ones((len(keys), 2))))
    other = RowSet.build([v for v, _ in keys], [n for _, n in keys], 3, "exp_avg")
    writer.write(StepRecord("exp_avg", 0, ("norm",), other, np.ones((len(keys), 1))))
    writer.close()
    sink = CustomScalarsSink(tmp_path, {0: "Net", 1: "Net"})
    sink.write(StepRecord("grad_unreduced", 0, ("norm", "max"), rows, np.ones((len(keys), 2))))
    tags = _accumulator(tmp_path).Tags()["scalars"]
    charts = _charts(_layouts(tmp_path)[-1])
    assert list(charts) == ["grad_unreduced norm", "grad_unreduced max"]
    for op in ("norm", "max"):
        drawn = {}
        for title, regex in charts[f"grad_unreduced {op}"]:
            for tag in tags:
                if re.match(regex, tag):
                    assert tag not in drawn, f"{tag} in two charts"
                    drawn[tag] = title
        expected = {f"{v}:{n}:0/rank3/acc_grad_{op}": f"{v}:{group}" for (v, n), group in _ROWS.items()}
        assert drawn == expected  # every row in its group's chart; exp_avg tags in none


def test_sink_on_the_writer_thread_adds_each_data_type_once(tmp_path):
    rows = RowSet.build([0, 0], ["a.weight", "b.weight"], 0, "post_grad")
    moments = RowSet.build([0, 0], ["a.weight", "b.weight"], 0, "exp_avg")
    thread = WriterThread([TensorBoardWriter(tmp_path), CustomScalarsSink(tmp_path)])
    for step in range(3):
        thread.submit(StepRecord("grad_reduced", step, ("norm", "max"), rows, np.ones((2, 2)) * step))
        if step >= 1:
            thread.submit(StepRecord("exp_avg", step, ("norm",), moments, np.ones((2, 1))))
        thread.end_step(step)
    thread.close()
    layouts = _layouts(tmp_path)
    assert len(layouts) == 2  # one per new data type, none for the steps after
    charts = _charts(layouts[-1])
    assert {title: [chart for chart, _ in group] for title, group in charts.items()} == {
        "grad_reduced norm": ["a", "b"],
        "grad_reduced max": ["a", "b"],
        "exp_avg norm": ["a", "b"],
    }
    assert len([n for n in os.listdir(tmp_path) if n.endswith(LAYOUT_SUFFIX)]) == 1
