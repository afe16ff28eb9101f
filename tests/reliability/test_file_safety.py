"""Promise 6: files are safe.

Every directory the monitor creates is 0750 and every file 0640 (msprobe's modes) whatever
the umask; a symlink planted at the output directory, at a directory below it or at a file path
is refused with a clear error, never followed; no file outside MONITOR_OUTPUT_DIR is ever written;
the config file is parsed as data only (YAML tags that construct objects are rejected and run
nothing, and no eval/exec/pickle is used to read anything).
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from monitor import ConfigError, StructurePrinted, TrainerMon
from tests.reliability.training import EVERYTHING, Net, make_batches, train

DUMP = {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": 1.0}}], "dump": True}
#: everything that writes a file: all data types, TensorBoard, the anomaly dump, stack_info.
WRITES_ALL = {**EVERYTHING, "format": "tensorboard", "stack_info": True, "alert": DUMP}


def _train(config: dict, steps: int = 3) -> TrainerMon:
    """Attach (an error here is a refusal at the door) and train; only StructurePrinted may stop it."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    mon = TrainerMon(config)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)
    try:
        train(model, optimizer, make_batches(steps, 1))
    except StructurePrinted:
        pass
    finally:
        mon.stop()
    return mon


def _every_output_run() -> None:
    """CSV and TensorBoard runs with every writer, then print_struct (module_struct.json)."""
    _train({**WRITES_ALL, "format": "csv"})
    _train(WRITES_ALL)
    _train({"print_struct": True, "xy_distribution": True})


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


# -- modes ---------------------------------------------------------------------------------------


def test_every_directory_is_0750_and_every_file_0640(tmp_path, monkeypatch, umask_022):
    out = tmp_path / "new" / "monitor_output"  # its parent does not exist yet: the monitor makes it
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    _every_output_run()
    modes = _modes(tmp_path / "new")
    names = {Path(p).name for p in modes}
    assert {"anomaly.json", "stack_info.csv", "module_struct.json", "grad_reduced_0-0.csv"} <= names
    assert any(n.startswith("events.out.tfevents.") for n in names)
    wrong = {p: oct(m) for p, m in modes.items() if m != (0o750 if os.path.isdir(p) else 0o640)}
    assert not wrong, wrong


def test_every_file_is_0640_whatever_the_umask(tmp_path, monkeypatch):
    previous = os.umask(0)
    try:
        monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
        _every_output_run()
    finally:
        os.umask(previous)
    files = {p: m for p, m in _modes(tmp_path / "out").items() if not os.path.isdir(p)}
    assert len(files) > 10
    assert {p: oct(m) for p, m in files.items() if m != 0o640} == {}


def test_an_evidence_bundle_has_the_outputs_modes(tmp_path, umask_022):
    """It holds weights, gradients and batches: readable by the group as the CSVs are, no more."""
    from monitor.alerts.bundle import load_bundle, write_bundle

    weights = np.arange(6, dtype=np.float32).reshape(2, 3)
    path = write_bundle(
        str(tmp_path / "anomaly"), {"id": 1}, {}, {"w": (weights, "float32", "param", (2, 3))}, 1 << 20
    )
    modes = {p: oct(m) for p, m in _modes(Path(path)).items()}
    assert len(modes) == 3, modes  # the bundle, its manifest, its one tensor
    assert {p: m for p, m in modes.items() if m != ("0o750" if os.path.isdir(p) else "0o640")} == {}
    assert np.array_equal(load_bundle(path).tensors["w"], weights)


def _modes(root: Path) -> dict[str, int]:
    found = {str(root): stat.S_IMODE(os.lstat(root).st_mode)}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(directory, name)
            found[path] = stat.S_IMODE(os.lstat(path).st_mode)
    return found


# -- symlinks ------------------------------------------------------------------------------------


def test_a_symlink_at_the_output_directory_is_refused(tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "link").symlink_to(elsewhere)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "link"))
    with pytest.raises(OSError, match="symbolic link"):
        _train({"wg_distribution": True})
    assert list(elsewhere.iterdir()) == []


def test_an_output_directory_that_cannot_be_made_is_refused_naming_the_setting(tmp_path, monkeypatch):
    """A file where MONITOR_OUTPUT_DIR's directory would go: one error at attach that names the
    setting and its value, and nothing written."""
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "afile" / "sub"))
    with pytest.raises(OSError, match=r"MONITOR_OUTPUT_DIR='.*afile/sub'\) cannot be made: Not a directory"):
        _train(EVERYTHING)
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]


