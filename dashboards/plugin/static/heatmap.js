// trainmon heatmap: rows x steps on a canvas. Values come from the server already downsampled;
// this file only maps them to colours, draws labels and answers hover and click.
// Names and values from the data are drawn as canvas text or set with textContent, never as HTML.

export const COLORS = {
  nan: "#ff1744",      // NaN
  posinf: "#000000",   // +Inf
  neginf: "#2979ff",   // -Inf
  missing: "#e6e6e6",  // nothing recorded
  zero: "#ffffff",     // exactly 0 on a log scale, which has no place for it
  anomaly: "#ff00ff",  // outline of an anomaly cell
  selected: "#00e5ff", // outline of the selected cell
};

// viridis, 9 stops
const STOPS = [
  [68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141],
  [39, 173, 129], [92, 200, 99], [170, 220, 50], [253, 231, 37],
];

export function ramp(t) {
  const x = Math.min(1, Math.max(0, t)) * (STOPS.length - 1);
  const i = Math.min(STOPS.length - 2, Math.floor(x));
  const f = x - i;
  const a = STOPS[i], b = STOPS[i + 1];
  return [0, 1, 2].map((k) => Math.round(a[k] + (b[k] - a[k]) * f));
}

export function formatValue(v) {
  if (Number.isNaN(v)) return "NaN";
  if (v === Infinity) return "+Inf";
  if (v === -Infinity) return "-Inf";
  if (v === 0) return "0";
  const a = Math.abs(v);
  return a >= 1e5 || a < 1e-3 ? v.toExponential(4) : String(Number(v.toPrecision(6)));
}

// The colour scale of the finite values: linear, or log10 of |value| (an exact 0, which has no
// place there, gets its own colour); over the whole matrix, or per row (each from its min to max).
export function scaleOf(values, status, cols, { log, perRow }) {
  const tf = (v) => (log ? (v === 0 ? null : Math.log10(Math.abs(v))) : v);
  const rows = cols ? values.length / cols : 0;
  const lows = new Float64Array(perRow ? rows : 1).fill(Infinity);
  const highs = new Float64Array(perRow ? rows : 1).fill(-Infinity);
  let zeros = false;
  for (let i = 0; i < values.length; i++) {
    if (status[i] !== 0 || !Number.isFinite(values[i])) continue;
    const t = tf(values[i]);
    if (t === null) { zeros = true; continue; }
    const k = perRow ? Math.floor(i / cols) : 0;
    if (t < lows[k]) lows[k] = t;
    if (t > highs[k]) highs[k] = t;
  }
  const empty = zeros && lows.every((low) => low === Infinity);  // finite values, every one 0
  for (let k = 0; k < lows.length; k++) {
    if (lows[k] === Infinity) { lows[k] = 0; highs[k] = 1; }
    if (highs[k] === lows[k]) highs[k] = lows[k] + 1;
  }
  // -1: an exact 0 on a log scale, drawn in its own colour rather than as the smallest value
  const map = (v, row) => {
    const k = perRow ? row : 0;
    const t = tf(v);
    return t === null ? -1 : (t - lows[k]) / (highs[k] - lows[k]);
  };
  return { lo: lows[0], hi: highs[0], log, perRow, map, zeros, empty };
}

export class Heatmap {
  constructor(container, { onCell, onHover }) {
    this.container = container;
    this.onCell = onCell;
    this.onHover = onHover;
    this.axis = document.createElement("canvas");
    this.axis.className = "tm-axis";
    this.scroll = document.createElement("div");
    this.scroll.className = "tm-scroll";
    this.canvas = document.createElement("canvas");
    this.canvas.className = "tm-canvas";
    this.scroll.append(this.axis, this.canvas);  // the axis sticks to the top while rows scroll
    container.append(this.scroll);
    this.data = null;
    this.selected = null;
    this.canvas.addEventListener("mousemove", (e) => this._hover(e));
    this.canvas.addEventListener("mouseleave", () => this.onHover(null));
    this.canvas.addEventListener("click", (e) => {
      const cell = this.cellAt(e);
      if (cell) this.onCell(cell);
    });
  }

  // data: {rows, steps, values: Float64Array, status: Uint8Array, anomalyCells: [[r, c, index]]}
  show(data, options) {
    this.data = data;
    this.scale = scaleOf(data.values, data.status, data.steps.length, options);
    this.anomalyAt = new Map();
    for (const [r, c, index] of data.anomalyCells) {
      const key = r * data.steps.length + c;
      if (!this.anomalyAt.has(key)) this.anomalyAt.set(key, []);
      this.anomalyAt.get(key).push(index);
    }
    this.canvas.dataset.rows = String(data.rows.length);
    this.canvas.dataset.cols = String(data.steps.length);
    this.canvas.dataset.anomalyCells = String(data.anomalyCells.length);
    this.draw();
  }

  _geometry() {
    const d = this.data;
    const ctx = this.canvas.getContext("2d");
    ctx.font = "11px sans-serif";
    let labelW = 40;
    for (const label of d.rows) labelW = Math.max(labelW, ctx.measureText(label).width + 10);
    labelW = Math.min(Math.ceil(labelW), 340);
    const avail = Math.max(200, this.container.clientWidth - labelW - 24);
    const cw = Math.max(2, Math.min(40, Math.floor(avail / Math.max(1, d.steps.length))));
    const ch = d.rows.length <= 40 ? 16 : Math.max(3, Math.min(14, Math.floor(640 / d.rows.length)));
    return { labelW, cw, ch };
  }

