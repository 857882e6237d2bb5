#!/usr/bin/env bash
# Stop a vLLM server started by start.sh: SIGTERM its process group, wait, SIGKILL if needed.
#
# Usage: scripts/real-vllm/stop.sh [PORT]      (without PORT: every server with a pid file)
# Env:   MARS_REAL_VLLM_HOME, RUN_DIR as in start.sh; STOP_TIMEOUT (seconds, default 30)
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"
source "$SCRIPT_DIR/env.sh"
RUN_DIR="${RUN_DIR:-$REAL_VLLM_HOME/run}"
STOP_TIMEOUT="${STOP_TIMEOUT:-30}"

if [ $# -ge 1 ]; then
  pid_files=("$RUN_DIR/vllm-$1.pid")
else
  shopt -s nullglob
  pid_files=("$RUN_DIR"/vllm-*.pid)
fi

group_alive() { kill -0 -- "-$1" 2>/dev/null; }

rc=0
for pf in "${pid_files[@]}"; do
  if [ ! -f "$pf" ]; then echo "not running (no pid file $pf)"; continue; fi
  pid="$(cat "$pf")"
  if ! group_alive "$pid"; then
    echo "pid $pid ($pf) is not running"; rm -f "$pf"; continue
  fi
  t0=$(date +%s.%N)
  kill -TERM -- "-$pid" 2>/dev/null || true
  end=$(( $(date +%s) + STOP_TIMEOUT ))
  while group_alive "$pid" && [ "$(date +%s)" -lt "$end" ]; do sleep 0.2; done
  if group_alive "$pid"; then
    echo "process group $pid still alive after ${STOP_TIMEOUT}s: SIGKILL" >&2
    kill -KILL -- "-$pid" 2>/dev/null || true
  fi
  rm -f "$pf"
  awk -v a="$t0" -v b="$(date +%s.%N)" -v p="$pid" 'BEGIN { printf "stopped vLLM process group %s in %.1f s\n", p, b - a }'
done
exit "$rc"
