// Rendering the state document into the panels. Everything from the proxy goes in through
// textContent (session ids and tool names are the clients' strings), never as HTML.

import { COLORS, drawChart, legend } from "./chart.js";

export const fmt = {
  pct: (v) => (v == null ? "–" : `${Math.round(v * 100)}%`),
  num: (v, d = 0) => (v == null ? "–" : Number(v).toFixed(d)),
  secs: (v) => (v == null ? "–" : v < 60 ? `${v.toFixed(1)} s` : `${Math.floor(v / 60)} m ${Math.round(v % 60)} s`),
  time: (ts) => new Date(ts * 1000).toLocaleTimeString([], { hour12: false }),
};

/** "<tenant>/id/<id>" → "<id>"; "<tenant>/chain/3" → "chain/3" (as the state shows them). */
export function unscoped(key) {
  if (key == null) return "";
  const i = key.indexOf("/");
  const rest = i < 0 ? key : key.slice(i + 1);
  return rest.startsWith("id/") ? rest.slice(3) : rest;
}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else e.setAttribute(k, v);
  }
  e.append(...children.map((c) => (c instanceof Node ? c : String(c))));
  return e;
}

function fillRows(tbody, rows) {
  tbody.replaceChildren(...rows);
}

function stat(label, value, attrs = {}) {
  return el("div", attrs, el("span", {}, label), value);
}

const KV_SERIES = [{ key: "kv", label: "KV usage", color: COLORS[0] }];
const SESSION_SERIES = [
  { key: "admitted", label: "admitted", color: COLORS[0] },
  { key: "limit", label: "limit", color: COLORS[1] },
  { key: "window", label: "window", color: COLORS[3] },
  { key: "running", label: "running", color: COLORS[2] },
  { key: "waiting", label: "waiting", color: COLORS[4] },
];

/** One card per worker: health, numbers, KV against the marks, sessions against the limit. */
export function renderWorkers(root, doc, history, spanS) {
  const adm = doc.admission;
  const marks = adm ? adm.marks : null;
  const seen = new Set();
  for (const w of doc.workers) {
    seen.add(w.name);
    let card = root.querySelector(`.worker[data-name="${CSS.escape(w.name)}"]`);
    if (!card) {
      card = el("div", { class: "worker", "data-name": w.name });
      const kvMarks = marks ? [
        { y: marks.kv_enter, color: COLORS[1], label: `overload ≥ ${fmt.pct(marks.kv_enter)}` },
        { y: marks.kv_leave, color: COLORS[2], label: `clear < ${fmt.pct(marks.kv_leave)}` },
      ] : [];
      card.append(
        el("h3", {}, el("span", { class: "name" }), el("span", { class: "health" }),
          el("span", { class: "muted url" })),
        el("div", { class: "stats" }),
        el("canvas", { class: "kv", width: "420", height: "80" }),
        legend(KV_SERIES, kvMarks),
        el("canvas", { class: "load", width: "420", height: "90" }),
        legend(adm ? SESSION_SERIES : SESSION_SERIES.slice(3)),
      );
      root.append(card);
    }
    const aw = adm ? adm.workers[w.name] : null;
    card.querySelector(".name").textContent = w.name;
    const health = card.querySelector(".health");
    const ok = w.healthy && !w.stale;
    health.dataset.ok = String(ok);
    health.textContent = !w.healthy ? "unhealthy" : w.stale ? "stale" : "ok";
    card.querySelector(".url").textContent = w.url;
    const binds = aw ? aw.binds : null;
    card.querySelector(".stats").replaceChildren(
      stat("KV", fmt.pct(w.kv_usage), { class: "kv-usage" }),
      stat("running", fmt.num(w.running)),
      stat("waiting", fmt.num(w.waiting)),
      stat("preempt/s", fmt.num(w.preemptions_per_s, 2)),
      stat("prefix hit", fmt.pct(w.prefix_cache_hit_rate)),
      // probes.vllm.period_s while it serves or sessions wait, idle_period_s while idle.
      stat("read every", fmt.secs(w.scrape_period_s), { class: "scrape-period" }),
      stat("admitted", aw ? `${aw.admitted_store}` : "–", { class: "admitted" }),
      // binds "none": no count bound (not overloaded, no window_max); the KV fit decides.
      stat("limit", aw ? `${aw.binds === "none" ? "none" : aw.limit} (window ${aw.window})` : "off",
        { class: "limit" }),
      stat("binds", binds ? binds.replace("_", " ") : "–",
        { class: "binds", "data-binds": binds || "" }),
    );
    const samples = history.get(w.name) || [];
    drawChart(card.querySelector("canvas.kv"), samples, KV_SERIES, {
      spanS, yMax: 1,
      marks: marks ? [{ y: marks.kv_enter, color: COLORS[1] }, { y: marks.kv_leave, color: COLORS[2] }] : [],
    });
    drawChart(card.querySelector("canvas.load"), samples, adm ? SESSION_SERIES : SESSION_SERIES.slice(3), { spanS });
  }
  for (const card of root.querySelectorAll(".worker")) {
    if (!seen.has(card.dataset.name)) card.remove();
  }
}

/** The admission queue: who waits, how long, why, and the Retry-After each would get. */
export function renderQueue(doc, els) {
  const q = doc.admission ? doc.admission.queue : null;
  const n = q ? q.length + q.pending : 0;
  els.count.textContent = String(n);
  els.why.textContent = !doc.admission ? "admission control is off (admission.enabled: false)"
    : n ? `${q.why}${q.pending ? ` · ${q.pending} awaiting the store` : ""}`
      : "nobody waits";
  const rows = (q ? q.waiting : []).map((w, i) => el("tr", { "data-session": w.session },
    el("td", { class: "num" }, i + 1), el("td", {}, w.session), el("td", { class: "num" }, fmt.secs(w.waited_s)),
    el("td", { class: "num" }, w.est_tokens + (w.long ? " (long)" : "")), el("td", { class: "num" }, w.bypasses),
    el("td", { class: "num" }, `${w.retry_after_s} s`)));
  fillRows(els.tbody, rows);
}