  draw() {
    const d = this.data;
    if (!d) return;
    const g = (this.geometry = this._geometry());
    Object.assign(this.canvas.dataset, { labelWidth: g.labelW, cellWidth: g.cw, cellHeight: g.ch });
    const rows = d.rows.length, cols = d.steps.length;
    const width = g.labelW + cols * g.cw + 2, height = rows * g.ch + 2;
    const ratio = window.devicePixelRatio || 1;
    for (const [canvas, h] of [[this.canvas, height], [this.axis, 28]]) {
      canvas.width = Math.ceil(width * ratio);
      canvas.height = Math.ceil(h * ratio);
      canvas.style.width = `${width}px`;
      canvas.style.height = `${h}px`;
    }
    const ctx = this.canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const image = ctx.createImageData(Math.max(1, cols), Math.max(1, rows));
    const px = image.data;
    const special = {
      nan: hex(COLORS.nan), posinf: hex(COLORS.posinf), neginf: hex(COLORS.neginf), missing: hex(COLORS.missing),
      zero: hex(COLORS.zero),
    };
    for (let r = 0; r < rows; r++) {
      for (let c = 0; c < cols; c++) {
        const i = r * cols + c;
        let rgb;
        if (d.status[i] !== 0) rgb = special.missing;
        else {
          const v = d.values[i];
          if (Number.isNaN(v)) rgb = special.nan;
          else if (v === Infinity) rgb = special.posinf;
          else if (v === -Infinity) rgb = special.neginf;
          else {
            const t = this.scale.map(v, r);
            rgb = t < 0 ? special.zero : ramp(t);
          }
        }
        px.set([rgb[0], rgb[1], rgb[2], 255], i * 4);
      }
    }
    // draw the matrix at one pixel per cell, then scale it up without smoothing
    const buffer = document.createElement("canvas");
    buffer.width = Math.max(1, cols);
    buffer.height = Math.max(1, rows);
    buffer.getContext("2d").putImageData(image, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(buffer, g.labelW, 1, cols * g.cw, rows * g.ch);
    // row labels
    ctx.fillStyle = "#333";
    ctx.font = "11px sans-serif";
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    const every = g.ch >= 10 ? 1 : Math.ceil(11 / g.ch);
    for (let r = 0; r < rows; r += every) {
      ctx.fillText(clip(ctx, d.rows[r], g.labelW - 8), g.labelW - 5, 1 + r * g.ch + g.ch / 2);
    }
    // anomaly outlines, then the selection
    ctx.lineWidth = 2;
    ctx.strokeStyle = COLORS.anomaly;
    for (const [r, c] of d.anomalyCells) {
      ctx.strokeRect(g.labelW + c * g.cw + 1, 1 + r * g.ch + 1, Math.max(1, g.cw - 2), Math.max(1, g.ch - 2));
    }
    if (this.selected) {
      const [r, c] = this.selected;
      ctx.strokeStyle = COLORS.selected;
      ctx.strokeRect(g.labelW + c * g.cw - 1, r * g.ch - 1, g.cw + 3, g.ch + 3);
    }
    this._drawAxis(width);
  }

  _drawAxis(width) {
    const d = this.data, g = this.geometry;
    const ratio = window.devicePixelRatio || 1;
    const ctx = this.axis.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, 28);
    ctx.fillStyle = "#333";
    ctx.font = "11px sans-serif";
    ctx.textAlign = "center";
    ctx.textBaseline = "bottom";
    ctx.fillText("step", g.labelW / 2, 24);
    let next = 0;
    for (let c = 0; c < d.steps.length; c++) {
      const x = g.labelW + c * g.cw + g.cw / 2;
      if (x < next) continue;
      ctx.fillText(String(d.steps[c]), x, 20);
      ctx.fillRect(x, 22, 1, 5);
      next = x + ctx.measureText(String(d.steps[c])).width + 12;
    }
  }

  cellAt(e) {
    if (!this.data || !this.geometry) return null;
    const rect = this.canvas.getBoundingClientRect();
    const x = e.clientX - rect.left - this.geometry.labelW, y = e.clientY - rect.top - 1;
    const c = Math.floor(x / this.geometry.cw), r = Math.floor(y / this.geometry.ch);
    if (x < 0 || r < 0 || c < 0 || r >= this.data.rows.length || c >= this.data.steps.length) return null;
    const i = r * this.data.steps.length + c;
    return {
      row: r, col: c, step: this.data.steps[c], label: this.data.rows[r],
      value: this.data.values[i], missing: this.data.status[i] !== 0,
      anomalies: this.anomalyAt.get(i) || [],
    };
  }

  _hover(e) {
    const cell = this.cellAt(e);
    this.onHover(cell, e);
  }

  select(row, col) {
    this.selected = row === null ? null : [row, col];
    this.canvas.dataset.selected = row === null ? "" : `${row},${col}`;
    this.draw();
    if (row === null || !this.geometry) return;
    const y = 28 + row * this.geometry.ch, x = this.geometry.labelW + col * this.geometry.cw;
    this.scroll.scrollTop = Math.max(0, y - this.scroll.clientHeight / 2);
    this.scroll.scrollLeft = Math.max(0, x - this.scroll.clientWidth / 2);
  }
}

function hex(color) {
  return [1, 3, 5].map((i) => parseInt(color.slice(i, i + 2), 16));
}

function clip(ctx, text, width) {
  if (ctx.measureText(text).width <= width) return text;
  let lo = 0, hi = text.length;
  while (lo < hi) {
    const mid = (lo + hi + 1) >> 1;
    if (ctx.measureText("…" + text.slice(text.length - mid)).width <= width) lo = mid;
    else hi = mid - 1;
  }
  return "…" + text.slice(text.length - lo);
}
