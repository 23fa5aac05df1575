// The inflight dashboard: reads /dashboard/feed (server-sent events, read with
// fetch so that it can send the API key) and draws the slot strip, the tiles,
// the charts (uPlot), tenants and the latest requests. `window.inflightDashboard`
// holds what is drawn (the browser test reads it).
//
// Every redraw costs the browser a paint and a composite, so the page asks the
// feed for one frame per refresh period (1 s by default, chosen in the header),
// changes only what changed, and draws nothing while its tab is hidden.
"use strict";

const MAX_COLUMNS = 600;        // columns the strip keeps (newest right)
const COL_WIDTH = 3;            // pixels per column
const KEY_STORE = "inflight-api-key";
const REFRESH_STORE = "inflight-refresh";
const REFRESH_DEFAULT = "1";     // seconds between frames; "0" is paused
const COLOURS = { p: "#3b7ddd", d: "#2e9e5b", x: "#d9443a", h: "#b9bec6" };
const IDLE = "#f1f2f4";
const KIND_NAMES = { p: "prompt chunk", d: "decode", x: "preempted", h: "held, not computed" };

const state = { hello: null, columns: [], summary: null, load: null, replica: null };
window.inflightDashboard = state;

const $ = (id) => document.getElementById(id);
// Write a property only when it changes (an unchanged write still costs the
// page a layout).
function setProp(el, name, value) {
  if (el[name] !== value) el[name] = value;
}

function setText(id, text) { setProp($(id), "textContent", String(text)); }

// Seconds between frames, one of the picker's: from the address (#refresh=2),
// else as last chosen here, else 1.
function refreshPeriod() {
  const allowed = [...$("refresh").options].map((option) => option.value);
  const chosen = [new URLSearchParams(location.hash.slice(1)).get("refresh"),
                  localStorage.getItem(REFRESH_STORE)];
  return chosen.find((value) => allowed.includes(value)) || REFRESH_DEFAULT;
}

function apiKey() { return localStorage.getItem(KEY_STORE) || ""; }
function headers() {
  const key = apiKey();
  return key ? { Authorization: "Bearer " + key } : {};
}

function setStatus(text, kind) {
  const el = $("status");
  el.textContent = text;
  el.className = "status " + (kind || "");
}

// ------------------------------------------------------------------ feed
let feed = null;  // the open feed's AbortController

async function connect() {
  if (feed) feed.abort();
  const period = refreshPeriod();
  if (period === "0") { feed = null; setStatus("paused", ""); return; }
  const params = new URLSearchParams({ interval: period });
  if (state.replica) params.set("replica", state.replica);
  const controller = feed = new AbortController();
  let response;
  try {
    response = await fetch("/dashboard/feed?" + params, { headers: headers(), cache: "no-store",
                                                          signal: controller.signal });
  } catch (e) {
    return retry("server unreachable", controller);
  }
  if (response.status === 401) {
    setStatus("API key needed", "down");
    $("key-form").hidden = false;
    return;
  }
  if (!response.ok) return retry("feed error " + response.status, controller);
  $("key-form").hidden = true;
  setStatus("live", "live");
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        handle(buffer.slice(0, end));
        buffer = buffer.slice(end + 2);
      }
    }
  } catch (e) { /* the server went away, or the feed was closed here */ }
  retry("disconnected", controller);
}

// Connect again in a second, unless this feed was closed on purpose (paused,
// or replaced by one at another refresh period).
function retry(why, controller) {
  if (controller.signal.aborted) return;
  setStatus(why + ", retrying", "down");
  setTimeout(() => { if (feed === controller) connect(); }, 1000);
}

function handle(block) {
  let name = "message", data = "";
  for (const line of block.split("\n")) {
    if (line.startsWith("event: ")) name = line.slice(7);
    else if (line.startsWith("data: ")) data += line.slice(6);
  }
  if (!data) return;
  const payload = JSON.parse(data);
  if (name === "hello") onHello(payload);
  else if (name === "steps") onSteps(payload);
  else if (name === "load") onLoad(payload);
  else if (name === "summary") onSummary(payload);
}

function onHello(hello) {
  state.hello = hello;
  state.columns = [];
  state.replica = hello.replica;
  $("model").textContent = hello.model + " · " + hello.capacity + " slots";
  const pick = $("replica");
  if (hello.replicas.length > 1) {
    $("replica-pick").hidden = false;
    pick.innerHTML = "";
    for (const name of hello.replicas) {
      const option = document.createElement("option");
      option.value = option.textContent = name;
      option.selected = name === hello.replica;
      pick.appendChild(option);
    }
  }
}

function onSteps(frame) {
  for (const column of frame.columns) state.columns.push(column);
  if (state.columns.length > MAX_COLUMNS) state.columns.splice(0, state.columns.length - MAX_COLUMNS);
  onLoad(frame.load);
  requestDraw("strip");
}

