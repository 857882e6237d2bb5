#!/usr/bin/env bash
# Capture wire-format fixtures from a real vLLM 0.32.0 CPU server into tests/fixtures/.
# Starts the tiny model (start.sh), sends a small, bounded amount of loopback traffic,
# saves raw bodies/headers, then stops the server (also on error).
#
# Usage: scripts/real-vllm/capture_fixtures.sh [OUT_DIR]   (default <repo>/tests/fixtures)
# Env:   PORT (default 8011), MODEL_DIR (default $REAL_VLLM_HOME/models/tiny),
#        SERVED_MODEL_NAME (default "tiny"), KEEP_SERVER=1 to leave it running.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"
source "$SCRIPT_DIR/env.sh"
OUT="${1:-$REPO_ROOT/tests/fixtures}"
PORT="${PORT:-8011}"
MODEL_DIR="${MODEL_DIR:-$REAL_VLLM_HOME/models/tiny}"
export SERVED_MODEL_NAME="${SERVED_MODEL_NAME:-tiny}"
M="$SERVED_MODEL_NAME"
B="http://127.0.0.1:$PORT"
RAW="$REAL_VLLM_HOME/capture"   # headers and scratch output (not committed)
mkdir -p "$OUT" "$RAW"

cleanup() { [ "${KEEP_SERVER:-0}" = "1" ] || "$SCRIPT_DIR/stop.sh" "$PORT" || true; }
trap cleanup EXIT

# The Responses API keeps responses (previous_response_id) only with this switch.
export VLLM_ENABLE_RESPONSES_API_STORE=1
# Tool calls as the emulator stands for them: vLLM with auto tool choice and a tool parser.
"$SCRIPT_DIR/start.sh" "$MODEL_DIR" "$PORT" --enable-auto-tool-choice --tool-call-parser hermes
T0=$(date +%s)

# curl wrapper: -D headers to $RAW/NAME.headers, body to FILE, status to $RAW/NAME.status
req() {  # req NAME FILE METHOD PATH [JSON]
  local name="$1" file="$2" method="$3" path="$4" data="${5:-}"
  local extra=()
  if [ -n "$data" ]; then extra=(-H 'Content-Type: application/json' --data-binary "$data"); fi
  curl -sS -N --max-time 60 -X "$method" -D "$RAW/$name.headers" -o "$file" \
    -w '%{http_code}' "${extra[@]}" "$B$path" > "$RAW/$name.status"
  echo "  $method $path -> $(cat "$RAW/$name.status") ($name)"
}

echo "== simple routes"
req health "$RAW/health.body" GET /health
req ping "$RAW/ping.body" GET /ping
req version "$OUT/vllm-0.32-version.json" GET /version
req models "$OUT/vllm-0.32-models.json" GET /v1/models
req load0 "$RAW/load0.body" GET /load
req metrics_idle "$OUT/vllm-0.32-metrics-idle.txt" GET /metrics
req tokenize "$RAW/tokenize.body" POST /tokenize "{\"model\":\"$M\",\"prompt\":\"hello world\"}"

echo "== non-streaming"
req chat "$OUT/vllm-0.32-chat.json" POST /v1/chat/completions \
  "{\"model\":\"$M\",\"messages\":[{\"role\":\"user\",\"content\":\"Say hello.\"}],\"max_tokens\":5,\"ignore_eos\":true,\"temperature\":0}"
req completion "$OUT/vllm-0.32-completion.json" POST /v1/completions \
  "{\"model\":\"$M\",\"prompt\":\"def main():\",\"max_tokens\":5,\"ignore_eos\":true,\"temperature\":0}"

echo "== streaming (include_usage)"
req chat_stream "$OUT/vllm-0.32-chat-stream.txt" POST /v1/chat/completions \
  "{\"model\":\"$M\",\"messages\":[{\"role\":\"user\",\"content\":\"Say hello.\"}],\"max_tokens\":5,\"ignore_eos\":true,\"temperature\":0,\"stream\":true,\"stream_options\":{\"include_usage\":true}}"
