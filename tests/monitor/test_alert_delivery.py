"""What reaches the endpoint, and what never does: redirects, chat tools' refusals in a 200
answer, signed messages, a command's process group and environment, claims of an earlier run,
and which rank's root the one message of a job names. Against real local servers and programs;
expected values are computed here (HMAC with the standard library), not read from the sinks."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import sys
import time
import urllib.parse

import pytest

from monitor import ConfigError, load_config
from tests.monitor.alert_endpoints import TOKEN, Server, alerts_of, incident, lines, wait_for


def test_a_redirect_is_a_failure_and_the_token_never_follows_it(tmp_path, monkeypatch, caplog, quick):
    elsewhere = Server()
    redirecting = Server(statuses=(302,), location=elsewhere.url)
    monkeypatch.setenv("HOOK_TOKEN", TOKEN)
    sink = {
        "type": "webhook",
        "url": redirecting.url,
        "headers_env": {"Authorization": "HOOK_TOKEN"},
        "ranks": "all",
        "retries": 0,
    }
    alerts = alerts_of([sink], 0, tmp_path)
    alerts.incident(incident(), None)
    alerts.close()
    redirecting.close()
    elsewhere.close()
    assert len(redirecting.requests) == 1 and elsewhere.requests == []
    assert alerts.channels == [] and "HTTP 302, a redirect: not followed" in caplog.text
    assert TOKEN not in caplog.text


def test_a_header_variable_unset_since_the_start_is_a_failure_not_an_empty_header(
    tmp_path, monkeypatch, caplog, quick
):
    server = Server()
    monkeypatch.setenv("HOOK_TOKEN", TOKEN)
    sink = {"type": "webhook", "url": server.url, "headers_env": {"Authorization": "HOOK_TOKEN"}}
    alerts = alerts_of([{**sink, "ranks": "all", "retries": 0}], 0, tmp_path)
    monkeypatch.delenv("HOOK_TOKEN")
    alerts.incident(incident(), None)
    alerts.close()
    server.close()
    assert server.requests == [] and alerts.channels == []
    assert "the header variable HOOK_TOKEN is not set now" in caplog.text


def test_a_header_value_turned_multiline_is_said_as_such_not_as_an_unreachable_endpoint(
    tmp_path, monkeypatch, caplog, quick
):
    server = Server()
    monkeypatch.setenv("HOOK_TOKEN", TOKEN)
    sink = {"type": "webhook", "url": server.url, "headers_env": {"Authorization": "HOOK_TOKEN"}}
    alerts = alerts_of([{**sink, "ranks": "all", "retries": 0}], 0, tmp_path)
    monkeypatch.setenv("HOOK_TOKEN", f"{TOKEN}\r\nX-Injected: 1")
    alerts.incident(incident(), None)
    alerts.close()
    server.close()
    assert server.requests == []
    assert "the value of HOOK_TOKEN holds a line break or a control character now" in caplog.text
    assert "cannot reach" not in caplog.text and TOKEN not in caplog.text


@pytest.mark.parametrize(
    "preset, answer, words",
    [
        ("dingtalk", {"errcode": 310000, "errmsg": "keywords not in content"}, "errcode 310000"),
        ("feishu", {"code": 19021, "msg": "sign match fail"}, "code 19021 (sign match fail)"),
        ("feishu", {"StatusCode": 9499, "StatusMessage": "Bad Request"}, "StatusCode 9499"),
    ],
)
def test_a_chat_tool_that_refuses_in_a_200_answer_is_a_failure(
    tmp_path, caplog, quick, preset, answer, words
):
    refusing = Server(answer=json.dumps(answer).encode())
    accepting = Server(answer=json.dumps({"errcode": 0, "errmsg": "ok", "code": 0}).encode())
    common = {"type": "webhook", "preset": preset, "ranks": "all", "retries": 0}
    alerts = alerts_of([{**common, "url": refusing.url}, {**common, "url": accepting.url}], 0, tmp_path)
    refused, taken = alerts.channels
    alerts.incident(incident(), None)
    alerts.close()
    refusing.close()
    accepting.close()
    assert (refused.delivered, refused.failed, taken.delivered, taken.failed) == (0, 1, 1, 0)
    said = [r.getMessage() for r in caplog.records if "alert.sinks[0]" in r.getMessage()]
    assert len(said) == 1 and f"{preset} refused the message: {words}" in said[0]


def expected_signature(key: str, text: str) -> str:
    return base64.b64encode(hmac.new(key.encode(), text.encode(), hashlib.sha256).digest()).decode()


@pytest.mark.parametrize("preset", ["dingtalk", "feishu"])
def test_a_signing_secret_signs_each_message_as_the_chat_tool_checks_it(tmp_path, monkeypatch, quick, preset):
    server = Server(answer=b'{"errcode": 0, "code": 0}')
    secret = "SEC-robot-secret"
    monkeypatch.setenv("ROBOT_SECRET", secret)
    sink = {
        "type": "webhook",
        "url": f"{server.url}?access_token=abc",
        "preset": preset,
        "secret_env": "ROBOT_SECRET",
    }
    alerts = alerts_of([{**sink, "ranks": "all"}], 0, tmp_path)
    before = time.time()
    alerts.incident(incident(), None)
    alerts.close()
    server.close()
    ((_, body),) = server.requests
    (path,) = server.paths
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
    if preset == "dingtalk":
        stamp = query["timestamp"][0]
        assert before * 1000 - 1000 <= int(stamp) <= time.time() * 1000
        assert query["sign"][0] == expected_signature(secret, f"{stamp}\n{secret}")
        assert query["access_token"] == ["abc"] and "sign" not in body
    else:
        stamp = body["timestamp"]
        assert before - 1 <= int(stamp) <= time.time()
        assert body["sign"] == expected_signature(f"{stamp}\n{secret}", "")
        assert body["msg_type"] == "text" and "sign" not in query
    config = load_config({"alert": {"sinks": [sink]}})
    assert (
        secret not in json.dumps(config.to_dict())
        and config.to_dict()["alert"]["sinks"][0]["secret_env"] == "ROBOT_SECRET"
    )


def test_a_command_that_times_out_is_ended_with_its_children_and_never_sees_the_secrets(
    tmp_path, monkeypatch, caplog, quick
):
    monkeypatch.setenv("HOOK_TOKEN", TOKEN)
    monkeypatch.setenv("HOOK_URL", "http://127.0.0.1:9/hook")
    child_pid, seen = tmp_path / "child.pid", tmp_path / "environment.json"
    program = (
        "import json, os, subprocess, sys, time; "
        f"json.dump(dict(os.environ), open({str(seen)!r}, 'w')); "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(child_pid)!r}, 'w').write(str(child.pid)); time.sleep(60)"
    )
    sinks = [
        {
            "type": "command",
            "argv": [sys.executable, "-c", program],
            "ranks": "all",
            "timeout_s": 2,
            "retries": 0,
        },
        {
            "type": "webhook",
            "url_env": "HOOK_URL",
            "headers_env": {"X-Token": "HOOK_TOKEN"},
            "ranks": "rank0",
        },
    ]
    alerts = alerts_of(sinks, 1, tmp_path)
    alerts.incident(incident(rank=1), None)
    assert wait_for(lambda: alerts.channels[0].failed == 1, 15)
    alerts.close()
    pid = int(child_pid.read_text())
    assert wait_for(lambda: not _alive(pid), 5), "the program's child outlived the timeout"
    environment = json.loads(seen.read_text())
    assert "HOOK_TOKEN" not in environment and "HOOK_URL" not in environment and "PATH" in environment
    assert "no exit within timeout_s (2 s)" in caplog.text


def test_a_command_still_running_when_the_run_ends_is_ended_with_its_children(tmp_path, caplog, quick):
    """Its session of its own outlives the job otherwise, and could still page after the run said
    that the message was not delivered."""
    pids = tmp_path / "pids"
    program = (
        "import os, subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}'); time.sleep(60)"
    )
    sink = {"type": "command", "argv": [sys.executable, "-c", program], "ranks": "all", "timeout_s": 60}
    alerts = alerts_of([sink], 0, tmp_path)
    alerts.incident(incident(), None)
    assert wait_for(lambda: pids.exists() and pids.read_text().count(" ") == 1, 15)
    alerts.close()
    for pid in map(int, pids.read_text().split()):
        assert wait_for(lambda pid=pid: not _alive(pid), 5), "the program outlived the run"
    assert "1 alert message(s) not delivered" in caplog.text


def test_a_program_starting_when_the_run_ends_is_ended_too_and_none_starts_after(
    tmp_path, monkeypatch, quick
):
    """The run's end abandons the command while the delivery thread is starting its program (a
    retry under way): the program started then is ended, and none starts after it; otherwise it
    would run in a session of its own past the run and page late."""
    import threading

    import monitor.alerts.sinks as sinks

    started = tmp_path / "started"
    program = f"import time; time.sleep(1); open({str(started)!r}, 'a').write('x')"
    sink = {"type": "command", "argv": [sys.executable, "-c", program], "ranks": "all", "timeout_s": 10}
    alerts = alerts_of([sink], 0, tmp_path)
    command = alerts.channels[0].sink
    inside, go_on, real_popen = threading.Event(), threading.Event(), sinks.subprocess.Popen

    def slow_popen(*args, **kwargs):  # the program is being started when the run ends
        inside.set()
        go_on.wait(10)
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(sinks.subprocess, "Popen", slow_popen)
    outcome: list[BaseException | None] = []

    def deliver() -> None:
        try:
            command.deliver({"step": 1})
            outcome.append(None)
        except OSError as exc:
            outcome.append(exc)

    delivering = threading.Thread(target=deliver)
    delivering.start()
    assert inside.wait(10)
    abandoning = threading.Thread(target=command.abandon)
    abandoning.start()
    time.sleep(0.2)  # abandon() is under way while the program starts
    go_on.set()
    abandoning.join(10)
    delivering.join(10)
    assert outcome and isinstance(outcome[0], OSError) and "SIGKILL" in str(outcome[0]), outcome
    with pytest.raises(OSError, match="not started: the run has ended"):
        command.deliver({"step": 2})
    alerts.close()
    time.sleep(1.5)  # the program, had it run on, would have written by now
    assert not started.exists()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


def test_a_hanging_sink_does_not_use_up_the_others_time_at_close(tmp_path, caplog, quick):
    hanging = Server(hang=True)
    out = tmp_path / "incidents.jsonl"
    sinks = [
        {"type": "webhook", "url": hanging.url, "ranks": "all", "retries": 0, "timeout_s": 60},
        {"type": "file", "path": str(out), "ranks": "all"},
    ]
    alerts = alerts_of(sinks, 0, tmp_path)
    alerts.incident(incident(step=4), None)
    assert hanging.inside.wait(10) and wait_for(lambda: len(lines(out)) == 1)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        alerts.close()
    hanging.close()
    said = [r.getMessage() for r in caplog.records if "not delivered" in r.getMessage()]
    assert len(said) == 1 and "alert.sinks[0] (webhook" in said[0], said


def claim_of(root, step: int, rank: int, tag: str, micro_step: int = 0, age: float = 0.0) -> None:
    """A claim file of another rank, as that rank writes it, ``age`` seconds old."""
    directory = root / "anomaly_detected" / "alerts" / f"step{step}"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank{rank}"
    message = {"rank": rank, "step": step, "micro_step": micro_step, "tag": tag, "summary": f"rank {rank}'s"}
    path.write_text(json.dumps(message))
    os.utime(path, (time.time() - age, time.time() - age))


@pytest.mark.parametrize("root", ["0:layers.2.output:0/rank1/actv", "0:layers.2.bias/rank1/acc_grad"])
def test_the_one_message_names_the_rank_whose_root_comes_first_in_the_step(tmp_path, quick, root):
    """Rank 1's NaN input reached rank 0 through the gradient all-reduce: rank 0, the lowest,
    delivers, and names rank 1's root (its forward activation, or with weight gradients alone
    its local gradient, measured at the same place in the step) rather than its own reduced
    gradient."""
    out = tmp_path / "lowest.jsonl"
    alerts = alerts_of([{"type": "file", "path": str(out)}], 0, tmp_path)
    claim_of(tmp_path, 20, 1, root)
    alerts.incident(incident(step=20, rank=0), None)  # its root: a reduced gradient (post_grad)
    alerts.close()
    (message,) = lines(out)
    assert (message["rank"], message["tag"], message["delivered_by"], message["ranks"]) == (
        1,
        root,
        0,
        [0, 1],
    )
    assert "incidents began at this step on ranks 0, 1; rank 1's root comes first" in message["summary"]


def test_claims_of_an_earlier_run_in_the_same_root_are_not_this_runs(tmp_path, quick):
    """A restart in the same output root: rank 0's claim of step 20 from the run before must not
    keep rank 1 from delivering its own incident at step 20."""
    out = tmp_path / "lowest.jsonl"
    claim_of(tmp_path, 20, 0, "0:layers.0.weight/rank0/post_grad", age=30.0)
    alerts = alerts_of([{"type": "file", "path": str(out)}], 1, tmp_path)
    alerts.incident(incident(step=20, rank=1), None)
    alerts.close()
    (message,) = lines(out)
    assert (message["rank"], message["ranks"], message["delivered_by"]) == (1, [1], 1)


@pytest.mark.parametrize(
    "sink, words, hidden",
    [
        (
            {"url_env": "$HOOK_URL"},
            "got a value that is not one (not shown: it may be a secret); write 'HOOK_URL'",
            "$",
        ),
        (
            {"url_env": "https://hooks.example/T0/B0/XYZ"},
            "url_env: expected the name of an environment variable",
            "XYZ",
        ),
        (
            {"url": "http://x", "headers_env": {"Authorization": "Bearer abc123"}},
            "headers_env.Authorization",
            "abc123",
        ),
        (
            {"url": "http://x", "headers_env": {"Bad Header:": "HOOK_URL"}},
            "expected header names of letters",
            None,
        ),
        ({"url": "http://x", "secret_env": "HOOK_URL"}, "only the feishu and dingtalk presets sign", None),
    ],
)
def test_bad_secret_settings_are_refused_without_quoting_a_secret(monkeypatch, sink, words, hidden):
    monkeypatch.setenv("HOOK_URL", "http://127.0.0.1:9/hook")
    with pytest.raises(ConfigError) as info:
        load_config({"alert": {"sinks": [{"type": "webhook", **sink}]}})
    assert words in str(info.value)
    if hidden == "$":
        assert "$HOOK_URL" not in str(info.value)
    elif hidden:
        assert hidden not in str(info.value)


def test_a_signing_secret_pasted_where_its_variable_belongs_is_not_quoted_back():
    """A DingTalk secret (SEC and hex digits) is a valid variable name, yet not one anybody
    names a variable: the error says the variable is not set without showing it."""
    secret = "SEC4f2a9be0c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f6a7b8c9d0"
    with pytest.raises(ConfigError, match="is not set") as info:
        load_config(
            {
                "alert": {
                    "sinks": [
                        {"type": "webhook", "url": "http://x", "preset": "dingtalk", "secret_env": secret}
                    ]
                }
            }
        )
    assert "4f2a9b" not in str(info.value)
    with pytest.raises(ConfigError, match="TRAINMON_UNSET_SECRET is not set"):
        load_config(
            {
                "alert": {
                    "sinks": [
                        {
                            "type": "webhook",
                            "url": "http://x",
                            "preset": "feishu",
                            "secret_env": "TRAINMON_UNSET_SECRET",
                        }
                    ]
                }
            }
        )


def test_a_header_value_with_a_line_break_is_refused_at_the_door(monkeypatch):
    monkeypatch.setenv("HOOK_TOKEN", "Bearer abc\nX-Evil: 1")
    with pytest.raises(ConfigError, match="the value of HOOK_TOKEN holds a line break") as info:
        load_config(
            {"alert": {"sinks": [{"type": "webhook", "url": "http://x", "headers_env": {"A": "HOOK_TOKEN"}}]}}
        )
    assert "abc" not in str(info.value)
