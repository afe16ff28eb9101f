"""The "trainmon" TensorBoard tab: heatmaps of every layer over steps, and the first anomalies.

Registered through the ``tensorboard_plugins`` entry point, so ``tensorboard --logdir DIR`` shows
it with no extra step; it reads the monitor's own outputs (CSV or TensorBoard event files, and
``anomaly_detected/*/anomaly.json`` and ``incidents.json``) found under the logdir.

Routes (under ``/data/plugin/trainmon``), all GET, all read-only:

* ``/runs``: the runs with their ranks, data types, ops, step ranges, a version that changes when
  data arrives, and the landing view.
* ``/anomalies?run=&rank=&prefix=&rule=&step_min=&step_max=&limit=``: anomalies in analysis order,
  optionally filtered by rank, data type, rule and step range.
* ``/incidents?run=&rank=&prefix=&rule=&step_min=&step_max=&limit=&records=``: the incidents of all
  ranks merged, earliest first, each with its root, evidence and records (with their heatmap
  cells); filtered by the ranks involved, the records' data type and rule, and the onset step.
* ``/heatmap?run=&prefix=&op=&mode=rank&rank=`` or ``mode=tag&vpp=&name=&micro=``, with
  optional ``lo``, ``hi`` (step range) and ``cols``: a binary matrix (heatmap.encode).
* ``/series?run=&prefix=&op=&vpp=&name=&micro=&lo=&hi=&cols=``: one tag on every rank, as JSON,
  with the regular expression that selects its TensorBoard scalars (for a link to them).
* the static front end (a fixed list of files shipped in ``static/``).

Safety: a run is chosen by its id from what discovery found; no request parameter is ever used
to build a path, so nothing outside the logdir can be named. Names and messages from the data are
only ever shown as text by the front end.
"""

from __future__ import annotations

import logging
import os
from importlib import resources

import numpy as np
from tensorboard.backend import http_util
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from dashboards.plugin.anomalies import counts
from dashboards.plugin.discovery import Run
from dashboards.plugin.heatmap import MAX_COLUMNS, PRESENT, Matrix, encode, rank_matrix, tag_matrix
from dashboards.plugin.incidents import select as select_incidents
from dashboards.plugin.store import RunStore
from monitor.datatypes.tasks import ACTIVATION_PREFIXES, RowKey, scalar_tag_pattern
from monitor.files import RANK_DIR_PATTERN

logger = logging.getLogger("trainmon")

PLUGIN_NAME = "trainmon"
STATIC_FILES = {
    "index.js": "text/javascript",
    "heatmap.js": "text/javascript",
    "chart.js": "text/javascript",
    "dom.js": "text/javascript",
    "lists.js": "text/javascript",
    "style.css": "text/css",
}
DEFAULT_COLUMNS = 300
ANOMALY_LIMIT = 5000
INCIDENT_LIMIT = 1000
RECORD_LIMIT = 5000
MAX_NAME = 4096


class BadRequest(Exception):
    """A request parameter is missing or wrong (HTTP 400), or names nothing (HTTP 404)."""

    def __init__(self, message: str, code: int = 400) -> None:
        super().__init__(message)
        self.code = code


def _int(args, name: str, default: int | None = None, low: int | None = None, high: int | None = None) -> int:
    text = args.get(name)
    if text is None or text == "":
        if default is None:
            raise BadRequest(f"{name}: required")
        return default
    try:
        value = int(text)
    except ValueError:
        raise BadRequest(f"{name}: expected an integer, got {text[:40]!r}") from None
    if (low is not None and value < low) or (high is not None and value > high):
        wanted = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise BadRequest(f"{name}: expected an integer {wanted}, got {value}")
    return value


def _filters(args) -> tuple[int, str, str, int | None, int | None]:
    """The list filters: rank (-1: any), data type, rule ("": any), step range (None: open end)."""
    rank = _int(args, "rank", -1, -1)
    step_min, step_max = (None if not args.get(n) else _int(args, n) for n in ("step_min", "step_max"))
    if step_min is not None and step_max is not None and step_max < step_min:
        raise BadRequest(f"step_max: {step_max} is below step_min {step_min}")
    return rank, args.get("prefix") or "", args.get("rule") or "", step_min, step_max


def _choice(args, name: str, allowed, default: str | None = None) -> str:
    value = args.get(name) or default
    if value is None:
        raise BadRequest(f"{name}: required")
    if value not in allowed:
        raise BadRequest(f"{name}: {value[:80]!r} is not one of {sorted(allowed)[:20]}", code=404)
    return value


