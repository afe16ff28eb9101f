"""Alert sinks, claims and limits, framework-free, against a real local HTTP server and real programs.

Incidents are built as the tracker builds them; what a sink received is read back from the
server's request log, the file, or the program's output, never from the dispatcher itself.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading

import pytest

import monitor.alerts.dispatch as dispatch
from monitor import ConfigError, load_config
from monitor.alerts.config import parse_sinks
from monitor.alerts.dispatch import Alerts
from tests.monitor.alert_endpoints import TOKEN, Server, alerts_of, incident, lines, wait_for


@pytest.mark.parametrize(
    "preset, text_at",
    [
        ("json", None),
        ("slack", ("text",)),
        ("feishu", ("content", "text")),
        ("dingtalk", ("text", "content")),
    ],
)
def test_webhook_posts_each_preset_with_headers_from_the_environment(
    tmp_path, monkeypatch, caplog, quick, preset, text_at
):
    server = Server()
    monkeypatch.setenv("HOOK_URL", server.url)
    monkeypatch.setenv("HOOK_TOKEN", TOKEN)
    spec = {
        "type": "webhook",
        "url_env": "HOOK_URL",
        "preset": preset,
        "headers_env": {"X-Token": "HOOK_TOKEN"},
    }
    caplog.set_level(logging.DEBUG, logger="trainmon")
    alerts = alerts_of([{**spec, "ranks": "all"}], 3, tmp_path)
    alerts.incident(incident(rank=3), "/out/rank3")
    alerts.close()
    server.close()
    ((headers, body),) = server.requests
    assert headers["X-Token"] == TOKEN and headers["Content-Type"] == "application/json"
    summary = "trainmon: incident 1 at step 7 on rank 3: root 0:layers.1.weight/rank3/post_grad norm = nan"
    if text_at is None:
        assert (body["step"], body["rank"], body["rule"], body["op"]) == (7, 3, "AnomalyNan", "norm")
        assert body["tag"] == "0:layers.1.weight/rank3/post_grad" and body["value"] == "nan"
        assert body["summary"].startswith(summary) and body["output_dir"] == "/out/rank3"
    else:
        text = body
        for key in text_at:
            text = text[key]
        assert text.startswith(summary)
    config = load_config({"alert": {"sinks": [spec]}})
    assert TOKEN not in json.dumps(config.to_dict()) and server.url not in json.dumps(config.to_dict())
    assert TOKEN not in caplog.text


def test_a_failing_endpoint_is_retried_with_back_off_then_reported_once(tmp_path, caplog, quick):
    failing, recovering = Server(statuses=(500,)), Server(statuses=(503, 500, 200))
    common = {"type": "webhook", "ranks": "all", "retries": 2, "backoff_s": 0.01}
    alerts = alerts_of([{**common, "url": failing.url}, {**common, "url": recovering.url}], 0, tmp_path)
    alerts.incident(incident(step=3), None)
    alerts.incident(incident(step=9, number=2), None)
    alerts.close()
    failing.close()
    recovering.close()
    assert [body["step"] for _, body in failing.requests] == [3, 3, 3, 9, 9, 9]  # 1 + 2 retries each
    assert [body["step"] for _, body in recovering.requests] == [3, 3, 3, 9]
    warnings = [r for r in caplog.records if "alert.sinks[0]" in r.getMessage()]
    assert len(warnings) == 1 and "(HTTP 500)" in warnings[0].getMessage()
    assert not [r for r in caplog.records if "alert.sinks[1]" in r.getMessage()]


def test_each_retry_waits_twice_as_long_as_the_one_before(tmp_path, quick):
    """The back-off doubles: ``backoff_s`` before the first retry, twice that before the second
    (lower bounds only: a loaded machine may wait longer, never shorter)."""
    server = Server(statuses=(500, 500, 200))
    alerts = alerts_of(
        [{"type": "webhook", "ranks": "all", "retries": 2, "backoff_s": 0.3, "url": server.url}], 0, tmp_path
    )
    alerts.incident(incident(), None)
    assert wait_for(lambda: len(server.requests) == 3)
    alerts.close()
    server.close()
    first, second = (later - earlier for earlier, later in zip(server.arrivals, server.arrivals[1:]))
    assert first >= 0.3 and second >= 0.6


def test_a_token_in_the_url_never_reaches_the_log(tmp_path, monkeypatch, caplog, quick):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]  # nothing listens there once closed
    monkeypatch.setenv("HOOK_URL", f"http://127.0.0.1:{port}/hook/{TOKEN}?access_token={TOKEN}")
    alerts = alerts_of(
        [{"type": "webhook", "url_env": "HOOK_URL", "ranks": "all", "retries": 0}], 0, tmp_path
    )
    alerts.incident(incident(), None)
    alerts.close()
    assert "cannot reach the endpoint" in caplog.text and TOKEN not in caplog.text


def test_a_hanging_endpoint_holds_up_only_itself(tmp_path, quick):
    hanging = Server(hang=True)
    out = tmp_path / "incidents.jsonl"
    sinks = [
        {"type": "webhook", "url": hanging.url, "ranks": "all", "retries": 0, "timeout_s": 60},
        {"type": "file", "path": str(out), "ranks": "all", "max_per_hour": 1000},
    ]
    alerts = alerts_of(sinks, 0, tmp_path)
    alerts.incident(incident(step=4), None)
    assert hanging.inside.wait(10)  # the webhook is stuck inside its request ...
    steps = list(range(5, 5 + dispatch.QUEUE_SIZE + 3))
    for step in steps:  # ... its queue fills up and drops, while the file sink keeps up
        alerts.incident(incident(step=step, number=step), None)
        assert wait_for(lambda count=step - 3: len(lines(out)) == count)
    webhook = alerts.channels[0]
    alerts.close()  # returns although the request still hangs
    assert webhook.suppressed == len(steps) - dispatch.QUEUE_SIZE
    assert [m["step"] for m in lines(out)] == [4, *steps]
    hanging.close()


def test_sinks_replaced_while_training_runs_drain_without_holding_up_the_caller(tmp_path, monkeypatch, quick):
    """The alert config changed in a live run (dynamic mode): the old sinks are closed without
    waiting (``block=False``) and deliver what they hold on their own threads, up to the close
    deadline, while a hanging endpoint would have held the training thread for all of it: the
    deadline is beyond pytest's timeout, so a close that waited would fail the test."""
    monkeypatch.setattr(dispatch, "CLOSE_WAIT_S", 3600.0)
    hanging = Server(hang=True)
    out = tmp_path / "incidents.jsonl"
    alerts = alerts_of(
        [
            {"type": "webhook", "url": hanging.url, "ranks": "all", "retries": 0, "timeout_s": 60},
            {"type": "file", "path": str(out), "ranks": "all", "max_per_hour": 1000},
        ],
        0,
        tmp_path,
    )
    alerts.incident(incident(step=4), None)
    assert hanging.inside.wait(10)
    webhook_thread = alerts.channels[0]._thread
    alerts.close(block=False)
    assert webhook_thread.is_alive()  # still inside its request, on its own thread
    assert wait_for(lambda: [m["step"] for m in lines(out)] == [4])
    hanging.close()  # the request ends; the thread finds its queue closed and ends


