#!/usr/bin/env bash
# Start a real vLLM 0.32.0 CPU server on loopback and wait until GET /health answers 200.
#
# Usage: scripts/real-vllm/start.sh MODEL_DIR PORT [extra vllm serve args...]
# Env:   MARS_REAL_VLLM_HOME (default ~/.cache/marsproxy/real-vllm; venv in venv/)
#        SCHEDULING_POLICY  (fcfs|priority; default fcfs = vLLM's own default, flag omitted)
#        SERVED_MODEL_NAME  (default: vLLM's default, i.e. MODEL_DIR as given)
#        KV_CACHE_BYTES     (default 64M)   NUM_BLOCKS (default 160)   BLOCK_SIZE (default 32)
#        MAX_MODEL_LEN      (default 4096)  HEALTH_TIMEOUT (seconds, default 120)
#        RUN_DIR            (pid + log files; default $REAL_VLLM_HOME/run)
# Files: $RUN_DIR/vllm-PORT.pid (the server's pid = its process-group id), $RUN_DIR/vllm-PORT.log
# Stop:  scripts/real-vllm/stop.sh PORT
set -euo pipefail

if [ $# -lt 2 ]; then
  echo "usage: $0 MODEL_DIR PORT [extra vllm serve args...]" >&2
  exit 2
fi
MODEL_DIR="$1"; PORT="$2"; shift 2

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"
source "$SCRIPT_DIR/env.sh"
VENV="$REAL_VLLM_HOME/venv"
RUN_DIR="${RUN_DIR:-$REAL_VLLM_HOME/run}"
PID_FILE="$RUN_DIR/vllm-$PORT.pid"
LOG_FILE="$RUN_DIR/vllm-$PORT.log"
HEALTH_TIMEOUT="${HEALTH_TIMEOUT:-120}"

[ -x "$VENV/bin/python" ] || { echo "no real-vLLM venv at $VENV: run scripts/real-vllm/setup.sh" >&2; exit 1; }
[ -f "$MODEL_DIR/config.json" ] || { echo "no model at $MODEL_DIR (config.json missing)" >&2; exit 1; }
mkdir -p "$RUN_DIR"

if [ -f "$PID_FILE" ] && kill -0 "$(cat "$PID_FILE")" 2>/dev/null; then
  echo "a server is already running on port $PORT (pid $(cat "$PID_FILE")); stop it first" >&2
  exit 1
fi

args=(
  "$MODEL_DIR"
  --host 127.0.0.1 --port "$PORT"
  --max-model-len "${MAX_MODEL_LEN:-4096}"
  --enforce-eager
  --block-size "${BLOCK_SIZE:-32}"
  --kv-cache-memory-bytes "${KV_CACHE_BYTES:-64M}"
  --num-gpu-blocks-override "${NUM_BLOCKS:-160}"
  --enable-server-load-tracking
)
if [ -n "${SCHEDULING_POLICY:-}" ]; then args+=(--scheduling-policy "$SCHEDULING_POLICY"); fi
if [ -n "${SERVED_MODEL_NAME:-}" ]; then args+=(--served-model-name "$SERVED_MODEL_NAME"); fi
args+=("$@")

# `vllm serve` needs the vllm-*.dist-info stub that setup.sh adds; the module entry point does not.
if [ -x "$VENV/bin/vllm" ]; then
  cmd=("$VENV/bin/vllm" serve "${args[@]}")
else
  cmd=("$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "${args[@]}")
fi

echo "starting: ${cmd[*]}" | tee "$LOG_FILE"
T0=$(date +%s.%N)
# setsid: the server leads its own process group, so stop.sh can signal the whole tree.
setsid "${cmd[@]}" >>"$LOG_FILE" 2>&1 < /dev/null &
PID=$!
echo "$PID" > "$PID_FILE"

deadline=$(( $(date +%s) + HEALTH_TIMEOUT ))
while :; do
  if ! kill -0 "$PID" 2>/dev/null; then
    echo "vLLM exited before becoming healthy; last log lines ($LOG_FILE):" >&2
    tail -n 40 "$LOG_FILE" >&2
    rm -f "$PID_FILE"
    exit 1
  fi
  code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$PORT/health" || true)
  if [ "$code" = "200" ]; then break; fi
  if [ "$(date +%s)" -ge "$deadline" ]; then
    echo "vLLM not healthy after ${HEALTH_TIMEOUT}s; last log lines ($LOG_FILE):" >&2
    tail -n 40 "$LOG_FILE" >&2
    "$SCRIPT_DIR/stop.sh" "$PORT" >&2 || true
    exit 1
  fi
  sleep 0.5
done
awk -v a="$T0" -v b="$(date +%s.%N)" -v p="$PID" -v port="$PORT" \
  'BEGIN { printf "vLLM healthy on http://127.0.0.1:%s after %.1f s (pid %s)\n", port, b - a, p }'
