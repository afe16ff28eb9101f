"""The worked example of docs/alerts.md, run as written: its receiver, its config, the demo.

The receiver and the config are taken from the page itself (only the port is changed to a free
one), so the page cannot drift from what works.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "alerts.md"


def page_block(marker: str) -> str:
    """The fenced block that follows ``<!-- example:{marker} -->`` in docs/alerts.md."""
    match = re.search(rf"<!-- example:{marker} -->\n```\w+\n(.*?)```", PAGE.read_text(), re.S)
    assert match, f"docs/alerts.md has no example:{marker} block"
    return match.group(1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_demo_sends_its_incident_to_the_documented_receiver(tmp_path):
    port = str(free_port())
    receiver, config = page_block("receiver"), page_block("config")
    assert "8765" in receiver and "8765" in config
    (tmp_path / "receiver.py").write_text(receiver.replace("8765", port))
    (tmp_path / "alerts.yaml").write_text(config.replace("8765", port))
    listening = subprocess.Popen(
        [sys.executable, "receiver.py"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 30
        while socket.socket().connect_ex(("127.0.0.1", int(port))) != 0:
            assert time.monotonic() < deadline and listening.poll() is None, "the receiver did not start"
            time.sleep(0.1)
        demo = subprocess.run(
            [sys.executable, "-m", "monitor.cli", "demo", "--config", "alerts.yaml", "--output", "out"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "NO_COLOR": "1"},
        )
        assert demo.returncode == 0, demo.stderr[-3000:]
    finally:
        listening.terminate()
        printed = listening.communicate(timeout=30)[0].decode()
    assert "trainmon: incident 1 at step 30 on rank 0: root 0:" in printed
    (line,) = (tmp_path / "out" / "incidents.jsonl").read_text().splitlines()
    message = json.loads(line)
    assert (message["step"], message["rank"], message["incident"]) == (30, 0, 1)
    assert message["summary"] in printed
