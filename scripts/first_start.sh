#!/usr/bin/env bash
# The first `make serve` on a fresh cache, measured as a newcomer meets it (issue 27): starts `make serve`
# with an empty DSPARK_CACHE (the venv as it is), polls every 2 s from that moment with the README's
# `/v1/models` and its first chat curl, stops at the first answered chat, shuts the cluster down and
# prints one JSON line: seconds to the first 200 on /v1/models and to the first answered chat, and every
# status seen (000 = nothing listening yet; a 503 is counted apart when it lacks Retry-After).
#   scripts/first_start.sh [--keep-cache]     (FIRST_START_TIMEOUT_S, default 900; PORT, default 8000)
set -uo pipefail
cd "$(dirname "$0")/.."
TIMEOUT_S=${FIRST_START_TIMEOUT_S:-900}
PORT=${PORT:-8000}
export DSPARK_CACHE
DSPARK_CACHE=$(mktemp -d)
LOG=$(mktemp /tmp/first_start.XXXX.log)
HDR=$(mktemp)
CHAT='{"messages": [{"role": "user", "content": "What is 2+3?"}], "max_tokens": 32}'

setsid make serve >"$LOG" 2>&1 &
SERVE_PID=$!
stop() {
  RAY_AUTH_MODE=token .venv/bin/serve shutdown -y >/dev/null 2>&1
  kill -INT -- "-$SERVE_PID" 2>/dev/null; sleep 5; kill -KILL -- "-$SERVE_PID" 2>/dev/null
  .venv/bin/ray stop --force >/dev/null 2>&1
  rm -f "$HDR"
  [ "${1:-}" = "--keep-cache" ] || rm -rf "$DSPARK_CACHE"
}
trap 'stop "$@"' EXIT

declare -A SEEN=()
T0=$(date +%s.%N)
elapsed() { echo "$(date +%s.%N) - $T0" | bc; }
FIRST_MODELS="" FIRST_CHAT="" ANSWER=""
poll() {  # $1 = route label, then curl arguments; sets CODE
  CODE=$(curl -s -o "$HDR.body" -D "$HDR" -w '%{http_code}' -m "${MAXT:-5}" "${@:2}")
  if [ "$CODE" = 503 ] && ! grep -qi '^retry-after:' "$HDR"; then CODE=503-no-retry-after; fi
  SEEN["$1 $CODE"]=$(( ${SEEN["$1 $CODE"]:-0} + 1 ))
}
while :; do
  TICK=$(date +%s.%N)
  poll models "localhost:$PORT/v1/models"
  [ "$CODE" = 200 ] && [ -z "$FIRST_MODELS" ] && FIRST_MODELS=$(elapsed)
  MAXT=120 poll chat "localhost:$PORT/v1/chat/completions" -H 'content-type: application/json' -d "$CHAT"
  if [ "$CODE" = 200 ]; then
    FIRST_CHAT=$(elapsed); ANSWER=$(cat "$HDR.body")
    # the chat was answered between this round's two polls: /v1/models must say ready now too
    [ -z "$FIRST_MODELS" ] && poll models "localhost:$PORT/v1/models" && [ "$CODE" = 200 ] && FIRST_MODELS=$(elapsed)
    break
  fi
  if ! kill -0 "$SERVE_PID" 2>/dev/null; then break; fi  # make serve exited (failed start)
  if (( $(echo "$(elapsed) > $TIMEOUT_S" | bc) )); then break; fi
  sleep "$(echo "x = 2 - ($(date +%s.%N) - $TICK); if (x < 0) x = 0; x" | bc)"
done
rm -f "$HDR.body"
HIST=$(for k in "${!SEEN[@]}"; do printf '"%s": %s\n' "$k" "${SEEN[$k]}"; done | sort | paste -sd, -)
TEXT=$(printf '%s' "$ANSWER" | .venv/bin/python -c 'import json,sys
try: print(json.dumps(json.load(sys.stdin)["choices"][0]["message"]["content"]))
except Exception: print("null")')
CPU=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
ISA=$(grep -o -w 'avx2\|avx512f\|amx_bf16' /proc/cpuinfo | sort -u | paste -sd, -)
printf '{"cpu": "%s", "isa": "%s", "num_cores": %s, "first_models_200_s": %s, "first_chat_s": %s, "answer": %s, "statuses": {%s}, "log": "%s"}\n' \
  "$CPU" "$ISA" "$(nproc)" "${FIRST_MODELS:-null}" "${FIRST_CHAT:-null}" "$TEXT" "$HIST" "$LOG"
