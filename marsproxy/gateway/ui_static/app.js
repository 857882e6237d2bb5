// The live page: polls /mars/v1/state about once a second, reads /mars/v1/events as a stream
// only while the operator turns on "live events" (a reader makes the proxy build every event),
// keeps a few minutes of history in memory and redraws at most a few times a second.

import { eventLoop, pollLoop, token } from "./api.js";
import { Ring } from "./chart.js";
import { renderCpu, renderEvents, renderQueue, renderSessions, renderStore, renderWorkers } from "./panels.js";

const STATE_PERIOD_S = 1;
const HISTORY_S = 300; // the charts' span: the last five minutes
const PAGE_SIZE = 50; // sessions rows in the DOM at once
const EVENTS_KEPT = 2000;
const EVENTS_SHOWN = 200;
const EVENTS_REDRAW_MS = 250;
const LIVE_KEY = "marsproxy.liveEvents"; // sessionStorage: the toggle, per tab
const NOTE_OFF = "Off: this page reads no event stream. Streaming events makes the proxy "
  + "build every event for as long as the page reads them.";
const NOTE_ON = "Streaming: the proxy builds every event while this page reads them "
  + "(a little CPU per request); turn off when done.";

const $ = (id) => document.getElementById(id);

class Page {
  constructor() {
    this.history = new Map(); // worker → Ring of samples
    this.cpuHistory = new Ring(HISTORY_S);
    this.events = [];
    this.eventTypes = new Set();
    this.page = 0;
    this.controller = null;
    this.streamController = null;
    this.liveEvents = sessionStorage.getItem(LIVE_KEY) === "1";
    this.eventsDirty = false;
    this.streamState = "off";
    this.stateOk = false;
  }

  start() {
    this.stop();
    $("token-panel").hidden = true;
    this.controller = new AbortController();
    const signal = this.controller.signal;
    this.setConn("connecting", "connecting…");
    pollLoop({
      path: () => `/mars/v1/state?sessions=1&limit=${PAGE_SIZE}&offset=${this.page * PAGE_SIZE}`,
      periodS: STATE_PERIOD_S, signal,
      onData: (doc) => this.onState(doc),
      onError: (err, wait) => {
        this.stateOk = false;
        this.setConn("retrying", `proxy unreachable, retrying in ${wait} s`, err);
      },
      onAuth: (msg) => this.askToken(msg),
    });
    if (this.liveEvents) this.startStream();
  }

  startStream() {
    this.stopStream();
    this.streamController = new AbortController();
    this.streamState = "connecting";
    eventLoop({
      signal: this.streamController.signal,
      onEvents: (batch) => this.onEvents(batch),
      onState: (s, wait) => {
        this.streamState = s;
        if (s === "retrying" && this.stateOk) this.setConn("retrying", `event stream lost, retrying in ${wait} s`);
      },
      onAuth: (msg) => this.askToken(msg),
    });
  }

  stopStream() {
    if (this.streamController) this.streamController.abort();
    this.streamController = null;
    this.streamState = "off";
  }

  /** The "live events" toggle: remembered in this tab; the stream runs only while it is on. */
  setLiveEvents(on) {
    this.liveEvents = on;
    sessionStorage.setItem(LIVE_KEY, on ? "1" : "0");
    $("events-live").checked = on;
    $("events-note").textContent = on ? NOTE_ON : NOTE_OFF;
    if (!on) this.stopStream();
    else if (this.controller && !this.streamController) this.startStream();
  }

  stop() {
    if (this.controller) this.controller.abort();
    this.controller = null;
    this.stopStream();
  }

  setConn(state, text) {
    const c = $("conn");
    c.dataset.state = state;
    c.textContent = text;
  }

  askToken(message, force = false) {
    // Both loops hit the same 401: the first one asks, the second finds the page stopped.
    if (!this.controller && !force) return;
    this.stop();
    const had = Boolean(token.get());
    token.clear();
    this.setConn("auth", "admin token needed");
    $("token-why").textContent = had
      ? `The proxy refused the token: ${message}`
      : "This proxy requires its admin token (auth.admin_token) for the state and the event stream.";
    $("token-panel").hidden = false;
    $("forget-token").hidden = true;
    $("token-input").focus();
  }