req completions_stream "$OUT/vllm-0.32-completions-stream.txt" POST /v1/completions \
  "{\"model\":\"$M\",\"prompt\":\"def main():\",\"max_tokens\":5,\"ignore_eos\":true,\"temperature\":0,\"stream\":true,\"stream_options\":{\"include_usage\":true}}"
echo "== streaming (no stream_options), for comparison"
req chat_stream_nousage "$OUT/vllm-0.32-chat-stream-no-usage.txt" POST /v1/chat/completions \
  "{\"model\":\"$M\",\"messages\":[{\"role\":\"user\",\"content\":\"Say hello.\"}],\"max_tokens\":3,\"ignore_eos\":true,\"temperature\":0,\"stream\":true}"
req chat_stream_contusage "$OUT/vllm-0.32-chat-stream-continuous-usage.txt" POST /v1/chat/completions \
  "{\"model\":\"$M\",\"messages\":[{\"role\":\"user\",\"content\":\"Say hello.\"}],\"max_tokens\":3,\"ignore_eos\":true,\"temperature\":0,\"stream\":true,\"stream_options\":{\"include_usage\":true,\"continuous_usage_stats\":true}}"

echo "== errors"
req err404 "$OUT/vllm-0.32-error-404.json" POST /v1/chat/completions \
  '{"model":"no-such-model","messages":[{"role":"user","content":"hi"}],"max_tokens":5}'
req err400 "$OUT/vllm-0.32-error-400.json" POST /v1/chat/completions \
  '{"model": "'"$M"'", "messages": [{"role": "user", "content": "hi"}'
req err400_ctx "$OUT/vllm-0.32-error-400-context.json" POST /v1/completions \
  "{\"model\":\"$M\",\"prompt\":[$(yes 7 | head -n 4200 | paste -sd,)],\"max_tokens\":5}"
req err404_stream "$RAW/error-404-stream.txt" POST /v1/chat/completions \
  '{"model":"no-such-model","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"stream":true}'

req oov "$RAW/error-400-token-id.json" POST /v1/completions \
  "{\"model\":\"$M\",\"prompt\":[5,99999],\"max_tokens\":2}"

# The "id" a response file starts with.
id_of() { sed -n 's/^{"id":"\([^"]*\)".*/\1/p' "$1"; }

echo "== the Responses API (store on)"
req responses "$OUT/vllm-0.32-responses.json" POST /v1/responses \
  "{\"model\":\"$M\",\"input\":\"Say hello.\",\"max_output_tokens\":5,\"temperature\":0}"
RID=$(id_of "$OUT/vllm-0.32-responses.json")
req responses_stream "$OUT/vllm-0.32-responses-stream.txt" POST /v1/responses \
  "{\"model\":\"$M\",\"input\":\"Say hello.\",\"max_output_tokens\":3,\"temperature\":0,\"stream\":true}"
req responses_continued "$OUT/vllm-0.32-responses-continued.json" POST /v1/responses \
  "{\"model\":\"$M\",\"input\":\"Go on.\",\"max_output_tokens\":5,\"temperature\":0,\"previous_response_id\":\"$RID\"}"
req responses_items "$OUT/vllm-0.32-responses-items.json" POST /v1/responses \
  "{\"model\":\"$M\",\"instructions\":\"You are terse.\",\"input\":[{\"type\":\"message\",\"role\":\"user\",\"content\":[{\"type\":\"input_text\",\"text\":\"Say hello.\"}]},{\"type\":\"message\",\"role\":\"assistant\",\"content\":[{\"type\":\"output_text\",\"text\":\"Hi.\"}]},{\"role\":\"user\",\"content\":\"Again.\"}],\"max_output_tokens\":4,\"temperature\":0,\"store\":false}"
req responses_err404 "$OUT/vllm-0.32-responses-error-404.json" POST /v1/responses \
  "{\"model\":\"$M\",\"input\":\"Go on.\",\"max_output_tokens\":5,\"previous_response_id\":\"resp_nope\"}"
req responses_err400 "$OUT/vllm-0.32-responses-error-400.json" POST /v1/responses "{\"model\":\"$M\"}"
# background: answered queued at once; a long one cancelled while still queued; store false.
req responses_bg "$OUT/vllm-0.32-responses-background.json" POST /v1/responses \
  "{\"model\":\"$M\",\"input\":\"Say hello.\",\"max_output_tokens\":5,\"temperature\":0,\"background\":true}"
