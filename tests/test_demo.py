"""`trainmon demo` end to end: it trains, finds the injected spike at its step, and says where to look."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pandas as pd
import pytest

pytest.importorskip("torch")


def _demo(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "monitor.cli", "demo", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _anomaly_steps(root) -> set[int]:
    with open(os.path.join(root, "anomaly_detected", "rank0", "anomaly.json")) as handle:
        return {record["step"] for record in json.load(handle).values()}


def test_demo_reports_the_injected_spike_at_its_step(tmp_path):
    out = tmp_path / "run"
    done = _demo("--steps", "40", "--spike-step", "25", "--output", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "incident 1 at step 25:" in done.stdout
    assert "Detected:    1 incident(s)" in done.stdout
    assert f"trainmon anomaly-analyse -d {out}" in done.stdout  # the run's root, as the README has it
    assert f"tensorboard --logdir {out}" in done.stdout
    assert f"trainmon csv2tb {out}" in done.stdout  # CSV reaches the Scalars tab only converted
    assert "Warning" not in done.stderr, done.stderr  # neither torch's nor Python's warnings
    assert "\x1b[" not in done.stdout + done.stderr  # no colour codes, on a terminal or not
    assert _anomaly_steps(out) == {25}
    (rank_dir,) = [d for d in os.listdir(out) if "-rank0-" in d]
    frame = pd.read_csv(out / rank_dir / "grad_unreduced_20-29.csv")
    spike = frame[frame["step"] == 25]["norm"].median()
    normal = frame[frame["step"] == 24]["norm"].median()
    assert spike > 100 * normal


def test_analysing_steps_without_an_incident_says_so(tmp_path, capsys):
    from monitor.anomaly.analyse import main

    out = tmp_path / "run"
    assert _demo("--steps", "30", "--spike-step", "25", "--output", str(out), cwd=tmp_path).returncode == 0
    assert main(["-d", str(out), "-s", "[25]"]) == 0
    assert "1 incident(s) (steps [25]), earliest first:" in capsys.readouterr().out
    assert main(["-d", str(out), "-s", "[3, 4]"]) == 0
    printed = capsys.readouterr().out
    assert "0 incidents (steps [3, 4])" in printed
    records = len(json.loads((out / "anomaly_detected" / "rank0" / "anomaly.json").read_text()))
    said = f"No anomalies at steps [3, 4] among the {records:,} read; without -s every step is ranked."
    assert said in printed
    assert "Top 0" not in printed


def test_demo_without_spike_reports_no_anomaly(tmp_path):
    done = _demo("--steps", "40", "--no-spike", "--output", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Detected:    no anomalies" in done.stdout
    assert "anomaly-analyse" not in done.stdout  # nothing to analyse: not suggested
    assert _anomaly_steps(tmp_path / "run") == set()


def test_demo_writes_tensorboard_when_asked(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    out = tmp_path / "run"
    done = _demo(
        "--steps", "12", "--spike-step", "11", "--format", "tensorboard", "--output", str(out), cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    (rank_dir,) = [d for d in os.listdir(out) if "-rank0-" in d]
    events = EventAccumulator(str(out / rank_dir), size_guidance={SCALARS: 0})
    events.Reload()
    tag = "0:lm_head.weight/rank0/post_grad_norm"
    assert [e.step for e in events.Scalars(tag)] == list(range(12))


def test_demo_output_defaults_to_monitor_output_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "from_env"))
    done = _demo("--steps", "3", "--no-spike", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert any("-rank0-" in d for d in os.listdir(tmp_path / "from_env"))


def test_a_short_demo_places_its_spike_within_its_steps_and_says_why_it_went_unseen(tmp_path):
    """The spike's default step follows --steps (three fifths of them); one that comes before the
    rules could judge it (their warm-up) is said to be the reason nothing was detected."""
    done = _demo("--steps", "8", "--output", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "spike at step 4\n" in done.stdout
    assert "the spike at step 4 came before the rules had values enough" in done.stdout
    assert "try --steps 20 --spike-step 10" in done.stdout  # the rule waits for 10 values: past step 7
    done = _demo("--steps", "12", "--spike-step", "5", "--output", str(tmp_path / "longer"), cwd=tmp_path)
    assert "try --spike-step 10 or later" in done.stdout


def test_a_demo_config_that_records_nothing_says_so(tmp_path):
    """A misspelt key is warned about at attach; the summary then says that nothing could be
    detected rather than "no anomalies", and names no anomaly directory that was not made."""
    (tmp_path / "typo.json").write_text('{"wg_distrbution": true}')
    done = _demo("--steps", "3", "--config", "typo.json", "--output", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "did you mean 'wg_distribution'?" in done.stderr
    assert "Detected:    nothing could be: the config records no data type" in done.stdout
    assert "Anomalies:" not in done.stdout and not (tmp_path / "run" / "anomaly_detected").exists()


def test_demo_rejects_a_spike_after_the_last_step(tmp_path):
    done = _demo("--steps", "5", "--spike-step", "9", cwd=tmp_path)
    assert done.returncode == 2 and "--spike-step 9" in done.stderr


@pytest.mark.parametrize(
    "args, says",
    [
        (["--config", "missing.yaml"], "trainmon demo: config file 'missing.yaml': cannot be read"),
        (["--config", "bad_op.yaml"], "ops[1]: expected one of"),
        (["--output", "a_file"], "a_file' exists and is not a directory"),
        (["--format", "tensorbord"], "got 'tensorbord'; did you mean 'tensorboard'?"),
    ],
)
def test_demo_says_what_is_wrong_in_one_line(tmp_path, args, says):
    (tmp_path / "bad_op.yaml").write_text("wg_distribution: true\nops: [norm, nan]\n")
    (tmp_path / "a_file").write_text("")
    done = _demo("--steps", "3", "--no-spike", *args, cwd=tmp_path)
    assert done.returncode == 2 and says in done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_demo_reports_a_stop_its_config_asked_for(tmp_path):
    from adapters.torch.demo_command import DEMO_TEMPLATE, template_path

    with open(template_path(DEMO_TEMPLATE), encoding="utf-8") as handle:
        template = handle.read()
    assert "  dump: true\n" in template
    stop = template.replace("  dump: true\n", "  dump: true\n  actions: [stop]\n")
    (tmp_path / "stop.yaml").write_text(stop)
    done = _demo("--steps", "20", "--spike-step", "10", "--config", "stop.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    stopped = [line for line in done.stdout.splitlines() if line.startswith("Stopped:")]
    assert len(stopped) == 1 and "incident 1 at step 10" in stopped[0]
    trained = int(done.stdout.split("GPT-like model for ")[1].split(" steps")[0])
    assert 11 <= trained < 20  # the faulty step ran (its update with it), the rest did not
    assert "at the step the run stopped)." in done.stdout  # its loss is the spiked one, said so


def test_demo_with_evidence_bundles_says_how_to_read_them(tmp_path):
    from adapters.torch.demo_command import DEMO_TEMPLATE, template_path

    with open(template_path(DEMO_TEMPLATE), encoding="utf-8") as handle:
        template = handle.read()
    (tmp_path / "bundle.yaml").write_text(
        template.replace("  dump: true\n", "  dump: true\n  bundle: {incidents: 1}\n")
    )
    out = tmp_path / "run"
    done = _demo(
        "--steps", "20", "--spike-step", "10", "--config", "bundle.yaml", "--output", str(out), cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    (bundle,) = [line for line in done.stdout.splitlines() if "trainmon bundle show" in line]
    path = bundle.split("trainmon bundle show ")[1].split()[0]
    assert os.path.isdir(path) and path.startswith(
        str(out / "anomaly_detected" / "rank0" / "bundle_incident")
    )


def test_console_script_is_installed():
    assert shutil.which("trainmon") or os.path.exists(
        os.path.join(os.path.dirname(sys.executable), "trainmon")
    )


def test_version_is_the_installed_packages():
    from importlib import metadata

    done = subprocess.run([sys.executable, "-m", "monitor.cli", "--version"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"trainmon {metadata.version('trainmon')}"


def test_without_the_installed_package_the_help_says_where_the_missing_commands_come_from(
    monkeypatch, capsys
):
    """A source tree on the path, not installed: no entry points register demo and the converters;
    ``trainmon --help`` says so instead of leaving them out in silence."""
    from importlib import metadata

    from monitor import cli

    # this checkout is installed, so its entry points exist: an uninstalled tree is stood in for
    # by an empty entry-point group (installing and uninstalling here would take minutes)
    monkeypatch.setattr(metadata, "entry_points", lambda group: [])
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "demo, csv2tb, csv2db and compact are registered by the installed package" in shown
    assert "pip install -e ." in shown


def test_a_misspelt_command_gets_a_did_you_mean(capsys):
    """msprobe's module is anomaly_analyse; trainmon's command is anomaly-analyse."""
    from monitor import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(["anomaly_analyse", "-d", "monitor_output"])
    assert exited.value.code == 2
    assert "did you mean 'anomaly-analyse'?" in capsys.readouterr().err


def test_an_option_a_command_does_not_take_is_refused_under_that_commands_usage(capsys):
    """argparse said it under trainmon's own usage, which lists no option of the command."""
    from monitor import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(["anomaly-analyse", "-d", "monitor_output", "--cross-ranks"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("usage: trainmon anomaly-analyse"), err
    assert "unrecognized arguments: --cross-ranks; did you mean '--cross-rank'?" in err


def test_trainmon_alone_lists_the_commands(capsys):
    from monitor import cli

    assert cli.main([]) == 2
    shown = capsys.readouterr().err
    assert "anomaly-analyse" in shown and "rank the anomalies of all ranks" in shown


@pytest.mark.parametrize("no_color", [None, "1"])
def test_warnings_on_a_terminal_carry_no_colour_codes(no_color):
    """Our log lines are plain text on a terminal too (with NO_COLOR set or not): what is copied
    from a terminal or a log file reads the same."""
    import pty

    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    if no_color:
        env["NO_COLOR"] = no_color
    leader, follower = pty.openpty()
    code = "from monitor import load_config; load_config({'ops': ['shape']})"  # warns: nothing recorded
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], stdout=follower, stderr=follower, env=env, timeout=120
        )
        os.close(follower)
        said = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal closed once everything was read
                break
            if not chunk:
                break
            said += chunk
    finally:
        os.close(leader)
    assert done.returncode == 0
    assert b"[trainmon] WARNING" in said and b"\x1b[" not in said
