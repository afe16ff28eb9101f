"""TensorBoardWriter: what TensorBoard's own reader gets back, file safety, whole records."""

from __future__ import annotations

import os
import socket
import stat
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as reference_masked_crc32c

import monitor.writers.tensorboard as tb
from monitor.record import RowSet, StepRecord
from monitor.writers.eventfile import masked_crc32c

OPS = ("min", "max", "norm", "zeros")
SPECIAL = np.array([np.nan, np.inf, -np.inf, 1e-30, 1e30, 0.0, -0.0, -1e-30, 3.5, -2.25])


def _rows() -> RowSet:
    return RowSet.build(
        [0, 0, 1, 1, 0],
        ["layers.0.fc1.weight", "layers.0.fc2.weight", "layers.1.fc1.weight", "bias", "w"],
        0,
        "post_grad",
    )


def _values(rows: int, ops: int, step: int) -> np.ndarray:
    rng = np.random.default_rng(step)
    values = rng.standard_normal((rows, ops)) * 10.0 ** rng.integers(-5, 6, (rows, ops))
    flat = values.ravel()
    flat[: min(len(SPECIAL), flat.size)] = np.roll(SPECIAL, step)[: flat.size]
    return values


def _read(log_dir: os.PathLike) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(os.fspath(log_dir), size_guidance={SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _assert_same(got: float, want: float) -> None:
    with np.errstate(over="ignore"):
        want32 = np.float32(want)
    if np.isnan(want32):
        assert np.isnan(got)
    else:
        assert np.float32(got) == want32
        assert np.signbit(np.float32(got)) == np.signbit(want32)


def test_round_trip_every_tag_step_and_value(tmp_path):
    rows = _rows()
    micro = RowSet.build([0, 0], ["layers.0.fc1", "layers.0.fc1"], 3, "actv", micro_steps=[0, 1])
    writer = tb.TensorBoardWriter(tmp_path)
    expected: dict[str, list[tuple[int, float]]] = {}
    for step in range(4):
        for rowset, prefix in ((rows, "grad"), (micro, "actv")):
            values = _values(len(rowset), len(OPS), step)
            writer.write(StepRecord(prefix, step, OPS, rowset, values))
            for tag, row in zip(rowset.tags, values):
                for op, value in zip(OPS, row):
                    expected.setdefault(f"{tag}_{op}", []).append((step, value))
        writer.write_scalars(step, ["loss", "lr"], [1.0 / (step + 1), np.nan if step == 2 else 1e-4])
        expected.setdefault("loss", []).append((step, 1.0 / (step + 1)))
        expected.setdefault("lr", []).append((step, np.nan if step == 2 else 1e-4))
        writer.end_step(step)
    writer.close()

    got = _read(tmp_path)
    assert "0:layers.0.fc1.weight/rank0/post_grad_norm" in got
    assert "1:bias/rank0/post_grad_zeros" in got
    assert "0:layers.0.fc1:1/rank3/actv_max" in got
    assert set(got) == set(expected)
    for tag, points in expected.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag
        for (_, value), (_, want) in zip(got[tag], points):
            _assert_same(value, want)


def test_special_values_exactly_as_float32(tmp_path):
    with_big = np.concatenate([SPECIAL, [1e39, -1e39, 1e-46]])
    rows = RowSet.build([0] * len(with_big), [f"p{i}" for i in range(len(with_big))], None, "param")
    writer = tb.TensorBoardWriter(tmp_path)
    writer.write(StepRecord("param", 7, ("norm",), rows, with_big[:, None].copy()))
    writer.close()
    got = _read(tmp_path)
    for i, want in enumerate(with_big):
        ((step, value),) = got[f"0:p{i}/param_norm"]
        assert step == 7
        _assert_same(value, want)  # past float32's range: +-inf and (signed) zero, as float32 casts


def test_resolves_pending_copy_and_reuses_template_per_rowset(tmp_path):
    rows = _rows()
    writer = tb.TensorBoardWriter(tmp_path)
    values = _values(len(rows), len(OPS), 1)
    writer.write(StepRecord("grad", 1, OPS, rows, fetch=lambda: values))
    writer.write(StepRecord("grad", 2, OPS, rows, values + 1))
    writer.write(StepRecord("grad", 2, OPS[:2], rows, values[:, :2] * 2))  # same rows, other ops
    rebuilt = RowSet.build(rows.vpp_stages, rows.names, 0, "post_grad")  # equal, not identical
    writer.write(StepRecord("grad", 3, OPS, rebuilt, values + 3))
    for i in range(tb.TEMPLATE_CACHE_SIZE + 5):  # evicts the oldest templates
        writer.write(
            StepRecord("x", 4, ("norm",), RowSet.build([0], [f"n{i}"], 0, "x"), np.array([[i]], float))
        )
    writer.write(StepRecord("grad", 5, OPS, rows, values + 5))
    assert len(writer._templates) == tb.TEMPLATE_CACHE_SIZE
    writer.close()
    got = _read(tmp_path)
    for r, tag in enumerate(rows.tags):
        for o, op in enumerate(OPS):
            want = [(1, values[r, o]), (2, values[r, o] + 1), (3, values[r, o] + 3), (5, values[r, o] + 5)]
            if o < 2:
                want.insert(2, (2, values[r, o] * 2))
            assert [s for s, _ in got[f"{tag}_{op}"]] == [s for s, _ in want]
            for (_, value), (_, w) in zip(got[f"{tag}_{op}"], want):
                _assert_same(value, w)
    assert got["0:n36/rank0/x_norm"] == [(4, 36.0)]


def test_template_cache_bounded_by_scalars(tmp_path):
    writer = tb.TensorBoardWriter(tmp_path)
    writer.template_scalars_limit = 50
    big = RowSet.build([0] * 20, [f"b{i}" for i in range(20)], 0, "x")  # 20 x 4 = 80 scalars
    small = _rows()  # 5 x 4 = 20 scalars
    for step in range(3):
        writer.write(StepRecord("x", step, OPS, small, _values(len(small), len(OPS), step)))
        writer.write(StepRecord("x", step, OPS, big, _values(len(big), len(OPS), step)))
        assert [entry[0] for entry in writer._templates.values()] == [big]  # over the limit: newest kept
        assert writer._template_scalars == 80
    writer.write(StepRecord("x", 3, OPS[:2], small, _values(len(small), 2, 3)))
    writer.write(StepRecord("x", 3, OPS, small, _values(len(small), len(OPS), 3)))
    assert writer._template_scalars == 30 and len(writer._templates) == 2
    writer.close()
    got = _read(tmp_path)
    assert len(got) == 100 and all(len(points) == 3 for tag, points in got.items() if tag.startswith("0:b"))
    small_tag = "0:layers.0.fc1.weight/rank0/post_grad"
    assert [s for s, _ in got[f"{small_tag}_min"]] == [0, 1, 2, 3, 3]
    assert [s for s, _ in got[f"{small_tag}_norm"]] == [0, 1, 2, 3]
    for step, (_, value) in enumerate(got["0:b19/rank0/x_zeros"]):
        _assert_same(value, _values(len(big), len(OPS), step)[19, 3])


def test_file_name_mode_and_first_event(tmp_path):
    old = os.umask(0o077)  # the mode must not depend on the umask
    before = int(time.time())
    try:
        writer = tb.TensorBoardWriter(tmp_path)
        other = tb.TensorBoardWriter(tmp_path, file_mode=0o600)
    finally:
        os.umask(old)
    after = int(time.time())
    assert stat.S_IMODE(os.stat(writer.path).st_mode) == 0o640
    assert stat.S_IMODE(os.stat(other.path).st_mode) == 0o600
    parts = os.path.basename(writer.path).split(".")
    assert parts[:3] == ["events", "out", "tfevents"]
    assert before <= int(parts[3]) <= after  # the time of its creation
    assert parts[-2] == str(os.getpid())
    assert int(os.path.basename(other.path).split(".")[-1]) == int(parts[-1]) + 1
    assert writer.path != other.path
    # the file_version Event is on disk right away
    (first,) = _records(writer.path)
    assert Event.FromString(first).file_version == "brain.Event:2"
    writer.close()
    other.close()


def test_symlink_refused(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    link = tmp_path / "link"
    link.symlink_to(target)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    for path in (link, dangling, target):
        with pytest.raises(FileExistsError, match="refusing"):
            tb.create_exclusive(path)
    assert target.read_bytes() == b"keep"
    assert not (tmp_path / "nowhere").exists()

    # The writer itself: plant symlinks under the names it is about to choose.
    log_dir = tmp_path / "run"
    log_dir.mkdir()
    index = next(tb._file_counter) + 1
    now = int(time.time())
    host = socket.gethostname()
    for second in range(now, now + 60):  # whenever within a minute the writer picks its name
        (log_dir / f"events.out.tfevents.{second}.{host}.{os.getpid()}.{index}").symlink_to(target)
    with pytest.raises(FileExistsError, match="symlink"):
        tb.TensorBoardWriter(log_dir)
    assert target.read_bytes() == b"keep"


def test_close_is_idempotent_and_final(tmp_path):
    writer = tb.TensorBoardWriter(tmp_path)
    rows = _rows()
    writer.write(StepRecord("grad", 0, OPS, rows, _values(len(rows), len(OPS), 0)))
    writer.close()
    writer.close()
    writer.end_step(1)  # no-op once closed
    with pytest.raises(ValueError, match="closed"):
        writer.write(StepRecord("grad", 1, OPS, rows, _values(len(rows), len(OPS), 1)))
    with pytest.raises(ValueError, match="closed"):
        writer.write_scalars(1, ["a"], [1.0])
    assert len(_records(writer.path)) == 2  # close wrote the buffered record


def test_bad_shapes_rejected(tmp_path):
    writer = tb.TensorBoardWriter(tmp_path)
    rows = _rows()
    with pytest.raises(ValueError, match="shape"):
        writer.write(StepRecord("grad", 0, OPS, rows, np.zeros((len(rows), len(OPS) + 1))))
    with pytest.raises(ValueError, match="tags"):
        writer.write_scalars(0, ["a", "b"], [1.0])
    writer.write(StepRecord("grad", 0, (), rows, np.zeros((len(rows), 0))))  # nothing to write
    writer.close()
    assert len(_records(writer.path)) == 1


def _records(path: os.PathLike) -> list[bytes]:
    """Parse the TFRecord framing, checking both CRCs and that the file ends on a record boundary."""
    data = Path(path).read_bytes()
    records, pos = [], 0
    while pos < len(data):
        assert len(data) - pos >= 12, "partial record header"
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[pos + 8 : pos + 12])[0] == reference_masked_crc32c(header)
        assert len(data) - pos >= 16 + length, "partial record"
        body = data[pos + 12 : pos + 12 + length]
        assert struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])[0] == masked_crc32c(body)
        records.append(body)
        pos += 16 + length
    return records