/** Tool CPU: backlog against its marks, PSI, tools in flight (numbers and a chart). */
export function renderCpu(doc, dl, canvas, cpuHistory, spanS) {
  const m = doc.admission ? doc.admission.marks : null;
  const c = doc.cpu, t = doc.tools;
  dl.replaceChildren(
    el("dt", {}, "tools in flight"), el("dd", { id: "tools-in-flight" }, t.in_flight),
    el("dt", {}, "backlog"), el("dd", {}, `${fmt.num(t.backlog_ratio, 2)} of ${fmt.num(c.tool_cpus, 1)} CPUs`
      + (m ? ` (overload ≥ ${m.cpu_backlog_enter})` : "")),
    el("dt", {}, "PSI some avg10"), el("dd", {}, c.psi_some_avg10 == null ? "– (no PSI here)"
      : `${fmt.num(c.psi_some_avg10, 1)}%` + (m ? ` (overload ≥ ${m.psi_enter}%)` : "")),
    el("dt", {}, "CPU"), el("dd", {}, `${fmt.num(c.cpu_percent, 0)}% · ${c.source}`),
    el("dt", {}, "tool wait / slowdown"), el("dd", {}, `${fmt.secs(t.queue_wait_ema_s)} / ×${fmt.num(t.slowdown_ema, 2)}`),
  );
  drawChart(canvas, cpuHistory, [
    { key: "backlog", color: COLORS[0] }, { key: "inflight", color: COLORS[2] },
  ], { spanS, marks: m ? [{ y: m.cpu_backlog_enter, color: COLORS[1] }] : [] });
}

/** Replicas and the admission store (Redis when store.backend is redis). */
export function renderStore(doc, dl) {
  const a = doc.admission;
  if (!a) { dl.replaceChildren(el("dt", {}, "admission"), el("dd", {}, "off")); return; }
  const s = a.store;
  dl.replaceChildren(
    el("dt", {}, "store"), el("dd", { id: "store-backend" }, `${s.backend} (${s.mode})`),
    el("dt", {}, "up"), el("dd", {}, s.up ? "yes" : "NO: degraded, see docs/operations.md"),
    el("dt", {}, "live replicas"), el("dd", { id: "store-replicas" }, s.live_replicas),
    el("dt", {}, "this replica leads"), el("dd", {}, s.is_leader ? "yes" : "no"),
    el("dt", {}, "store failures"), el("dd", {}, s.failures_total),
    el("dt", {}, "events"), el("dd", {}, `${doc.events.published_total} published, `
      + `${doc.events.dropped_total} dropped, ${doc.events.subscribers} readers`),
  );
}

/** One page of sessions (the state document pages them; the DOM never holds more). */
export function renderSessions(doc, els, page, pageSize) {
  const s = doc.sessions;
  // A session held in the admission queue has a request in flight, but it waits, not runs.
  const queued = new Set(doc.admission ? doc.admission.queue.waiting.map((w) => w.session) : []);
  els.count.textContent = String(s.total);
  els.states.textContent = Object.entries(s.by_state).map(([k, v]) => `${k} ${v}`).join(" · ");
  const pages = Math.max(1, Math.ceil(s.total / pageSize));
  els.page.textContent = `page ${Math.min(page + 1, pages)} of ${pages}`;
  els.prev.disabled = page <= 0;
  els.next.disabled = page + 1 >= pages;
  const shown = (d) => (queued.has(d.id) ? "queued" : d.state === "tool" && d.tool ? `tool (${d.tool})` : d.state);
  const rows = (s.details || []).map((d) => el("tr", { "data-session": d.id, "data-state": queued.has(d.id) ? "queued" : d.state },
    el("td", {}, d.id), el("td", {}, shown(d)),
    el("td", { class: "num" }, d.level == null ? "–" : d.level), el("td", {}, d.worker || "–"),
    el("td", { class: "num" }, d.retained_blocks ? `${d.retained_blocks} blocks` : "–"),
    el("td", { class: "num" }, d.turns), el("td", { class: "num" }, fmt.secs(d.since_s)),
    el("td", { class: "num" }, fmt.secs(d.age_s))));
  fillRows(els.tbody, rows);
}

const SKIP = new Set(["type", "ts", "session", "worker"]);

/** The newest `max` events passing the filters, newest first. */
export function renderEvents(events, tbody, { session, type }, max) {
  const out = [];
  for (let i = events.length - 1; i >= 0 && out.length < max; i--) {
    const e = events[i];
    if (type.startsWith("-") ? e.type === type.slice(1) : type && e.type !== type) continue;
    const sid = unscoped(e.session);
    if (session && !sid.includes(session)) continue;
    const details = Object.entries(e).filter(([k, v]) => !SKIP.has(k) && v != null && v !== "")
      .map(([k, v]) => `${k}=${typeof v === "number" && !Number.isInteger(v) ? v.toFixed(3) : v}`)
      .join(" ");
    out.push(el("tr", { "data-type": e.type, "data-session": sid },
      el("td", {}, fmt.time(e.ts)), el("td", {}, e.type), el("td", {}, sid),
      el("td", {}, e.worker || ""), el("td", {}, details)));
  }
  fillRows(tbody, out);
}
