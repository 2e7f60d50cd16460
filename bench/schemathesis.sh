#!/usr/bin/env bash
# Schemathesis (4.x) against `kvarn serve`'s own OpenAPI document, bounded.
#
# Starts `kvarn serve` (the default KVarN layout; KVARN_ARGS adds flags) on a free loopback port,
# waits for /health (at most 120 s), runs `schemathesis run .../openapi.json --checks all` with a
# fixed seed, one worker and a wall-clock bound, then stops the server (also on error or Ctrl-C).
# Every check is on; nothing is excluded. bench/schemathesis_hooks.py sets a generated string
# `model` to the served id (else every generated completion is a 404 before anything else is
# looked at) and caps max_tokens / n (a fuzzed request could otherwise decode 128 x 4,000 tokens).
# Schemathesis reports one failure of a kind per operation; bench/schemathesis_har.py then reads
# the run's HAR and lists every 5xx, every response outside the documented statuses and every
# schema-valid request that was refused, grouped by error message.
#
# Usage: bash bench/schemathesis.sh
# Env:   MAX_EXAMPLES=30  SEED=1  MAX_SECONDS=480  REPORT_DIR=(a new temp folder)  KVARN_ARGS=""
# Exit:  schemathesis's status (1 when it found a failure; 124 past MAX_SECONDS), else 1 when
#        bench/schemathesis_har.py found a 5xx, an undocumented status or a nonconforming body.
set -euo pipefail
cd "$(dirname "$0")/.."

MAX_EXAMPLES=${MAX_EXAMPLES:-30}
SEED=${SEED:-1}
MAX_SECONDS=${MAX_SECONDS:-480}
REPORT_DIR=${REPORT_DIR:-$(mktemp -d -t kvarn-schemathesis-XXXXXX)}
KVARN_ARGS=${KVARN_ARGS:-}
command -v schemathesis >/dev/null || { echo "schemathesis is not installed: pip install 'schemathesis>=4,<5'" >&2; exit 2; }

PORT=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
BASE=http://127.0.0.1:$PORT
mkdir -p "$REPORT_DIR"
LOG=$REPORT_DIR/server.log
# shellcheck disable=SC2086
kvarn serve --host 127.0.0.1 --port "$PORT" $KVARN_ARGS >"$LOG" 2>&1 &
SERVER=$!
stop() { kill "$SERVER" 2>/dev/null && wait "$SERVER" 2>/dev/null || true; }
trap stop EXIT INT TERM

for _ in $(seq 1 600); do
    curl -sf "$BASE/health" >/dev/null 2>&1 && break
    kill -0 "$SERVER" 2>/dev/null || { echo "kvarn serve exited:" >&2; tail -20 "$LOG" >&2; exit 1; }
    sleep 0.2
done
curl -sf "$BASE/health" >/dev/null || { echo "kvarn serve not ready in 120 s" >&2; tail -20 "$LOG" >&2; exit 1; }

echo "kvarn serve $KVARN_ARGS on $BASE; reports in $REPORT_DIR"
curl -sf "$BASE/openapi.json" >"$REPORT_DIR/openapi.json"
status=0
# run in REPORT_DIR: schemathesis keeps a cache of failing cases (.schemathesis/) in its working folder
HOOKS=$PWD/bench/schemathesis_hooks.py
(cd "$REPORT_DIR" && SCHEMATHESIS_HOOKS=$HOOKS timeout "$MAX_SECONDS" \
    schemathesis run "$BASE/openapi.json" --checks all --max-examples "$MAX_EXAMPLES" --seed "$SEED" \
    --workers 1 --request-timeout 120 --continue-on-failure --output-sanitize false \
    --report junit,json,har --report-dir .) || status=$?
python bench/schemathesis_har.py "$REPORT_DIR"/har-*.json "$REPORT_DIR/openapi.json" || { [ "$status" -ne 0 ] || status=1; }
exit "$status"
