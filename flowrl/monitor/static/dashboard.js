// flowrl dashboard: step metrics from the event stream (/events), a light poll of /status and
// /trace once a second for the gauges and the pipeline timeline. Plain SVG and canvas, no
// library, nothing fetched from the network but this monitor.
"use strict";

const WINDOW_S = 20;          // timeline span
const POLL_MS = 1000;         // /status and /trace
const MAX_STEPS = 5000;       // points kept per chart
const MAX_EVENTS = 60;        // lines kept in the event list
const LANE_H = 18;
const AXIS_H = 14;            // time labels under the lanes
const PALETTE = ["#4fb3ff", "#ffb454", "#5ad17a", "#c792ea", "#ff6b6b", "#7fdbca", "#f78c6c"];
const SVG_NS = "http://www.w3.org/2000/svg";

const state = {
  token: new URLSearchParams(location.hash.slice(1)).get("token") || "",
  steps: [],            // {step, reward, sps}
  evals: [],            // {step, greedy, sampled}: one per evaluation round
  status: null,
  trace: null,          // the latest /trace answer, its spans merged into `spans`
  spans: new Map(),     // task id -> complete event, for the last WINDOW_S seconds
  marks: new Map(),     // "pid:tid:ts" -> instant event (an interrupted weight load)
  threads: new Map(),   // "pid:tid" -> worker id
  lastId: 0,
  stageColors: new Map(),
  lanes: 0,
  spansDrawn: 0,
  events: 0,
};
window.flowrl = state;  // for inspection from the console (and the browser test)

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (state.token) h["Authorization"] = "Bearer " + state.token;
  return h;
}

function el(id) { return document.getElementById(id); }

function svgEl(name, attrs, text) {
  const e = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function fmt(x, digits) {
  if (x === null || x === undefined || !isFinite(x)) return "–";
  if (digits === undefined && Number.isInteger(x)) return String(x);
  const a = Math.abs(x);
  if (a >= 1e4) return x.toExponential(1);
  return x.toFixed(digits === undefined ? (a >= 100 ? 0 : a >= 1 ? 2 : 3) : digits);
}

function bytes(n) {
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n.toFixed(0)) + " " + u[i];
}

function stageColor(stage) {
  if (!state.stageColors.has(stage)) {
    state.stageColors.set(stage, PALETTE[state.stageColors.size % PALETTE.length]);
  }
  return state.stageColors.get(stage);
}

// ---- charts ---------------------------------------------------------------------------------

// One series (ys, color), or several: ys a list of series and color a list of colors.
function lineChart(svg, xs, ys, color, empty) {
  svg.replaceChildren();
  const W = 420, H = 170, L = 42, B = 18, T = 8, R = 8;
  const many = Array.isArray(color);
  const series = (many ? ys : [ys]).map(s => {
    const pts = [];
    for (let i = 0; i < xs.length; i++) if (s[i] !== null && s[i] !== undefined && isFinite(s[i])) pts.push([xs[i], s[i]]);
    return pts;
  });
  const colors = many ? color : [color];
  const all = series.flat();
  if (!all.length) {
    svg.append(svgEl("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty"},
                     empty || "waiting for the first step"));
    return;
  }
  const pts = all;
  let x0 = Math.min(...pts.map(p => p[0])), x1 = Math.max(...pts.map(p => p[0]));
  let y0 = Math.min(...pts.map(p => p[1])), y1 = Math.max(...pts.map(p => p[1]));
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const pad = (y1 - y0) * 0.05; y0 -= pad; y1 += pad;
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = y => H - B - (y - y0) / (y1 - y0) * (H - B - T);
  for (const f of [0, 0.5, 1]) {
    const y = y0 + f * (y1 - y0);
    svg.append(svgEl("line", {x1: L, x2: W - R, y1: sy(y), y2: sy(y), class: "axis"}));
    svg.append(svgEl("text", {x: L - 4, y: sy(y) + 3, "text-anchor": "end", class: "label"},
                     fmt(y)));
  }
  svg.append(svgEl("text", {x: L, y: H - 4, class: "label"}, "step " + x0));
  svg.append(svgEl("text", {x: W - R, y: H - 4, "text-anchor": "end", class: "label"},
                   "step " + x1));
  series.forEach((s, k) => {
    if (!s.length) return;
    svg.append(svgEl("polyline", {class: "series", stroke: colors[k],
      points: s.map(p => sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join(" ")}));
    if (s.length <= 60) {
      for (const p of s) svg.append(svgEl("circle", {cx: sx(p[0]), cy: sy(p[1]), r: 2, fill: colors[k]}));
    }
  });
}

