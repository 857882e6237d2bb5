// A small line chart on a canvas: a few series over the last minutes, horizontal marks
// (dashed), no axes library. Enough for "how did this move", not for reading exact values
// (the numbers next to each chart do that).

export const COLORS = ["#2458b3", "#c62828", "#1a7f37", "#b35900", "#7b1fa2", "#00838f"];

/** A bounded history of samples: {t, ...values}; oldest dropped past `max`. */
export class Ring {
  constructor(max) { this.max = max; this.items = []; }
  push(x) {
    this.items.push(x);
    if (this.items.length > this.max) this.items.splice(0, this.items.length - this.max);
  }
}

/**
 * Draw `series` ([{key, label, color}]) of `samples` on `canvas`, x = time over `spanS`
 * seconds ending now, y from 0 to `yMax` (or the largest value), plus `marks` ([{y, color}]).
 */
export function drawChart(canvas, samples, series, { spanS = 300, yMax = null, marks = [] } = {}) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || canvas.width;
  const h = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(w * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const pad = { l: 30, r: 4, t: 4, b: 12 };
  const now = samples.length ? samples[samples.length - 1].t : Date.now() / 1000;
  let top = yMax;
  if (top === null) {
    top = 1;
    for (const s of samples) {
      for (const { key } of series) if (s[key] != null && s[key] > top) top = s[key];
    }
    top = Math.ceil(top * 1.1);
  }
  const x = (t) => pad.l + (w - pad.l - pad.r) * (1 - (now - t) / spanS);
  const y = (v) => pad.t + (h - pad.t - pad.b) * (1 - Math.min(v, top) / top);
  ctx.strokeStyle = "#ddd";
  ctx.lineWidth = 1;
  ctx.strokeRect(pad.l, pad.t, w - pad.l - pad.r, h - pad.t - pad.b);
  ctx.fillStyle = "#6b6b70";
  ctx.font = "10px system-ui, sans-serif";
  ctx.textAlign = "right";
  ctx.fillText(fmtTick(top), pad.l - 3, pad.t + 8);
  ctx.fillText("0", pad.l - 3, h - pad.b);
  ctx.textAlign = "left";
  ctx.fillText(spanS < 120 ? `-${Math.round(spanS)} s` : `-${Math.round(spanS / 60)} min`, pad.l + 2, h - 1);
  ctx.setLineDash([4, 3]);
  for (const m of marks) {
    if (m.y == null) continue;
    ctx.strokeStyle = m.color;
    ctx.beginPath();
    ctx.moveTo(pad.l, y(m.y));
    ctx.lineTo(w - pad.r, y(m.y));
    ctx.stroke();
  }
  ctx.setLineDash([]);
  ctx.lineWidth = 1.5;
  for (const { key, color } of series) {
    ctx.strokeStyle = color;
    ctx.beginPath();
    let pen = false;
    for (const s of samples) {
      if (now - s.t > spanS || s[key] == null) { pen = false; continue; }
      if (pen) ctx.lineTo(x(s.t), y(s[key]));
      else ctx.moveTo(x(s.t), y(s[key]));
      pen = true;
    }
    ctx.stroke();
  }
}

function fmtTick(v) {
  return v >= 10 ? String(Math.round(v)) : String(Math.round(v * 100) / 100);
}

/** The legend as DOM nodes (textContent only: names come from the config). */
export function legend(series, marks = []) {
  const div = document.createElement("div");
  div.className = "legend";
  for (const s of [...series, ...marks.filter((m) => m.label)]) {
    const i = document.createElement("i");
    i.style.background = s.color;
    div.append(i, s.label);
  }
  return div;
}
