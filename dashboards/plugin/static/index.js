// trainmon tab: TensorBoard loads this ES module in an iframe and calls render().
// Plain DOM, no framework, nothing loaded from outside this plugin. Every name, tag and message
// from the data is inserted with textContent (never innerHTML).

import { COLORS, Heatmap, formatValue } from "./heatmap.js";
import { LineChart } from "./chart.js";
import { BASE, el, formatAny, getJSON, labelled, plural, routeURL, setOptions } from "./dom.js";
import { SideList } from "./lists.js";

const POLL_MS = 5000;

async function getHeatmap(params) {
  const response = await fetch(routeURL("heatmap", params));
  if (!response.ok) throw new Error((await response.json()).error || response.statusText);
  const buffer = await response.arrayBuffer();
  const headerLength = new DataView(buffer).getUint32(0, true);
  const header = JSON.parse(new TextDecoder().decode(new Uint8Array(buffer, 4, headerLength)));
  const cells = header.rows.length * header.steps.length;
  const values = new Float64Array(buffer, 4 + headerLength, cells);
  const status = new Uint8Array(buffer, 4 + headerLength + 8 * cells, cells);
  return { ...header, values, status, anomalyCells: header.anomaly_cells };
}

class App {
  constructor(root) {
    this.root = root;
    this.state = { run: null, prefix: null, op: null, mode: "rank", rank: null, row: null, log: true,
      perRow: false, lo: null, hi: null, live: true };
    this.runs = [];
    this.pending = null;
  }

  build() {
    const link = document.createElement("link");
    link.rel = "stylesheet";
    link.href = new URL("style.css", BASE).href;
    document.head.appendChild(link);
    const app = el("div", "tm-app");
    const bar = el("div", "tm-controls");
    this.runSelect = el("select");
    this.prefixSelect = el("select");
    this.opSelect = el("select");
    this.modeSelect = el("select");
    setOptions(this.modeSelect, [["rank", "all tags, one rank"], ["tag", "one tag, all ranks"]]);
    this.rankSelect = el("select");
    this.logBox = el("input");
    this.logBox.type = "checkbox";
    this.logBox.checked = true;
    this.rowBox = el("input");
    this.rowBox.type = "checkbox";
    this.loInput = el("input", "tm-step");
    this.hiInput = el("input", "tm-step");
    for (const input of [this.loInput, this.hiInput]) { input.type = "number"; input.placeholder = "auto"; }
    this.resetButton = el("button", "", "all steps");
    this.liveBox = el("input");
    this.liveBox.type = "checkbox";
    this.liveBox.checked = true;
    this.status = el("span", "tm-status");
    bar.append(
      labelled("run", this.runSelect), labelled("data type", this.prefixSelect), labelled("op", this.opSelect),
      labelled("view", this.modeSelect), labelled("rank", this.rankSelect), labelled("log scale", this.logBox),
      labelled("colour per row", this.rowBox),
      labelled("steps", this.loInput), labelled("to", this.hiInput), this.resetButton,
      labelled("live", this.liveBox), this.status);
    const main = el("div", "tm-main");
    const heat = el("section", "tm-heat");
    this.heatTitle = el("div", "tm-heat-title");
    this.legend = el("div", "tm-legend");
    const holder = el("div", "tm-holder");
    heat.append(this.heatTitle, this.legend, holder);
    this.heatmap = new Heatmap(holder, { onCell: (cell) => this.openChart(cell), onHover: (c, e) => this.tip(c, e) });
    const side = el("aside", "tm-anomalies");
    this.lists = new SideList(side, (record) => this.jumpTo(record));
    this.lists.build();
    main.append(heat, side);
    this.chartBox = el("section", "tm-chart");
    this.chartBox.hidden = true;
    this.chart = new LineChart(this.chartBox);
    this.tooltip = el("div", "tm-tip");
    this.tooltip.hidden = true;
    app.append(bar, main, this.chartBox, this.tooltip);
    this.root.replaceChildren(app);

    this.runSelect.onchange = () => this.chooseRun(this.runSelect.value);
    this.prefixSelect.onchange = () => { this.state.prefix = this.prefixSelect.value; this.fillOps(); this.refresh(); };
    this.opSelect.onchange = () => { this.state.op = this.opSelect.value; this.refresh(); };
    this.modeSelect.onchange = () => this.setMode(this.modeSelect.value);
    this.rankSelect.onchange = () => { this.state.rank = Number(this.rankSelect.value); this.refresh(); };
    this.logBox.onchange = () => {
      this.state.log = this.logBox.checked;
      this.redraw();
      this.chart.log = this.state.log;
      this.chart.draw();
    };
    this.rowBox.onchange = () => { this.state.perRow = this.rowBox.checked; this.redraw(); };
    const range = () => {
      this.state.lo = this.loInput.value === "" ? null : Number(this.loInput.value);
      this.state.hi = this.hiInput.value === "" ? null : Number(this.hiInput.value);
      this.refresh();
    };
    this.loInput.onchange = range;
    this.hiInput.onchange = range;
    this.resetButton.onclick = () => { this.loInput.value = ""; this.hiInput.value = ""; range(); };
    this.liveBox.onchange = () => { this.state.live = this.liveBox.checked; };
    window.addEventListener("resize", () => { this.heatmap.draw(); this.chart.draw(); });
  }

