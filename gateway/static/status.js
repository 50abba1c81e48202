// kvgate status page (gateway/status_page.py): polls GET /admin/report and GET /admin/replicas.
// The admin token comes from the URL fragment (#token=...), kept in sessionStorage; every value is
// written with textContent, never as HTML.
"use strict";

const REFRESH_MS = 2000;
const frag = new URLSearchParams(location.hash.slice(1));
if (frag.get("token")) sessionStorage.setItem("kvgate-token", frag.get("token"));
const token = sessionStorage.getItem("kvgate-token");

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function fmt(v, digits = 2) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  if (!Number.isInteger(v) && Math.abs(v) < Math.pow(10, -digits) && v !== 0) return v.toExponential(2);
  return v.toLocaleString("en-US", { maximumFractionDigits: Number.isInteger(v) ? 0 : digits });
}

const pct = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1) + " %");

function fill(id, headers, rows) {
  const t = document.getElementById(id);
  t.replaceChildren(el("tr", {}, ...headers.map((h) => el("th", {}, h))));
  for (const r of rows) t.append(el("tr", {}, ...r.map((c) => (c instanceof Node ? el("td", {}, c) : el("td", {}, c)))));
}

async function getJSON(path) {
  const r = await fetch(path, { headers: token ? { authorization: "Bearer " + token } : {} });
  if (!r.ok) throw new Error(path + ": " + r.status + " " + (await r.text()).slice(0, 200));
  return r.json();
}

function renderFleet(replicas, report) {
  const hits = report.savings.by_replica;
  const speed = report.savings.prefill_s_per_token;
  const life = report.cache_lifetime.replicas;
  fill("fleet", ["replica", "health", "agent", "in flight", "KV usage", "requests", "hit rate (engine)",
    "prediction exact", "prefill ms/1k tok", "residency p50 s"], replicas.map((r) => [
    r.id,
    el("span", { class: r.healthy ? "ok" : "bad" }, r.healthy ? "healthy" : "unhealthy"),
    r.agent_connected ? "connected" : "–",
    fmt(r.in_flight_requests),
    pct(r.kv_usage),
    fmt(r.requests),
    pct(hits[r.id] ? hits[r.id].hit_rate : null),
    pct(r.prediction_audit.exact_fraction),
    speed[r.id] === null || speed[r.id] === undefined ? "–" : fmt(speed[r.id] * 1e6),
    life[r.id] ? fmt(life[r.id].residency.p50_s) : "–",
  ]));
}

function renderSavings(s) {
  const t = s.totals;
  const cards = [
    ["USD saved", t.saved_usd === null ? "–" : "$" + fmt(t.saved_usd, 4)],
    ["prompt tokens from cache", fmt(t.saved_prefill_tokens)],
    ["hit rate (engine)", pct(t.hit_rate)],
    ["engine s saved", fmt(t.saved_engine_s)],
    ["GPU-s saved", fmt(t.saved_gpu_s)],
  ];
  document.getElementById("savings-cards").replaceChildren(
    ...cards.map(([k, v]) => el("div", { class: "card" }, el("div", { class: "v" }, v), el("div", { class: "k" }, k))));
  fill("savings", ["tenant", "model", "requests", "cached tok", "hit rate", "USD saved"], s.rows.map((r) => [
    r.tenant, r.model, fmt(r.requests), fmt(r.saved_prefill_tokens), pct(r.hit_rate),
    r.saved_usd === null ? "no price" : "$" + fmt(r.saved_usd, 4)]));
  document.getElementById("savings-note").textContent = t.unpriced_models.length
    ? "No price for: " + t.unpriced_models.join(", ") + " (operator.prices)." : "";
}

function renderLifetime(report) {
  const svg = document.getElementById("lifetime-chart");
  const ns = "http://www.w3.org/2000/svg";
  const res = report.cache_lifetime.all.buckets, gap = report.turns.turn_gap.buckets;
  const share = (b) => { const n = b.reduce((a, x) => a + x[1], 0); return b.map((x) => (n ? x[1] / n : 0)); };
  const a = share(res), g = share(gap);
  const w = svg.clientWidth || 600, h = 190, pad = 24, n = res.length, bw = (w - 2 * pad) / n;
  const top = Math.max(0.01, ...a, ...g);
  svg.replaceChildren();
  const add = (tag, attrs, text) => {
    const e = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    svg.append(e);
  };
  for (let i = 0; i < n; i++) {
    const x = pad + i * bw;
    add("rect", { x: x + 1, y: h - pad - (a[i] / top) * (h - 2 * pad), width: bw / 2 - 1, height: (a[i] / top) * (h - 2 * pad), fill: "#3b6fd8" });
    add("rect", { x: x + bw / 2, y: h - pad - (g[i] / top) * (h - 2 * pad), width: bw / 2 - 1, height: (g[i] / top) * (h - 2 * pad), fill: "#e39b2f" });
    if (i % 2 === 0) add("text", { x: x, y: h - 8 }, res[i][0] === null ? ">" : "≤" + res[i][0] + "s");
  }
  add("text", { x: pad, y: 12 }, "■ block residency (blue)   ■ gap between a session's turns (orange); share per bucket");
  const tt = report.turns;
  fill("turns", ["tenant", "returning turns", "prefix evicted", "eviction-miss share", "engine-miss share"],
    [...Object.entries(tt.by_tenant), ["all", tt.all]].map(([k, c]) => [
      k, fmt(c.returning_turns), fmt(c.prefix_evicted), pct(c.eviction_miss_share), pct(c.engine_miss_share)]));
}

function renderDecisions(ds) {
  fill("decisions", ["time", "tenant", "model", "replica", "reason", "matched blocks", "predicted cached",
    "engine cached", "TTFT ms", "scores"], ds.slice().reverse().slice(0, 20).map((d) => [
    new Date(d.at * 1000).toLocaleTimeString(), d.tenant, d.model, d.replica, d.reason, fmt(d.matched_blocks),
    fmt(d.predicted_cached_tokens), fmt(d.engine_cached_tokens), fmt(d.ttft_ms, 1),
    Object.entries(d.scores).map(([k, v]) => k + " " + fmt(v, 3)).join(", ")]));
}

async function refresh() {
  try {
    const [report, fleet] = await Promise.all([getJSON("/admin/report"), getJSON("/admin/replicas")]);
    renderFleet(fleet.replicas, report);
    renderSavings(report.savings);
    renderLifetime(report);
    renderDecisions(report.recent_decisions);
    document.getElementById("meta").textContent =
      fleet.replicas.length + " replicas · " + report.savings.totals.requests + " requests · updated " +
      new Date().toLocaleTimeString() + (report.trace.enabled ? " · recording trace" : "");
    document.getElementById("error").textContent = "";
    document.body.dataset.ready = "1";
  } catch (e) {
    document.getElementById("error").textContent = String(e.message || e);
    document.body.dataset.ready = "error";
  }
}

refresh();
setInterval(refresh, REFRESH_MS);