function barChart(svg, labels, values, color) {
  svg.replaceChildren();
  const W = 420, H = 170, B = 18, T = 14;
  if (!values.length) {
    svg.append(svgEl("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty"},
                     "no sample trained yet"));
    return;
  }
  const total = values.reduce((a, b) => a + b, 0) || 1;
  const top = Math.max(...values) || 1;
  const bw = Math.min(80, (W - 20) / values.length);
  values.forEach((v, i) => {
    const h = v / top * (H - B - T), x = 10 + i * bw;
    svg.append(svgEl("rect", {x: x + 3, y: H - B - h, width: bw - 6, height: h, fill: color,
                              class: "bar"}));
    svg.append(svgEl("text", {x: x + bw / 2, y: H - 4, "text-anchor": "middle", class: "label"},
                     labels[i]));
    svg.append(svgEl("text", {x: x + bw / 2, y: H - B - h - 3, "text-anchor": "middle",
                              class: "label"}, (100 * v / total).toFixed(0) + "%"));
  });
}

function storeChart(svg, store) {
  svg.replaceChildren();
  if (!store || !store.capacity_bytes) return;
  const f = Math.min(1, store.used_bytes / store.capacity_bytes);
  svg.append(svgEl("rect", {x: 0, y: 8, width: 420, height: 24, fill: "#11161c"}));
  svg.append(svgEl("rect", {x: 0, y: 8, width: 420 * f, height: 24, class: "bar",
                            fill: f > 0.8 ? "#ff6b6b" : "#4fb3ff"}));
  el("store-text").textContent = bytes(store.used_bytes) + " of " + bytes(store.capacity_bytes) +
    " (" + (100 * f).toFixed(1) + "%), " + store.segments + " segments, " +
    store.waiting_puts + " puts waiting";
}

let chartsQueued = false;
function drawCharts() {
  if (chartsQueued) return;
  chartsQueued = true;
  requestAnimationFrame(() => {
    chartsQueued = false;
    const xs = state.steps.map(s => s.step);
    lineChart(el("reward-chart"), xs, state.steps.map(s => s.reward), "#5ad17a");
    lineChart(el("throughput-chart"), xs, state.steps.map(s => s.sps), "#4fb3ff");
    const last = state.steps[state.steps.length - 1];
    el("reward-last").textContent = last ? "last " + fmt(last.reward) : "";
    document.body.dataset.steps = String(state.steps.length);
    const evs = state.evals;
    lineChart(el("eval-chart"), evs.map(e => e.step),
              [evs.map(e => e.greedy), evs.map(e => e.sampled)], ["#5ad17a", "#ffb454"],
              "no evaluation yet (the recipe's eval section)");
    const lastEval = evs[evs.length - 1];
    el("eval-last").textContent = lastEval ? "step " + lastEval.step + ": greedy " +
      fmt(lastEval.greedy) + ", sampled " + fmt(lastEval.sampled) : "";
    document.body.dataset.evals = String(evs.length);
  });
}

// ---- pipeline timeline ----------------------------------------------------------------------