def test_a_slow_endpoint_is_waited_for_up_to_the_sinks_timeout(tmp_path, caplog, quick):
    """An endpoint that answers after 2 s: a sink with a 5 s timeout delivers; one with a
    0.1 s timeout gives up on each try, retries once, says so once, and never delivers."""
    slow = Server(delay=2.0)
    sinks = [
        {"type": "webhook", "url": slow.url, "ranks": "all", "timeout_s": 5},
        {
            "type": "webhook",
            "url": slow.url,
            "ranks": "all",
            "timeout_s": 0.1,
            "retries": 1,
            "backoff_s": 0.01,
        },
    ]
    alerts = alerts_of(sinks, 0, tmp_path)
    patient, impatient = alerts.channels
    alerts.incident(incident(step=3), None)
    assert patient.delivered == 0  # handed over, not sent on the caller's thread (which would wait 2 s)
    assert wait_for(lambda: patient.delivered == 1 and impatient.failed == 1)
    alerts.close()
    # one for the patient sink, two tries of the impatient one (which may give up on a try before
    # a loaded machine lets the server read it: the server's count can lag the sink's)
    assert wait_for(lambda: len(slow.requests) == 3, 5), slow.requests
    warnings = [r.getMessage() for r in caplog.records if "alert.sinks[1]" in r.getMessage()]
    assert len(warnings) == 1 and "no complete answer within timeout_s (0.1 s)" in warnings[0], warnings
    assert not [r for r in caplog.records if "alert.sinks[0]" in r.getMessage()]
    slow.close()


