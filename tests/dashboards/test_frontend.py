"""The trainmon tab in a real TensorBoard server, and in real headless Chromium.

TensorBoard finds the plugin through the ``tensorboard_plugins`` entry point of the installed
package (``pip install -e .`` registers it). The browser tests need the Debian packages chromium
and chromium-driver and are skipped, saying so, where they are missing. Screenshots go to
``test-artifacts/dashboards/`` (or $TRAINMON_TEST_ARTIFACTS).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import time
import urllib.parse
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from tests.dashboards.browser import browser, http_get, missing_browser, tensorboard
from tests.dashboards.conftest import (
    DEMO_SPIKE,
    DEMO_STEPS,
    INCIDENT_RUN,
    NAMES,
    anomaly_records,
    incident_documents,
    rank_dir,
    read_csv_rows,
    write_run,
)

INCIDENT_RUN_TAGS = {
    "0:layers.0.fc1.weight/rank0/acc_grad",
    "0:layers.0.fc1.weight/rank0/post_grad",
    "0:layers.0.fc1.weight/rank1/post_grad",
}
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboards"
READY = "const a = document.querySelector('.tm-app'); return a && a.dataset.ready === '1';"


def artifacts() -> Path:
    path = Path(os.environ.get("TRAINMON_TEST_ARTIFACTS") or ARTIFACTS)
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def server(demo_runs, tmp_path_factory):
    """TensorBoard on a logdir with copies of both demo runs and small generated runs: "live" (no
    anomalies, grows during the tests) and "incidents" (INCIDENT_RUN, two incidents)."""
    names = [e.name for e in entry_points(group="tensorboard_plugins")]
    assert "trainmon" in names, "the trainmon entry point is not installed: run `pip install -e .` again"
    logdir = tmp_path_factory.mktemp("tb_logdir")
    for root in demo_runs.values():
        shutil.copytree(root, logdir / root.name)
    write_run(logdir / "live", fmt="tensorboard", steps=range(4))
    write_run(logdir / "incidents", **INCIDENT_RUN)
    for stamp in ("Jan02_03-04-05", "Jan02_03-05-05"):  # the second run's anomaly files replace the first's
        write_run(logdir / "replaced", anomalies=[(0, "grad_reduced", 3, 1, "norm")], stamp=stamp)
    with tensorboard(str(logdir), str(logdir.parent / "tensorboard.log")) as base:
        yield base, logdir


def _json(base: str, path: str):
    status, body = http_get(base + path)
    assert status == 200, body[:300]
    return json.loads(body)


def test_tensorboard_lists_the_trainmon_tab(server):
    base, _ = server
    listing = _json(base, "/data/plugins_listing")["trainmon"]
    assert listing["enabled"] and listing["tab_name"] == "trainmon"
    assert listing["loading_mechanism"] == {"type": "IFRAME", "module_path": "/data/plugin/trainmon/index.js"}


def test_custom_scalars_tab_gets_the_layout_and_every_layer(server):
    base, logdir = server
    layout = _json(base, "/data/plugin/custom_scalars/layout")
    charts = {c["title"]: [ch["multiline"]["tag"][0] for ch in c["chart"]] for c in layout["category"]}
    # written by the monitor itself (format tensorboard), one category per data type and op of the demo
    prefixes = ("grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq", "param_origin")
    assert {f"{prefix} norm" for prefix in prefixes} <= set(charts)
    assert [c.get("closed", False) for c in layout["category"]][:2] == [False, True]
    run = f"demo_tensorboard/{rank_dir(logdir / 'demo_tensorboard').name}"
    names = {row["name"] for row in read_csv_rows(rank_dir(logdir / "demo_csv"), "grad_reduced")}
    drawn: list[str] = []
    for regex in charts["grad_reduced norm"]:  # one chart per layer group
        query = urllib.parse.urlencode({"run": run, "tag": regex})
        answer = _json(base, f"/data/plugin/custom_scalars/scalars?{query}")
        assert answer["regex_valid"]
        assert all(len(points) == DEMO_STEPS for points in answer["tag_to_events"].values())
        drawn += answer["tag_to_events"]
    assert 1 < len(charts["grad_reduced norm"]) < len(names)
    assert sorted(drawn) == sorted(f"0:{name}/rank0/post_grad_norm" for name in names)  # each once


def test_a_series_names_the_tensorboard_scalars_of_its_row_and_no_others(server):
    base, logdir = server
    runs = {r["name"]: r for r in _json(base, "/data/plugin/trainmon/runs")["runs"]}
    run = f"demo_tensorboard/{rank_dir(logdir / 'demo_tensorboard').name}"
    tags = set(_json(base, "/data/plugin/scalars/tags")[run])
    names = sorted({row["name"] for row in read_csv_rows(rank_dir(logdir / "demo_csv"), "grad_reduced")})
    for name in names[:3]:
        query = {"run": runs["demo_tensorboard"]["id"], "prefix": "grad_reduced", "op": "norm", "name": name}
        series = _json(base, f"/data/plugin/trainmon/series?{urllib.parse.urlencode(query)}")
        pattern = re.compile(series["scalar_tag_pattern"])
        assert {tag for tag in tags if pattern.search(tag)} == {f"0:{name}/rank0/post_grad_norm"}


@pytest.mark.parametrize(
    "path",
    [
        "/data/plugin/trainmon/../../../../../../etc/passwd",
        "/data/plugin/trainmon/%2e%2e/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
        "/data/plugin/trainmon/..%2f..%2f..%2f..%2fetc%2fpasswd",
        "/data/plugin/trainmon/index.js/../../../../etc/passwd",
        "/data/plugin/trainmon/heatmap?run=..%2F..%2F..%2Fetc&prefix=passwd&op=norm",
    ],
)
def test_raw_path_traversal_is_refused_by_the_server(server, path):
    base, _ = server
    host, port = urllib.parse.urlparse(base).netloc.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.putrequest("GET", path, skip_accept_encoding=True)  # sent as is, not normalised
    connection.endheaders()
    response = connection.getresponse()
    body = response.read()
    connection.close()
    assert response.status in (400, 404) and b"root:" not in body


@pytest.fixture(scope="module")
def page(server):
    reason = missing_browser()
    if reason:
        pytest.skip(reason)
    base, logdir = server
    with browser(str(logdir.parent)) as session:
        session.open(f"{base}/#trainmon")
        session.enter_frame("iframe")
        session.wait_for(READY, 60, "the trainmon tab")
        yield session, base, logdir


def _state(session) -> dict:
    return session.script(
        """const c = document.querySelector('.tm-canvas');
        const active = document.querySelector('.tm-active');
        const shown = (css) => [...document.querySelectorAll(css)].filter((n) => n.offsetParent !== null);
        const chart = document.querySelector('.tm-chart');
        return {rows: +c.dataset.rows, cols: +c.dataset.cols, cells: +c.dataset.anomalyCells,
          selected: c.dataset.selected || '', title: document.querySelector('.tm-heat-title').textContent,
          items: [...document.querySelectorAll('.tm-anomaly')].map((li) => li.textContent),
          incidents: shown('.tm-incident').map((li) => li.textContent),
          records: shown('.tm-record').map((li) => li.textContent),
          anomalies_shown: shown('.tm-anomaly').length,
          side: document.querySelector('.tm-side-title').textContent,
          controls: [...document.querySelectorAll('.tm-controls select')].map((s) => s.value),
          active: active ? active.dataset.key : null, run: document.querySelector('select').value,
          chart: chart.hidden ? null : {ranks: +document.querySelector('.tm-chart-canvas').dataset.ranks,
            points: +document.querySelector('.tm-chart-canvas').dataset.points,
            title: document.querySelector('.tm-chart-title').textContent}};"""
    )


def _choose_run(session, run_id: str) -> None:
    """Pick a run in the tab's run list, as a user does."""
    session.script(
        "const s = document.querySelector('select'); s.value = arguments[0];"
        "s.dispatchEvent(new Event('change'));",
        run_id,
    )


