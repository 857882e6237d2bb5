#!/usr/bin/env bash
# What the proxy's /metrics scraping costs a real vLLM: the server's CPU (all its processes)
# while idle alone, idle behind `marsproxy serve` on defaults (an idle worker: one scrape a
# second) and with every scrape at 0.2 s (idle_period_s = period_s), and per scrape: the whole
# page with and without gzip, and the filtered page the proxy reads (/metrics/?name[]=...).
# About 3 minutes; docs/performance.md (what the proxy costs the engine).
#
# Usage: scripts/real-vllm/scrape-cost.sh   Env: MODEL (medium), PORT (8741), SECONDS_EACH (30)
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"
source "$SCRIPT_DIR/env.sh"
MODEL="${MODEL:-medium}" PORT="${PORT:-8741}" EACH="${SECONDS_EACH:-30}"
PROXY_PORT=$((PORT + 50))
MARSPROXY="$REPO_ROOT/.venv/bin/marsproxy"
WORK="$(mktemp -d)"

[ -f "$REAL_VLLM_HOME/models/$MODEL/.built" ] || "$SCRIPT_DIR/setup.sh" "$MODEL"
trap '"$SCRIPT_DIR/stop.sh" "$PORT" >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
SERVED_MODEL_NAME="$MODEL" "$SCRIPT_DIR/start.sh" "$REAL_VLLM_HOME/models/$MODEL" "$PORT" >&2
PGID="$(cat "$REAL_VLLM_HOME/run/vllm-$PORT.pid")"

cpu_s() {  # CPU seconds (user + system) of the server's process group so far
  local total=0 p t
  for p in $(ps -o pid= -g "$PGID"); do
    t=$(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0)
    total=$((total + t))
  done
  echo "$total $(getconf CLK_TCK)"
}
share() {  # LABEL: the server's CPU over EACH seconds, in percent of one core
  local a b
  a=$(cpu_s); sleep "$EACH"; b=$(cpu_s)
  python3 -c "a, hz = map(int, '$a'.split()); b = int('$b'.split()[0]); \
print(f'$1: {(b - a) / hz / $EACH * 100:.1f} % of a core')"
}

sleep 5  # past the start's own work
share "vLLM idle, alone"
for idle in 1.0 0.2; do
  printf 'workers: [{url: "http://127.0.0.1:%s"}]\nserver: {port: %s}\nprobes: {vllm: {idle_period_s: %s}}\n' \
    "$PORT" "$PROXY_PORT" "$idle" > "$WORK/marsproxy.yaml"
  "$MARSPROXY" serve --config "$WORK/marsproxy.yaml" > "$WORK/serve.log" 2>&1 &
  proxy=$!
  sleep 5
  share "vLLM idle behind marsproxy, probes.vllm.idle_period_s $idle"
  kill "$proxy"; wait "$proxy" 2>/dev/null || true
done
FILTER="$("$REPO_ROOT/.venv/bin/python" -c "from urllib.parse import urlencode
from marsproxy.probes.vllm_metrics import READ_NAMES
print(urlencode([('name[]', n) for n in READ_NAMES]))")"
per_scrape() {  # LABEL ENCODING PATH: the server's CPU per GET, over 150 of them
  local a b
  a=$(cpu_s)
  for _ in $(seq 150); do curl -s -H "Accept-Encoding: $2" "http://127.0.0.1:$PORT$3" >/dev/null; done
  b=$(cpu_s)
  python3 -c "a, hz = map(int, '$a'.split()); b = int('$b'.split()[0]); \
print(f'one scrape, $1: {(b - a) / hz / 150 * 1000:.1f} ms of vLLM CPU')"
}
per_scrape "whole page, gzip" gzip /metrics
per_scrape "whole page, uncompressed" identity /metrics
per_scrape "the series the proxy reads, uncompressed" identity "/metrics/?$FILTER"