def test_an_endpoint_that_trickles_its_answer_is_cut_off_at_the_sinks_timeout(tmp_path, caplog, quick):
    """A socket timeout bounds each read only: an endpoint that sends a byte every 0.2 s would
    hold the sink for ever. The whole request ends at ``timeout_s``, and the failure is said once."""
    release = threading.Event()

    def trickle(connection: socket.socket) -> None:
        with connection:
            connection.recv(65536)
            for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"x" * 200:
                if release.wait(0.2):
                    return
                connection.sendall(bytes([byte]))

    listener = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/hook"
    threading.Thread(target=lambda: trickle(listener.accept()[0]), daemon=True).start()
    alerts = alerts_of(
        [{"type": "webhook", "url": url, "ranks": "all", "timeout_s": 1, "retries": 0}], 0, tmp_path
    )
    (channel,) = alerts.channels
    alerts.incident(incident(step=3), None)
    assert wait_for(lambda: channel.failed == 1, 10)  # the trickle alone would last 40 s
    warnings = [r.getMessage() for r in caplog.records if "alert.sinks[0]" in r.getMessage()]
    assert len(warnings) == 1 and "no complete answer within timeout_s (1 s)" in warnings[0], warnings
    alerts.close()
    release.set()
    listener.close()


def test_cool_down_and_hourly_limit_drop_and_count(tmp_path, caplog, quick):
    limited, cooled = tmp_path / "limited.jsonl", tmp_path / "cooled.jsonl"
    sinks = [
        {"type": "file", "path": str(limited), "ranks": "all", "max_per_hour": 2},
        {"type": "file", "path": str(cooled), "ranks": "all", "cooldown_s": 3600},
    ]
    alerts = alerts_of(sinks, 0, tmp_path)
    for step in range(5):
        alerts.incident(incident(step=step, number=step + 1), None)
    channels = list(alerts.channels)
    alerts.close()
    assert [m["step"] for m in lines(limited)] == [0, 1] and channels[0].suppressed == 3
    assert [m["step"] for m in lines(cooled)] == [0] and channels[1].suppressed == 4
    assert [m["suppressed"] for m in lines(limited)] == [0, 0]
    said = [r.getMessage() for r in caplog.records if "holds back a message" in r.getMessage()]
    assert len(said) == 2 and "max_per_hour (2)" in said[0] + said[1] and "cooldown_s" in said[0] + said[1]
    at_close = [r.getMessage() for r in caplog.records if "held back by its limits" in r.getMessage()]
    assert sorted(m.split(": ")[2].split()[0] for m in at_close) == ["3", "4"], at_close