function drawTimeline() {
  const st = state.status, tr = state.trace;
  if (!st || !tr) return;
  const canvas = el("timeline");
  const workers = st.workers.slice();
  const roleOrder = new Map(Object.values(st.stages).map((s, i) => [s.role, i]));
  const num = id => parseInt(id.split("-").pop(), 10) || 0;
  workers.sort((a, b) => ((roleOrder.get(a.role) ?? 99) - (roleOrder.get(b.role) ?? 99)) ||
                         (num(a.id) - num(b.id)));
  const labels = el("lane-labels");
  if (labels.dataset.key !== workers.map(w => w.id).join(",")) {
    labels.dataset.key = workers.map(w => w.id).join(",");
    labels.replaceChildren(...workers.map(w => {
      const d = document.createElement("div");
      d.className = "lane"; d.textContent = w.id; d.title = w.name + " on " + w.node;
      return d;
    }));
  }
  state.lanes = workers.length;
  const dpr = window.devicePixelRatio || 1;
  const lanesH = Math.max(LANE_H, workers.length * LANE_H);
  const cssW = canvas.clientWidth || 800, cssH = lanesH + AXIS_H;
  canvas.style.height = cssH + "px";
  canvas.width = Math.round(cssW * dpr); canvas.height = Math.round(cssH * dpr);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, cssW, cssH);
  // thread names map a trace tid to a worker id; lanes follow the sorted worker list
  const laneOf = new Map(workers.map((w, i) => [w.id, i]));
  // The window covers the last WINDOW_S seconds, or the whole run while it is younger.
  const now = tr.otherData.now_us;
  let first = now;
  for (const e of state.spans.values()) if (e.ts < first) first = e.ts;
  const span = Math.min(WINDOW_S * 1e6, Math.max(2e6, now - first));
  const t0 = now - span;
  const x = t => (t - t0) / span * cssW;
  for (let i = 0; i < workers.length; i++) {
    ctx.fillStyle = i % 2 ? "#141a21" : "#11161c";
    ctx.fillRect(0, i * LANE_H, cssW, LANE_H);
  }
  const tick = [0.5, 1, 2, 5, 10, 30].find(t => span / 1e6 / t <= 6) || 60;
  ctx.font = "10px system-ui, sans-serif";
  ctx.textBaseline = "top";
  for (let k = 0; k * tick * 1e6 <= span; k++) {
    const px = x(now - k * tick * 1e6);
    ctx.fillStyle = "#2a323c";
    ctx.fillRect(px, 0, 1, lanesH);
    ctx.fillStyle = "#7d8894";
    ctx.textAlign = k === 0 ? "right" : "center";
    ctx.fillText(k === 0 ? "now" : "-" + (k * tick) + " s", px, lanesH + 2);
  }
  let drawn = 0;
  const bar = (lane, start, end, stage, open) => {
    const x0 = Math.max(0, x(start)), x1 = Math.min(cssW, x(end));
    if (x1 < 0 || x0 > cssW) return;
    ctx.fillStyle = stageColor(stage);
    ctx.globalAlpha = open ? 0.55 : 1;
    ctx.fillRect(x0, lane * LANE_H + 2, Math.max(1, x1 - x0 - 0.5), LANE_H - 4);
    ctx.globalAlpha = 1;
    drawn++;
  };
  for (const e of state.spans.values()) {
    const lane = laneOf.get(state.threads.get(e.pid + ":" + e.tid));
    if (lane !== undefined) bar(lane, e.ts, e.ts + e.dur, e.name, false);
  }
  // tasks still running end "now", drawn lighter
  for (const w of workers) {
    for (const t of w.tasks || []) {
      if (t.running_s !== null && t.running_s !== undefined) {
        bar(laneOf.get(w.id), now - t.running_s * 1e6, now, t.stage, true);
      }
    }
  }
  // a weight load that interrupted running generations: a tick across the worker's lane
  let marked = 0;
  ctx.fillStyle = "#ffffff";
  for (const e of state.marks.values()) {
    const lane = laneOf.get(state.threads.get(e.pid + ":" + e.tid));
    const px = x(e.ts);
    if (lane === undefined || px < 0 || px > cssW) continue;
    ctx.fillRect(px - 1, lane * LANE_H, 2, LANE_H);
    marked++;
  }
  canvas.dataset.marks = String(marked);
  state.spansDrawn = drawn;
  canvas.dataset.lanes = String(workers.length);
  canvas.dataset.lanePx = String(LANE_H * dpr);
  canvas.dataset.spans = String(drawn);
  const legend = el("legend");
  const stages = Object.keys(st.stages);
  if (legend.dataset.key !== stages.join(",")) {
    legend.dataset.key = stages.join(",");
    legend.replaceChildren(...stages.map(s => {
      const sp = document.createElement("span");
      sp.textContent = s; sp.style.setProperty("--c", stageColor(s));
      return sp;
    }));
  }
}

// ---- status ---------------------------------------------------------------------------------

function showStatus(st) {
  state.status = st;
  el("run").textContent = "run " + st.run_id;
  el("version").textContent = "version " + st.version;
  const s = el("state");
  s.textContent = st.paused ? "paused" : "running";
  s.className = "pill " + (st.paused ? "paused" : "running");
  el("throughput").textContent = fmt(st.throughput.last_step_samples_per_s, 1) + " samples/s";
  if (st.loop_lag) el("lag").textContent = "loop lag " + fmt(st.loop_lag.last_ms, 1) + " ms";
  const inp = el("staleness");
  if (document.activeElement !== inp) inp.value = st.max_staleness;
  const hist = st.staleness_histogram || {};
  const keys = Object.keys(hist).sort((a, b) => a - b);
  barChart(el("staleness-chart"), keys, keys.map(k => hist[k]), "#c792ea");
  storeChart(el("store-chart"), st.store);
  const body = el("stages").tBodies[0];
  body.replaceChildren(...Object.entries(st.stages).map(([name, g]) => {
    const tr = document.createElement("tr");
    for (const v of [name, g.queue_depth, g.in_flight, g.ready, g.waiting, g.done]) {
      const td = document.createElement("td"); td.textContent = v; tr.append(td);
    }
    return tr;
  }));
  document.body.dataset.version = String(st.version);
}

