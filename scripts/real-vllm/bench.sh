#!/usr/bin/env bash
# The live benchmark against a real vLLM 0.32 (CPU build, medium model): direct, fcfs, autellix,
# continuum and mars at a light and a heavy load, with the agents' tool phases as real CPU work
# on this host. About 15-20 minutes on a quiet 2-core machine. docs/methodology.md (real vLLM).
#
# Usage: scripts/real-vllm/bench.sh [OUT_DIR] [-- extra `marsproxy bench live` args]
#        (default OUT_DIR: results/<UTC timestamp>-live-vllm)
# Env:   MODEL (medium), PORT (8741), NUM_BLOCKS (256), KV_CACHE_BYTES (256M),
#        MAX_MODEL_LEN (4096), POLICIES (direct,fcfs,autellix,continuum,mars),
#        RATES ("0.1,1": light, heavy; sessions/s, Poisson), SESSIONS (8),
#        MARSPROXY (the marsproxy command; default <repo>/.venv/bin/marsproxy),
#        KV_EVENTS (1: the server publishes KV events on PORT+1, replay PORT+2, and the
#        proxy subscribes: resident-block fit, verified retention; default 0)
#
# The server runs with --scheduling-policy priority (the proxy's level hints reach the engine;
# direct and fcfs send none, so all their requests are equal and served in arrival order),
# --enable-prompt-tokens-details (cached prompt tokens per call: warm resumes) and
# VLLM_SERVER_DEV_MODE=1 (POST /reset_prefix_cache: the bench empties the prefix cache before
# every policy, so no policy inherits another's cached prefixes). It is stopped on exit.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"
source "$SCRIPT_DIR/env.sh"

OUT="results/$(date -u +%Y%m%d-%H%M%S)-live-vllm"
if [ $# -gt 0 ] && [ "$1" != "--" ]; then OUT="$1"; shift; fi
[ "${1:-}" = "--" ] && shift
MODEL="${MODEL:-medium}"
PORT="${PORT:-8741}"
MARSPROXY="${MARSPROXY:-$REPO_ROOT/.venv/bin/marsproxy}"
MODEL_DIR="$REAL_VLLM_HOME/models/$MODEL"

if [ ! -f "$MODEL_DIR/.built" ]; then
  "$SCRIPT_DIR/setup.sh" "$MODEL"
fi
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/uptime.txt" >&2; }

# 256 blocks of 32 tokens = 8,192 KV tokens: five of this workload's median session peaks
# (1.6k tokens), so the cache holds a handful of sessions, as an H200 holds a handful at the
# paper's 64k regime, and mars' smallest window (4) fits; 128 MiB of KV for the medium model
# (16 KiB per token). The default 160 blocks would hold fewer sessions than that window.
export NUM_BLOCKS="${NUM_BLOCKS:-256}" KV_CACHE_BYTES="${KV_CACHE_BYTES:-256M}"
export MAX_MODEL_LEN="${MAX_MODEL_LEN:-4096}" SERVED_MODEL_NAME="$MODEL"
export SCHEDULING_POLICY=priority VLLM_SERVER_DEV_MODE=1

trap '"$SCRIPT_DIR/stop.sh" "$PORT" >&2 || true' EXIT
log "uptime before start: $(uptime)"
kv_server=() kv_bench=()
if [ "${KV_EVENTS:-0}" = 1 ]; then
  kv_server=(--kv-events-config "{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:$((PORT + 1))\", \"replay_endpoint\": \"tcp://127.0.0.1:$((PORT + 2))\", \"topic\": \"kv\"}")
  kv_bench=(--vllm-kv-events "tcp://127.0.0.1:$((PORT + 1)),tcp://127.0.0.1:$((PORT + 2))")
fi
"$SCRIPT_DIR/start.sh" "$MODEL_DIR" "$PORT" --enable-prompt-tokens-details "${kv_server[@]}" >&2

# Workload: the packaged sample trace, the 8k input-length regime scaled by 0.2 (median peak
# context 1.6k tokens; no prompt over max_model_len - 1024 = 3,072, room for the reply), at most
# 6 calls per session, tool times × 0.4 (about 30 % of a session's time alone).
log "uptime before bench: $(uptime)"
set +e
"$MARSPROXY" bench live --vllm-url "http://127.0.0.1:$PORT" --vllm-priority true \
  --regimes 8k --token-scale 0.2 --max-turns 6 --tool-time-scale 0.4 \
  --sessions "${SESSIONS:-8}" --rates "${RATES:-0.1,1}" --arrivals poisson \
  --policies "${POLICIES:-direct,fcfs,autellix,continuum,mars}" \
  --out "$OUT" "${kv_bench[@]}" "$@"
rc=$?
set -e
log "uptime after bench: $(uptime)"
cp "$REAL_VLLM_HOME/run/vllm-$PORT.log" "$OUT/vllm.log" 2>/dev/null || true
exit "$rc"