def test_command_gets_the_message_on_stdin_and_a_failing_one_is_reported(tmp_path, caplog, quick):
    got = tmp_path / "got.json"
    program = f"import sys; open({str(got)!r}, 'w').write(sys.stdin.read())"
    sinks = [
        {"type": "command", "argv": [sys.executable, "-c", program], "ranks": "all"},
        {
            "type": "command",
            "argv": [sys.executable, "-c", "import sys; sys.exit(3)"],
            "ranks": "all",
            "retries": 0,
        },
        {
            "type": "command",
            "argv": [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"],
            "ranks": "all",
            "retries": 0,
        },
    ]
    alerts = alerts_of(sinks, 2, tmp_path)
    alerts.incident(incident(step=11, rank=2), None)
    alerts.close()
    message = json.loads(got.read_text())
    assert (message["step"], message["rank"], message["tag"]) == (11, 2, "0:layers.1.weight/rank2/post_grad")
    assert "alert.sinks[1] (command python" in caplog.text and "exit status 3" in caplog.text
    assert "alert.sinks[2] (command python" in caplog.text and "ended by signal SIGTERM" in caplog.text


def test_lowest_rank_that_saw_the_step_delivers_and_rank0_means_rank_0(tmp_path, quick):
    out, only0 = tmp_path / "lowest.jsonl", tmp_path / "rank0.jsonl"
    sinks = [{"type": "file", "path": str(out)}, {"type": "file", "path": str(only0), "ranks": "rank0"}]
    ranks = {rank: alerts_of(sinks, rank, tmp_path) for rank in (1, 2, 3)}
    for rank in (3, 2):  # ranks 2 and 3 see step 10; rank 1 alone sees step 12
        ranks[rank].incident(incident(step=10, rank=rank), None)
    ranks[1].incident(incident(step=12, rank=1), None)
    for alerts in ranks.values():
        alerts.close()
    assert sorted((m["step"], m["rank"]) for m in lines(out)) == [(10, 2), (12, 1)]
    assert lines(only0) == []  # rank 0 saw nothing
    assert sorted(p.name for p in (tmp_path / "anomaly_detected" / "alerts" / "step10").iterdir()) == [
        "rank2",
        "rank3",
    ]


def test_a_callback_that_raises_is_reported_once_and_others_still_run(tmp_path, caplog, quick):
    seen = []

    def broken(message):
        raise RuntimeError("user bug")

    alerts = Alerts((), ("stop",), 0, str(tmp_path))
    alerts.add_callback(broken)
    alerts.add_callback(lambda message: seen.append(message["step"]))
    alerts.incident(incident(step=5), None)
    alerts.incident(incident(step=6, number=2), None)
    alerts.close()
    assert seen == [5, 6]
    assert caplog.text.count("user bug") == 1
    assert alerts.action_requested.is_set() and "incident 1 at step 5" in alerts.action_reason


@pytest.mark.parametrize(
    "alert, words",
    [
        (
            {"sinks": [{"type": "webhok", "url": "http://x"}]},
            "alert.sinks[0].type: expected one of webhook, ",
        ),
        ({"sinks": [{"type": "webhok", "url": "http://x"}]}, "did you mean 'webhook'?"),
        ({"sinks": [{"type": "webhook"}]}, "alert.sinks[0]: expected exactly one of 'url' and 'url_env'"),
        ({"sinks": [{"type": "webhook", "url": "ftp://x/y"}]}, "alert.sinks[0].url: expected an http:// or"),
        ({"sinks": [{"type": "webhook", "url": "http://x/a b"}]}, "a bad port, got http://x/... (the rest"),
        (
            {"sinks": [{"type": "webhook", "url": "http://user:s3cr3t@x/hook/t0ken"}]},
            "got http://x/... (the rest not shown: it may hold a token): it holds a user name or password",
        ),
        (
            {"sinks": [{"type": "webhook", "url": "hooks.example/services/s3cr3t"}]},
            "got a URL not shown (it may hold a token): it does not begin with http:// or https://",
        ),
        (
            {"sinks": [{"type": "webhook", "url_env": "TRAINMON_UNSET_VARIABLE"}]},
            "TRAINMON_UNSET_VARIABLE is not set",
        ),
        ({"sinks": [{"type": "webhook", "url": "http://x", "preset": "slak"}]}, "did you mean 'slack'?"),
        (
            {"sinks": [{"type": "file", "path": "a", "ranks": "first"}]},
            "alert.sinks[0].ranks: expected one of",
        ),
        (
            {"sinks": [{"type": "file", "path": "a", "retries": -1}]},
            "alert.sinks[0].retries: expected an integer",
        ),
        (
            {"sinks": [{"type": "command", "argv": "notify-send"}]},
            "alert.sinks[0].argv: expected a list of strings",
        ),
        (
            {"sinks": [{"type": "command", "argv": ["/no/such/pager", "-x"]}]},
            "alert.sinks[0].argv[0]: '/no/such/pager' is not a program found here",
        ),
        ({"sinks": [{"type": "file"}]}, "alert.sinks[0].path: expected the path of a file, got None"),
        (
            {"sinks": [{"type": "file", "path": "logs/../../escaped.jsonl"}]},
            "alert.sinks[0].path: 'logs/../../escaped.jsonl' leaves the output root",
        ),
        ({"sinks": [{"type": "file", "path": "logs/"}]}, "expected the path of a file, got 'logs/'"),
        (
            {"sinks": [{"type": "webhook", "url": "http://127.0.0.1:99999/hook"}]},
            "or a bad port, got http://127",
        ),
        ({"sinks": [{"type": "file", "path": "/tmp"}]}, "alert.sinks[0].path: '/tmp' is a directory"),
        ({"sinks": [{"type": "webhook", "url": "http://[::1/x"}]}, "alert.sinks[0].url: expected an http"),
        ({"sinks": [{"type": "webhook", "url": "http://u:pw@host/x"}]}, "without spaces, credentials"),
        ({"sinks": {"type": "file"}}, "alert.sinks: expected a list of sinks"),
        (
            {"sinks": [{"type": "file", "path": "a", "backoff_s": 1e12}]},
            "backoff_s: expected a number <= 3600",
        ),
        (
            {"actions": ["stpo"]},
            "alert.actions[0]: expected one of stop, checkpoint, skip_step, got 'stpo'; did you mean 'stop'?",
        ),
    ],
)
def test_bad_alert_config_is_refused_at_the_door(alert, words):
    with pytest.raises(ConfigError) as info:
        load_config({"alert": alert})
    assert words in str(info.value)
    assert "s3cr3t" not in str(info.value) and "t0ken" not in str(info.value)


def test_a_file_sink_at_a_directory_under_the_output_root_is_refused_at_the_door(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    (tmp_path / "logs").mkdir()
    with pytest.raises(ConfigError, match=r"alert\.sinks\[0\]\.path: 'logs' is a directory"):
        load_config({"alert": {"sinks": [{"type": "file", "path": "logs"}]}})
    load_config({"alert": {"sinks": [{"type": "file", "path": "logs/incidents.jsonl"}]}})


def test_a_file_sink_that_cannot_be_written_is_refused_at_the_door(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))
    (tmp_path / "notes").write_text("a file where a directory was meant")
    sink = {"type": "file", "path": "notes/alerts/incidents.jsonl"}
    with pytest.raises(ConfigError, match=r"sinks\[0\]\.path: 'notes/alerts/incidents.jsonl' cannot be"):
        load_config({"alert": {"sinks": [sink]}})
    assert not (tmp_path / "notes" / "alerts").exists()
    monkeypatch.setenv("RANK", "1")
    load_config({"alert": {"sinks": [{**sink, "ranks": "rank0"}]}})  # rank 0 delivers it, not this one
    monkeypatch.delenv("RANK")
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    if os.access(read_only, os.W_OK):  # a superuser (these machines' tests) writes anywhere: the
        # kernel's answer for another user stands in, for that directory alone
        real_access = os.access
        monkeypatch.setattr(
            os, "access", lambda path, mode: False if str(path) == str(read_only) else real_access(path, mode)
        )
    with pytest.raises(ConfigError, match=r"the directory .*read-only' is not writable"):
        load_config({"alert": {"sinks": [{"type": "file", "path": "read-only/incidents.jsonl"}]}})


@pytest.mark.parametrize(
    ("ranks", "launched", "refused"),
    [("rank0", "1", False), ("rank0", "0", True), ("lowest", "1", True), ("all", "3", True)],
)
def test_a_missing_program_is_refused_where_this_rank_may_deliver(monkeypatch, ranks, launched, refused):
    """A rank0 sink's program is needed on rank 0 alone (a pager on the head node): another
    rank, as torchrun numbers it, starts; a sink that any rank may deliver is checked on each."""
    monkeypatch.setenv("RANK", launched)
    sink = {"type": "command", "argv": ["/no/such/pager"], "ranks": ranks}
    if refused:
        with pytest.raises(ConfigError, match="'/no/such/pager' is not a program found here"):
            parse_sinks([sink])
    else:
        (spec,) = parse_sinks([sink])
        assert spec.argv == ("/no/such/pager",)


def test_stop_needs_every_rank():
    with pytest.raises(ConfigError, match="module_ranks empty with actions"):
        load_config({"alert": {"actions": ["stop"]}, "module_ranks": [0]})


def test_config_round_trips_and_unknown_sink_and_bundle_keys_are_errors():
    """Sinks and bundles are trainmon's own: a misspelt key there is an error at the door (an
    alert that silently goes nowhere is what alerts exist to prevent)."""
    raw = {"sinks": [{"type": "file", "path": "x.jsonl", "cooldown_s": 5}], "actions": ["stop"]}
    config = load_config({"alert": raw})
    assert load_config(config.to_dict()) == config
    with pytest.raises(
        ConfigError, match=r"alert\.sinks\[0\]\.retry: unknown key for a file sink; .*'retries'"
    ):
        load_config({"alert": {"sinks": [{"type": "file", "path": "x.jsonl", "retry": 3}]}})
    with pytest.raises(
        ConfigError, match=r"alert\.bundle\.incident: unknown key; .*did you mean 'incidents'"
    ):
        load_config({"alert": {"bundle": {"incident": 2}}})


def test_a_file_sink_makes_its_missing_directories_and_a_webhook_whose_variable_went_names_it(tmp_path):
    """A file sink's sub-directories are made at its first delivery; a webhook whose URL variable
    was unset after the config was loaded fails naming the variable (urllib's message would quote
    the URL, which may hold a token)."""
    from monitor.alerts.sinks import FileSink, WebhookSink

    (spec,) = load_config({"alert": {"sinks": [{"type": "file", "path": "sub/dir/x.jsonl"}]}}).alert.sinks
    FileSink(spec, str(tmp_path)).deliver({"step": 3})
    assert json.loads((tmp_path / "sub" / "dir" / "x.jsonl").read_text()) == {"step": 3}
    environment = {"TRAINMON_TEST_HOOK": "http://127.0.0.1:8080/secret-token"}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in environment.items():
            patch.setenv(name, value)
        (hook,) = load_config(
            {"alert": {"sinks": [{"type": "webhook", "url_env": "TRAINMON_TEST_HOOK"}]}}
        ).alert.sinks
        patch.delenv("TRAINMON_TEST_HOOK")  # unset after the config was loaded
        with pytest.raises(OSError) as info:
            WebhookSink(hook).deliver({"step": 3})
    assert "TRAINMON_TEST_HOOK" in str(info.value) and "secret" not in str(info.value)


def test_a_single_process_delivers_at_once_and_what_close_leaves_undelivered_is_said(tmp_path, caplog, quick):
    """One process has no other rank to wait 3 s for; a sink still retrying when the run ends
    (a command that fails, with a long back-off) says how many messages it never delivered."""
    monkeypatch_wait = dispatch.CLAIM_WAIT_S
    dispatch.CLAIM_WAIT_S = 30.0  # a wait would show: the delivery below must not take it
    try:
        alert = load_config({"alert": {"sinks": [{"type": "file", "path": "alone.jsonl"}]}}).alert
        alone = Alerts(alert.sinks, (), 0, str(tmp_path), world_size=1)
        alone.incident(incident(step=4), None)
        assert wait_for(lambda: (tmp_path / "alone.jsonl").exists(), 5.0)
        alone.close()
    finally:
        dispatch.CLAIM_WAIT_S = monkeypatch_wait
    assert not (tmp_path / "anomaly_detected" / "alerts").exists()  # no claims in one process
    failing = [sys.executable, "-c", "import sys; sys.exit(1)"]
    sink = {"type": "command", "argv": failing, "ranks": "all", "retries": 3, "backoff_s": 30}
    alerts = alerts_of([sink], 0, tmp_path)
    alerts.incident(incident(step=5), None)
    assert wait_for(lambda: alerts.channels[0].queue.empty(), 5.0)  # its first attempt is under way
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        alerts.close()  # the 30 s back-off would outlast the run: the failure is said at once
    assert "failed after 1 attempt(s) (exit status 1)" in caplog.text
    slow = [sys.executable, "-c", "import time; time.sleep(4)"]
    alerts = alerts_of([{"type": "command", "argv": slow, "ranks": "all", "timeout_s": 30}], 0, tmp_path)
    for step in (6, 7):
        alerts.incident(incident(step=step), None)
    with caplog.at_level(logging.WARNING, logger="trainmon"):
        alerts.close()  # one delivery under way past the 2 s, one still queued
    assert "2 alert message(s) not delivered in the 2 s left to it at the run's end" in caplog.text


def test_a_200_whose_body_is_cut_off_at_the_timeout_is_no_delivery(quick):
    """The status and headers come at once, the body a byte every 0.2 s: the answer is not
    complete within ``timeout_s``, so the message is not taken as delivered (it is retried)."""
    from monitor.alerts.sinks import WebhookSink

    release = threading.Event()

    def trickle(connection: socket.socket) -> None:
        with connection:
            connection.recv(65536)
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
            for _ in range(100):
                if release.wait(0.2):
                    return
                connection.sendall(b"x")

    listener = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/hook"
    threading.Thread(target=lambda: trickle(listener.accept()[0]), daemon=True).start()
    (spec,) = load_config({"alert": {"sinks": [{"type": "webhook", "url": url, "timeout_s": 1}]}}).alert.sinks
    try:
        with pytest.raises(OSError, match=r"no complete answer within timeout_s \(1 s\)"):
            WebhookSink(spec).deliver({"step": 3})
    finally:
        release.set()
        listener.close()