function onLoad(load) {
  state.load = load;
  requestDraw("load");
}

function drawLoad(load) {
  setText("waiting", load.waiting);
  setText("running", load.running);
  setText("kv", (100 * load.kv_usage).toFixed(1) + " %");
}

// ----------------------------------------------------------------- strip
// What changed since the last paint. One animation frame draws it all, so
// that a feed frame's steps, load and summary cost the browser one paint; a
// hidden tab draws nothing until it is shown.
const dirty = { strip: false, load: false, summary: false };
let drawPending = false;

function requestDraw(what) {
  if (what) dirty[what] = true;
  if (!drawPending && !document.hidden) { drawPending = true; requestAnimationFrame(draw); }
}

function draw() {
  drawPending = false;
  if (document.hidden) return;  // what is dirty stays so until the tab is shown
  if (dirty.load && state.load) drawLoad(state.load);
  if (dirty.summary && state.summary) drawSummary(state.summary);
  if (dirty.strip) drawStrip();
  dirty.strip = dirty.load = dirty.summary = false;
}

// The strip's width in CSS pixels, kept by a ResizeObserver (reading
// clientWidth in every frame would force a layout).
let stripWidth = 0;

function stripLayout() {
  const canvas = $("strip");
  const width = stripWidth || canvas.clientWidth;
  const visible = state.columns.slice(-Math.max(1, Math.floor(width / COL_WIDTH)));
  let rows = 4;
  for (const column of visible) for (const cell of column.cells) rows = Math.max(rows, cell[0] + 1);
  const rowHeight = Math.max(3, Math.min(16, Math.floor(320 / rows)));
  return { canvas, width, visible, rows, rowHeight, colWidth: COL_WIDTH, height: rows * rowHeight,
           x0: width - visible.length * COL_WIDTH };
}

// What the canvas shows, so that a frame paints only its new columns (the
// rest scrolls left): the layout it was painted with, the last step in it and
// each slot's sequence in its last column (for the refill marks).
const painted = { layout: "", lastStep: -1, seqs: new Map() };

function paintColumn(g, L, column, x) {
  const here = new Map();
  for (const cell of column.cells) {
    const [slot, seq, kind] = cell;
    const y = slot * L.rowHeight;
    g.fillStyle = COLOURS[kind];
    g.fillRect(x, y + 0.5, L.colWidth, L.rowHeight - 1);
    if (cell.length > 4) {  // refilled in the step its holder was preempted
      g.fillStyle = COLOURS.x;
      g.fillRect(x, y + 0.5, L.colWidth, Math.max(1, Math.floor(L.rowHeight / 3)));
    }
    const before = painted.seqs.get(slot);
    if (before !== undefined && before !== seq) {  // a slot refilled: mark the change
      g.fillStyle = "#1d2330";
      g.fillRect(x, y + 0.5, 1, L.rowHeight - 1);
    }
    here.set(slot, seq);
  }
  painted.seqs = here;
}

function drawStrip() {
  const L = stripLayout();
  if (!L.visible.length) return;
  const ratio = window.devicePixelRatio || 1;
  const layout = [L.width, L.height, ratio].join();
  const g = L.canvas.getContext("2d");
  const last = L.visible[L.visible.length - 1].steps[1];
  let fresh = L.visible.findIndex((column) => column.steps[0] > painted.lastStep);
  if (fresh < 0) fresh = L.visible.length;
  if (layout !== painted.layout || last < painted.lastStep || fresh === 0) {
    L.canvas.style.height = L.height + "px";
    L.canvas.width = Math.round(L.width * ratio);
    L.canvas.height = Math.round(L.height * ratio);
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.fillStyle = IDLE;
    g.fillRect(0, 0, L.width, L.height);
    painted.seqs = new Map();
    fresh = 0;
  } else if (fresh < L.visible.length) {  // scroll what is painted left by the new columns
    const dx = (L.visible.length - fresh) * L.colWidth;
    const kept = L.canvas.width - Math.round(dx * ratio);
    g.setTransform(1, 0, 0, 1, 0, 0);
    g.drawImage(L.canvas, L.canvas.width - kept, 0, kept, L.canvas.height, 0, 0, kept,
                L.canvas.height);
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.fillStyle = IDLE;
    g.fillRect(L.width - dx, 0, dx, L.height);
  }
  painted.layout = layout;
  painted.lastStep = last;
  L.visible.slice(fresh).forEach((column, i) => {
    paintColumn(g, L, column, L.x0 + (fresh + i) * L.colWidth);
  });
  const first = L.visible[0].steps[0];
  setText("strip-steps", `steps ${first}–${last}`);
}

