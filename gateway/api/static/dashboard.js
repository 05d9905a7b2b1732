// Prism's latency dashboard: polls /dashboard/data and draws with <canvas>.
// No external libraries, so it works offline and behind any firewall.
"use strict";

const COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];
const GRID = "#2a3441", MUTED = "#8b98a5";

function fit(canvas) {
  const ratio = window.devicePixelRatio || 1, width = canvas.clientWidth, height = canvas.height / (canvas._ratio || 1);
  canvas._ratio = ratio;
  canvas.width = width * ratio; canvas.height = height * ratio;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.font = "11px system-ui, sans-serif";
  return { ctx, width, height };
}

function fmt(value, digits = 1) { return value === null || value === undefined ? "–" : Number(value).toFixed(digits); }

// One bar per TTFT percentile: the mean stages of the requests near it, which add up to
// their TTFT (each stage's own percentiles would not: the table beside shows those).
function stackedBars(canvas, stages, breakdown) {
  const { ctx, width, height } = fit(canvas);
  ctx.clearRect(0, 0, width, height);
  const rows = ["p50", "p95"], left = 40, top = 8, barHeight = 34, gap = 14;
  const totals = rows.map(q => breakdown[q] ? breakdown[q].ttft : 0);
  const scale = (width - left - 10) / Math.max(1, ...totals);
  rows.forEach((q, row) => {
    const y = top + row * (barHeight + gap);
    ctx.fillStyle = MUTED; ctx.fillText(q, 4, y + barHeight / 2 + 4);
    let x = left;
    if (!breakdown[q]) { ctx.fillText("no requests yet", x, y + barHeight / 2 + 4); return; }
    stages.forEach((stage, i) => {
      const w = Math.max(0, breakdown[q].stages[stage] || 0) * scale;
      ctx.fillStyle = COLORS[i % COLORS.length]; ctx.fillRect(x, y, w, barHeight);
      x += w;
    });
    ctx.fillStyle = "#e6e6e6"; ctx.fillText(`${fmt(totals[row])} ms`, Math.min(x + 6, width - 60), y + barHeight / 2 + 4);
  });
  let x = left, y = top + 2 * (barHeight + gap) + 6;
  stages.forEach((stage, i) => {
    const label = stage, w = ctx.measureText(label).width + 26;
    if (x + w > width) { x = left; y += 16; }
    ctx.fillStyle = COLORS[i % COLORS.length]; ctx.fillRect(x, y - 9, 10, 10);
    ctx.fillStyle = MUTED; ctx.fillText(label, x + 14, y); x += w;
  });
}

function lineChart(canvas, points, series, { percent = false } = {}) {
  const { ctx, width, height } = fit(canvas);
  ctx.clearRect(0, 0, width, height);
  const left = 44, right = 8, top = 8, bottom = 20;
  const values = points.flatMap(p => series.map(s => p[s.key])).filter(v => v !== null && v !== undefined);
  const max = percent ? 1 : Math.max(1, ...values) * 1.1;
  const ts = points.map(p => p.t), t0 = Math.min(...ts), t1 = Math.max(t0 + 1, ...ts);
  const xOf = t => left + (t - t0) / (t1 - t0) * (width - left - right);
  const yOf = v => top + (1 - v / max) * (height - top - bottom);
  ctx.strokeStyle = GRID; ctx.fillStyle = MUTED;
  for (let i = 0; i <= 4; i++) {
    const v = max * i / 4, y = yOf(v);
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(width - right, y); ctx.stroke();
    ctx.fillText(percent ? `${Math.round(v * 100)}%` : fmt(v, v < 10 ? 1 : 0), 2, y + 4);
  }
  if (!points.length) { ctx.fillText("no data yet", left + 10, height / 2); return; }
  series.forEach((s, i) => {
    ctx.strokeStyle = COLORS[i % COLORS.length]; ctx.lineWidth = 2; ctx.beginPath();
    let drawing = false;
    points.forEach(p => {
      const v = p[s.key];
      if (v === null || v === undefined) { drawing = false; return; }
      const x = xOf(p.t), y = yOf(v);
      drawing ? ctx.lineTo(x, y) : ctx.moveTo(x, y); drawing = true;
    });
    ctx.stroke(); ctx.lineWidth = 1;
    ctx.fillStyle = COLORS[i % COLORS.length];
    points.forEach(p => {  // dots, so isolated values show too
      const v = p[s.key];
      if (v !== null && v !== undefined) { ctx.beginPath(); ctx.arc(xOf(p.t), yOf(v), 2.5, 0, 2 * Math.PI); ctx.fill(); }
    });
    ctx.fillStyle = COLORS[i % COLORS.length]; ctx.fillText(s.label, left + 8 + i * 70, height - 4);
  });
}

function renderTable(stages, data) {
  const body = document.querySelector("#stage-table tbody");
  body.innerHTML = "";
  stages.forEach((stage, i) => {
    const row = document.createElement("tr");
    const ran = data[stage].ran === null ? "–" : `${(data[stage].ran * 100).toFixed(0)}%`;
    row.innerHTML = `<td><span class="swatch" style="background:${COLORS[i % COLORS.length]}"></span>${stage}</td>` +
      `<td data-stage="${stage}" data-q="ran">${ran}</td><td data-stage="${stage}" data-q="p50">${fmt(data[stage].p50, 2)}</td><td data-stage="${stage}" data-q="p95">${fmt(data[stage].p95, 2)}</td>`;
    body.appendChild(row);
  });
}

function render(d) {
  const stages = Object.keys(d.stages);
  document.getElementById("requests").textContent = d.requests;
  document.getElementById("throughput").textContent = `${fmt(d.throughput_rps, 2)} req/s`;
  document.getElementById("ttft").textContent = `${fmt(d.ttft.p50, 0)} / ${fmt(d.ttft.p95, 0)} ms`;
  document.getElementById("cache-hit-rate").textContent = d.cache_hit_rate === null ? "–" : `${(d.cache_hit_rate * 100).toFixed(1)}%`;
  document.getElementById("errors").textContent = d.errors;
  stackedBars(document.getElementById("stages"), stages, d.breakdown);
  renderTable(stages, d.stages);
  lineChart(document.getElementById("ttft-chart"), d.series, [{ key: "ttft_p50", label: "p50" }, { key: "ttft_p95", label: "p95" }]);
  lineChart(document.getElementById("tpot-chart"), d.series, [{ key: "tpot_p50", label: "p50" }, { key: "tpot_p95", label: "p95" }]);
  lineChart(document.getElementById("rps-chart"), d.series, [{ key: "rps", label: "req/s" }]);
  lineChart(document.getElementById("cache-chart"), d.series, [{ key: "cache_hit_rate", label: "hit rate" }], { percent: true });
  lineChart(document.getElementById("batch-chart"), d.services, [{ key: "batch_size", label: "images" }]);
  lineChart(document.getElementById("queue-chart"), d.services, [
    { key: "encoder_queue", label: "encoder" }, { key: "engine_waiting", label: "engine" }, { key: "gateway_in_flight", label: "gateway" }]);
  document.getElementById("status").textContent = `last ${d.window_s}s · updated ${new Date().toLocaleTimeString()}`;
  document.body.dataset.ready = "1";
}

async function refresh() {
  try {
    const response = await fetch("/dashboard/data", { cache: "no-store" });
    render(await response.json());
  } catch (err) {
    document.getElementById("status").textContent = `cannot reach the gateway: ${err}`;
  }
}

refresh();
setInterval(refresh, 2000);