@pytest.mark.parametrize(
    "planted, config",
    [
        ("anomaly_detected", {"wg_distribution": True, "alert": DUMP}),
        ("module_struct", {"print_struct": True}),
    ],
)
def test_a_symlink_planted_below_the_output_directory_is_not_followed(
    tmp_path, monkeypatch, trainmon_log, planted, config
):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir(mode=0o750)
    elsewhere.mkdir()
    (out / planted).symlink_to(elsewhere)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    refusal = None
    try:
        TrainerMon(config).set_monitor(Net(), 1, torch.optim.SGD(Net().parameters(), lr=0.1)).stop()
    except OSError as exc:  # refused at the door
        refusal = str(exc)
    else:  # accepted at the door: a failure later must be contained (logged, never raised)
        _train(config)
    assert list(elsewhere.rglob("*")) == [], "files were written through the planted symlink"
    messages = [refusal] if refusal else [r.getMessage() for r in trainmon_log.errors()]
    assert any("symbolic link" in m for m in messages), messages  # refused at the door or logged


def test_a_symlink_at_anomaly_json_is_refused_and_its_target_untouched(tmp_path, monkeypatch):
    out, target = tmp_path / "out", tmp_path / "precious.txt"
    target.write_text("keep me")
    (out / "anomaly_detected" / "rank0").mkdir(parents=True)
    (out / "anomaly_detected" / "rank0" / "anomaly.json").symlink_to(target)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    with pytest.raises(OSError, match="symbolic link"):
        _train({"wg_distribution": True, "alert": DUMP})
    assert target.read_text() == "keep me"


def test_symlinks_at_file_paths_of_a_resumed_run_are_refused(tmp_path, monkeypatch, trainmon_log):
    """append_output resumes into an existing rank directory, where files can be planted in advance."""
    out, target = tmp_path / "out", tmp_path / "precious.txt"
    target.write_text("keep me")
    rank_dir = out / "Jan01_00-00-00-rank0-0123abcd"
    rank_dir.mkdir(parents=True)
    (rank_dir / "grad_reduced_0-9.csv").symlink_to(target)
    (rank_dir / "stack_info.csv").symlink_to(tmp_path / "dangling")
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    config = {
        "wg_distribution": True,
        "stack_info": True,
        "step_count_per_record": 10,
        "append_output": ["Jan01_00-00-00", "Jan01_00-00-01"],
    }
    _train(config)
    assert target.read_text() == "keep me"
    assert not (tmp_path / "dangling").exists()
    refusals = [r.getMessage() for r in trainmon_log.errors()]
    assert any("symlink" in m or "symbolic link" in m for m in refusals), refusals


# -- nothing outside the output directory --------------------------------------------------------


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*") if not p.is_dir()}


def test_nothing_is_written_outside_the_output_directory(tmp_path, monkeypatch):
    """cwd, HOME and the temporary directory are watched; only MONITOR_OUTPUT_DIR may change."""
    watched = tmp_path / "watched"
    for name in ("cwd", "home", "tmp"):
        (watched / name).mkdir(parents=True)
        (watched / name / "existing.txt").write_text("x")
    out = watched / "cwd" / "out"
    monkeypatch.chdir(watched / "cwd")
    monkeypatch.setenv("HOME", str(watched / "home"))
    monkeypatch.setenv("TMPDIR", str(watched / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(watched / "tmp"))
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    before = _tree(watched)
    _every_output_run()
    _train({**WRITES_ALL, "cc_distribution": {"enable": True}})
    after = _tree(watched)
    changed = {p for p in after if before.get(p) != after[p]} | (before.keys() - after.keys())
    outside = sorted(p for p in changed if not p.startswith(str(out) + os.sep))
    assert changed and not outside, outside


# -- config parsed as data only ------------------------------------------------------------------


@pytest.mark.parametrize(
    "tag",
    [
        "!!python/object/apply:os.system ['touch {marker}']",
        "!!python/object/new:os.system ['touch {marker}']",
        "!!python/name:os.system",
        "!!python/object:subprocess.Popen {{args: ['touch', '{marker}']}}",
    ],
)
def test_a_yaml_tag_that_builds_objects_is_rejected_and_runs_nothing(tmp_path, tag):
    marker = tmp_path / "ran"
    path = tmp_path / "config.yaml"
    path.write_text(f"format: csv\nops: {tag.format(marker=marker)}\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        TrainerMon(str(path))
    assert not marker.exists()


def test_no_code_path_evaluates_or_unpickles_input():
    """The sources read input with json, yaml's safe loader, csv and ast.literal_eval only."""
    root = Path(__file__).resolve().parents[2]
    unsafe = re.compile(
        r"\b(pickle|marshal|shelve|unsafe_load|full_load|UnsafeLoader|FullLoader)\b|(?<![\w.])(eval|exec)\("
    )
    found = []
    for package in ("monitor", "adapters", "dashboards"):
        for path in (root / package).rglob("*.py"):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                code = line.split("#", 1)[0]
                if unsafe.search(code) and '"""' not in code and "``" not in code:
                    found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert not found, found