  async start() {
    this.build();
    await this.loadRuns();
    if (!this.runs.length) {
      const logdir = this.logdir || {};
      this.heatTitle.textContent = (logdir.rank_directory ?
        "This logdir is one rank's directory: start TensorBoard on the directory that holds the " +
        "{time}-rank{R}-{id} directories (MONITOR_OUTPUT_DIR)." :
        logdir.exists === false ? "This logdir does not exist (yet)" :
        "No trainmon output under this logdir yet (per-rank directories {time}-rank{R}-{id})") +
        "; this page checks again every few seconds.";
    }
    setInterval(() => this.poll(), POLL_MS);
  }

  run() { return this.runs.find((r) => r.id === this.state.run); }

  async loadRuns() {
    const body = await getJSON("runs");
    this.runs = body.runs;
    this.logdir = body.logdir;
    const label = (r) => `${r.name} (${r.format || "no data yet"}, ${r.ranks.length} rank${r.ranks.length === 1 ? "" : "s"})`;
    setOptions(this.runSelect, this.runs.map((r) => [r.id, label(r)]), this.state.run);
    if (!this.run() && this.runs.length) {
      const pointed = (r) => r.landing && (r.landing.incident !== null || r.landing.anomaly !== null);
      // without an anomaly anywhere, the newest run of a directory
      const first = this.runs.find(pointed) || this.runs.find((r) => r.landing && r.newest) ||
        this.runs.find((r) => r.landing);
      await this.chooseRun((first || this.runs[0]).id);
    }
  }

  async chooseRun(id) {
    this.state.run = id;
    this.runSelect.value = id;
    const run = this.run();
    this.version = run.version;
    setOptions(this.prefixSelect, Object.keys(run.prefixes).map((p) => [p, p]));
    const landing = run.landing;
    this.chartBox.hidden = true;  // a chart of the run shown before
    this.lists.setRun(run);
    await this.lists.load();
    if (this.state.run !== id) return;  // another run was chosen while this one's lists loaded
    if (!landing) {
      this.heatTitle.textContent = "This run has no statistics yet.";
      return;
    }
    const target = this.lists.landingTarget(landing);
    if (target) {
      this.lists.markActive(target[1]);
      await this.jumpTo(target[0]);
    } else {
      Object.assign(this.state, { prefix: landing.prefix, op: landing.op, rank: landing.rank, mode: "rank" });
      this.syncControls();
      await this.refresh();
    }
  }

  fillOps() {
    const entry = this.run().prefixes[this.state.prefix];
    if (!entry.ops.includes(this.state.op)) this.state.op = entry.ops.includes("norm") ? "norm" : entry.ops[0];
    setOptions(this.opSelect, entry.ops.map((o) => [o, o]), this.state.op);
    if (!entry.ranks.includes(this.state.rank)) this.state.rank = entry.ranks[0];
    setOptions(this.rankSelect, entry.ranks.map((r) => [r, `rank ${r}`]), this.state.rank);
  }

  syncControls() {
    this.prefixSelect.value = this.state.prefix;
    this.fillOps();
    this.modeSelect.value = this.state.mode;
    this.rankSelect.disabled = this.state.mode !== "rank";
  }