// Only spans that ended since the previous answer travel; older ones are kept here.
function mergeTrace(tr) {
  for (const e of tr.traceEvents) {
    if (e.ph === "X") state.spans.set(e.args.task, e);
    else if (e.ph === "i") state.marks.set(e.pid + ":" + e.tid + ":" + e.ts, e);
    else if (e.name === "thread_name") state.threads.set(e.pid + ":" + e.tid, e.args.name);
  }
  const oldest = tr.otherData.now_us - WINDOW_S * 1e6;
  for (const [task, e] of state.spans) if (e.ts + e.dur < oldest) state.spans.delete(task);
  for (const [key, e] of state.marks) if (e.ts < oldest) state.marks.delete(key);
  state.trace = tr;
}

async function poll() {
  const since = state.trace ? "&after=" + state.trace.otherData.now_us : "";
  try {
    const [st, tr] = await Promise.all([
      fetch("status", {headers: headers()}).then(r => r.ok ? r.json() : Promise.reject(r.status)),
      fetch("trace?window=" + WINDOW_S + since, {headers: headers()})
        .then(r => r.ok ? r.json() : Promise.reject(r.status)),
    ]);
    mergeTrace(tr);
    showStatus(st);
    drawTimeline();
  } catch (err) {
    el("conn").textContent = "status unavailable (" + err + ")";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

// ---- event stream ---------------------------------------------------------------------------
// fetch + a stream reader rather than EventSource, so that a token can travel in a header.

function onEvent(ev) {
  state.lastId = Math.max(state.lastId, ev.seq);
  state.events++;
  if (ev.kind === "step") {
    state.steps.push({step: ev.step, reward: ev.reward_mean, sps: ev.samples_per_s});
    if (state.steps.length > MAX_STEPS) state.steps.shift();
    drawCharts();
  }
  if (ev.kind === "eval" && !("eval/failed" in ev)) {
    state.evals.push({step: ev.step, greedy: ev["eval/greedy_accuracy"],
                      sampled: ev["eval/sampled_accuracy"]});
    if (state.evals.length > MAX_STEPS) state.evals.shift();
    drawCharts();
  }
  const li = document.createElement("li");
  li.className = ev.kind;
  const extra = Object.entries(ev).filter(([k]) => !["seq", "kind", "time"].includes(k))
    .map(([k, v]) => k + "=" + (typeof v === "number" ? fmt(v) : JSON.stringify(v))).join(" ");
  li.textContent = new Date(ev.time * 1000).toLocaleTimeString() + " #" + ev.seq + " " +
    ev.kind + " " + extra.slice(0, 240);
  const list = el("events");
  list.prepend(li);
  while (list.children.length > MAX_EVENTS) list.lastChild.remove();
}

async function stream() {
  for (;;) {
    try {
      const r = await fetch("events?last_id=" + state.lastId, {headers: headers()});
      if (!r.ok) throw new Error("HTTP " + r.status);
      el("conn").textContent = "live";
      el("conn").className = "pill running";
      const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
      let buf = "";
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        buf += value;
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, cut); buf = buf.slice(cut + 2);
          const data = block.split("\n").filter(l => l.startsWith("data:"))
            .map(l => l.slice(5).trimStart()).join("\n");
          if (data) onEvent(JSON.parse(data));
        }
      }
    } catch (err) {
      el("conn").textContent = "reconnecting (" + err.message + ")";
    }
    el("conn").className = "pill dim";
    await new Promise(res => setTimeout(res, 2000));
  }
}

// ---- control --------------------------------------------------------------------------------

async function control(path, body) {
  if (!state.token) {
    state.token = window.prompt("monitor token (printed when the run started)") || "";
    if (!state.token) return;
  }
  const r = await fetch(path, {method: "POST", body: body ? JSON.stringify(body) : undefined,
                               headers: headers({"Content-Type": "application/json"})});
  if (r.status === 401) { state.token = ""; alert("wrong token"); }
  else if (!r.ok) alert(await r.text());
}

// The run's trace for the planner (python -m flowrl.plan): fetched with the token, saved as a file.
async function exportTrace() {
  if (!state.token) {
    state.token = window.prompt("monitor token (printed when the run started)") || "";
    if (!state.token) return;
  }
  const r = await fetch("plan-trace", {headers: headers()});
  if (r.status === 401) { state.token = ""; alert("wrong token"); return; }
  if (!r.ok) { alert(await r.text()); return; }
  const name = (/filename="([^"]+)"/.exec(r.headers.get("Content-Disposition") || "") || [])[1];
  const a = document.createElement("a");
  a.href = URL.createObjectURL(await r.blob());
  a.download = name || "flowrl.trace.jsonl";
  a.click();
  URL.revokeObjectURL(a.href);
}

el("pause").onclick = () => control("pause");
el("export-trace").onclick = exportTrace;
el("resume").onclick = () => control("resume");
el("set-staleness").onclick = () =>
  control("staleness", {max_staleness: parseInt(el("staleness").value, 10)});
el("window-label").textContent = "last " + WINDOW_S + " s, one lane per worker";
drawCharts();
poll();
stream();
