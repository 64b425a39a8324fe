// Line charts drawn on a <canvas> (no library): x = step, one line per series, dots at each point.
export const PALETTE = ["#1a56db", "#c5221f", "#1e8e3e", "#b06000", "#7e3af2", "#0e7490", "#be185d", "#4b5563"];

function ticks(lo, hi, count) {
  if (hi === lo) return [lo];
  const raw = (hi - lo) / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
  return out;
}

// series: [{name, points: [[x, y], ...]}]; options: {yMin, yMax} fix the y range (else it fits the data).
export function lineChart(canvas, series, options = {}) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 330;
  const height = canvas.clientHeight || 190;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const g = canvas.getContext("2d");
  g.scale(ratio, ratio);
  g.font = "11px system-ui, sans-serif";
  const points = series.flatMap((s) => s.points);
  canvas.dataset.points = String(points.length);
  if (points.length === 0) {
    g.fillStyle = "#667085";
    g.fillText(options.empty || "no data", 12, height / 2);
    return;
  }
  const xs = points.map((p) => p[0]);
  const ys = points.map((p) => p[1]);
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let y0 = options.yMin ?? Math.min(...ys);
  let y1 = options.yMax ?? Math.max(...ys);
  if (x0 === x1) [x0, x1] = [x0 - 1, x1 + 1];
  if (y0 === y1) [y0, y1] = [y0 - 0.5, y1 + 0.5];
  const box = { left: 46, right: width - 8, top: 8 + 14 * Math.ceil(series.length / 3), bottom: height - 22 };
  const px = (x) => box.left + ((x - x0) / (x1 - x0)) * (box.right - box.left);
  const py = (y) => box.bottom - ((y - y0) / (y1 - y0)) * (box.bottom - box.top);

  g.strokeStyle = "#d0d5dd";
  g.fillStyle = "#667085";
  g.lineWidth = 1;
  g.textAlign = "right";
  for (const v of ticks(y0, y1, 4)) {
    g.beginPath();
    g.moveTo(box.left, py(v));
    g.lineTo(box.right, py(v));
    g.stroke();
    g.fillText(String(Number(v.toPrecision(3))), box.left - 4, py(v) + 3);
  }
  g.textAlign = "center";
  for (const v of ticks(x0, x1, 6).filter(Number.isInteger)) g.fillText(String(v), px(v), box.bottom + 14);

  series.forEach((s, i) => {
    const color = PALETTE[i % PALETTE.length];
    g.strokeStyle = color;
    g.fillStyle = color;
    g.lineWidth = 1.6;
    g.beginPath();
    s.points.forEach(([x, y], j) => (j === 0 ? g.moveTo(px(x), py(y)) : g.lineTo(px(x), py(y))));
    g.stroke();
    for (const [x, y] of s.points) {
      g.beginPath();
      g.arc(px(x), py(y), 2.5, 0, 2 * Math.PI);
      g.fill();
    }
    const lx = box.left + (i % 3) * 95;
    const ly = 10 + 14 * Math.floor(i / 3);
    g.fillRect(lx, ly - 7, 9, 9);
    g.textAlign = "left";
    g.fillStyle = "#1d2330";
    g.fillText(s.name, lx + 13, ly + 1);
  });
}
