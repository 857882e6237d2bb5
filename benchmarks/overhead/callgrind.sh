#!/bin/bash
# Instructions per request of a proxy, counted by valgrind's callgrind: repeatable to about
# 0.3 % on a shared, noisy machine, where CPU seconds vary by 10-20 % from run to run.
#
#   benchmarks/overhead/callgrind.sh fcfs|mars|relay [seconds=15] [connections=4] [sessions=16]
#
# Starts the fast upstream (CPU 1), the proxy under callgrind with instrumentation off (CPU 0),
# warms it up with wrk for 5 s, counts instructions during a second wrk run, and prints
# instructions per request. "relay" is the bare aiohttp relay (marsproxy/bench/overhead_relay.py),
# the floor of marsproxy's HTTP stack. sessions: how many x-session-id values the requests rotate
# over, or "one-call" (each request a new session with x-session-final: true).
# Needs valgrind and wrk (apt-get install valgrind wrk).
set -euo pipefail
cd "$(dirname "$0")/../.."
WHAT=${1:-fcfs}; SECS=${2:-15}; CONNS=${3:-4}; SESSIONS=${4:-16}
WORK=benchmarks/overhead/.work/callgrind; mkdir -p "$WORK"
PY=.venv/bin/python
port() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
UP=$(port); PX=$(port)
$PY -c "from marsproxy.bench.overhead_load import request_body; from marsproxy.bench.overhead_setup import Point
open('$WORK/body.json', 'wb').write(request_body(Point('x', False, 1, 1)))"
taskset -c 1 $PY -m marsproxy.bench.overhead_upstream --port "$UP" > "$WORK/upstream.log" 2>&1 &
UPID=$!
trap 'kill $UPID ${VPID:-} 2>/dev/null || true' EXIT
for _ in $(seq 50); do curl -sf -o /dev/null "http://127.0.0.1:$UP/health" && break; sleep 0.2; done
if [ "$WHAT" = relay ]; then
  CMD=(-m marsproxy.bench.overhead_relay --port "$PX" --upstream "http://127.0.0.1:$UP"); READY=/health
else
  CMD=(-m marsproxy.cli serve --config benchmarks/overhead/marsproxy-callgrind.yaml --policy "$WHAT"
       --port "$PX" --worker "http://127.0.0.1:$UP"); READY=/readyz
fi
OUT="$WORK/$WHAT-$SESSIONS.callgrind"; rm -f "$OUT"*
taskset -c 0 valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$OUT" \
  $PY "${CMD[@]}" > "$WORK/$WHAT.log" 2>&1 &
VPID=$!
for _ in $(seq 120); do curl -sf -o /dev/null "http://127.0.0.1:$PX$READY" && break; sleep 1; done
URL="http://127.0.0.1:$PX/v1/chat/completions"
LUA=benchmarks/overhead/wrk.lua
taskset -c 1 wrk -t1 -c"$CONNS" -d5s -s $LUA "$URL" -- "$WORK/body.json" 0 "$SESSIONS" > /dev/null
callgrind_control -i on $VPID > /dev/null
N=$(taskset -c 1 wrk -t1 -c"$CONNS" -d"${SECS}s" -s $LUA "$URL" -- "$WORK/body.json" 0 "$SESSIONS" \
    | sed -n 's/.*"requests":\([0-9]*\).*/\1/p')
callgrind_control -i off $VPID > /dev/null
callgrind_control --dump $VPID > /dev/null
sleep 1
kill -9 $VPID 2>/dev/null || true; wait $VPID 2>/dev/null || true
IR=$(callgrind_annotate "$OUT.1" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); s += $1} END {print s}')
echo "$WHAT: $N requests, $IR instructions, $((IR / N)) instructions per request"