def _heatmap_rows(base: str, run_id: str, prefix: str, op: str) -> list[str]:
    from struct import unpack_from

    query = urllib.parse.urlencode({"run": run_id, "prefix": prefix, "op": op, "rank": 0})
    status, body = http_get(f"{base}/data/plugin/trainmon/heatmap?{query}")
    assert status == 200
    (length,) = unpack_from("<I", body)
    return json.loads(body[4 : 4 + length])["rows"]


def test_tab_opens_on_the_first_incident_with_heatmap_and_list(page):
    session, base, logdir = page
    records = anomaly_records(logdir / "demo_csv")
    (document,) = incident_documents(logdir / "demo_csv").values()
    (incident,) = document["incidents"]  # the demo's one incident, at its spike
    root = incident["root"]
    state = _state(session)
    runs = {r["name"]: r for r in _json(base, "/data/plugin/trainmon/runs")["runs"]}
    assert state["run"] == runs["demo_csv"]["id"]  # the first run with an anomaly
    names = {row["name"] for row in read_csv_rows(rank_dir(logdir / "demo_csv"), "grad_unreduced")}
    assert state["rows"] == len(names) and state["cols"] == DEMO_STEPS
    assert state["cells"] > 0 and state["active"] == "i1:root"
    assert state["side"] == "Incidents (earliest first): 1 of 1"
    (entry,) = state["incidents"]
    last = incident["last_abnormal_step"]  # the file's, read with json
    steps = f"steps {DEMO_SPIKE}-{last}" if last > DEMO_SPIKE else f"step {DEMO_SPIKE}"
    assert f"#1 {steps}" in entry and root["tag_name"] in entry and incident["state"] in entry
    assert all(line in entry for line in incident["evidence"])
    assert state["anomalies_shown"] == 0 and state["records"] == []  # behind the toggle; collapsed
    assert len(state["items"]) == min(500, len(records)) and f"step {DEMO_SPIKE}" in state["items"][0]
    rows = _heatmap_rows(base, state["run"], root["prefix"], root["op"])
    row_name = root["tag_name"].split("/")[0].split(":")[1]
    assert state["selected"] == f"{rows.index(row_name)},{DEMO_SPIKE}"
    assert state["controls"][1:3] == [root["prefix"], root["op"]]
    assert "first first" not in session.script("return document.body.textContent;")
    session.leave_frames()
    session.screenshot(str(artifacts() / "trainmon-tab-csv.png"))
    session.enter_frame("iframe")
    # "one tag, all ranks" opens on the tag the tab landed on, not on the first row
    mode = "const s = document.querySelectorAll('.tm-controls select')[3]; s.value = arguments[0];"
    session.script(mode + "s.dispatchEvent(new Event('change'));", "tag")
    session.wait_for(
        "return document.querySelector('.tm-heat-title').textContent.includes('all ranks');", 20, "tag"
    )
    assert f"{row_name}, all ranks" in _state(session)["title"]
    session.script(mode + "s.dispatchEvent(new Event('change'));", "rank")
    session.wait_for(
        "return document.querySelector('.tm-heat-title').textContent.includes('rank 0');", 20, "rank"
    )