function cellAt(event) {
  const L = stripLayout();
  const rect = L.canvas.getBoundingClientRect();
  const x = event.clientX - rect.left, y = event.clientY - rect.top;
  const i = Math.floor((x - L.x0) / L.colWidth), slot = Math.floor(y / L.rowHeight);
  if (i < 0 || i >= L.visible.length) return null;
  const column = L.visible[i];
  const cell = column.cells.find((c) => c[0] === slot);
  return { column, slot, cell, x, y };
}

function requestOf(sequence) { return sequence.replace(/#\d+$/, ""); }

function setupStrip() {
  const canvas = $("strip"), tip = $("tip");
  canvas.addEventListener("mousemove", (event) => {
    const hit = cellAt(event);
    if (!hit) { tip.hidden = true; return; }
    const steps = hit.column.steps[0] === hit.column.steps[1]
      ? `step ${hit.column.steps[0]}` : `steps ${hit.column.steps[0]}–${hit.column.steps[1]}`;
    const c = hit.cell;
    tip.textContent = c
      ? `slot ${hit.slot} · ${steps} · ${c[1]} · ${KIND_NAMES[c[2]]} · ${c[3]} tokens` +
        (c.length > 4 ? ` · in place of ${c[4]} (preempted)` : "")
      : `slot ${hit.slot} · ${steps} · idle`;
    tip.hidden = false;
    tip.style.left = Math.min(hit.x + 12, canvas.clientWidth - tip.offsetWidth) + "px";
    tip.style.top = (hit.y + 14) + "px";
  });
  canvas.addEventListener("mouseleave", () => { tip.hidden = true; });
  canvas.addEventListener("click", (event) => {
    const hit = cellAt(event);
    if (hit && hit.cell) showHistory(requestOf(hit.cell[1]));
  });
  new ResizeObserver((entries) => {
    stripWidth = entries[entries.length - 1].contentRect.width;
    requestDraw("strip");
  }).observe(canvas);
}

// --------------------------------------------------------------- summary
const charts = {};

// series: [label, colour, scale]; a series on a scale other than "y" gets its
// own axis on the right.
function makeChart(id, series) {
  const box = $(id);
  const axes = [{ size: 28 }, { size: 44, values: (u, ticks) => ticks.map(compact) }];
  for (const [, stroke, scale] of series) {
    if (scale && scale !== "y") {
      axes.push({ scale, side: 1, size: 44, stroke, grid: { show: false },
                  values: (u, ticks) => ticks.map(compact) });
    }
  }
  return new uPlot({
    width: Math.max(200, box.clientWidth), height: 150,
    legend: { show: true },
    scales: { x: { time: true } },
    series: [{}, ...series.map(([label, stroke, scale]) => ({ label, stroke, width: 1.5,
                                                              scale: scale || "y" }))],
    axes,
  }, [[], ...series.map(() => [])], box);
}

const compact = (v) => (v == null ? "" : Math.abs(v) >= 1000 ? +(v / 1000).toFixed(1) + "k" : +v.toFixed(2));

function setupCharts() {
  charts.queue = makeChart("chart-queue", [["waiting", "#d9443a"], ["running", "#3b7ddd"]]);
  charts.tokens = makeChart("chart-tokens", [["tokens/s", "#3b7ddd"], ["generated/s", "#2e9e5b"]]);
  charts.latency = makeChart("chart-latency", [["TTFT", "#8e44ad"], ["ITL", "#e67e22", "itl"]]);
  charts.kv = makeChart("chart-kv", [["KV use", "#2e9e5b"]]);
  window.addEventListener("resize", () => {
    for (const [name, chart] of Object.entries(charts)) {
      chart.setSize({ width: Math.max(200, $("chart-" + name).clientWidth), height: 150 });
    }
  });
}

const ms = (s) => (s == null ? "–" : s < 1 ? (s * 1000).toFixed(0) + " ms" : s.toFixed(2) + " s");

function onSummary(summary) {
  state.summary = summary;
  requestDraw("summary");
}

function drawSummary(summary) {
  setText("tps", summary.tokens_per_s.toFixed(0));
  setText("tps-detail", `${summary.generated_per_s.toFixed(0)} generated/s`);
  setText("hit", summary.prefix_hit_rate == null ? "–"
    : (100 * summary.prefix_hit_rate).toFixed(1) + " %");
  setText("ttft", `${ms(summary.ttft_p50)} / ${ms(summary.ttft_p99)}`);
  setText("itl", `${ms(summary.itl_p50)} / ${ms(summary.itl_p99)}`);
  setText("preemptions", summary.preemptions);
  const s = summary.series;
  const t = s.map((p) => p.t);
  const latency = (v) => (v == null ? null : v * 1000);
  charts.queue.setData([t, s.map((p) => p.waiting), s.map((p) => p.running)]);
  charts.tokens.setData([t, s.map((p) => p.tokens), s.map((p) => p.generated)]);
  charts.latency.setData([t, s.map((p) => latency(p.ttft_p50)), s.map((p) => latency(p.itl_p50))]);
  charts.kv.setData([t, s.map((p) => 100 * p.kv_usage)]);
  drawTenants(summary.tenant_tokens);
  drawRequests(summary.recent);
}

// `count` children of `box` made by `make` (added or removed at the end), so
// that a redraw changes existing elements rather than building new ones.
function rows(box, count, make) {
  while (box.children.length > count) box.lastChild.remove();
  while (box.children.length < count) box.appendChild(make());
  return box.children;
}

function drawTenants(tokens) {
  const entries = Object.entries(tokens).sort((a, b) => b[1] - a[1]);
  const total = entries.reduce((sum, [, n]) => sum + n, 0);
  setProp($("tenants-none"), "hidden", total > 0);
  const bars = rows($("tenants"), total ? entries.length : 0, () => {
    const row = document.createElement("div");
    row.className = "bar";
    row.innerHTML = '<span class="name"></span><span class="fill"></span><span class="share"></span>';
    return row;
  });
  entries.forEach(([tenant, n], i) => {
    if (!total) return;
    const share = n / total;
    const [name, fill, text] = bars[i].children;
    setProp(name, "textContent", tenant || "(no tenant)");
    setProp(fill.style, "width", (share * 60).toFixed(1) + "%");
    setProp(text, "textContent", `${(100 * share).toFixed(1)} % · ${n} tokens`);
  });
}

let picked = null;
function drawRequests(recent) {
  const body = $("requests").querySelector("tbody");
  const shown = rows(body, recent.length, () => {
    const row = document.createElement("tr");
    for (let i = 0; i < 6; i++) row.appendChild(document.createElement("td"));
    row.addEventListener("click", () => showHistory(row.dataset.request));
    return row;
  });
  recent.forEach((r, i) => {
    const row = shown[i];
    row.dataset.request = r.request_id;
    setProp(row, "className", [r.request_id === picked && "picked", r.background && "background"]
      .filter(Boolean).join(" "));
    setProp(row, "title", r.background ? "a batch job's request (background priority)" : "");
    const cells = [r.request_id, (r.tenant || "") + (r.background ? " · batch" : ""), r.state,
                   r.prompt_tokens, r.output_tokens, ms(r.ttft)];
    cells.forEach((value, j) => setProp(row.children[j], "textContent", String(value)));
    setProp(row.children[2], "className", "state-" + r.state);
  });
}

async function showHistory(requestId) {
  picked = requestId;
  if (state.summary) drawRequests(state.summary.recent);
  $("history-id").textContent = requestId;
  const list = $("history");
  const params = new URLSearchParams();
  if (state.replica) params.set("replica", state.replica);
  const response = await fetch(`/dashboard/requests/${encodeURIComponent(requestId)}?${params}`,
                               { headers: headers() });
  list.innerHTML = "";
  if (!response.ok) {
    list.innerHTML = '<li class="hint">no longer in the recent history</li>';
    return;
  }
  const history = await response.json();
  for (const e of history.events) {
    const item = document.createElement("li");
    const offset = ((e.time - history.arrival) * 1000).toFixed(0);
    item.innerHTML = `<span class="when"></span><b></b> <span></span>`;
    item.querySelector(".when").textContent =
      `+${offset} ms` + (e.step == null ? "" : ` · step ${e.step}`);
    item.querySelector("b").textContent = (e.sequence ? e.sequence + " " : "") + e.event;
    item.lastChild.textContent = e.detail;
    list.appendChild(item);
  }
}

function setupRefresh() {
  const pick = $("refresh");
  pick.value = refreshPeriod();
  pick.addEventListener("change", () => {
    localStorage.setItem(REFRESH_STORE, pick.value);
    const hash = new URLSearchParams(location.hash.slice(1));
    if (hash.has("refresh")) {  // the choice made here wins over the address's
      hash.delete("refresh");
      history.replaceState(null, "", "#" + hash);
    }
    connect();
  });
  // A hidden tab keeps reading the feed but draws nothing; shown again, it
  // draws what came meanwhile.
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) requestDraw();
  });
}

// ------------------------------------------------------------------ start
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  localStorage.setItem(KEY_STORE, $("key").value);
  $("key-form").hidden = true;
  connect();
});
$("replica").addEventListener("change", (event) => {
  // A fresh page follows the chosen replica (the hash keeps the choice).
  const hash = new URLSearchParams(location.hash.slice(1));
  hash.set("replica", event.target.value);
  location.hash = hash.toString();
  location.reload();
});
const fromHash = new URLSearchParams(location.hash.slice(1)).get("replica");
if (fromHash) state.replica = fromHash;
setupStrip();
setupCharts();
setupRefresh();
connect();
