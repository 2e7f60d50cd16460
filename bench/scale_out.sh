#!/usr/bin/env bash
# N kvarn replicas behind a router, on loopback only, for machines without Docker.
#
#   bench/scale_out.sh                          # 3 replicas, SMG cache_aware on 127.0.0.1:8100
#   ROUTER=vllm-router POLICY=kv_aware bench/scale_out.sh   # exact routing from kvarn's KV events
#   N=2 POLICY=round_robin bench/scale_out.sh -- --apc-memory-bytes 64MiB   # flags after -- go to every replica
#
# Replica i serves http://127.0.0.1:$((BASE_PORT+i)), publishes KV events on
# tcp://127.0.0.1:$((EVENTS_PORT+2i)) (replay on the next port) and shares one prefix cache on
# disk ($CACHE_DIR). Logs go to $LOG_DIR. Ctrl-C (or SIGTERM) drains the replicas and stops all.
# Requires `pip install smg` or `pip install vllm-router` (not kvarn dependencies).
set -euo pipefail

N=${N:-3}
ROUTER=${ROUTER:-smg}                 # smg | vllm-router
POLICY=${POLICY:-cache_aware}         # smg: cache_aware, round_robin, ...; vllm-router: kv_aware, ...
ROUTER_PORT=${ROUTER_PORT:-8100}
BASE_PORT=${BASE_PORT:-8101}
EVENTS_PORT=${EVENTS_PORT:-5557}
CACHE_DIR=${CACHE_DIR:-$(mktemp -d /tmp/kvarn-cache.XXXX)}
LOG_DIR=${LOG_DIR:-$(mktemp -d /tmp/kvarn-scale.XXXX)}
MODEL=${MODEL:-}                      # a model folder (default: the bundled model)
TOKENIZER=${TOKENIZER:-$(python -c 'import engine, pathlib; print(pathlib.Path(engine.__file__).parent / "bundled/fixture-chat-29m-q8")')}
EXTRA=()
if [[ ${1:-} == "--" ]]; then shift; EXTRA=("$@"); fi

pids=()
stop() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap stop EXIT INT TERM

urls=()
sources=()
for ((i = 0; i < N; i++)); do
  port=$((BASE_PORT + i)); pub=$((EVENTS_PORT + 2 * i)); replay=$((pub + 1))
  python -m server.cli serve ${MODEL:+"$MODEL"} --host 127.0.0.1 --port "$port" \
    --apc-disk-dir "$CACHE_DIR" \
    --kv-events-endpoint "tcp://127.0.0.1:$pub" --kv-events-replay-endpoint "tcp://127.0.0.1:$replay" \
    --kv-events-layout map \
    "${EXTRA[@]}" >"$LOG_DIR/replica-$i.log" 2>&1 &
  pids+=($!)
  urls+=("http://127.0.0.1:$port")
  sources+=(--kv-event-source "http://127.0.0.1:$port=tcp://127.0.0.1:$pub"
            --kv-event-replay-source "http://127.0.0.1:$port=tcp://127.0.0.1:$replay")
done
for url in "${urls[@]}"; do
  until curl -sf "$url/health" >/dev/null; do sleep 0.5; done
done
echo "replicas ready: ${urls[*]} (cache $CACHE_DIR, logs $LOG_DIR)"

# the router's own metrics on loopback beside it; /health checked every second, so a draining
# replica (503) leaves the pool at once
common=(--host 127.0.0.1 --port "$ROUTER_PORT" --policy "$POLICY" --prometheus-host 127.0.0.1
        --prometheus-port $((ROUTER_PORT + 1000)) --health-check-interval-secs 1 --health-failure-threshold 1)
case "$ROUTER" in
  smg)
    smg launch "${common[@]}" --worker-urls "${urls[@]}" >"$LOG_DIR/router.log" 2>&1 & ;;
  vllm-router)
    extra=()
    if [[ $POLICY == kv_aware ]]; then
      extra=("${sources[@]}" --kv-event-block-size 16 --kv-event-model "$TOKENIZER")
    fi
    vllm-router "${common[@]}" --worker-urls "${urls[@]}" "${extra[@]}" >"$LOG_DIR/router.log" 2>&1 & ;;
  *) echo "ROUTER must be smg or vllm-router" >&2; exit 2 ;;
esac
pids+=($!)
echo "router $ROUTER ($POLICY) on http://127.0.0.1:$ROUTER_PORT"
wait "${pids[-1]}"