  onState(doc) {
    this.stateOk = true;
    this.setConn("live", !this.liveEvents || this.streamState === "live" ? "live" : "live (state only)");
    $("forget-token").hidden = !token.get();
    $("version").textContent = `v${doc.version}`;
    const t = doc.time;
    const adm = doc.admission;
    for (const w of doc.workers) {
      if (!this.history.has(w.name)) this.history.set(w.name, new Ring(HISTORY_S));
      const aw = adm ? adm.workers[w.name] : null;
      this.history.get(w.name).push({
        t, kv: w.kv_usage, running: w.running, waiting: w.waiting,
        admitted: aw ? aw.admitted_store : null,
        limit: aw && aw.binds !== "none" ? aw.limit : null,  // no count bound: nothing to draw
        window: aw ? aw.window : null,
      });
    }
    this.cpuHistory.push({ t, backlog: doc.tools.backlog_ratio, inflight: doc.tools.in_flight });
    const hist = new Map([...this.history].map(([k, r]) => [k, r.items]));
    // The charts span what the tab has seen, from half a minute up to HISTORY_S.
    const oldest = this.cpuHistory.items.length ? this.cpuHistory.items[0].t : t;
    const spanS = Math.min(HISTORY_S, Math.max(30, t - oldest));
    renderWorkers($("workers"), doc, hist, spanS);
    $("workers-note").textContent = `${doc.workers.length} · ${adm ? "admission on" : "admission off"}`;
    renderQueue(doc, { count: $("queue-count"), why: $("queue-why"), tbody: $("queue").tBodies[0] });
    renderCpu(doc, $("cpu"), $("cpu-chart"), this.cpuHistory.items, spanS);
    renderStore(doc, $("store"));
    renderSessions(doc, {
      count: $("sessions-count"), states: $("sessions-states"), page: $("sessions-page"),
      prev: $("sessions-prev"), next: $("sessions-next"), tbody: $("sessions").tBodies[0],
    }, this.page, PAGE_SIZE);
    const pages = Math.max(1, Math.ceil(doc.sessions.total / PAGE_SIZE));
    if (this.page >= pages) this.page = pages - 1;
    const q = adm ? adm.queue.length + adm.queue.pending : 0;
    $("summary").textContent = `${doc.sessions.total} sessions · ${q} waiting · `
      + `${doc.tools.in_flight} tools running`;
  }

  onEvents(batch) {
    for (const e of batch) {
      this.events.push(e);
      if (!this.eventTypes.has(e.type)) {
        this.eventTypes.add(e.type);
        $("filter-type").append(new Option(e.type, e.type));
      }
    }
    if (this.events.length > EVENTS_KEPT) this.events.splice(0, this.events.length - EVENTS_KEPT);
    this.eventsDirty = true;
  }

  drawEvents() {
    if (!this.eventsDirty || $("events-pause").checked) return;
    this.eventsDirty = false;
    $("events-count").textContent = String(this.events.length);
    renderEvents(this.events, $("events").tBodies[0], {
      session: $("filter-session").value.trim(), type: $("filter-type").value,
    }, EVENTS_SHOWN);
  }
}

function main() {
  const page = new Page();
  $("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const t = $("token-input").value.trim();
    if (!t) return;
    token.set(t);
    $("token-input").value = "";
    page.start();
  });
  $("forget-token").addEventListener("click", () => { token.clear(); page.askToken("", true); });
  $("sessions-prev").addEventListener("click", () => { page.page = Math.max(0, page.page - 1); });
  $("sessions-next").addEventListener("click", () => { page.page += 1; });
  const refilter = () => { page.eventsDirty = true; page.drawEvents(); };
  $("filter-session").addEventListener("input", refilter);
  $("filter-type").addEventListener("change", refilter);
  $("events-pause").addEventListener("change", refilter);
  $("events-live").addEventListener("change", (ev) => page.setLiveEvents(ev.target.checked));
  page.setLiveEvents(page.liveEvents);
  // Events arrive in bursts under load: redraw the list a few times a second, not per event.
  setInterval(() => page.drawEvents(), EVENTS_REDRAW_MS);
  page.start();
}

main();