def test_clicking_an_anomaly_and_a_cell(page):
    session, base, _ = page
    run = _state(session)["run"]
    third = _json(base, f"/data/plugin/trainmon/anomalies?run={urllib.parse.quote(run)}&limit=3")["items"][2]
    session.script("document.querySelector('.tm-view-anomalies').click();")
    state = _state(session)
    assert state["side"].startswith("Anomalies (earliest first): ") and state["incidents"] == []
    assert state["anomalies_shown"] == len(state["items"]) > 3
    session.script("document.querySelectorAll('.tm-anomaly')[2].click();")
    rows = _heatmap_rows(base, run, third["prefix"], third["op"])
    wanted = f"{rows.index(third['row'][1])},{third['step']}"
    session.wait_for(
        f"return document.querySelector('.tm-canvas').dataset.selected === '{wanted}';", 20, "jump"
    )
    assert _state(session)["active"] == "a2"
    session.script(
        """const c = document.querySelector('.tm-canvas'), r = c.getBoundingClientRect();
        const at = {clientX: r.right - 5, clientY: r.top + 30, bubbles: true};
        c.dispatchEvent(new MouseEvent('click', at));"""
    )
    session.wait_for("return !document.querySelector('.tm-chart').hidden;", 20, "line chart")
    chart = _state(session)["chart"]
    assert chart["ranks"] == 1 and chart["points"] == DEMO_STEPS and third["prefix"] in chart["title"]
    assert session.script("return document.querySelector('.tm-scalars-link');") is None  # CSV: no scalars
    # a jump to another data type's anomaly takes the open chart along, not left on the old tag
    listed = _json(base, f"/data/plugin/trainmon/anomalies?run={urllib.parse.quote(run)}&limit=1000")
    shown = state["anomalies_shown"]
    other = next(a for a in listed["items"] if a["prefix"] != third["prefix"] and a["index"] < shown)
    session.script(
        "[...document.querySelectorAll('.tm-anomaly')]"
        ".find((li) => li.dataset.index === arguments[0]).click();",
        str(other["index"]),
    )
    title = "document.querySelector('.tm-chart-title').textContent"
    session.wait_for(f"return {title}.includes({json.dumps(other['prefix'])});", 20, "the chart jumped to")
    session.leave_frames()
    session.screenshot(str(artifacts() / "trainmon-tab-chart.png"))
    session.enter_frame("iframe")