  setMode(mode) {
    if (mode === "tag" && !this.state.row) {
      const d = this.heatmap.data;
      if (d && d.row_keys && d.row_keys.length) this.state.row = { key: d.row_keys[0], label: d.rows[0] };
    }
    if (mode === "tag" && !this.state.row) { this.modeSelect.value = "rank"; return; }
    this.state.mode = mode;
    this.syncControls();
    this.refresh();
  }

  params() {
    const s = this.state;
    const p = { run: s.run, prefix: s.prefix, op: s.op, mode: s.mode, lo: s.lo, hi: s.hi,
      cols: Math.max(20, Math.min(600, Math.floor((this.heatmap.container.clientWidth - 200) / 3))) };
    if (s.mode === "rank") p.rank = s.rank;
    else Object.assign(p, { vpp: s.row.key[0], name: s.row.key[1], micro: s.row.key[2] });
    return p;
  }

  // Fetch and draw the heatmap of the current choices; ``then`` runs after this draw only (not
  // after a newer request's, which supersedes it).
  async refresh(then = null) {
    const ticket = (this.pending = {});
    this.status.textContent = "loading…";
    try {
      const data = await getHeatmap(this.params());
      if (ticket !== this.pending) return;
      this.data = data;
      const what = this.state.mode === "rank" ? `rank ${data.rank}` : `${this.state.row.label}, all ranks`;
      this.heatTitle.textContent = `${data.prefix} · ${data.op} · ${what} · steps ${data.steps[0] ?? "-"}–` +
        `${data.steps[data.steps.length - 1] ?? "-"} (${data.steps.length} columns` +
        `${data.sampled ? ", sampled: narrow the step range for every step" : ""}) · ${plural(data.rows.length, "row")}` +
        (data.skipped ? ` · ${plural(data.skipped, "entry", "entries")} could not be read` : "");
      this.heatmap.selected = null;
      this.heatmap.canvas.dataset.selected = "";
      this.heatmap.canvas.dataset.run = this.state.run;
      this.redraw();
      if (then) then();
      this.status.textContent = `updated ${new Date().toLocaleTimeString()}`;
      this.root.querySelector(".tm-app").dataset.ready = "1";
    } catch (error) {
      if (ticket === this.pending) this.status.textContent = `error: ${error.message}`;
    }
  }

  redraw() {
    if (!this.data) return;
    this.heatmap.show(this.data, { log: this.state.log, perRow: this.state.perRow });
    const sc = this.heatmap.scale;
    const fmt = (t) => formatValue(sc.log ? 10 ** t : t);
    const range = sc.empty ? "every value 0" :
      sc.perRow ? "each row from its min to its max" : `${fmt(sc.lo)} … ${fmt(sc.hi)}`;
    const items = [["tm-ramp", `${range}${sc.log && !sc.empty ? " (log |value|)" : ""}`],
      ...(sc.zeros ? [[COLORS.zero, "0"]] : []),
      [COLORS.nan, "NaN"], [COLORS.posinf, "+Inf"], [COLORS.neginf, "-Inf"], [COLORS.missing, "not recorded"],
      ["outline", "anomaly"]];
    this.legend.replaceChildren(...items.map(([color, text]) => {
      const item = el("span", "tm-legend-item");
      const swatch = el("span", "tm-swatch");
      if (color === "tm-ramp") swatch.classList.add("tm-ramp");
      else if (color === "outline") swatch.style.border = `2px solid ${COLORS.anomaly}`;
      else swatch.style.background = color;
      item.append(swatch, document.createTextNode(text));
      return item;
    }));
  }

  tip(cell, e) {
    if (!cell) { this.tooltip.hidden = true; return; }
    const lines = [cell.label, `step ${cell.step}`, cell.missing ? "not recorded" : `${this.data.op} = ${formatValue(cell.value)}`];
    for (const index of cell.anomalies) {
      const a = this.lists.anomalies.find((x) => x.index === index);
      lines.push(a ? `anomaly #${index + 1}: ${a.rule || ""} (baseline ${formatAny(a.baseline)})` : `anomaly #${index + 1}`);
    }
    this.tooltip.textContent = lines.join("\n");
    this.tooltip.hidden = false;
    this.tooltip.style.left = `${e.clientX + 14}px`;
    this.tooltip.style.top = `${e.clientY + 14}px`;
  }

