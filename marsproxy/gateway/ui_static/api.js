// Talking to the proxy: the admin token, the state poll and the event stream, each
// reconnecting with backoff. The token lives in this tab's sessionStorage and travels only in
// the Authorization header (never a URL: URLs end up in logs and in the history).

const TOKEN_KEY = "marsproxy.adminToken";

export class AuthError extends Error {}

export const token = {
  get: () => sessionStorage.getItem(TOKEN_KEY) || "",
  set: (t) => sessionStorage.setItem(TOKEN_KEY, t),
  clear: () => sessionStorage.removeItem(TOKEN_KEY),
};

function headers() {
  const t = token.get();
  return t ? { Authorization: `Bearer ${t}` } : {};
}

export async function getJson(path, signal) {
  const r = await fetch(path, { headers: headers(), cache: "no-store", signal });
  if (r.status === 401) throw new AuthError(await errorMessage(r));
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status}: ${await errorMessage(r)}`);
  return r.json();
}

async function errorMessage(r) {
  try {
    const body = await r.json();
    return (body.error && body.error.message) || r.statusText;
  } catch {
    return r.statusText;
  }
}

/** Exponential backoff: 0.5 s, 1 s, 2 s … up to maxS; reset() after a success. */
export class Backoff {
  constructor(maxS = 10) { this.maxS = maxS; this.n = 0; }
  next() { const s = Math.min(this.maxS, 0.5 * 2 ** this.n); this.n += 1; return s; }
  reset() { this.n = 0; }
}

const sleep = (s, signal) => new Promise((resolve) => {
  const t = setTimeout(resolve, s * 1000);
  if (signal) signal.addEventListener("abort", () => { clearTimeout(t); resolve(); });
});

/**
 * Poll `path()` every `periodS`: onData(doc) on success, onError(err, retryS) while the proxy
 * cannot be reached, onAuth(message) on 401 (the loop then stops until restarted).
 */
export async function pollLoop({ path, periodS, signal, onData, onError, onAuth }) {
  const backoff = new Backoff();
  while (!signal.aborted) {
    const t0 = performance.now();
    let doc;
    try {
      doc = await getJson(path(), signal);
    } catch (err) {
      if (signal.aborted) return;
      if (err instanceof AuthError) { onAuth(err.message); return; }
      const wait = backoff.next();
      onError(err, wait);
      await sleep(wait, signal);
      continue;
    }
    backoff.reset();
    try {
      onData(doc);
    } catch (err) {
      console.error("marsproxy page: cannot render the state", err); // a bug, not the network
    }
    await sleep(Math.max(0.05, periodS - (performance.now() - t0) / 1000), signal);
  }
}

/**
 * Read /mars/v1/events as NDJSON through fetch (so the token goes in a header, which
 * EventSource cannot send): onEvents(list) per chunk, onState("live" | "retrying", retryS) as
 * the stream comes and goes; it reconnects with backoff until `signal` aborts.
 */
export async function eventLoop({ signal, onEvents, onState, onAuth }) {
  const backoff = new Backoff();
  const decoder = new TextDecoder();
  while (!signal.aborted) {
    try {
      // flush_ms: the proxy gathers events between writes (the list redraws at 4 Hz anyway).
      const r = await fetch("/mars/v1/events?format=ndjson&flush_ms=250", { headers: headers(), signal });
      if (r.status === 401) { onAuth(await errorMessage(r)); return; }
      if (!r.ok || !r.body) throw new Error(`events: HTTP ${r.status}`);
      onState("live", 0);
      backoff.reset();
      const reader = r.body.getReader();
      let rest = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        rest += decoder.decode(value, { stream: true });
        const lines = rest.split("\n");
        rest = lines.pop();
        const batch = [];
        for (const line of lines) {
          if (line.trim()) batch.push(JSON.parse(line));
        }
        if (batch.length) onEvents(batch);
      }
      throw new Error("event stream ended");
    } catch (err) {
      if (signal.aborted) return;
      const wait = backoff.next();
      onState("retrying", wait, err);
      await sleep(wait, signal);
    }
  }
}