def test_other_runs_render_and_new_steps_appear_live(page):
    session, base, logdir = page
    runs = {r["name"]: r for r in _json(base, "/data/plugin/trainmon/runs")["runs"]}
    for name in ("demo_tensorboard", "live"):
        _choose_run(session, runs[name]["id"])
        session.wait_for(  # the heatmap drawn last is this run's, not the previous run's
            f"return document.querySelector('.tm-canvas').dataset.run === {json.dumps(runs[name]['id'])} && "
            "document.querySelector('.tm-heat-title').textContent.includes(' row');",
            30,
            name,
        )
    # the heatmap of the run switched to last (4 steps) replaces the previous one asynchronously
    session.wait_for("return +document.querySelector('.tm-canvas').dataset.cols === 4;", 30, "live run")
    assert _state(session)["cols"] == 4
    # a run without an incidents file has no toggle to show, nor a count left from the run before
    session.wait_for(
        "return document.querySelector('.tm-view-toggle').offsetParent === null;", 20, "no toggle"
    )
    assert session.script("return document.querySelector('.tm-view-incidents').textContent;") == "Incidents"
    session.script(  # a cell looked at stays selected as new steps arrive
        """const c = document.querySelector('.tm-canvas'), r = c.getBoundingClientRect();
        const at = {clientX: r.right - 5, clientY: r.top + 5, bubbles: true};
        c.dispatchEvent(new MouseEvent('click', at));"""
    )
    selected = _state(session)["selected"]
    assert selected.endswith(",3")
    write_run(
        logdir / "live", fmt="tensorboard", steps=range(4, 6), stamp="Jan02_03-04-05"
    )  # the same rank dir
    session.wait_for("return +document.querySelector('.tm-canvas').dataset.cols === 6;", 30, "live update")
    assert _state(session)["selected"] == selected
    session.leave_frames()
    session.screenshot(str(artifacts() / "trainmon-tab-live.png"))
    session.enter_frame("iframe")


