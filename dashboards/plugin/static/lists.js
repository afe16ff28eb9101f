// The side lists of the trainmon tab: incidents (earliest first, each expandable into its records)
// and, behind a toggle, every anomaly. Both share the filters (rank, data type, rule, step range);
// clicking an incident's root, one of its records or an anomaly calls onJump(record, key) so the
// heatmap shows that cell. A run without incidents files (msprobe's own monitor) lists anomalies.

import { el, formatAny, getJSON, labelled, plural, setOptions } from "./dom.js";

const ANOMALY_LIMIT = 500;
const INCIDENT_LIMIT = 200;
const RECORD_LIMIT = 1000;

// " (baseline b)", or nothing where the rule has no history (a NaN or Inf is abnormal by itself).
function baselineText(baseline) {
  return baseline === null || baseline === undefined || baseline === "NaN" ? "" : ` (baseline ${formatAny(baseline)})`;
}

// The tag as the files have it; a root module's activation row (".input": msprobe names it by
// an empty module name) also by its class, as the heatmap names it ("0:.input/rank0/actv (GPT.input)").
function tagText(a) {
  const rootRow = a.row && /^[.[]/.test(a.row[1]) && a.label && !/^(\d+:)?[.[]/.test(a.label);
  return rootRow ? `${a.tag} (${a.label})` : a.tag;
}

// "step 11 micro 1 · rank 0 · grad_reduced · norm", the tag, and "rule: value (baseline b), stage".
function recordLines(a, prefix) {
  const head = el("div", "tm-anomaly-head", `${prefix}step ${a.step}` + (a.micro_step ? ` micro ${a.micro_step}` : "") +
    ` · rank ${a.rank} · ${a.prefix} · ${a.op || "?"}`);
  const tag = el("div", "tm-anomaly-tag", tagText(a));
  const what = el("div", "tm-anomaly-what", `${a.rule || "rule ?"}: ${formatAny(a.value)}${baselineText(a.baseline)}, ` +
    a.stage);
  return [head, tag, what];
}

export class SideList {
  constructor(container, onJump) {
    this.container = container;
    this.onJump = onJump;
    this.preferred = "incidents";  // the view chosen with the toggle
    this.run = null;
    this.anomalies = [];
    this.incidents = [];
    this.expanded = new Set();
    this.activeKey = null;
    this.bodies = { anomalies: null, incidents: null };
  }

  build() {
    this.title = el("div", "tm-side-title", "Anomalies");
    this.toggle = el("div", "tm-view-toggle");
    this.incidentsButton = el("button", "tm-view-incidents", "Incidents");
    this.anomaliesButton = el("button", "tm-view-anomalies", "All anomalies");
    this.toggle.append(this.incidentsButton, this.anomaliesButton);
    this.rank = el("select");
    this.prefix = el("select");
    this.rule = el("select");
    this.stepMin = el("input", "tm-step tm-step-min");
    this.stepMax = el("input", "tm-step tm-step-max");
    for (const input of [this.stepMin, this.stepMax]) { input.type = "number"; input.placeholder = "any"; }
    const filters = el("div", "tm-filters");
    const steps = el("span", "tm-filter-steps");
    steps.append(labelled("steps", this.stepMin), labelled("to", this.stepMax));
    filters.append(labelled("rank", this.rank), labelled("data type", this.prefix), labelled("rule", this.rule), steps);
    this.error = el("div", "tm-list-error");
    this.error.hidden = true;
    this.incidentList = el("ol", "tm-incident-list");
    this.anomalyList = el("ol", "tm-anomaly-list");
    this.container.append(this.title, this.toggle, filters, this.error, this.incidentList, this.anomalyList);
    for (const control of [this.rank, this.prefix, this.rule, this.stepMin, this.stepMax]) {
      control.onchange = () => this.load();
    }
    this.incidentsButton.onclick = () => { this.preferred = "incidents"; this.showView(); };
    this.anomaliesButton.onclick = () => { this.preferred = "anomalies"; this.showView(); };
  }

  // A new run: filter choices from its ranks and data types, nothing expanded, no step range.
  setRun(run) {
    this.run = run;
    this.expanded.clear();
    this.activeKey = null;
    this.stepMin.value = this.stepMax.value = "";
    setOptions(this.rule, [["", "all"]]);
    this.updateRun(run);
  }

  // The same run with news (polling): choices refreshed, the chosen ones kept.
  updateRun(run) {
    this.run = run;
    setOptions(this.rank, [["", "all"], ...run.ranks.map((r) => [r, `rank ${r}`])], this.rank.value);
    setOptions(this.prefix, [["", "all"], ...Object.keys(run.prefixes).map((p) => [p, p])], this.prefix.value);
  }

  view() { return this.run && this.run.incidents !== null ? this.preferred : "anomalies"; }

  async load() {
    const run = this.run;
    const filters = { run: run.id, rank: this.rank.value, prefix: this.prefix.value, rule: this.rule.value,
      step_min: this.stepMin.value, step_max: this.stepMax.value };
    let anomalies, incidents;
    try {
      [anomalies, incidents] = await Promise.all([
        getJSON("anomalies", { ...filters, limit: ANOMALY_LIMIT }),
        run.incidents === null ? null :
          getJSON("incidents", { ...filters, limit: INCIDENT_LIMIT, records: RECORD_LIMIT })]);
    } catch (error) {
      this.error.textContent = `error: ${error.message}`;
      this.error.hidden = false;
      return;
    }
    if (run !== this.run) return;  // another run was chosen meanwhile
    this.error.hidden = true;
    this.bodies = { anomalies, incidents };
    this.anomalies = anomalies.items;
    this.incidents = incidents ? incidents.incidents : [];
    const rules = new Set([...anomalies.counts.rule, ...(incidents ? incidents.counts.rule : [])].map(([r]) => r));
    setOptions(this.rule, [["", "all"], ...[...rules].sort().map((r) => [r, r])], this.rule.value);
    this.anomalyList.replaceChildren(...this.anomalies.map((a) => this.anomalyEntry(a)));
    this.incidentList.replaceChildren(...this.incidents.map((i) => this.incidentEntry(i)));
    this.showView();
    this.markActive(this.activeKey);
  }

  showView() {
    const view = this.view();
    const { anomalies, incidents } = this.bodies;
    this.toggle.hidden = this.run.incidents === null;
    this.incidentList.hidden = view !== "incidents";
    this.anomalyList.hidden = view !== "anomalies";
    this.incidentsButton.classList.toggle("tm-view-active", view === "incidents");
    this.anomaliesButton.classList.toggle("tm-view-active", view === "anomalies");
    this.incidentsButton.textContent = incidents ? `Incidents (${incidents.total})` : "Incidents";
    this.anomaliesButton.textContent = anomalies ? `All anomalies (${anomalies.total})` : "All anomalies";
    const body = view === "incidents" ? incidents : anomalies;
    if (!body) return;
    const shown = view === "incidents" ? body.incidents.length : body.items.length;
    const name = view === "incidents" ? "Incidents" : "Anomalies";
    const unread = [
      body.skipped_files ? `${plural(body.skipped_files, "file")} could not be read` : "",
      body.skipped_incidents ? `${plural(body.skipped_incidents, "incident")} could not be read` : "",
      body.skipped_records ? `${plural(body.skipped_records, "record")} could not be read` : "",
    ].filter(Boolean).map((text) => ` (${text})`).join("");
    const none = this.run.replaced ?
      `${name}: not shown: a later run in the same directory replaced this run's anomaly files ` +
      "(kept beside them as anomaly.json.earlier-<time>)" : `${name}: none recorded`;
    this.title.textContent = (body.total === 0 ? none :
      `${name} (earliest first): ${body.matching} of ${body.total}` +
      (body.matching > shown ? ` (first ${shown} shown)` : "")) + unread;
  }

  anomalyEntry(a) {
    const item = el("li", "tm-anomaly");
    item.dataset.index = String(a.index);
    item.dataset.key = `a${a.index}`;
    item.append(...recordLines(a, `#${a.index + 1} `));
    item.title = a.message;
    item.onclick = () => this.jump(a, item.dataset.key);
    return item;
  }

  incidentEntry(incident) {
    const item = el("li", "tm-incident");
    item.dataset.number = String(incident.id);
    const head = el("div", "tm-incident-head");
    const state = el("span", incident.state === "open" ? "tm-state tm-open" : "tm-state tm-closed", incident.state);
    const last = incident.last_abnormal_step;
    const steps = last > incident.onset_step ? `steps ${incident.onset_step}-${last}` : `step ${incident.onset_step}`;
    head.append(el("span", "tm-incident-name", `#${incident.id} ${steps}`),
      document.createTextNode(` · ${incident.ranks.length === 1 ? "rank" : "ranks"} ${incident.ranks.join(", ")}` +
        ` · ${incident.tensors} series `), state);
    item.append(head);
    const root = incident.root;
    if (root) {
      const line = el("div", "tm-incident-root");
      line.dataset.key = `i${incident.id}:root`;
      line.append(el("span", "tm-root-label", "root"), el("div", "tm-anomaly-tag", tagText(root)),
        el("div", "tm-anomaly-what", `${root.op || "?"} = ${formatAny(root.value)} · ${root.rule || "rule ?"}` +
          `${baselineText(root.baseline)} · rank ${root.rank} · ${root.prefix}`));
      line.title = root.message;
      line.onclick = () => this.jump(root, line.dataset.key);
      item.append(line);
    }
    const evidence = el("ul", "tm-evidence");
    evidence.append(...incident.evidence.map((text) => el("li", "", text)));
    const expand = el("button", "tm-expand");
    const records = el("ol", "tm-records");
    const shown = incident.items.length < incident.matching_records ? ` (first ${incident.items.length} shown)` : "";
    const open = (on) => {
      if (on && !records.childElementCount) {
        records.append(...incident.items.map((a) => this.recordEntry(incident, a)));
        this.markActive(this.activeKey);
      }
      if (on) this.expanded.add(incident.id);
      else this.expanded.delete(incident.id);
      records.hidden = !on;
      item.classList.toggle("tm-expanded", on);
      expand.textContent = `${on ? "▾" : "▸"} ${plural(incident.matching_records, "record")}${shown}`;
    };
    const flip = () => open(records.hidden);
    head.onclick = flip;
    expand.onclick = flip;
    open(this.expanded.has(incident.id));
    item.append(evidence, expand, records);
    return item;
  }

  recordEntry(incident, a) {
    const item = el("li", "tm-record");
    item.dataset.index = String(a.index);
    item.dataset.key = `i${incident.id}:${a.index}`;
    item.classList.toggle("tm-record-root", a.index === incident.root_index);
    item.append(...recordLines(a, a.index === incident.root_index ? "root · " : ""));
    item.title = a.message;
    item.onclick = () => this.jump(a, item.dataset.key);
    return item;
  }

  jump(record, key) {
    this.markActive(key);
    this.onJump(record);
  }

  markActive(key) {
    this.activeKey = key;
    for (const node of this.container.querySelectorAll(".tm-active")) node.classList.remove("tm-active");
    if (key) for (const node of this.container.querySelectorAll(`[data-key="${key}"]`)) node.classList.add("tm-active");
  }

  // What the run's landing view points at in the lists: [record, key], or null.
  landingTarget(landing) {
    const incident = this.incidents.find((i) => i.id === landing.incident);
    if (incident && incident.root) return [incident.root, `i${incident.id}:root`];
    const anomaly = this.anomalies.find((a) => a.index === landing.anomaly) ||
      (landing.anomaly !== null ? this.anomalies[0] : undefined);
    return anomaly ? [anomaly, `a${anomaly.index}`] : null;
  }
}
