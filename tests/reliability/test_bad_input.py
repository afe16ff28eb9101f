"""Promise 4: bad input gets a clear error, never a crash.

Configs: hypothesis generates well over 500 configs (a valid base with one key given a wrong
type, an out-of-range or huge number, unicode, nested garbage; unknown keys; whole files of
random JSON/YAML text and non-UTF-8 bytes). Each either loads or raises monitor.ConfigError whose
message names the offending key; no other exception type ever escapes.

Anomaly files: the analysis CLI (monitor.anomaly.analyse.main, and ``python -m
monitor.anomaly_analyse`` once) is run on generated malformed anomaly.json files (truncated JSON,
wrong shapes, records with wrongly typed fields, non-UTF-8 bytes, deep nesting, a huge file). It
exits 0 as documented ("0 done": bad files are skipped, not fatal), prints one warning per
skipped file naming it, and its summary line counts exactly the skipped files and records.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import subprocess
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from monitor import ConfigError, MonitorConfig, TrainerMon, load_config
from monitor.anomaly.analyse import main as analyse
from tests.reliability.conftest import LogRecords

#: derandomized: the same examples every run, so CI is reproducible (and a strict xfail stays strict).
SETTINGS = settings(
    deadline=None, database=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)

# -- configs -------------------------------------------------------------------------------------

HUGE = st.sampled_from([10**400, -(10**400), 10**4000, 2**63, -(2**63) - 1, 1e308, -1e308, 2**1024 - 1])
NUMBERS = (
    st.integers()
    | HUGE
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([0, -1, 1, 0.5, -0.0, float("nan"), float("inf"), -float("inf")])
)
TEXT = st.text(max_size=12) | st.sampled_from(["", " ", "norm", "csv", "1", "1e-8", "true", "\u202e", "\x00"])
SCALARS = st.none() | st.booleans() | NUMBERS | TEXT
GARBAGE = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(TEXT | st.integers() | st.none() | st.booleans(), inner, max_size=4)
    ),
    max_leaves=10,
)

#: a valid config with every section present, so nested keys have somewhere to go wrong.
BASE = {
    "targets": {"layers.0": {"input": "tensor", "output": "tuple[2]:0"}},
    "wg_distribution": True,
    "xy_distribution": True,
    "ops": ["min", "max", "norm"],
    "eps": 1e-8,
    "format": "csv",
    "ndigits": 6,
    "step_count_per_record": 1,
    "start_step": 0,
    "step_interval": 1,
    "collect_times": 10,
    "module_ranks": [0, 1],
    "alert": {
        "rules": [
            {"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5, "ops": ["norm"], "warmup": 2}},
            {"rule_name": "AnomalyZScore", "args": {"threshold": 6, "beta": 0.9, "min_ratio": 5}},
        ],
        "dump": True,
    },
    "cc_distribution": {"enable": False, "cc_codeline": ["train.py\\[\\d+\\]"], "cc_pre_hook": False},
    "append_output": [],
    "l2_targets": {"linear_hook": ["layers.0"]},
    "sa_order": "s,b,h,d",
}
TOP_KEYS = [f.name for f in MonitorConfig.__dataclass_fields__.values()]


def _paths(obj, prefix=()):
    """Every key path in a nested dict/list config (lists by index)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield (*prefix, key)
            yield from _paths(value, (*prefix, key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield (*prefix, i)
            yield from _paths(value, (*prefix, i))


BASE_PATHS = list(_paths(BASE))


def _replaced(config, path, value):
    """A deep copy of config with the item at path replaced by value."""
    copy = json.loads(json.dumps(config))
    target = copy
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    return copy


def _assert_loads_or_names(raw, key: str) -> None:
    """load_config(raw) loads, or raises ConfigError naming ``key``; any other exception fails."""
    try:
        load_config(raw)
    except ConfigError as exc:
        assert key in str(exc), f"ConfigError does not name {key!r}: {exc}"


@settings(SETTINGS, max_examples=400)
@given(path=st.sampled_from(BASE_PATHS + [(k,) for k in TOP_KEYS]), value=GARBAGE)
def test_a_config_with_one_bad_value_loads_or_names_the_key(path, value):
    _assert_loads_or_names(_replaced(BASE, path, value), path[0])


@settings(SETTINGS, max_examples=150)
@given(extra=st.dictionaries(TEXT, GARBAGE, min_size=1, max_size=3), nested=st.booleans())
def test_unknown_keys_anywhere_load_with_a_warning_or_name_their_section(extra, nested):
    if nested:  # unknown keys inside a section: alert warns, cc_distribution rejects them by name
        for section in ("alert", "cc_distribution"):
            raw = {**BASE, section: {**BASE[section], **extra}}
            _assert_loads_or_names(raw, section)
    else:  # unknown top-level keys load, with one warning naming each of them
        unknown = {k: v for k, v in extra.items() if k not in (*TOP_KEYS, "is_select", "opt_ty")}
        handler = LogRecords()
        logger = logging.getLogger("trainmon")
        logger.addHandler(handler)
        try:
            load_config({**BASE, **unknown})
        finally:
            logger.removeHandler(handler)
        for key in unknown:
            assert [w for w in handler.warnings() if repr(key) in w], (key, handler.warnings())


@settings(SETTINGS, max_examples=60)
@given(key=st.integers() | st.none() | st.booleans() | st.tuples(st.integers()), value=GARBAGE)
def test_non_string_keys_are_rejected_with_a_config_error(key, value):
    with pytest.raises(ConfigError, match="key"):
        load_config({**BASE, key: value})
    for section in ("alert", "cc_distribution", "targets", "l2_targets"):
        _assert_loads_or_names({**BASE, section: {**BASE[section], key: value}}, section)


FILE_TEXT = st.one_of(
    GARBAGE.map(lambda v: json.dumps(v, allow_nan=True)),
    st.dictionaries(st.sampled_from(TOP_KEYS) | TEXT, GARBAGE, max_size=5).map(json.dumps),
    st.text(max_size=200),
    st.sampled_from(
        [
            "",
            "{",
            "[]",
            "null",
            "{'ops': ['norm']}",
            '{"ops": ["norm"]',
            "ops: [norm\n",
            "ops: !!python/object/apply:os.system ['true']\n",
            "? [a, b]\n: c\n",
            "&a [*a]\n",
            "x: &a\n  - *a\n",
            "1e999: 1\n",
            "format: !!binary aGVsbG8=\n",
            "eps: 1e-8\nops: [norm]\n",
        ]
    ),
)


@settings(SETTINGS, max_examples=150)
@given(text=FILE_TEXT, yaml_file=st.booleans(), prefix=st.binary(max_size=4))
def test_any_config_file_loads_or_raises_a_config_error(text, yaml_file, prefix):
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "config.yaml" if yaml_file else "config.json")
        with open(path, "wb") as handle:
            handle.write(prefix + text.encode("utf-8", "surrogatepass"))
        try:
            load_config(path)
        except ConfigError as exc:
            message = str(exc)  # the file's problem, or the key whose value is wrong
            assert message.startswith(("config file", "config:", *TOP_KEYS)), message


@settings(SETTINGS, max_examples=60)
@given(path=st.sampled_from(BASE_PATHS), value=GARBAGE)
def test_trainer_mon_raises_only_config_errors_at_the_door(path, value):
    raw = _replaced(BASE, path, value)
    try:
        mon = TrainerMon(raw)
    except ConfigError as exc:
        assert path[0] in str(exc)
    else:
        mon.stop()


def test_an_integer_too_long_to_print_is_a_config_error_at_every_key():
    """10**5000 cannot even be repr()'d (Python's 4300-digit limit): the message must still come."""
    failures = []
    for path in BASE_PATHS:
        try:
            _assert_loads_or_names(_replaced(BASE, path, 10**5000), path[0])
        except Exception as exc:
            failures.append(f"{path}: {type(exc).__name__}")
    assert not failures, failures


@pytest.mark.parametrize(
    "path",
    [
        ("eps",),
        ("alert", "rules", 0, "args", "threshold"),
        ("alert", "rules", 1, "args", "beta"),
    ],
)
def test_a_number_too_large_for_a_float_is_a_config_error(path):
    _assert_loads_or_names(_replaced(BASE, path, 10**400), path[0])


def test_a_non_string_key_in_alert_is_a_config_error():
    _assert_loads_or_names({**BASE, "alert": {**BASE["alert"], 3: True}}, "alert")


# -- anomaly files -------------------------------------------------------------------------------

#: fields of a record with a valid value and values that no reading of the documented format accepts.
FIELDS = {
    "rank": (0, ["0", 1.5, None, [0], True]),
    "step": (3, ["3", 3.0, None, {}, False]),
    "tag_name": ("0:fc.weight/rank0/post_grad", [7, None, ["x"], 1.5]),
    "message": ("Rule AnomalyNan reports anomaly signal", [None, 3, {"a": 1}]),
    "micro_step": (0, ["0", 0.5, [1]]),
    "pp_stage": (0, ["x", 2.5, {}]),
    "vpp_stage": (0, ["0", [0]]),
    "call_id": (2, ["2", 2.2, [2]]),
}


@st.composite
def _record(draw):
    """A record and whether it is well formed."""
    record, valid = {}, True
    for name, (good, bad) in FIELDS.items():
        choice = draw(st.sampled_from(["good", "good", "good", "bad", "absent"]))
        required = name in ("rank", "step", "tag_name", "message")
        if choice == "good":
            record[name] = good
        elif choice == "bad":
            record[name] = draw(st.sampled_from(bad))
            valid = False
        elif required:
            valid = False
    record["op"] = "norm"
    record["value"] = draw(st.sampled_from([1.5, "nan", "inf", None]))
    return record, valid


def _broken_bytes(draw, document: dict) -> bytes:
    text = json.dumps(document).encode()
    kind = draw(st.sampled_from(["truncated", "shape", "not_utf8", "deep", "empty", "binary"]))
    if kind == "truncated":
        return text[: draw(st.integers(0, max(0, len(text) - 1)))]
    if kind == "shape":
        return json.dumps(draw(st.sampled_from([[document], 3, "text", None, True]))).encode()
    if kind == "not_utf8":
        return json.dumps({"k": {"message": "caf\xe9 \u00ff"}}, ensure_ascii=False).encode("latin-1")
    if kind == "deep":
        return b"[" * 100_000 + b"]" * 100_000
    if kind == "empty":
        return b""
    return b"\xff\xfe\x00" + draw(st.binary(max_size=64))


def _analyse(data_dir: str, out_dir: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = analyse(["-d", data_dir, "-o", out_dir, "-k", "5"])
    return status, out.getvalue(), err.getvalue()


@settings(SETTINGS, max_examples=120)
@given(data=st.data(), records=st.lists(_record(), min_size=1, max_size=6), broken_files=st.integers(0, 2))
def test_malformed_anomaly_files_are_skipped_and_counted(data, records, broken_files):
    with tempfile.TemporaryDirectory() as directory:
        data_dir = os.path.join(directory, "anomaly_detected")
        document = {f"key{i}": record for i, (record, _) in enumerate(records)}
        paths = []
        for rank in range(1 + broken_files):
            os.makedirs(os.path.join(data_dir, f"rank{rank}"))
            path = os.path.join(data_dir, f"rank{rank}", "anomaly.json")
            with open(path, "wb") as handle:
                handle.write(
                    json.dumps(document).encode() if rank == 0 else _broken_bytes(data.draw, document)
                )
            paths.append(path)
        status, out, err = _analyse(data_dir, os.path.join(directory, "out"))
    bad = sum(not valid for _, valid in records)
    assert status == 0, err
    assert "Traceback" not in err
    summary = out.rstrip().splitlines()[-1]
    assert summary == (
        f"{_count(len(records) - bad, 'record')} from 1 file; skipped {_count(broken_files, 'file')}, "
        f"{_count(bad, 'record')}"
    ), (summary, err)
    warnings = err.strip().splitlines()
    for path in paths[1:]:
        (line,) = [w for w in warnings if f"skipping {path}:" in w]
        assert line.startswith("anomaly-analyse: warning: ")
    if bad:
        assert any(f"skipped {bad} malformed record(s)" in w for w in warnings), warnings


@pytest.mark.slow
def test_a_huge_anomaly_file_and_a_truncated_one(tmp_path):
    """Two ~40 MB files (the parallel reader's size): one complete, one cut off in the middle."""
    data_dir = tmp_path / "anomaly_detected"
    record = {name: good for name, (good, _) in FIELDS.items()}
    records = {f"k{i}": {**record, "step": i, "call_id": i} for i in range(180_000)}
    text = json.dumps(records).encode()
    assert len(text) > 32 * 2**20
    for rank, content in ((0, text), (1, text[: len(text) // 2])):
        (data_dir / f"rank{rank}").mkdir(parents=True)
        (data_dir / f"rank{rank}" / "anomaly.json").write_bytes(content)
    status, out, err = _analyse(str(data_dir), str(tmp_path / "out"))
    assert status == 0
    assert out.rstrip().splitlines()[-1] == f"{len(records)} records from 1 file; skipped 1 file, 0 records"
    assert "not valid JSON" in err and "rank1" in err
    ranked = json.loads((tmp_path / "out" / "anomaly_analyse.json").read_text())
    assert [r["step"] for r in ranked.values()] == [0, 1, 2, 3, 4]


def test_the_module_entry_point_documents_its_exit_codes(tmp_path):
    """``python -m monitor.anomaly_analyse``: 2 with one line for a bad path, and when no file can be
    read (an empty result would read as a run without anomalies); 0 when some are skipped."""
    command = [sys.executable, "-m", "monitor.anomaly_analyse", "-d"]
    missing = subprocess.run([*command, str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert missing.returncode == 2
    assert missing.stderr.count("\n") == 1 and "does not exist" in missing.stderr
    (tmp_path / "run" / "rank0").mkdir(parents=True)
    (tmp_path / "run" / "rank0" / "anomaly.json").write_bytes(b'{"a": {"step": 1')
    skipped = subprocess.run([*command, str(tmp_path / "run")], capture_output=True, text=True)
    assert skipped.returncode == 2 and skipped.stdout == ""
    assert "Traceback" not in skipped.stderr and "not valid JSON" in skipped.stderr
    assert "no anomaly file could be read (1 skipped" in skipped.stderr
    assert not (tmp_path / "run" / "anomaly_analyse.json").exists()
    (tmp_path / "run" / "rank1").mkdir()
    (tmp_path / "run" / "rank1" / "anomaly.json").write_text(json.dumps({}))
    some = subprocess.run([*command, str(tmp_path / "run")], capture_output=True, text=True)
    assert some.returncode == 0, some.stderr
    assert some.stdout.rstrip().splitlines()[-1] == "0 records from 1 file; skipped 1 file, 0 records"


def test_non_finite_and_huge_numbers_in_a_record_are_not_a_crash(tmp_path):
    record = {name: good for name, (good, _) in FIELDS.items()}
    records = {
        "a": {**record, "value": "nan", "baseline": "-inf"},
        "b": {**record, "step": 10**30},
        "c": {**record, "value": 1e308, "baseline": math.pi},
    }
    (tmp_path / "d" / "rank0").mkdir(parents=True)
    (tmp_path / "d" / "rank0" / "anomaly.json").write_text(json.dumps(records))
    status, out, err = _analyse(str(tmp_path / "d"), str(tmp_path / "out"))
    assert status == 0 and "Traceback" not in err
    assert out.rstrip().splitlines()[-1].startswith("3 records from 1 file;")


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"