def test_incidents_expand_into_records_that_jump_to_their_cell(page):
    session, base, _ = page
    runs = {r["name"]: r for r in _json(base, "/data/plugin/trainmon/runs")["runs"]}
    session.script("document.querySelector('.tm-view-incidents').click();")
    _choose_run(session, runs["incidents"]["id"])
    fc1, head = NAMES.index("layers.0.fc1.weight"), NAMES.index("head.weight")
    # it opens on the first incident's root: rank 0's NaN local gradient of layers.0.fc1 at step 3
    session.wait_for(
        f"return document.querySelector('.tm-canvas').dataset.selected === '{fc1},3' && "
        "document.querySelectorAll('.tm-incident').length === 2;",
        30,
        "incident run",
    )
    state = _state(session)
    assert state["side"] == "Incidents (earliest first): 2 of 2" and state["active"] == "i1:root"
    assert state["controls"][1:3] == ["grad_unreduced", "norm"] and state["controls"][4] == "0"
    first, second = state["incidents"]
    assert "#1 steps 3-4" in first and "ranks 0, 1" in first and "closed" in first
    assert "0:layers.0.fc1.weight/rank0/acc_grad" in first and "only rank 0" in first
    assert "#2 steps 9-11" in second and "rank 1" in second and "open" in second
    assert "0:head.weight/rank1/exp_avg" in second and "max = +Inf" in second
    assert state["records"] == []
    session.script("document.querySelector('.tm-incident-head').click();")  # expand the first
    records = _state(session)["records"]
    assert len(records) == 3
    assert {tag for tag in INCIDENT_RUN_TAGS if any(tag in r for r in records)} == INCIDENT_RUN_TAGS
    session.script(
        "[...document.querySelectorAll('.tm-record')].find((li) => "
        "li.textContent.includes(arguments[0])).click();",
        "0:layers.0.fc1.weight/rank1/post_grad",
    )
    title = "return document.querySelector('.tm-heat-title').textContent"
    session.wait_for(f"{title}.includes('grad_reduced · norm · rank 1');", 20, "jump to rank 1's record")
    state = _state(session)
    assert state["selected"] == f"{fc1},3" and state["controls"][1] == "grad_reduced"
    active = session.script("return document.querySelector('.tm-active').textContent;")
    assert "0:layers.0.fc1.weight/rank1/post_grad" in active
    session.leave_frames()
    session.screenshot(str(artifacts() / "trainmon-tab-incidents.png"))
    session.enter_frame("iframe")
    # the step filter keeps incidents abnormal in the range (the first is abnormal at steps 3-4);
    # the second's root jumps to exp_avg max on rank 1
    session.script(
        "const i = document.querySelector('.tm-step-min'); i.value = '5';"
        "i.dispatchEvent(new Event('change'));"
    )
    session.wait_for("return document.querySelectorAll('.tm-incident').length === 1;", 20, "step filter")
    (only,) = _state(session)["incidents"]
    assert "#2 steps 9-11" in only
    session.script("document.querySelector('.tm-incident-root').click();")
    session.wait_for(
        f"return document.querySelector('.tm-canvas').dataset.selected === '{head},9';", 20, "root jump"
    )
    assert "exp_avg · max · rank 1" in _state(session)["title"]


def test_a_line_that_turns_non_finite_is_drawn_up_to_its_marker(page):
    """After the incidents test: rank 1's exp_avg max of head.weight is finite at steps 0-8 and
    +Inf from step 9. The chart draws rank 1's line (its legend colour, orange) over steps 0-8
    and marks the Inf steps; a marker once threw away the line drawn before it."""
    session, _, _ = page
    head, last = NAMES.index("head.weight"), INCIDENT_RUN["steps"][-1]
    session.script(
        """const c = document.querySelector('.tm-canvas'), r = c.getBoundingClientRect();
        const at = {clientX: r.right - 5, clientY: r.top + 1 + 16 * arguments[0] + 8, bubbles: true};
        c.dispatchEvent(new MouseEvent('click', at));""",
        head,
    )
    session.wait_for("return !document.querySelector('.tm-chart').hidden;", 20, "line chart")
    assert _state(session)["selected"] == f"{head},{last}"
    assert _state(session)["chart"]["ranks"] == 2
    orange, black = session.script(
        """const c = document.querySelector('.tm-chart-canvas');
        const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let orange = 0, black = 0;
        for (let i = 0; i < px.length; i += 4) {
          const [r, g, b, a] = [px[i], px[i + 1], px[i + 2], px[i + 3]];
          if (a > 200 && r > 200 && g > 100 && g < 160 && b < 60) orange++;
          if (a > 200 && r < 30 && g < 30 && b < 30) black++;
        }
        return [orange, black];"""
    )
    assert orange > 200, orange  # rank 1's line over nine steps, not only a marker's edge
    assert black > 0  # the +Inf triangles


def test_no_script_errors_in_the_console(page):
    session, _, _ = page
    errors = [m for m in session.console_errors() if "/data/plugin/trainmon/" in m or "Uncaught" in m]
    assert errors == []


