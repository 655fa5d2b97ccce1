// BucketServe operator dashboard: polls the monitor's dashboard data and draws SVG charts.
// No libraries and no network beyond the data URL; the chart builders return SVG markup
// strings so they can be checked outside a browser (see the node test).
"use strict";

const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];
const CLASS_COLORS = { online: "#2563eb", offline: "#ea580c" };
const QUANTILE_COLORS = { p50: "#16a34a", p90: "#ca8a04", p99: "#dc2626" };

function esc(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

function fmtNumber(v, digits) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toFixed(1) + "G";
  if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(1) + "k";
  const d = digits === undefined ? (a >= 100 ? 0 : a >= 10 ? 1 : 2) : digits;
  return v.toFixed(d);
}

function fmtPercent(v) {
  return v === null || v === undefined ? "–" : (100 * v).toFixed(1) + "%";
}

function fmtBytes(v) {
  if (v === null || v === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return v.toFixed(i ? 1 : 0) + " " + units[i];
}

function fmtTime(epochS) {
  const d = new Date(epochS * 1000);
  return String(d.getHours()).padStart(2, "0") + ":" + String(d.getMinutes()).padStart(2, "0") + ":" + String(d.getSeconds()).padStart(2, "0");
}

// "Nice" axis maximum so that gridlines fall on round numbers.
function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

// Line chart over shared x values. series: [{name, values (numbers or null), color}].
// opts: {yMax, yFormat, width}. A null breaks the line; a lone point is a dot.
function lineChartSvg(t, series, opts) {
  opts = opts || {};
  // Wide panels get a wider viewBox rather than stretched text.
  const W = opts.width || 560, H = 200, R = 10, T = 10, B = 24;
  const fmt = opts.yFormat || fmtNumber;
  let maxV = 0;
  let points = 0;
  for (const s of series) for (const v of s.values) if (v !== null && v !== undefined) { maxV = Math.max(maxV, v); points += 1; }
  const yMax = opts.yMax !== undefined ? opts.yMax : niceMax(maxV);
  // The left margin fits the widest y label ("23.3 GiB" needs more room than "0.50").
  const widest = Math.max(...[0, 1, 2, 3, 4].map((g) => fmt((yMax * g) / 4).length));
  const L = Math.max(40, Math.ceil(10 + 6.6 * widest));
  const n = t.length;
  const x = (i) => L + (n > 1 ? (i * (W - L - R)) / (n - 1) : (W - L - R) / 2);
  const y = (v) => T + (H - T - B) * (1 - Math.min(v, yMax) / yMax);
  const out = [`<svg viewBox="0 0 ${W} ${H}" class="chart" role="img" data-points="${points}">`];
  for (let g = 0; g <= 4; g += 1) {
    const v = (yMax * g) / 4;
    out.push(`<line class="grid" x1="${L}" x2="${W - R}" y1="${y(v).toFixed(1)}" y2="${y(v).toFixed(1)}"/>`);
    out.push(`<text class="axis" x="${L - 4}" y="${(y(v) + 3).toFixed(1)}" text-anchor="end">${esc(fmt(v))}</text>`);
  }
  if (n > 0) {
    // The end labels hug the plot edges so the newest time is not cut off at the right.
    const ticks = n > 2 ? [[0, "start"], [Math.floor((n - 1) / 2), "middle"], [n - 1, "end"]] : n > 1 ? [[0, "start"], [n - 1, "end"]] : [[0, "middle"]];
    for (const [i, anchor] of ticks) {
      out.push(`<text class="axis" x="${x(i).toFixed(1)}" y="${H - 6}" text-anchor="${anchor}">${esc(fmtTime(t[i]))}</text>`);
    }
  }
  // An empty plot says so, rather than looking like a flat line at zero.
  if (points === 0) {
    out.push(`<text class="no-data" x="${(W + L - R) / 2}" y="${(H - B + T) / 2}" text-anchor="middle">no data in this window</text>`);
  }
  series.forEach((s, k) => {
    const color = s.color || COLORS[k % COLORS.length];
    let d = "";
    let pen = false;
    s.values.forEach((v, i) => {
      if (v === null || v === undefined) { pen = false; return; }
      const isolated = (i === 0 || s.values[i - 1] == null) && (i === n - 1 || s.values[i + 1] == null);
      // Earlier series get bigger dots, so equal values (both classes at 100%) stay visible as rings.
      const r = 2.5 + 1.5 * (series.length - 1 - k);
      if (isolated) out.push(`<circle cx="${x(i).toFixed(1)}" cy="${y(v).toFixed(1)}" r="${r}" fill="${color}"/>`);
      d += (pen ? "L" : "M") + x(i).toFixed(1) + " " + y(v).toFixed(1) + " ";
      pen = true;
    });
    if (d) out.push(`<path class="line" data-series="${esc(s.name)}" d="${d.trim()}" stroke="${color}"/>`);
  });
  out.push("</svg>");
  const legend = series.map((s, k) => `<span class="key"><i style="background:${s.color || COLORS[k % COLORS.length]}"></i>${esc(s.name)}</span>`).join("");
  return out.join("") + `<div class="legend">${legend}</div>`;
}

// Bars for the request buckets: one per bucket [low, high), labelled with its range.
function barChartSvg(labels, values) {
  const W = 560, H = 200, L = 48, R = 10, T = 10, B = 36;
  const yMax = niceMax(Math.max(0, ...values));
  const n = labels.length;
  const slot = n ? (W - L - R) / n : 0;
  const y = (v) => T + (H - T - B) * (1 - v / yMax);
  const out = [`<svg viewBox="0 0 ${W} ${H}" class="chart" role="img" data-points="${n}">`];
  for (let g = 0; g <= 4; g += 1) {
    const v = (yMax * g) / 4;
    out.push(`<line class="grid" x1="${L}" x2="${W - R}" y1="${y(v).toFixed(1)}" y2="${y(v).toFixed(1)}"/>`);
    out.push(`<text class="axis" x="${L - 4}" y="${(y(v) + 3).toFixed(1)}" text-anchor="end">${esc(fmtNumber(v, 0))}</text>`);
  }
  labels.forEach((label, i) => {
    const bx = L + i * slot + slot * 0.15;
    const by = y(values[i]);
    out.push(`<rect class="bar" data-bucket="${esc(label)}" x="${bx.toFixed(1)}" y="${by.toFixed(1)}" width="${(slot * 0.7).toFixed(1)}" height="${(H - B - by).toFixed(1)}"/>`);
    out.push(`<text class="axis" x="${(bx + slot * 0.35).toFixed(1)}" y="${(by - 3).toFixed(1)}" text-anchor="middle">${values[i]}</text>`);
    out.push(`<text class="axis" x="${(bx + slot * 0.35).toFixed(1)}" y="${H - 20}" text-anchor="middle">${esc(label)}</text>`);
  });
  out.push(`<text class="axis" x="${(W + L) / 2}" y="${H - 4}" text-anchor="middle">prompt tokens</text>`);
  out.push("</svg>");
  return out.join("");
}

function classSeries(byClass) {
  return Object.keys(byClass).map((c) => ({ name: c, values: byClass[c], color: CLASS_COLORS[c] }));
}

function quantileSeries(byQuantile) {
  return Object.keys(byQuantile).map((q) => ({ name: q, values: byQuantile[q], color: QUANTILE_COLORS[q] }));
}

function workersTableHtml(workers) {
  const head = "<tr><th>worker</th><th>role</th><th>health</th><th>last seen</th><th>KV used</th><th>KV blocks free</th><th>free memory</th><th>queue</th><th>running</th><th>batch ms</th><th>warmed</th><th>compilations</th></tr>";
  const rows = workers.map((w) => {
    const health = w.up ? '<span class="up">up</span>' : '<span class="down">down</span>';
    return `<tr data-worker="${esc(w.worker_id)}" class="${w.up ? "" : "is-down"}"><td>${esc(w.worker_id)}</td><td>${esc(w.role)}</td><td>${health}</td>` +
      `<td>${fmtNumber(w.age_s, 1)} s ago</td><td>${fmtPercent(w.kv_usage)}</td><td>${w.kv_blocks_free} / ${w.kv_blocks_total}</td>` +
      `<td>${fmtBytes(w.free_memory_bytes)}</td><td>${w.queue_len}</td><td>${w.running}</td><td>${fmtNumber(w.batch_latency_ms)}</td>` +
      `<td>${w.warmed ? "yes" : "no"}</td><td class="${w.runtime_compilations ? "down" : ""}">${w.runtime_compilations}</td></tr>`;
  });
  return `<table><thead>${head}</thead><tbody>${rows.join("") || '<tr><td colspan="12">no worker has reported yet</td></tr>'}</tbody></table>`;
}

// Where the time to first token goes, one row per stage in the order a request passes them (monitor/stages.py).
const TTFT_STAGES = ["admission", "controller_queue", "prefill_queue", "prefill_forward", "first_token_out"];

function stagesTableHtml(stages) {
  const names = Object.keys(stages || {});
  if (!names.length) {
    return '<p class="empty">no request with measured stages in this window</p>';
  }
  const head = "<tr><th>stage</th><th>part of</th><th>requests</th><th>mean ms</th><th>p50 ms</th><th>p90 ms</th><th>p99 ms</th></tr>";
  const rows = names.map((n) => {
    const s = stages[n];
    const part = TTFT_STAGES.includes(n) ? "time to first token" : n === "overhead" ? "TTFT less prefill forward" : "hand-off to decode";
    return `<tr data-stage="${esc(n)}"><td>${esc(n)}</td><td>${part}</td><td>${fmtNumber(s.count, 0)}</td><td>${fmtNumber(s.mean_ms)}</td>` +
      `<td>${fmtNumber(s.p50_ms)}</td><td>${fmtNumber(s.p90_ms)}</td><td>${fmtNumber(s.p99_ms)}</td></tr>`;
  });
  return `<table><thead>${head}</thead><tbody>${rows.join("")}</tbody></table>`;
}

// Everything the page shows, as {element id: inner HTML}; render() only writes these.
function buildView(d) {
  const view = {};
  const totals = d.window_totals || {};
  view["slo-headline"] = d.classes.map((c) => {
    const tot = totals[c] || {};
    return `<div class="stat"><span class="stat-label">${esc(c)} SLO attainment</span><span class="stat-value" style="color:${CLASS_COLORS[c] || "#111"}">${fmtPercent(tot.slo_attainment)}</span><span class="stat-sub">${fmtNumber(tot.requests, 0)} requests, ${fmtNumber(tot.errors, 0)} errors</span></div>`;
  }).join("");
  const up = d.workers.filter((w) => w.up).length;
  view["health-headline"] = `<div class="stat"><span class="stat-label">workers up</span><span class="stat-value ${up < d.workers.length ? "down" : ""}">${up} / ${d.workers.length}</span></div>`;
  view["compilations"] = `<div class="stat"><span class="stat-label">runtime compilations</span><span class="stat-value ${d.runtime_compilations ? "down" : ""}">${d.runtime_compilations}</span><span class="stat-sub">shapes compiled while serving</span></div>`;
  const sc = d.scaling_events || {};
  const role = (r) => `${r} +${(sc[r] || {}).up || 0} / \u2212${(sc[r] || {}).down || 0}`;
  view["scaling"] = `<div class="stat"><span class="stat-label">autoscaling</span><span class="stat-value">${["prefill", "decode"].reduce((n, r) => n + ((sc[r] || {}).up || 0) + ((sc[r] || {}).down || 0), 0)}</span><span class="stat-sub">workers added / drained: ${role("prefill")}, ${role("decode")}</span></div>`;
  const lent = Object.values(d.lending || {});
  const lentBatches = lent.reduce((n, w) => n + w.batches, 0);
  const lentPrompts = lent.reduce((n, w) => n + w.prompts, 0);
  const lentCores = lent.reduce((n, w) => n + (w.core_batches || 0), 0);
  view["lending"] = `<div class="stat"><span class="stat-label">elastic prefill</span><span class="stat-value">${lentBatches}</span><span class="stat-sub">batches decode workers prefilled themselves (${lentPrompts} prompts); ${lentCores} prefill batches ran on a decode worker's cores too</span></div>`;
  view["slo-chart"] = lineChartSvg(d.t, classSeries(d.slo_attainment), { yMax: 1, yFormat: fmtPercent, width: 1120 });
  view["goodput-chart"] = lineChartSvg(d.t, classSeries(d.goodput_rps));
  view["rate-chart"] = lineChartSvg(d.t, [
    ...classSeries(d.request_rate_rps).map((s) => ({ ...s, name: s.name + " finished" })),
    { name: "arrivals", values: d.arrival_rate_rps, color: "#6b7280" },
  ]);
  view["ttft-chart"] = lineChartSvg(d.t, quantileSeries(d.ttft_ms));
  view["tpot-chart"] = lineChartSvg(d.t, quantileSeries(d.tpot_ms));
  view["tokens-chart"] = lineChartSvg(d.t, [
    { name: "prompt tok/s", values: d.tokens_per_s.prompt, color: "#0891b2" },
    { name: "output tok/s", values: d.tokens_per_s.output, color: "#9333ea" },
  ]);
  view["queue-chart"] = lineChartSvg(d.t, [
    { name: "queued in buckets", values: d.queue_depth, color: "#dc2626" },
    { name: "bucket count", values: d.bucket_count, color: "#6b7280" },
  ]);
  if (d.buckets) {
    view["buckets-chart"] = barChartSvg(d.buckets.labels, d.buckets.queue_depths);
    view["bucket-boundaries"] = `boundaries: ${d.buckets.boundaries.map((b) => esc(b)).join(" | ")} (as of ${esc(fmtTime(d.buckets.timestamp))})`;
  } else {
    view["buckets-chart"] = '<p class="empty">no request buckets: the bucketing controller has not pushed its buckets yet (a single-engine gateway has none)</p>';
    view["bucket-boundaries"] = "";
  }
  const workerIds = Object.keys(d.worker_kv_usage);
  view["kv-chart"] = lineChartSvg(d.t, workerIds.map((w) => ({ name: w, values: d.worker_kv_usage[w] })), { yMax: 1, yFormat: fmtPercent });
  view["mem-chart"] = lineChartSvg(d.t, workerIds.map((w) => ({ name: w, values: d.worker_free_memory_bytes[w] })), { yFormat: fmtBytes });
  view["workers-table"] = workersTableHtml(d.workers);
  view["stages-table"] = stagesTableHtml(d.stages);
  return view;
}

// The API key (when the server has one) is typed into the login form and kept in this tab's session
// storage only: never in the URL (logs, history) nor in a cookie. It is sent as a Bearer header.
const KEY_STORAGE = "bucketserve_api_key";

function apiKey() {
  return window.sessionStorage.getItem(KEY_STORAGE);
}

// Show or hide the login form; while it is shown the page does not poll.
function showLogin(message) {
  const form = document.getElementById("login");
  form.hidden = false;
  document.body.dataset.auth = "needed";
  document.getElementById("login-error").textContent = message || "";
  const status = document.getElementById("status");
  status.textContent = "API key needed";
  status.className = "down";
  document.getElementById("login-key").focus();
}

function hideLogin() {
  document.getElementById("login").hidden = true;
  document.getElementById("login-error").textContent = "";
  document.body.dataset.auth = "ok";
}

async function refresh() {
  const body = document.body;
  if (body.dataset.auth === "needed") return;
  const windowS = document.getElementById("window-select").value;
  const headers = {};
  const key = apiKey();
  if (key) headers["Authorization"] = "Bearer " + key;
  const status = document.getElementById("status");
  try {
    const resp = await fetch(`${body.dataset.url}?window_s=${encodeURIComponent(windowS)}`, { headers, cache: "no-store" });
    if (resp.status === 401) {
      // No key yet: ask for one. A key that was sent and refused is dropped, and the form says so.
      window.sessionStorage.removeItem(KEY_STORAGE);
      showLogin(key ? "The server did not accept this API key. Check it and try again." : "");
      return;
    }
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    const data = await resp.json();
    hideLogin();
    const view = buildView(data);
    for (const id of Object.keys(view)) {
      const el = document.getElementById(id);
      if (el) el.innerHTML = view[id];
    }
    status.textContent = `updated ${fmtTime(data.time)} · ${data.resolution_s} s resolution`;
    status.className = "ok";
    body.dataset.loaded = "true";
  } catch (err) {
    status.textContent = `cannot load data: ${err.message}`;
    status.className = "down";
  }
}

function login(event) {
  event.preventDefault();
  const input = document.getElementById("login-key");
  const key = input.value.trim();
  if (!key) return;
  window.sessionStorage.setItem(KEY_STORAGE, key);
  input.value = "";
  document.body.dataset.auth = "trying";
  document.getElementById("login-error").textContent = "checking…";
  refresh();
}

function start() {
  const every = Number(document.body.dataset.refreshMs || 2000);
  document.getElementById("window-select").addEventListener("change", refresh);
  document.getElementById("login").addEventListener("submit", login);
  refresh();
  window.setInterval(refresh, every);
}

if (typeof module !== "undefined" && module.exports) {
  module.exports = { lineChartSvg, barChartSvg, buildView, workersTableHtml, niceMax, fmtNumber, fmtBytes };
} else {
  document.addEventListener("DOMContentLoaded", start);
}
