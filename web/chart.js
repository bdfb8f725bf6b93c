// A small live line chart on a <canvas>: the last N samples of a few series, no library.
//
// Series: [{key, label, color: CSS custom property name, unit, max: number | "auto"}].
// "auto" series share the left scale (rounded up to a readable value); a numeric max gives a
// series its own fixed scale (drawn dashed, labelled on the right).

const PAD = { top: 16, right: 36, bottom: 6, left: 6 };
const MIN_WINDOW = 30;  // samples across the width while the history is still short

export class LiveChart {
  constructor(canvas, series, capacity = 120) {
    this.canvas = canvas;
    this.series = series;
    this.capacity = capacity;
    this.samples = [];
    new ResizeObserver(() => this.draw()).observe(canvas);
  }

  push(sample) {
    this.samples.push(sample);
    if (this.samples.length > this.capacity) this.samples.shift();
    this.draw();
  }

  draw() {
    const { canvas } = this;
    const dpr = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    if (!width || !height) return;
    canvas.width = Math.round(width * dpr);
    canvas.height = Math.round(height * dpr);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const color = (name) => this.color(name) || "#888";
    const plot = { x: PAD.left, y: PAD.top, w: width - PAD.left - PAD.right,
                   h: height - PAD.top - PAD.bottom };
    const autoMax = niceMax(Math.max(0, ...this.autoValues()));
    this.drawGrid(ctx, plot, color("--chart-grid"), color("--muted"), autoMax);
    for (const series of this.series) {
      const max = series.max === "auto" ? autoMax : series.max;
      this.drawSeries(ctx, plot, series, max, color(series.color));
    }
  }

  color(customProperty) {
    return getComputedStyle(this.canvas).getPropertyValue(customProperty).trim();
  }

  autoValues() {
    const keys = this.series.filter((s) => s.max === "auto").map((s) => s.key);
    return this.samples.flatMap((sample) => keys.map((k) => sample[k] || 0));
  }

  drawGrid(ctx, plot, gridColor, textColor, autoMax) {
    ctx.strokeStyle = gridColor;
    ctx.lineWidth = 1;
    for (let i = 0; i <= 4; i += 1) {
      const y = Math.round(plot.y + (plot.h * i) / 4) + 0.5;
      ctx.beginPath();
      ctx.moveTo(plot.x, y);
      ctx.lineTo(plot.x + plot.w, y);
      ctx.stroke();
    }
    ctx.fillStyle = textColor;
    ctx.font = "11px system-ui, sans-serif";
    ctx.textBaseline = "bottom";
    const auto = this.series.find((s) => s.max === "auto");
    if (auto) ctx.fillText(`${autoMax} ${auto.unit}`, plot.x, plot.y - 2);
    const fixed = this.series.find((s) => s.max !== "auto");
    if (fixed) {
      ctx.textAlign = "right";
      const label = fixed.unit === "%" ? "100%" : `${fixed.max}`;
      ctx.fillStyle = this.color(fixed.color) || textColor;
      ctx.fillText(label, plot.x + plot.w + PAD.right, plot.y + 10);
      ctx.textAlign = "left";
    }
  }

  drawSeries(ctx, plot, series, max, stroke) {
    const values = this.samples.map((sample) => sample[series.key]);
    if (values.length < 2) return;
    const numSlots = Math.min(this.capacity, Math.max(MIN_WINDOW, this.samples.length));
    const step = plot.w / (numSlots - 1);
    const x0 = plot.x + plot.w - step * (values.length - 1);  // newest sample at the right
    const y = (v) => plot.y + plot.h - (Math.min(Math.max(v || 0, 0), max) / max) * plot.h;
    ctx.beginPath();
    values.forEach((v, i) => (i ? ctx.lineTo : ctx.moveTo).call(ctx, x0 + i * step, y(v)));
    ctx.strokeStyle = stroke;
    ctx.lineWidth = 2;
    ctx.lineJoin = "round";
    ctx.setLineDash(series.max === "auto" ? [] : [4, 3]);
    ctx.stroke();
    ctx.setLineDash([]);
    if (series.max !== "auto") return;
    ctx.lineTo(x0 + (values.length - 1) * step, plot.y + plot.h);
    ctx.lineTo(x0, plot.y + plot.h);
    ctx.closePath();
    ctx.globalAlpha = 0.15;
    ctx.fillStyle = stroke;
    ctx.fill();
    ctx.globalAlpha = 1;
  }
}

/** The smallest of 1, 2, 5 x 10^k at or above `value` (at least 10). */
function niceMax(value) {
  let scale = 10;
  for (;;) {
    for (const m of [1, 2, 5]) if (m * scale >= value) return m * scale;
    scale *= 10;
  }
}