def test_only_whole_records_reach_the_file(tmp_path):
    rows = RowSet.build([0] * 300, [f"layers.{i}.weight" for i in range(300)], 0, "post_grad")
    writer = tb.TensorBoardWriter(tmp_path)
    writer.write(StepRecord("grad", 0, OPS, rows, _values(300, len(OPS), 0)))
    assert len(_records(writer.path)) == 1  # buffered until the step ends
    writer.end_step(0)
    assert len(_records(writer.path)) == 2
    writer.close()

    # Past the size limit whole records go out before the step ends, never a part of one.
    fd = tb.create_exclusive(tmp_path / "small")
    target = tb._WholeRecordFile(fd, flush_bytes=1000)
    records = tb._FastRecordWriter(target)
    sizes = []
    for i in range(30):
        records.write(bytes([i]) * (50 + 37 * i))
        sizes.append(len(_records(tmp_path / "small")))
    assert sizes == sorted(sizes) and sizes[-1] > 0
    assert any(count < i + 1 for i, count in enumerate(sizes))  # some stayed buffered a while
    records.close()
    assert [r[0] for r in _records(tmp_path / "small")] == list(range(30))


@pytest.mark.parametrize("size", [0, 1, 7, 8, 255, 1023, 1024, 1025, 1027, 4096, 5001, 70001, 300007])
def test_crc_matches_tensorboard(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert masked_crc32c(data) == reference_masked_crc32c(data)
    assert masked_crc32c(b"\xff" * size) == reference_masked_crc32c(b"\xff" * size)
