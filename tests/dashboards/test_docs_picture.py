"""The README's picture of the trainmon tab is rendered from ``trainmon demo``'s own output by a
real TensorBoard in headless Chromium, and what it shows (steps, the spike, the incident and
anomaly counts) is kept beside it in docs/trainmon-tab.json. That file is compared with a fresh
default demo run on every test run, with or without a browser, so the picture cannot silently
fall behind the demo; ``TRAINMON_UPDATE_DOCS=1`` renders both anew.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dashboards.browser import browser, missing_browser, tensorboard
from tests.dashboards.conftest import anomaly_records, incident_documents, rank_dir, read_csv_rows

DOCS = Path(__file__).resolve().parents[2] / "docs"
PICTURE, FACTS = DOCS / "trainmon-tab.png", DOCS / "trainmon-tab.json"
UPDATE = bool(os.environ.get("TRAINMON_UPDATE_DOCS"))
REGENERATE = "TRAINMON_UPDATE_DOCS=1 pytest tests/dashboards/test_docs_picture.py"
READY = "const a = document.querySelector('.tm-app'); return a && a.dataset.ready === '1';"


@pytest.fixture(scope="module")
def default_demo(tmp_path_factory) -> Path:
    """The output root of ``trainmon demo`` with its defaults (as the README runs it)."""
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("picture_logdir") / "monitor_output"
    args = [sys.executable, "-m", "monitor.cli", "demo", "--output", str(root)]
    done = subprocess.run(args, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    return root


def demo_facts(root: Path) -> dict:
    """What the picture shows, read from the demo's files."""
    steps = sorted({row["step"] for row in read_csv_rows(rank_dir(root), "grad_unreduced")})
    incidents = [i for document in incident_documents(root).values() for i in document["incidents"]]
    return {
        "steps": [steps[0], steps[-1]],
        "incidents": len(incidents),
        "first_incident_step": min(i["onset_step"] for i in incidents),
        "anomaly_records": len(anomaly_records(root)),
    }


def test_the_pictures_facts_are_those_of_the_default_demo(default_demo):
    facts = demo_facts(default_demo)
    if UPDATE:
        pytest.skip("TRAINMON_UPDATE_DOCS: the browser test writes the picture and its facts")
    assert json.loads(FACTS.read_text()) == facts, f"docs/trainmon-tab.png is stale: run {REGENERATE}"


def test_the_picture_is_the_tab_on_the_default_demo(default_demo, tmp_path):
    reason = missing_browser()
    if reason:
        pytest.skip(reason)
    facts = demo_facts(default_demo)
    first, last = facts["steps"]
    with (
        tensorboard(str(default_demo.parent), str(tmp_path / "tensorboard.log")) as base,
        browser(str(tmp_path)) as session,
    ):
        session.open(f"{base}/#trainmon")
        session.enter_frame("iframe")
        session.wait_for(READY, 60, "the trainmon tab")
        text = session.script("return document.body.textContent;")
        assert f"steps {first}–{last}" in text
        assert f"Incidents (earliest first): 1 of {facts['incidents']}" in text
        assert f"#1 step {facts['first_incident_step']}" in text
        session.leave_frames()
        session.screenshot(str(tmp_path / "trainmon-tab.png"))
    if UPDATE:
        shutil.copyfile(tmp_path / "trainmon-tab.png", PICTURE)
        FACTS.write_text(json.dumps(facts, indent=1) + "\n")
    assert PICTURE.stat().st_size > 10_000