  async openChart(cell) {
    this.heatmap.select(cell.row, cell.col);
    const d = this.data;
    const row = d.mode === "rank" ? { key: d.row_keys[cell.row], label: d.rows[cell.row] } : this.state.row;
    this.state.row = row;
    const p = this.params();
    const series = await getJSON("series", { run: p.run, prefix: p.prefix, op: p.op, lo: p.lo, hi: p.hi, cols: p.cols,
      vpp: row.key[0], name: row.key[1], micro: row.key[2] });
    const marks = this.lists.anomalies.filter((a) => a.prefix === d.prefix && a.row[1] === row.key[1] &&
      a.row[0] === row.key[0] && a.row[2] === row.key[2]).map((a) => a.step);
    this.chartBox.hidden = false;
    this.chart.show(series, { log: this.state.log, label: row.label, marks, scalars: this.scalarsURL(series) });
    this.chartBox.scrollIntoView({ block: "nearest" });
  }

  // TensorBoard's time series of the same tag on every rank, without smoothing (its default 0.6
  // turns a one-step spike into a decaying curve); only runs written as TensorBoard files have them
  scalarsURL(series) {
    const run = this.run();
    if (!run || !(run.format || "").includes("tensorboard")) return null;
    const query = new URLSearchParams({ smoothing: "0", tagFilter: series.scalar_tag_pattern });
    return new URL(`../../../?${query}#timeseries`, BASE).href;
  }

  async jumpTo(a) {
    const run = this.run();
    const entry = run.prefixes[a.prefix];
    if (!entry) { this.status.textContent = `no ${a.prefix} statistics for this anomaly`; return; }
    const op = entry.ops.includes(a.op) ? a.op : (entry.ops.includes("norm") ? "norm" : entry.ops[0]);
    Object.assign(this.state, { prefix: a.prefix, op, mode: "rank", rank: a.rank });
    if ((this.state.lo !== null && a.step < this.state.lo) || (this.state.hi !== null && a.step > this.state.hi)) {
      this.state.lo = this.state.hi = null;
      this.loInput.value = this.hiInput.value = "";
    }
    this.syncControls();
    await this.refresh(() => {
      const d = this.data;
      const r = d.row_keys.findIndex((k) => k[0] === a.row[0] && k[1] === a.row[1] && k[2] === a.row[2]);
      const c = d.steps.indexOf(a.step);
      if (r >= 0) this.state.row = { key: d.row_keys[r], label: d.rows[r] };  // "one tag, all ranks" shows it
      if (r < 0 || c < 0) this.chartBox.hidden = true;  // not the chart of a tag this heatmap does not show
      else if (this.chartBox.hidden) this.heatmap.select(r, c);
      else this.openChart({ row: r, col: c });  // the open chart follows the jump
    });
  }

  // The selected cell as what survives a redraw with new steps: its row (by key where rows are
  // tags, by position where they are ranks) and its step; null without one.
  selection() {
    const d = this.data;
    if (!d || !this.heatmap.selected) return null;
    const [r, c] = this.heatmap.selected;
    return { key: d.mode === "rank" ? d.row_keys[r] : null, row: r, step: d.steps[c] };
  }

  reselect(kept) {
    const d = this.data;
    const wanted = JSON.stringify(kept.key);
    const r = kept.key ? d.row_keys.findIndex((k) => JSON.stringify(k) === wanted) : kept.row;
    const c = d.steps.indexOf(kept.step);
    if (r >= 0 && r < d.rows.length && c >= 0) this.heatmap.select(r, c);
  }

  async poll() {
    if (!this.state.live) return;
    try {
      const previous = this.state.run;
      await this.loadRuns();
      const run = this.run();
      if (!run || run.id !== previous || run.version === this.version) return;
      this.version = run.version;
      if (!this.data) { await this.chooseRun(run.id); return; }  // the run had no data before
      const prefixes = Object.keys(run.prefixes);
      setOptions(this.prefixSelect, prefixes.map((p) => [p, p]), this.state.prefix);
      this.lists.updateRun(run);
      if (run.prefixes[this.state.prefix]) this.fillOps();
      await this.lists.load();
      if (this.state.hi === null) {
        const kept = this.selection();  // new steps must not clear what the user looked at
        await this.refresh(kept && (() => this.reselect(kept)));
      }
    } catch (error) {
      this.status.textContent = `error: ${error.message}`;
    }
  }
}

export async function render() {
  const app = new App(document.body);
  await app.start();
}
