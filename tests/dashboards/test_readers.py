"""The dashboards' readers of the monitor's files: CSV (one file or many at once) and event records."""

from __future__ import annotations

import csv
import os

import numpy as np
import pytest
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import HistogramProto

from dashboards.csvfiles import csv_bounds, read_csv_file, read_csv_files
from dashboards.plugin.eventscalars import LayoutCache, event_head, first_scalar_tag
from monitor.writers.eventfile import frame_record, iter_records, open_regular, read_record, scan_records

HEADER = "vpp_stage,name,step,norm,min\n"


def _write(path, text: str):
    path.write_text(text, encoding="utf-8")
    return path


def _rows_by_csv_module(path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.reader(handle))[1:]


def test_one_file_many_forms_of_value(tmp_path):
    path = _write(
        tmp_path / "grad_reduced_0-0.csv",
        HEADER + '0,a.weight,0,1.5,-2\n1,"b,c ""q""",0,nan,inf\n0,nan,0,-inf,1e-300\n0,partial,0,1',
    )
    table = read_csv_file(path)
    assert table.ops == ("norm", "min") and table.names == ["a.weight", 'b,c "q"', "nan"]
    assert table.vpp_stages.tolist() == [0, 1, 0] and table.steps.tolist() == [0, 0, 0]
    expected = [[float(v) for v in row[3:]] for row in _rows_by_csv_module(path)[:3]]
    assert np.array_equal(table.values, np.array(expected), equal_nan=True)
    assert table.micro_steps is None and table.skipped == 0


@pytest.mark.parametrize("malformed", [False, True])
def test_every_value_is_read_exactly_as_written(tmp_path, malformed):
    """ndigits up to 17 writes values that only a correctly rounding parser reads back exactly."""
    values = np.random.default_rng(3).lognormal(0, 30, (500, 2)) * np.random.default_rng(4).choice(
        [-1, 1], (500, 2)
    )
    rows = "".join(f"0,t{i},{i},{float(a)!r},{float(b)!r}\n" for i, (a, b) in enumerate(values))
    path = _write(tmp_path / "x_0-499.csv", HEADER + rows + ("0,bad,1,one,2\n" if malformed else ""))
    table = read_csv_file(path)
    assert table.skipped == int(malformed)
    assert table.values.tobytes() == values.tobytes()


def test_rows_that_do_not_parse_are_skipped_and_counted(tmp_path):
    rows = "0,a,0,1,2\n0,b,zero,1,2\n0,c,1,one,2\n0,d,1\n0,e,2,3,4\n0,f,2,3,4,5\n"  # f: one field too many
    rows += "0,g,2.5,1,2\n1.5,h,3,1,2\n0,i,3,,2\n"  # a step or stage that is no integer, an empty value
    table = read_csv_file(_write(tmp_path / "x_0-0.csv", HEADER + rows))
    assert table.names == ["a", "e"] and table.skipped == 7
    assert table.values.tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_many_files_at_once_equal_one_by_one(tmp_path):
    paths = []
    rng = np.random.default_rng(0)
    for step in range(30):
        rows = "".join(f"0,layer.{r},{step},{rng.normal():.6g},{rng.normal():.6g}\n" for r in range(5))
        paths.append(_write(tmp_path / f"g_{step}-{step}.csv", HEADER + rows))
    paths.append(_write(tmp_path / "g_30-30.csv", HEADER + '0,"odd,name",30,1,2\n'))  # quoted: read alone
    paths.append(_write(tmp_path / "g_31-31.csv", "vpp_stage,name,step,micro_step,norm\n0,m,31,1,5\n"))
    paths.append(_write(tmp_path / "g_32-32.csv", HEADER + "0,bad,x,1,2\n0,good,32,1,2\n"))
    paths.append(_write(tmp_path / "g_33-33.csv", ""))
    together = read_csv_files(paths)
    for path, table in zip(paths, together, strict=True):
        alone = read_csv_file(path)
        assert table.ops == alone.ops and table.names == alone.names and table.skipped == alone.skipped
        assert np.array_equal(table.values, alone.values) and np.array_equal(table.steps, alone.steps)
        if alone.micro_steps is not None:
            assert table.micro_steps.tolist() == alone.micro_steps.tolist() == [1]
        rows = _rows_by_csv_module(path) if path.stat().st_size else []
        good = [r for r in rows if len(r) == len(HEADER.split(",")) and r[2].isdigit()]
        if table.micro_steps is None:
            assert table.names == [r[1] for r in good]