req responses_bg_long "$RAW/responses-bg-long.json" POST /v1/responses \
  "{\"model\":\"$M\",\"input\":\"Say hello.\",\"max_output_tokens\":3000,\"temperature\":0,\"background\":true}"
BGID=$(id_of "$RAW/responses-bg-long.json")
req responses_bg_cancel "$OUT/vllm-0.32-responses-background-cancelled.json" POST "/v1/responses/$BGID/cancel"
req responses_bg_nostore "$OUT/vllm-0.32-responses-error-background.json" POST /v1/responses \
  "{\"model\":\"$M\",\"input\":\"Say hello.\",\"background\":true,\"store\":false}"
# A named function forced: the tiny random model writes JSON there (under "required" the hermes
# parser finds no call in what it writes); a name not among the tools.
TOOLS='[{"type":"function","name":"run","description":"Run a shell command","parameters":{"type":"object","properties":{"command":{"type":"string"}},"required":["command"]}}]'
NAMED='{"type":"function","name":"run"}'
req responses_tool "$OUT/vllm-0.32-responses-tool-call.json" POST /v1/responses \
  "{\"model\":\"$M\",\"input\":\"List the files.\",\"tools\":$TOOLS,\"tool_choice\":$NAMED,\"max_output_tokens\":200,\"temperature\":0}"
req responses_tool_stream "$OUT/vllm-0.32-responses-tool-call-stream.txt" POST /v1/responses \
  "{\"model\":\"$M\",\"input\":\"List the files.\",\"tools\":$TOOLS,\"tool_choice\":$NAMED,\"max_output_tokens\":200,\"temperature\":0,\"stream\":true}"
req responses_tool_err "$OUT/vllm-0.32-responses-error-tool-choice.json" POST /v1/responses \
  "{\"model\":\"$M\",\"input\":\"x\",\"tools\":$TOOLS,\"tool_choice\":{\"type\":\"function\",\"name\":\"nope\"}}"

echo "== priority without --scheduling-policy priority"
req prio "$RAW/priority-fcfs.json" POST /v1/completions \
  "{\"model\":\"$M\",\"prompt\":\"x\",\"max_tokens\":2,\"ignore_eos\":true,\"priority\":5}"

echo "== shared prefix (prefix cache): 3 x 300-token prompts sharing 256 tokens"
PREFIX=$(seq -s, 100 355)
for i in 1 2 3; do
  req "prefix$i" "$RAW/prefix$i.json" POST /v1/completions \
    "{\"model\":\"$M\",\"prompt\":[$PREFIX,$(seq -s, $((1000 + i * 50)) $((1043 + i * 50)))],\"max_tokens\":4,\"ignore_eos\":true}"
done

echo "== 8 concurrent streaming requests (256 tokens each)"
for i in 1 2 3 4 5 6 7 8; do
  curl -sS -N --max-time 60 -o "$RAW/conc$i.txt" -H 'Content-Type: application/json' \
    --data-binary "{\"model\":\"$M\",\"prompt\":\"concurrent $i\",\"max_tokens\":256,\"ignore_eos\":true,\"stream\":true,\"stream_options\":{\"include_usage\":true}}" \
    "$B/v1/completions" &
done
# Sample until the engine reports running requests (on 2 cores the API server can answer
# /metrics seconds late while it streams, so poll instead of sleeping a fixed time).
for _ in $(seq 1 40); do
  req load_busy "$RAW/load-busy.body" GET /load
  req metrics_busy "$RAW/metrics-busy.txt" GET /metrics
  if grep -qE '^vllm:num_requests_running\{.*\} [1-9]' "$RAW/metrics-busy.txt"; then
    cp "$RAW/metrics-busy.txt" "$OUT/vllm-0.32-metrics-busy.txt"
    break
  fi
  sleep 0.1
done
wait
req load1 "$RAW/load1.body" GET /load

sleep 1
echo "== final /metrics"
req metrics "$OUT/vllm-0.32-metrics.txt" GET /metrics
echo "traffic phase: $(( $(date +%s) - T0 )) s"