def _row(args) -> RowKey:
    name = args.get("name")
    if not name or len(name) > MAX_NAME:
        raise BadRequest("name: required (at most 4096 characters)")
    return RowKey(_int(args, "vpp", 0), name, _int(args, "micro", -1))


class TrainmonPlugin(base_plugin.TBPlugin):
    """The trainmon tab (a TensorBoard plugin loaded as an ES module in an iframe)."""

    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext) -> None:
        self._store = RunStore(context.logdir or "")
        self._static: dict[str, bytes] = {}

    def get_plugin_apps(self) -> dict:
        apps = {f"/{name}": self._static_app(name) for name in STATIC_FILES}
        apps.update(
            {
                "/runs": self._serve_runs,
                "/anomalies": self._serve_anomalies,
                "/incidents": self._serve_incidents,
                "/heatmap": self._serve_heatmap,
                "/series": self._serve_series,
            }
        )
        return apps

    def is_active(self) -> bool:
        return bool(self._store.runs())

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(
            es_module_path="/index.js", tab_name="trainmon", disable_reload=True
        )

    # -- static files ----------------------------------------------------------------------

    def _static_app(self, name: str):
        @wrappers.Request.application
        def serve(request):
            if name not in self._static:
                self._static[name] = (
                    resources.files("dashboards.plugin").joinpath("static", name).read_bytes()
                )
            return http_util.Respond(request, self._static[name], STATIC_FILES[name])

        return serve

    # -- data routes -------------------------------------------------------------------------

    def _answer(self, request, build):
        try:
            return build(request.args)
        except BadRequest as exc:
            return http_util.Respond(request, {"error": str(exc)}, "application/json", code=exc.code)
        except OSError as exc:
            logger.warning("trainmon plugin: %s", exc)
            return http_util.Respond(
                request, {"error": f"could not read: {exc}"}, "application/json", code=500
            )

    def _run(self, args) -> Run:
        run_id = args.get("run")
        if not run_id:
            raise BadRequest("run: required")
        run = self._store.run(run_id)
        if run is None:
            raise BadRequest(f"run: no run {run_id[:200]!r} under the logdir", code=404)
        return run

    @wrappers.Request.application
    def _serve_runs(self, request):
        def build(args):
            runs = [self._store.summary(run) for run in self._store.runs()]
            logdir = self._store.logdir
            found = {  # why there is nothing to show, when there is not
                "exists": os.path.isdir(logdir),
                "rank_directory": bool(RANK_DIR_PATTERN.match(os.path.basename(os.path.normpath(logdir)))),
            }
            return http_util.Respond(request, {"runs": runs, "logdir": found}, "application/json")

        return self._answer(request, build)

    @wrappers.Request.application
    def _serve_anomalies(self, request):
        def build(args):
            run = self._run(args)
            listed = self._store.anomalies(run)
            rank, prefix, rule, step_min, step_max = _filters(args)
            limit = _int(args, "limit", ANOMALY_LIMIT, 1, ANOMALY_LIMIT)
            roots = self._root_classes(run)
            chosen = [
                item
                for item in listed.items
                if item.matches(rank, prefix, rule)
                and (step_min is None or item.record.step >= step_min)
                and (step_max is None or item.record.step <= step_max)
            ]
            body = {
                "total": len(listed.items),
                "matching": len(chosen),
                "items": [item.to_json(roots) for item in chosen[:limit]],
                "counts": counts(listed.items),
                "skipped_records": listed.skipped_records,
                "skipped_files": listed.skipped_files,
            }
            return http_util.Respond(request, body, "application/json")

        return self._answer(request, build)

    @wrappers.Request.application
    def _serve_incidents(self, request):
        def build(args):
            run = self._run(args)
            listed = self._store.incidents(run)
            chosen = select_incidents(listed.incidents, *_filters(args))
            limit = _int(args, "limit", INCIDENT_LIMIT, 1, INCIDENT_LIMIT)
            records = _int(args, "records", RECORD_LIMIT, 0, RECORD_LIMIT)
            shown, roots = [], self._root_classes(run)
            for incident, items in chosen[:limit]:
                shown.append({**incident.to_json(items[:records], roots), "matching_records": len(items)})
            body = {
                "files": listed.files,
                "total": len(listed.incidents),
                "matching": len(chosen),
                "incidents": shown,
                "counts": counts([item for incident in listed.incidents for item in incident.items]),
                "skipped_files": listed.skipped_files,
                "skipped_incidents": listed.skipped_incidents,
                "skipped_records": listed.skipped_records,
            }
            return http_util.Respond(request, body, "application/json")

        return self._answer(request, build)

    def _root_classes(self, run) -> dict[tuple[int, int], str]:
        """(rank, chunk) -> class name of the chunk's root module, from each rank's run-info file."""
        return {
            (rank, chunk): name
            for rank, source in self._store.sources(run).items()
            for chunk, name in source.root_modules().items()
        }

    def _view(self, args):
        """The common parameters of /heatmap and /series, checked against the run."""
        run = self._run(args)
        sources = self._store.sources(run)
        prefixes = self._store.prefixes(sources)
        prefix = _choice(args, "prefix", prefixes)
        entry = prefixes[prefix]
        op = _choice(args, "op", entry["ops"])
        lo = _int(args, "lo", entry["first_step"])
        hi = _int(args, "hi", entry["last_step"])
        if hi < lo:  # said in the words of the page's step range, whichever end was left empty
            first, last = entry["first_step"], entry["last_step"]
            raise BadRequest(
                f"steps {args.get('lo') or first} to {args.get('hi') or last}: the range is empty "
                f"({prefix} has steps {first}-{last})"
            )
        columns = _int(args, "cols", DEFAULT_COLUMNS, 1, MAX_COLUMNS)
        return run, sources, prefix, entry, op, lo, hi, columns

    @wrappers.Request.application
    def _serve_heatmap(self, request):
        def build(args):
            run, sources, prefix, entry, op, lo, hi, columns = self._view(args)
            mode = _choice(args, "mode", ("rank", "tag"), "rank")
            items = [
                item
                for item in self._store.anomalies(run).items
                if item.prefix == prefix and item.record.op in (op, "") and lo <= item.record.step <= hi
            ]
            header = {"run": run.id, "prefix": prefix, "op": op, "mode": mode, "lo": lo, "hi": hi}
            header["step_range"] = [entry["first_step"], entry["last_step"]]
            if mode == "rank":
                rank = _int(args, "rank", min(entry["ranks"]))
                if rank not in entry["ranks"]:
                    raise BadRequest(f"rank: {rank} has no {prefix}", code=404)
                items = [item for item in items if item.record.rank == rank]
                matrix = rank_matrix(
                    sources[rank], prefix, op, lo, hi, columns, [i.record.step for i in items]
                )
                show_vpp = any(key.vpp_stage for key in matrix.rows)
                header["rank"] = rank
                roots = sources[rank].root_modules() if prefix in ACTIVATION_PREFIXES else {}
                header["rows"] = [key.label(show_vpp, roots.get(key.vpp_stage, "")) for key in matrix.rows]
                header["row_keys"] = [list(key) for key in matrix.rows]
                position = {key: i for i, key in enumerate(matrix.rows)}
                cells = [(position.get(item.row), item) for item in items]
            else:
                row = _row(args)
                items = [item for item in items if item.row == row]
                matrix = tag_matrix(sources, prefix, op, row, lo, hi, columns, [i.record.step for i in items])
                header["row"] = list(row)
                header["rows"] = [f"rank {rank}" for rank in matrix.rows]
                position = {rank: i for i, rank in enumerate(matrix.rows)}
                cells = [(position.get(item.record.rank), item) for item in items]
            header.update(_describe(matrix, cells))
            return http_util.Respond(request, encode(header, matrix), "application/octet-stream")

        return self._answer(request, build)

    @wrappers.Request.application
    def _serve_series(self, request):
        def build(args):
            _, sources, prefix, _, op, lo, hi, columns = self._view(args)
            row = _row(args)
            matrix = tag_matrix(sources, prefix, op, row, lo, hi, columns)
            values = [
                [float(v) if s == PRESENT else None for v, s in zip(vs, ss)]
                for vs, ss in zip(matrix.values.tolist(), matrix.status.tolist())
            ]
            body = {
                "prefix": prefix,
                "op": op,
                "row": list(row),
                "steps": matrix.steps.tolist(),
                "ranks": matrix.rows,
                "values": values,
                "sampled": matrix.sampled,
                "scalar_tag_pattern": scalar_tag_pattern(prefix, op, row),
            }
            return http_util.Respond(request, body, "application/json")

        return self._answer(request, build)


def _describe(matrix: Matrix, cells) -> dict:
    """Steps, sampling and anomaly cells ``[row, column, anomaly index]`` of a heatmap."""
    anomaly_cells = []
    for row, item in cells:
        if row is None or len(matrix.steps) == 0:
            continue
        column = int(np.searchsorted(matrix.steps, item.record.step))
        if column < len(matrix.steps) and matrix.steps[column] == item.record.step:
            anomaly_cells.append([row, column, item.index])
    return {
        "steps": matrix.steps.tolist(),
        "sampled": matrix.sampled,
        "skipped": matrix.skipped,
        "anomaly_cells": anomaly_cells,
    }