def test_zeros_on_a_log_scale_have_their_own_colour_and_an_all_zero_matrix_says_so(page):
    """A log scale has no place for 0: such cells get their own legend entry instead of the
    smallest value's colour, and a matrix of zeros (no NaN anywhere: the nans op) says so
    instead of a made-up range."""
    session, base, _ = page
    runs = {r["name"]: r for r in _json(base, "/data/plugin/trainmon/runs")["runs"]}
    _choose_run(session, runs["demo_csv"]["id"])  # the demo's run records every op
    session.wait_for(
        f"return document.querySelector('.tm-canvas').dataset.run === {json.dumps(runs['demo_csv']['id'])};",
        30,
        "the demo's run",
    )
    legend = "return document.querySelector('.tm-legend').textContent;"
    choose = "const s = document.querySelectorAll('.tm-controls select')[2]; s.value = arguments[0];"
    for op, says in (("nans", "every value 0"), ("zeros", "0NaN")):  # the "0" item before "NaN"
        session.script(choose + "s.dispatchEvent(new Event('change'));", op)
        session.wait_for(
            f"return document.querySelector('.tm-heat-title').textContent.includes(' {op} ');", 20, op
        )
        assert says in session.script(legend), session.script(legend)
    session.script(choose + "s.dispatchEvent(new Event('change'));", "norm")


def test_a_run_whose_anomaly_files_a_later_run_replaced_says_so_instead_of_none(page):
    session, base, _ = page
    runs = {r["name"]: r for r in _json(base, "/data/plugin/trainmon/runs")["runs"]}
    older = runs["replaced @ Jan02_03-04-05"]["id"]
    _choose_run(session, older)
    side = "document.querySelector('.tm-side-title').textContent"
    session.wait_for(f"return {side}.includes('a later run in the same directory');", 30, "the older run")
    assert "none recorded" not in session.script(f"return {side};")


def test_without_anomalies_anywhere_the_tab_opens_on_the_newest_run_of_a_directory(tmp_path):
    reason = missing_browser()
    if reason:
        pytest.skip(reason)
    for stamp in ("Jan02_03-04-05", "Jan02_03-05-05"):
        write_run(tmp_path / "logdir" / "out", stamp=stamp)
    with tensorboard(str(tmp_path / "logdir"), str(tmp_path / "tensorboard.log")) as base:
        runs = {r["name"]: r["id"] for r in _json(base, "/data/plugin/trainmon/runs")["runs"]}
        with browser(str(tmp_path)) as session:
            session.open(f"{base}/#trainmon")
            session.enter_frame("iframe")
            session.wait_for(READY, 60, "the trainmon tab")
            assert _state(session)["run"] == runs["out @ Jan02_03-05-05"]


def test_a_tensorboard_run_links_its_chart_to_tensorboards_charts_without_smoothing(page):
    """Last, as it leaves the tab: TensorBoard's own charts of the selected tag, smoothing 0
    (its default 0.6 turns a one-step spike into a decaying curve)."""
    session, base, _ = page
    runs = {r["name"]: r for r in _json(base, "/data/plugin/trainmon/runs")["runs"]}
    run_id = runs["demo_tensorboard"]["id"]
    _choose_run(session, run_id)
    session.wait_for(
        f"return document.querySelector('.tm-canvas').dataset.run === {json.dumps(run_id)} && "
        "document.querySelector('.tm-heat-title').textContent.includes(' row');",
        30,
        "the TensorBoard run",
    )
    session.script(
        """const c = document.querySelector('.tm-canvas'), r = c.getBoundingClientRect();
        const at = {clientX: r.right - 5, clientY: r.top + 30, bubbles: true};
        c.dispatchEvent(new MouseEvent('click', at));"""
    )
    session.wait_for("return document.querySelector('.tm-scalars-link') !== null;", 20, "the link")
    href = session.script("return document.querySelector('.tm-scalars-link').href;")
    link = urllib.parse.urlparse(href)
    query = urllib.parse.parse_qs(link.query)
    assert link.fragment == "timeseries" and query["smoothing"] == ["0"]
    tag_filter = query["tagFilter"][0]
    name = session.script("return document.querySelector('.tm-chart-title').textContent;").split(" — ")[0]
    tags = [t for tags in _json(base, "/data/plugin/scalars/tags").values() for t in tags]
    (matched,) = [t for t in tags if re.search(tag_filter, t)]  # the row's one scalar (one rank here)
    assert matched.startswith(f"0:{name}/rank0/")
    session.leave_frames()
    session.open(href)
    session.wait_for("return document.querySelector('tb-webapp') !== null;", 60, "TensorBoard")
    time.sleep(3)  # TensorBoard writes its state back into the address once it has loaded
    search = urllib.parse.parse_qs(urllib.parse.urlparse(session.script("return location.href;")).query)
    assert search.get("smoothing") == ["0"] and search.get("tagFilter") == [tag_filter]
