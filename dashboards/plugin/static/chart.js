// trainmon line chart: one tag on every rank, overlaid. Non-finite values are marked, not drawn
// as lines: NaN with a red cross at the top, +Inf / -Inf with triangles at the top / bottom.

import { COLORS, formatValue } from "./heatmap.js";

const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
  "#bcbd22", "#17becf"];

function number(v) {
  if (v === null || v === undefined) return null;
  if (v === "NaN") return NaN;
  if (v === "Infinity") return Infinity;
  if (v === "-Infinity") return -Infinity;
  return v;
}

export class LineChart {
  constructor(container) {
    this.container = container;
    this.title = document.createElement("div");
    this.title.className = "tm-chart-title";
    this.legend = document.createElement("div");
    this.legend.className = "tm-legend";
    this.canvas = document.createElement("canvas");
    this.canvas.className = "tm-chart-canvas";
    this.readout = document.createElement("div");
    this.readout.className = "tm-readout";
    container.append(this.title, this.legend, this.canvas, this.readout);
    this.canvas.addEventListener("mousemove", (e) => this._hover(e));
  }

  // series: the /series answer; marks: steps to draw a vertical line at (e.g. anomalies);
  // scalars: a link to the same tag in TensorBoard's own charts, or null
  show(series, { log, label, marks = [], scalars = null }) {
    this.series = series;
    this.log = log;
    this.marks = marks;
    this.values = series.values.map((row) => row.map(number));
    this.title.textContent = `${label} — ${series.prefix} ${series.op}` +
      (series.sampled ? " (sampled steps; narrow the step range for every step)" : "");
    if (scalars) {
      const link = document.createElement("a");
      link.className = "tm-scalars-link";
      link.href = scalars;
      link.target = "_top";
      link.textContent = "in TensorBoard's charts, smoothing 0";
      link.title = "untick \"Ignore outliers in chart scaling\" in TensorBoard's settings to see a spike whole";
      this.title.append(" · ", link);
    }
    this.legend.replaceChildren(...series.ranks.map((rank, i) => {
      const item = document.createElement("span");
      item.className = "tm-legend-item";
      const swatch = document.createElement("span");
      swatch.className = "tm-swatch";
      swatch.style.background = PALETTE[i % PALETTE.length];
      item.append(swatch, document.createTextNode(`rank ${rank}`));
      return item;
    }));
    this.canvas.dataset.ranks = String(series.ranks.length);
    this.canvas.dataset.points = String(series.steps.length);
    this.draw();
  }

  draw() {
    const s = this.series;
    if (!s) return;
    const width = Math.max(300, this.container.clientWidth - 20), height = 260;
    const ratio = window.devicePixelRatio || 1;
    this.canvas.width = width * ratio;
    this.canvas.height = height * ratio;
    this.canvas.style.width = `${width}px`;
    this.canvas.style.height = `${height}px`;
    const ctx = this.canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const tf = (v) => (this.log ? (v === 0 ? null : Math.log10(Math.abs(v))) : v);
    let lo = Infinity, hi = -Infinity;
    for (const row of this.values) for (const v of row) {
      if (v === null || !Number.isFinite(v)) continue;
      const t = tf(v);
      if (t === null) continue;
      lo = Math.min(lo, t); hi = Math.max(hi, t);
    }
    if (lo === Infinity) { lo = 0; hi = 1; }
    if (lo === hi) { lo -= 0.5; hi += 0.5; }
    const steps = s.steps;
    const x0 = 70, x1 = width - 10, y0 = 10, y1 = height - 30;
    const first = steps.length ? steps[0] : 0, last = steps.length ? steps[steps.length - 1] : 1;
    const sx = (step) => x0 + (last === first ? 0.5 : (step - first) / (last - first)) * (x1 - x0);
    const sy = (t) => y1 - ((t - lo) / (hi - lo)) * (y1 - y0);
    this.geometry = { sx, x0, x1, first, last };
    ctx.strokeStyle = "#999";
    ctx.strokeRect(x0, y0, x1 - x0, y1 - y0);
    ctx.fillStyle = "#333";
    ctx.font = "11px sans-serif";
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let k = 0; k <= 4; k++) {
      const t = lo + ((hi - lo) * k) / 4;
      ctx.fillText(formatValue(this.log ? 10 ** t : t), x0 - 4, sy(t));
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    ctx.fillText(String(first), x0, y1 + 4);
    ctx.fillText(String(last), x1, y1 + 4);
    ctx.fillText("step", (x0 + x1) / 2, y1 + 14);
    ctx.strokeStyle = COLORS.anomaly;
    for (const step of this.marks) {
      ctx.beginPath(); ctx.moveTo(sx(step), y0); ctx.lineTo(sx(step), y1); ctx.stroke();
    }
    this.values.forEach((row, i) => {
      ctx.strokeStyle = PALETTE[i % PALETTE.length];
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let open = false;
      const nonFinite = [];  // marked once the line is drawn: a marker starts a path of its own
      row.forEach((v, j) => {
        const t = v === null || !Number.isFinite(v) ? null : tf(v);
        if (t === null) {
          open = false;
          if (v !== null && !Number.isFinite(v)) nonFinite.push([sx(steps[j]), v]);
          return;
        }
        if (open) ctx.lineTo(sx(steps[j]), sy(t)); else ctx.moveTo(sx(steps[j]), sy(t));
        open = true;
      });
      ctx.stroke();
      for (const [x, v] of nonFinite) marker(ctx, x, v, y0, y1);
    });
  }

  _hover(e) {
    if (!this.geometry || !this.series.steps.length) return;
    const rect = this.canvas.getBoundingClientRect();
    const { x0, x1, first, last } = this.geometry;
    const frac = (e.clientX - rect.left - x0) / (x1 - x0);
    const target = first + frac * (last - first);
    let best = 0;
    this.series.steps.forEach((step, j) => {
      if (Math.abs(step - target) < Math.abs(this.series.steps[best] - target)) best = j;
    });
    const parts = this.series.ranks.map((rank, i) => {
      const v = this.values[i][best];
      return `rank ${rank}: ${v === null ? "—" : formatValue(v)}`;
    });
    this.readout.textContent = `step ${this.series.steps[best]}   ${parts.join("   ")}`;
  }
}

function marker(ctx, x, v, y0, y1) {
  ctx.save();
  ctx.fillStyle = Number.isNaN(v) ? COLORS.nan : v > 0 ? COLORS.posinf : COLORS.neginf;
  ctx.strokeStyle = ctx.fillStyle;
  ctx.beginPath();
  if (Number.isNaN(v)) {
    ctx.moveTo(x - 4, y0 + 2); ctx.lineTo(x + 4, y0 + 10); ctx.moveTo(x + 4, y0 + 2); ctx.lineTo(x - 4, y0 + 10);
    ctx.stroke();
  } else {
    const y = v > 0 ? y0 + 2 : y1 - 2, d = v > 0 ? 8 : -8;
    ctx.moveTo(x, y); ctx.lineTo(x - 4, y + d); ctx.lineTo(x + 4, y + d); ctx.closePath(); ctx.fill();
  }
  ctx.restore();
}