def test_bounds_from_first_and_last_lines(tmp_path):
    path = _write(tmp_path / "x_0-9.csv", HEADER + "".join(f"0,a,{s},1,2\n" for s in range(3, 8)) + "0,a,9")
    assert tuple(csv_bounds(path)) == (("norm", "min"), 3, 7)
    assert csv_bounds(_write(tmp_path / "y_0-0.csv", HEADER)) is None


def test_symlinked_files_are_refused(tmp_path):
    target = _write(tmp_path / "target_0-0.csv", HEADER + "0,a,0,1,2\n")
    link = tmp_path / "link_0-0.csv"
    link.symlink_to(target)
    with pytest.raises(OSError):
        read_csv_file(link)
    with pytest.raises(OSError):
        open_regular(link)


def _scalar_event(step: int, tags: list[str], values: list[float]) -> bytes:
    event = Event(wall_time=1.0, step=step)
    for tag, value in zip(tags, values):
        event.summary.value.add(tag=tag, simple_value=value)
    return event.SerializeToString()


def test_event_scalars_by_layout_match_protobuf(tmp_path):
    tags = [f"0:l{i}/rank0/post_grad_norm" for i in range(50)]
    records = [
        _scalar_event(step, tags, list(np.arange(50) * (step + 1) * 0.5)) for step in (0, 1, 127, 128, -3)
    ]
    other = _scalar_event(5, [*tags[:49], "0:x49/rank0/post_grad_norm"], [1.0] * 50)  # same length, other tag
    histogram = Event(step=6)
    histogram.summary.value.add(tag="h", histo=HistogramProto(min=0, max=1, bucket_limit=[1], bucket=[1]))
    histogram.summary.value.add(tag="s", simple_value=2.0)
    path = tmp_path / "events.out.tfevents.1.x"
    path.write_bytes(
        b"".join(frame_record(r) for r in [*records, other, histogram.SerializeToString()]) + b"\x01"
    )
    assert [Event.FromString(r) for r in iter_records(path)][
        -1
    ].step == 6  # the trailing byte is not a record
    layouts = LayoutCache()
    fd = open_regular(path)
    spans, end = scan_records(fd)
    assert len(spans) == 7 and end == path.stat().st_size - 1
    for span in spans:
        data = read_record(fd, span)
        head = event_head(data)
        reference = Event.FromString(data)
        assert head.step == reference.step
        summary = data[head.summary_offset : head.summary_offset + head.summary_length]
        layout, values = layouts.read(summary)
        scalars = [v for v in reference.summary.value if v.HasField("simple_value")]
        assert layout.tags == [v.tag for v in scalars]
        assert values.tolist() == [np.float32(v.simple_value) for v in scalars]
        partial = event_head(data[:40], partial=True)
        assert partial.step == reference.step
        first = reference.summary.value[0]
        assert first_scalar_tag(data[:300], partial) == (
            first.tag if first.HasField("simple_value") else None
        )
    os.close(fd)


def test_corrupt_record_is_detected(tmp_path):
    data = bytearray(frame_record(_scalar_event(1, ["a"], [1.0])))
    data[-6] ^= 0xFF  # inside the data
    path = tmp_path / "events.out.tfevents.2.x"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        list(iter_records(path))


def test_windows_line_ends_blank_lines_and_a_line_break_in_a_name(tmp_path):
    """Files joined for one parse may differ in line ends; a blank line or a quoted name holding a
    line break puts the lines and the rows out of step: such a file is read alone, and its rows
    that do not parse are still counted."""
    paths = [
        _write(tmp_path / "g_1-1.csv", HEADER.replace("\n", "\r\n") + "0,a,1,1,2\r\n0,b,1,3,4\r\n"),
        _write(tmp_path / "g_2-2.csv", HEADER + "0,a,2,5,6\n\n0,a,2,x,6\n0,b,2,7,8\n"),
        _write(tmp_path / "g_3-3.csv", HEADER + '0,"c\nd",3,9,10\n0,e,3,x,1\n'),
    ]
    tables = read_csv_files(paths)
    assert [t.names for t in tables] == [["a", "b"], ["a", "b"], ["c\nd"]]
    assert [t.values.tolist() for t in tables] == [[[1, 2], [3, 4]], [[5, 6], [7, 8]], [[9, 10]]]
    assert [t.skipped for t in tables] == [0, 1, 1]
